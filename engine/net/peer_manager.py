"""Opens and accepts :class:`~engine.net.peer_link.PeerLink` s by peer id through signalling.

:meth:`PeerManager.connect` makes an offer (full SDP, candidates gathered by
aiortc), sends it signed through the :class:`~engine.net.signalling.SignallingClient`
under a fresh session nonce, and applies the verified answer. Incoming verified
offers are answered and the new links handed to :meth:`PeerManager.accept` /
``on_link``. An offer or answer that fails verification is refused: the
connection is never made, the offerer's ``connect`` raises
:class:`~engine.net.errors.AuthenticationError`.

Policy kept here: one link per peer (a newer link replaces an older one, so
calling ``connect`` again is the reconnect); simultaneous offers between two
peers resolve to the offer of the lower peer id; a peer disconnected for
protocol violations is refused for ``ban_s``; a replayed offer (a session seen
before) is ignored; ``accept_peer`` may veto peers (e.g. only swarm members).
It does not know what the links carry.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from engine.net.errors import AuthenticationError, LinkClosed, ProtocolViolation
from engine.net.peer_link import LinkConfig, PeerLink
from engine.net.signalling_client import SignallingClient
from engine.net.signalling_protocol import SESSION_HEX_CHARS, SignalProblem, SignedSignal

log = logging.getLogger(__name__)

#: how many (peer, session) pairs of answered offers are remembered to refuse replays
SEEN_OFFERS_KEPT = 4096
#: prefix of a reject reason that means "your signature did not verify"
AUTH_REJECT_PREFIX = "auth: "


@dataclass(frozen=True)
class PeerManagerConfig:
    """Link policy.

    link: how each link is built (ICE servers, frame size, limits, strikes).
    connect_timeout_s: offer -> open channels, at most.
    ban_s: how long a peer disconnected for protocol violations is refused.
    max_links: most simultaneous links; further offers are refused.
    """

    link: LinkConfig = field(default_factory=LinkConfig)
    connect_timeout_s: float = 20.0
    ban_s: float = 60.0
    max_links: int = 64


@dataclass
class _Pending:
    peer_id: str
    link: PeerLink
    future: asyncio.Future


class PeerManager:
    """Links to peers, by peer id, over one signalling connection."""

    def __init__(self, signalling: SignallingClient, config: PeerManagerConfig | None = None, *,
                 sdp_filter: Callable[[str], str | Awaitable[str]] | None = None,
                 accept_peer: Callable[[str], bool] | None = None,
                 validator: Callable[[dict], Any] | None = None) -> None:
        self.signalling = signalling
        self.config = config or PeerManagerConfig()
        self.sdp_filter = sdp_filter
        self.accept_peer = accept_peer
        self.validator = validator
        #: called with every new open link (incoming and outgoing)
        self.on_link: Callable[[PeerLink], None] | None = None
        self._links: dict[str, PeerLink] = {}
        self._pending: dict[str, _Pending] = {}
        self._incoming: asyncio.Queue[PeerLink] = asyncio.Queue()
        self._banned_until: dict[str, float] = {}
        self._seen_offers: dict[tuple[str, str], None] = {}  # insertion-ordered: oldest first
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        signalling.on_signal = self._on_signal
        signalling.on_problem = self._on_problem

    @property
    def peer_id(self) -> str:
        return self.signalling.peer_id

    @property
    def links(self) -> dict[str, PeerLink]:
        """Open links by peer id (a copy)."""
        return {p: link for p, link in self._links.items() if not link.closed}

    def link(self, peer_id: str) -> PeerLink | None:
        link = self._links.get(peer_id)
        return link if link is not None and not link.closed else None

    def is_banned(self, peer_id: str) -> bool:
        until = self._banned_until.get(peer_id)
        return until is not None and time.monotonic() < until

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _outgoing_sdp(self, sdp: str) -> str:
        """``sdp`` through ``sdp_filter`` (sync, or async such as ``engine.net.wan_hub.hub_sdp_filter``)."""
        if self.sdp_filter is None:
            return sdp
        result = self.sdp_filter(sdp)
        return await result if inspect.isawaitable(result) else result

    # ------------------------------------------------------------ outgoing

    async def connect(self, peer_id: str, timeout_s: float | None = None) -> PeerLink:
        """Open a new link to ``peer_id`` (replacing any existing one) and wait until it is open."""
        if self._closed:
            raise LinkClosed("the peer manager is closed")
        if peer_id == self.peer_id:
            raise ValueError("cannot connect to oneself")
        timeout_s = self.config.connect_timeout_s if timeout_s is None else timeout_s
        session = secrets.token_hex(SESSION_HEX_CHARS // 2)
        link = PeerLink.create(peer_id, self.config.link, validator=self.validator)
        pending = _Pending(peer_id, link, asyncio.get_running_loop().create_future())
        self._pending[session] = pending
        try:
            result = await asyncio.wait_for(self._offer(link, session, pending), timeout_s)
        except asyncio.TimeoutError:
            await link.close()
            raise LinkClosed(f"no working link to {peer_id} within {timeout_s} s") from None
        except BaseException:
            await link.close()
            raise
        finally:
            self._pending.pop(session, None)
        if result is not link:  # simultaneous offers: the peer's offer won and is already adopted
            await link.close()
            return result
        self._adopt(link)
        return link

    async def _offer(self, link: PeerLink, session: str, pending: _Pending) -> PeerLink:
        from aiortc import RTCSessionDescription

        pc = link.pc
        await pc.setLocalDescription(await pc.createOffer())
        offer_sdp = await self._outgoing_sdp(pc.localDescription.sdp)
        await self.signalling.send(link.peer_id, "offer", session, offer_sdp)
        result = await pending.future
        if isinstance(result, PeerLink):
            return result
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=result.sdp, type="answer"))
        except Exception as exc:  # a signed but unusable answer: the peer's bug, not ours
            raise ProtocolViolation(f"the answer from {link.peer_id} is not usable SDP: {exc}") from exc
        await link.wait_open(None)
        return link

    async def ensure_link(self, peer_id: str, timeout_s: float | None = None) -> PeerLink:
        """The open link to ``peer_id``, connecting (again) if there is none."""
        link = self.link(peer_id)
        return link if link is not None else await self.connect(peer_id, timeout_s)

    # ------------------------------------------------------------ incoming

    async def accept(self, timeout_s: float | None = None) -> PeerLink:
        """The next link opened by a remote peer."""
        return await asyncio.wait_for(self._incoming.get(), timeout_s)

    def _on_signal(self, signal: SignedSignal) -> None:
        if self._closed:
            return
        if signal.kind == "offer":
            self._spawn(self._answer(signal), f"polis-answer-{signal.sender}")
            return
        pending = self._pending.get(signal.session)
        if pending is None or pending.peer_id != signal.sender or pending.future.done():
            log.debug("ignored a %s from %s for an unknown session", signal.kind, signal.sender)
            return
        if signal.kind == "answer":
            pending.future.set_result(signal)
        else:  # reject (signed by the peer itself)
            reason = signal.sdp[:300]
            if reason.startswith(AUTH_REJECT_PREFIX):
                pending.future.set_exception(AuthenticationError(
                    f"{signal.sender} refused the connection: {reason[len(AUTH_REJECT_PREFIX):]}"))
            else:
                pending.future.set_exception(LinkClosed(f"{signal.sender} refused the connection: {reason}"))

    def _on_problem(self, problem: SignalProblem) -> None:
        pending = self._pending.get(problem.session) if problem.session else None
        if pending is not None and not pending.future.done():
            error = AuthenticationError if problem.authentication_failed else LinkClosed
            pending.future.set_exception(error(f"connection to {pending.peer_id} refused: {problem.reason}"))
            return
        if problem.authentication_failed and problem.kind == "offer" and problem.sender and problem.session:
            self._spawn(self._reject(problem.sender, problem.session, AUTH_REJECT_PREFIX + problem.reason),
                        f"polis-reject-{problem.sender}")

    async def _reject(self, peer_id: str, session: str, reason: str) -> None:
        log.warning("refused a connection from %s: %s", peer_id, reason)
        try:
            await self.signalling.send(peer_id, "reject", session, reason[:300])
        except LinkClosed:
            pass

    async def _answer(self, offer: SignedSignal) -> None:
        from aiortc import RTCSessionDescription

        peer = offer.sender
        if (peer, offer.session) in self._seen_offers:
            log.warning("ignored a replayed offer from %s", peer)
            return
        self._seen_offers[(peer, offer.session)] = None
        while len(self._seen_offers) > SEEN_OFFERS_KEPT:
            self._seen_offers.pop(next(iter(self._seen_offers)))
        if self.is_banned(peer):
            await self._reject(peer, offer.session, "banned for protocol violations")
            return
        if self.accept_peer is not None and not self.accept_peer(peer):
            await self._reject(peer, offer.session, "not accepted by this node")
            return
        if peer not in self._links and len(self.links) >= self.config.max_links:
            await self._reject(peer, offer.session, "too many links")
            return
        ours = [p for p in self._pending.values() if p.peer_id == peer and not p.future.done()]
        if ours and self.peer_id < peer:
            log.debug("simultaneous offers with %s: ours stands", peer)
            return
        link = PeerLink.create(peer, self.config.link, validator=self.validator)
        try:
            pc = link.pc
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=offer.sdp, type="offer"))
            except Exception as exc:
                await self._reject(peer, offer.session, f"offer is not usable SDP: {type(exc).__name__}")
                raise ProtocolViolation(f"unusable offer: {exc}") from exc
            await pc.setLocalDescription(await pc.createAnswer())
            answer_sdp = await self._outgoing_sdp(pc.localDescription.sdp)
            await self.signalling.send(peer, "answer", offer.session, answer_sdp)
            await link.wait_open(self.config.connect_timeout_s)
        except Exception as exc:  # aiortc raises its own errors; an offer must never crash the node
            log.warning("incoming link from %s failed: %s: %s", peer, type(exc).__name__, exc)
            await link.close()
            return
        if self._closed:
            await link.close()
            return
        self._adopt(link)
        claimed = False
        for pending in ours:
            if not pending.future.done():
                pending.future.set_result(link)
                claimed = True
        if not claimed:
            self._incoming.put_nowait(link)

    # ------------------------------------------------------------ bookkeeping

    def _adopt(self, link: PeerLink) -> None:
        old = self._links.get(link.peer_id)
        if old is not None and old is not link and not old.closed:
            log.info("a new link to %s replaces the old one", link.peer_id)
            self._spawn(old.close(), f"polis-replace-{link.peer_id}")
        self._links[link.peer_id] = link
        link.add_close_callback(self._on_link_closed)
        log.info("link to %s open", link.peer_id)
        if self.on_link is not None:
            try:
                self.on_link(link)
            except Exception:
                log.exception("on_link callback failed for %s", link.peer_id)

    def _on_link_closed(self, link: PeerLink) -> None:
        if self._links.get(link.peer_id) is link:
            del self._links[link.peer_id]
        if link.closed_reason == "strikes":
            self._banned_until[link.peer_id] = time.monotonic() + self.config.ban_s
            log.warning("peer %s banned for %.0f s after protocol violations", link.peer_id, self.config.ban_s)

    async def close(self) -> None:
        """Close every link and stop answering offers (the signalling client stays the caller's)."""
        self._closed = True
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(LinkClosed("the peer manager is closing"))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in list(self._links.values())), return_exceptions=True)
        self._links.clear()
