"""The prompt keys of a run task's items: the live training items, the held-out ones, their ids.

A run task hands the coordinator prompt *keys* (the rendered prompt text) and must find the item
behind a key again when its completion comes back, and its token ids when a job is built.
:class:`PromptKeys` keeps the most recent ``MAX_LIVE_ITEMS`` training items (an endless stream must
not grow without bound), every held-out item (a fixed split, rendered once), and the token ids of
the most recent keys.

A generation job decodes its rows in one KV cache, so its prompts have one token length:
:class:`LengthBuckets` gathers keys by length and hands them out a job's worth at a time (the
coordinator's jobs and ``polis bench swarm``'s in-process jobs are built by it). What it does not
know: what an item is, how it is rendered or scored, jobs or caches themselves.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Callable, Generic, Iterable, Iterator, TypeVar

from engine.rl.episode_outcome import MAX_LIVE_ITEMS

Item = TypeVar("Item")


class PromptKeys(Generic[Item]):
    """Keys of items (``key(item)``: the rendered prompt), their items and token ids (``encode``)."""

    def __init__(self, key: Callable[[Item], str], encode: Callable[[str], list[int]]) -> None:
        self._key, self._encode = key, encode
        self._live: OrderedDict[str, Item] = OrderedDict()
        self._eval: dict[str, Item] = {}
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def train(self, items: Iterable[Item]) -> Iterator[str]:
        """The keys of a training stream, each item held until ``MAX_LIVE_ITEMS`` newer ones came."""
        for item in items:
            key = self._key(item)
            self._live[key] = item
            self._live.move_to_end(key)
            while len(self._live) > MAX_LIVE_ITEMS:
                self._live.popitem(last=False)
            yield key

    def held_out(self, items: Callable[[], Iterable[Item]]) -> list[str]:
        """The keys of the held-out split (``items`` is called once)."""
        if not self._eval:
            self._eval = {self._key(item): item for item in items()}
        return list(self._eval)

    def ids(self, key: str) -> list[int]:
        """The token ids of ``key`` (cached for the most recent keys)."""
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = self._encode(key)
            while len(self._ids) > MAX_LIVE_ITEMS:
                self._ids.popitem(last=False)
        return list(ids)

    def item(self, key: str) -> Item | None:
        """The item behind ``key`` (None: no longer held, or never handed out)."""
        return self._live.get(key) or self._eval.get(key)


class LengthBuckets:
    """Prompt keys held by token length (``length(key)``) until ``size`` of one length are there."""

    def __init__(self, size: int, length: Callable[[str], int]) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self._length = size, length
        self._buckets: defaultdict[int, list[str]] = defaultdict(list)

    def add(self, key: str) -> list[str] | None:
        """Hold ``key``; once its length has ``size`` keys, those keys (oldest first), else None."""
        bucket = self._buckets[self._length(key)]
        bucket.append(key)
        if len(bucket) < self.size:
            return None
        batch = bucket[:self.size]
        del bucket[:self.size]
        return batch

    def take(self, keys: Iterator[str]) -> list[str]:
        """Draw from ``keys`` until one length has ``size`` keys; those keys (the rest stay held)."""
        while True:
            batch = self.add(next(keys))
            if batch is not None:
                return batch
