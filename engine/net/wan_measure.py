"""Measures a real WebRTC transfer across the WAN emulator (for tests and ``polis bench transport``).

Two :class:`~engine.net.peer_link.PeerLink` objects in this process are joined
through a :class:`~engine.net.wan_emulator.WanLink` or a
:class:`~engine.net.wan_relay_pair.UdpRelayPair` (their SDPs rewritten so every
packet crosses the relay); one sends a tensor over the bulk channel, the
other decodes it and checks it bit for bit. Reported: whether it arrived
intact, goodput, a small-message round trip, and the relay's counters.

What this module does not know: signalling or identities (the SDPs are handed
across directly), or what the bench does with the figures.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from engine.net.peer_link import LinkConfig, PeerLink
from engine.net.tensor_codec import decode_tensor, encode_tensor
from engine.net.wan_emulator import ImpairmentProfile, WanLink, sdp_host_candidates
from engine.net.wan_relay_pair import UdpRelayPair, static_sdp_filter

#: The issue's reference WAN: 50 ms one way, 20 Mbit/s, 1 % loss (both directions).
REFERENCE_WAN = ImpairmentProfile(delay_ms=50.0, bandwidth_mbps=20.0, loss_percent=1.0)


async def negotiate_through(pc_a, pc_b, filter_a: Callable[[str], str], filter_b: Callable[[str], str], *,
                            relay_host: str = "127.0.0.1") -> None:
    """Offer from ``pc_a``, answer from ``pc_b``, each SDP passed through its side's filter.

    Refuses (RuntimeError) if a candidate in either SDP is not on ``relay_host``.
    """
    from aiortc import RTCSessionDescription

    await pc_a.setLocalDescription(await pc_a.createOffer())
    offer = filter_a(pc_a.localDescription.sdp)
    await pc_b.setRemoteDescription(RTCSessionDescription(offer, "offer"))
    await pc_b.setLocalDescription(await pc_b.createAnswer())
    answer = filter_b(pc_b.localDescription.sdp)
    await pc_a.setRemoteDescription(RTCSessionDescription(answer, "answer"))
    if not all(ip == relay_host for ip, _ in sdp_host_candidates(offer) + sdp_host_candidates(answer)):
        raise RuntimeError("a candidate bypasses the relay")


async def connect_through(filter_a: Callable[[str], str], filter_b: Callable[[str], str], *,
                          relay_host: str = "127.0.0.1", open_timeout_s: float = 30.0,
                          config: LinkConfig | None = None) -> tuple[PeerLink, PeerLink]:
    """Two open links, "a" (offerer) and "b", whose SDPs pass through the given filters.

    Refuses (RuntimeError) if a candidate in either SDP is not on ``relay_host``.
    """
    a, b = PeerLink.create("wan-peer-b", config), PeerLink.create("wan-peer-a", config)
    try:
        await negotiate_through(a.pc, b.pc, filter_a, filter_b, relay_host=relay_host)
        await asyncio.gather(a.wait_open(open_timeout_s), b.wait_open(open_timeout_s))
    except BaseException:
        await asyncio.gather(a.close(), b.close(), return_exceptions=True)
        raise
    return a, b


async def wan_transfer(total_bytes: int = 2 * 1024 * 1024, *, profile: ImpairmentProfile = REFERENCE_WAN,
                       reverse: ImpairmentProfile | None = None, encoding: str = "fp32", seed: int = 0,
                       relay: str = "wanlink", timeout_s: float = 180.0) -> dict[str, Any]:
    """Send a float32 tensor of ``total_bytes`` (before encoding) a->b across an emulated WAN.

    ``relay``: ``"wanlink"`` (:class:`WanLink`, registers both SDPs' candidates) or
    ``"pair"`` (:class:`UdpRelayPair` with static filters, as separate processes would use).
    """
    if relay == "wanlink":
        wan: WanLink | UdpRelayPair = WanLink(profile, reverse, seed=seed)
        filters = (wan.sdp_filter("a"), wan.sdp_filter("b"))
    elif relay == "pair":
        wan = await UdpRelayPair(profile, reverse, seed=seed).start()
        filters = (static_sdp_filter(wan.advertised_by("a")), static_sdp_filter(wan.advertised_by("b")))
    else:
        raise ValueError("relay must be 'wanlink' or 'pair'")
    try:
        a, b = await connect_through(*filters)
        try:
            started = time.monotonic()
            await a.send({"type": "ping"}, b"", channel="control")
            await asyncio.wait_for(b.recv(), timeout_s)
            await b.send({"type": "pong"}, b"", channel="control")
            await asyncio.wait_for(a.recv(), timeout_s)
            rtt_s = time.monotonic() - started

            tensor = np.random.default_rng(seed).standard_normal(max(1, total_bytes // 4)).astype(np.float32)
            encoded = encode_tensor(tensor, encoding)
            started = time.monotonic()
            await a.send({"type": "tensor", "tensor": encoded.header}, encoded.payload, channel="bulk")
            header, payload = await asyncio.wait_for(b.recv(), timeout_s)
            seconds = time.monotonic() - started
            received = decode_tensor(header["tensor"], payload, max_elements=tensor.size,
                                     expected_shape=tensor.shape)
            reference = decode_tensor(encoded.header, encoded.payload, max_elements=tensor.size,
                                      expected_shape=tensor.shape)
        finally:
            await asyncio.gather(a.close(), b.close(), return_exceptions=True)
    finally:
        await wan.close()
    return {
        "intact": bool(np.array_equal(received.view(np.uint32), reference.view(np.uint32))),
        "encoding": encoding,
        "fp32_bytes": int(tensor.nbytes),
        "wire_bytes": len(encoded.payload),
        "seconds": seconds,
        "goodput_mb_s": len(encoded.payload) / seconds / 1e6,
        "fp32_equivalent_mb_s": tensor.nbytes / seconds / 1e6,
        "rtt_ms": rtt_s * 1e3,
        "profile": asdict(profile),
        "relay_kind": relay,
        "relay": wan.stats(),
    }
