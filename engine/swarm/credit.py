"""Verified credit as the coordinator's parts observe it, held in memory until it is written.

The generation scheduler credits an accepted generation result, the micro-batch dispatcher a
micro-batch it saw complete, the step runner a ``stepped`` whose weights digest the vote
decided (``engine.swarm.ledger`` says what each counter means). Nothing a node says of its
own work ever reaches :class:`Credit`. Writing on every observation would cost a synced commit
each; the coordinator's tick calls :meth:`Credit.flush` every ``FLUSH_S`` instead, one
transaction for all peers. While the disk refuses writes the credit stays pending (bounded
by the number of peers), and readers always see it: :meth:`Credit.pending_for`,
:meth:`Credit.pending_totals`.

What it does not know: messages, sockets, how work is verified (its callers do that).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable

from engine.swarm.ledger import VERIFIED
from engine.swarm.store import Store, StoreUnavailable

log = logging.getLogger(__name__)

#: seconds between writes of pending credit
FLUSH_S = 2.0


class Credit:
    """Verified credit per peer not written to the store yet."""

    def __init__(self) -> None:
        self._pending: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def add(self, peers: Iterable[str], **counts: int) -> None:
        """Credit each of ``peers`` (once, however often it is named) with ``counts`` (``ledger.VERIFIED``)."""
        unknown = set(counts) - set(VERIFIED)
        if unknown:
            raise ValueError(f"unknown verified counters: {sorted(unknown)}")
        if any(int(n) < 0 for n in counts.values()):
            raise ValueError("credit must be non-negative")
        for peer in set(peers):
            self._pending[peer].update({k: int(n) for k, n in counts.items() if n})

    def pending_for(self, peer: str) -> dict[str, int]:
        """``peer``'s credit not written yet."""
        return dict(self._pending.get(peer, {}))

    def pending(self) -> dict[str, dict[str, int]]:
        """Every peer's credit not written yet."""
        return {peer: dict(counts) for peer, counts in self._pending.items()}

    def pending_totals(self) -> dict[str, int]:
        """The sum over peers of the credit not written yet."""
        total: Counter[str] = Counter()
        for counts in self._pending.values():
            total.update(counts)
        return {c: int(total[c]) for c in VERIFIED}

    def flush(self, store: Store) -> bool:
        """Write the pending credit in one transaction; False (it stays pending) while the disk refuses."""
        if not self._pending:
            return True
        try:
            store.add_credit(self._pending)
        except StoreUnavailable as exc:
            log.debug("credit of %d peers stays pending: %s", len(self._pending), exc)
            return False
        self._pending = defaultdict(Counter)
        return True
