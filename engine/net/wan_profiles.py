"""Named internet-link profiles for emulated swarms, and how two ends make one link.

A :class:`WanProfile` describes one node's *access link* as seen from the rest of
the swarm: the round trip to a peer on the same kind of link (``rtt_ms``), random
loss, uplink and downlink rates, jitter. The built-in table (:data:`BUILTIN`):

========== ======= ====== ========= =========== ==========
name       rtt_ms  loss %  up Mbit/s down Mbit/s jitter_ms
========== ======= ====== ========= =========== ==========
metro        20     0.1     200        200         1
continental  80     0.5      50         50         2
home        150     1.0      10         50        10
========== ======= ====== ========= =========== ==========

Users add their own in a TOML file (``--wan-profiles FILE`` or ``POLIS_WAN_PROFILES``)::

    [profiles.satellite]
    rtt_ms = 600
    loss_percent = 1.0
    up_mbps = 5
    down_mbps = 50
    jitter_ms = 20

A swarm's *mix* names one profile per node: ``continental`` (every node), or
``home:1,metro`` (node 1 on ``home``, the rest on ``metro``); indexes may be
listed (``home:1+3``) or ranged (``home:0-2``); :func:`parse_mix`.

How two ends make a link (:func:`link_impairment`), per direction A -> B: one-way
delay ``(A.rtt_ms + B.rtt_ms) / 4`` (two nodes on one profile see its RTT), loss
and jitter the mean of the two ends, rate ``min(A.up_mbps, B.down_mbps)``. A
node's link to the coordinator (:func:`coordinator_impairment`) is its own
profile in full: one-way ``rtt_ms / 2``, its up and down rates (TCP: no loss).

What this module does not know: sockets, relays, WebRTC or which node is which.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Mapping

import msgspec

from engine.net.wan_emulator import ImpairmentProfile

#: environment variable naming a TOML file of extra profiles
PROFILES_ENV = "POLIS_WAN_PROFILES"
#: largest profile file read (bytes)
MAX_PROFILE_FILE_BYTES = 64 * 1024
#: most nodes a mix may name
MAX_MIX_NODES = 4096

_Name = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]


class WanProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One access link (see the module docstring); every field bounded."""

    #: round trip to a peer on the same kind of link, milliseconds
    rtt_ms: Annotated[float, msgspec.Meta(ge=0, le=10_000)]
    #: random packet loss, percent
    loss_percent: Annotated[float, msgspec.Meta(ge=0, le=50)] = 0.0
    #: uplink rate, megabits per second
    up_mbps: Annotated[float, msgspec.Meta(gt=0, le=100_000)]
    #: downlink rate, megabits per second
    down_mbps: Annotated[float, msgspec.Meta(gt=0, le=100_000)]
    #: uniform delay jitter, +- milliseconds (per end)
    jitter_ms: Annotated[float, msgspec.Meta(ge=0, le=1_000)] = 0.0


class _ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    profiles: dict[_Name, WanProfile]


BUILTIN: dict[str, WanProfile] = {
    "metro": WanProfile(rtt_ms=20, loss_percent=0.1, up_mbps=200, down_mbps=200, jitter_ms=1),
    "continental": WanProfile(rtt_ms=80, loss_percent=0.5, up_mbps=50, down_mbps=50, jitter_ms=2),
    "home": WanProfile(rtt_ms=150, loss_percent=1.0, up_mbps=10, down_mbps=50, jitter_ms=10),
}


def load_profiles(extra_file: str | os.PathLike | None = None) -> dict[str, WanProfile]:
    """The built-in profiles plus those of ``extra_file`` (default: ``$POLIS_WAN_PROFILES``), which win."""
    profiles = dict(BUILTIN)
    path = extra_file or os.environ.get(PROFILES_ENV) or None
    if path is None:
        return profiles
    path = Path(path)
    try:
        raw = path.read_bytes()[:MAX_PROFILE_FILE_BYTES + 1]
    except OSError as exc:
        raise ValueError(f"cannot read the WAN profile file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PROFILE_FILE_BYTES:
        raise ValueError(f"the WAN profile file {path} is larger than {MAX_PROFILE_FILE_BYTES} bytes")
    try:
        profiles.update(msgspec.toml.decode(raw, type=_ProfileFile).profiles)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"the WAN profile file {path} is not valid: {exc} (see `polis demo -h`)") from None
    return profiles


def _indexes(text: str, count: int) -> list[int]:
    out: list[int] = []
    for part in text.split("+"):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"'{text}' is not a node index list (e.g. 1, 1+3 or 0-2)")
        first, last = int(low), int(high or low)
        if last < first or last >= count:
            raise ValueError(f"node indexes '{text}' are out of range: the swarm has nodes 0-{count - 1}")
        out.extend(range(first, last + 1))
    return out


def parse_mix(spec: str, node_count: int, profiles: Mapping[str, WanProfile] | None = None) -> list[str]:
    """Profile name of each of ``node_count`` nodes for a mix such as ``home:1,metro`` (see the module docstring)."""
    profiles = BUILTIN if profiles is None else profiles
    if not 1 <= node_count <= MAX_MIX_NODES:
        raise ValueError(f"a mix is for 1-{MAX_MIX_NODES} nodes")
    chosen: list[str | None] = [None] * node_count
    default: str | None = None
    for item in (s.strip() for s in spec.split(",")):
        name, colon, where = item.partition(":")
        if name not in profiles:
            raise ValueError(f"unknown WAN profile '{name}' (known: {', '.join(sorted(profiles))})")
        if not colon:
            if default is not None:
                raise ValueError(f"'{spec}' names two default profiles; give the others node indexes (home:1)")
            default = name
            continue
        for i in _indexes(where, node_count):
            if chosen[i] is not None:
                raise ValueError(f"node {i} is named twice in '{spec}'")
            chosen[i] = name
    missing = [i for i, c in enumerate(chosen) if c is None]
    if missing and default is None:
        raise ValueError(f"'{spec}' leaves nodes {missing} without a profile; add a default (e.g. ',metro')")
    return [c or default for c in chosen]  # type: ignore[misc]


def link_impairment(sender: WanProfile, receiver: WanProfile) -> ImpairmentProfile:
    """What the emulated link does to packets from a node on ``sender`` to one on ``receiver``."""
    return ImpairmentProfile(delay_ms=(sender.rtt_ms + receiver.rtt_ms) / 4,
                             jitter_ms=(sender.jitter_ms + receiver.jitter_ms) / 2,
                             loss_percent=(sender.loss_percent + receiver.loss_percent) / 2,
                             bandwidth_mbps=min(sender.up_mbps, receiver.down_mbps))


def coordinator_impairment(profile: WanProfile) -> tuple[ImpairmentProfile, ImpairmentProfile]:
    """(node -> coordinator, coordinator -> node) for a node on ``profile``: delay and rate only."""
    one_way = profile.rtt_ms / 2
    return (ImpairmentProfile(delay_ms=one_way, bandwidth_mbps=profile.up_mbps),
            ImpairmentProfile(delay_ms=one_way, bandwidth_mbps=profile.down_mbps))
