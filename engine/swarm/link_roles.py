"""Which trainers serve generation only because their links would set every step's pace.

Every optimiser step waits for each training route's micro-batches and each replica's gradient
share, so one trainer on a slow link puts its round trips on the path of every step, however few
rows the route weights give it (measured on ``home``, 150 ms and 1 % loss against ``metro``'s 20 ms:
the swarm kept 0.32-0.38 of its pace with that node training, and all of it, 1.03x, with the same
node generating only). A generation job waits for no step: an *inference replica* (it follows its
stage's weight stream, downloads only) adds generation throughput wherever its link is.

So the coordinator moves a trainer to the inference role when its link is far slower than the
swarm's (:func:`slow_link_trainers`):

* its round trip (:func:`node_rtt_s`: the median over its links of the smaller of both ends'
  figures, so a peer that lies about its links cannot make an honest node look slow) is at least
  ``RTT_RATIO`` times the swarm's typical node's and ``MIN_EXCESS_S`` more (:func:`typical_rtt_s`:
  the median over the other nodes of their round trips *without their links to it*: counted in, a
  peer with two links, one of them to the slow node, was judged by their mean, and the slow node
  escaped; a median over links, a second slow node's many links set the bar);
* its stage keeps at least one trainer, and the stage's fastest trainer is never moved;
* only nodes measured over at least ``MIN_LINKS`` links.

A node keeps the inference role until its stage has no trainer left, then it trains again (the
coordinator's ``_node_left``). Moves are rare and cost the node a reload from its stage's leader.

Uplinks are left to ``engine.swarm.bandwidth_placement`` (which stage a node joins): what the
coordinator knows of an uplink is a claim or a lower bound (the fastest a link was seen sending),
and judging roles by it moved well-connected ``metro`` nodes whose links were simply not busy.

What it does not know: sessions, messages, how roles are changed on the wire.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence

#: a trainer whose round trip is at least this many times the typical node's (``typical_rtt_s``) ...
RTT_RATIO = 3.0
#: ... and at least this many seconds above it serves generation only
MIN_EXCESS_S = 0.05
#: links a node must have measured before its round trip is judged
MIN_LINKS = 2
#: seconds between two reviews of the trainers' links
REVIEW_EVERY_S = 10.0


def node_rtt_s(peer: str, reported: Mapping[tuple[str, str], float], *, without: str | None = None,
               min_links: int = MIN_LINKS) -> float | None:
    """``peer``'s typical round trip: over each link it reported (``reported[(reporter, other)]``, seconds),
    but its link to ``without``, the smaller of its figure and the other end's, then the median (None:
    fewer than ``min_links``)."""
    hops = [min(rtt, reported.get((other, peer), rtt)) for (reporter, other), rtt in reported.items()
            if reporter == peer and other != without]
    return statistics.median(hops) if hops and len(hops) >= min_links else None


def typical_rtt_s(peer: str, others: Iterable[str], reported: Mapping[tuple[str, str], float]) -> float | None:
    """The median over ``others`` of their round trips without their links to ``peer`` (None: none measured)."""
    rtts = [r for q in others if q != peer and (r := node_rtt_s(q, reported, without=peer, min_links=1)) is not None]
    return statistics.median(rtts) if rtts else None


def slow_link_trainers(trainers: Sequence[Sequence[str]], reported: Mapping[tuple[str, str], float]) -> dict[str, str]:
    """Trainers to move to the inference role, with why (in words a user can act on).

    ``trainers``: the ready trainers of each stage; ``reported[(reporter, other)]``: the round trips
    (seconds) each node reported of its links."""
    measured = {p: r for stage in trainers for p in stage if (r := node_rtt_s(p, reported)) is not None}
    everyone = [p for stage in trainers for p in stage]
    out: dict[str, str] = {}
    for peers in trainers:
        if len(peers) < 2:
            continue
        fastest = min(peers, key=lambda p: (measured.get(p, 0.0), p))
        keep = len(peers)
        for peer in sorted(peers, key=lambda p: -measured.get(p, 0.0)):
            if peer == fastest or keep <= 1:
                continue
            rtt, typical = measured.get(peer), typical_rtt_s(peer, everyone, reported)
            if rtt is None or typical is None:
                continue
            if rtt >= RTT_RATIO * typical and rtt - typical >= MIN_EXCESS_S:
                out[peer] = (f"its links' round trips ({1e3 * rtt:.0f} ms) are {rtt / max(typical, 1e-6):.0f}x the "
                             f"swarm's ({1e3 * typical:.0f} ms), and every training step would wait for them; on a "
                             f"faster or nearer connection it trains when it joins again")
                keep -= 1
    return out
