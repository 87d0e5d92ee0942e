"""The signalling wire protocol: typed messages, what gets signed, how it is verified.

Messages are JSON text frames on a websocket, size-capped and decoded into the
typed structs below (``engine.net.wire``) before use:

* server -> peer ``challenge`` {nonce}; peer -> server ``register`` {peer_id,
  public_key, signature over (nonce, public key)}; server -> peer ``registered``;
* peer -> server ``signal`` {to, kind: offer|answer|reject, session, sdp,
  signature over (kind, sender, recipient, session, sdp)}; the server forwards it
  with ``from`` and ``from_key`` (the key it verified at registration);
* server -> peer ``error`` {reason, session?, to?}.

A receiver trusts a relayed signal only if hash(from_key) == from and the
signature verifies, so a relay can neither forge nor alter an SDP (and with it
the DTLS fingerprint). Nothing here opens sockets; see
:mod:`engine.net.signalling` (server) and :mod:`engine.net.signalling_client`.
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, peer_id_for, verify_signature
from engine.net.wire import MessageSet, WireMessage

PROTOCOL_VERSION = 1
SIGNAL_KINDS = ("offer", "answer", "reject")
NONCE_HEX_CHARS = 64
SESSION_HEX_CHARS = 32
MAX_SDP_CHARS = 48 * 1024
#: no signalling message may be longer than this (characters), whatever a config says
MAX_MESSAGE_CHARS = 1024 * 1024
PeerId = Annotated[str, Meta(min_length=16, max_length=16)]
B64Key = Annotated[str, Meta(min_length=1, max_length=64)]
B64Signature = Annotated[str, Meta(min_length=1, max_length=128)]
SessionId = Annotated[str, Meta(min_length=SESSION_HEX_CHARS, max_length=SESSION_HEX_CHARS)]
SignalKind = Literal["offer", "answer", "reject"]


# ---------------------------------------------------------------- client -> server
class Register(WireMessage, frozen=True, tag="register"):
    peer_id: PeerId  # hash of public_key
    public_key: B64Key  # base64 Ed25519 public key
    signature: B64Signature  # base64, over registration_bytes(nonce, public key)


class SendSignal(WireMessage, frozen=True, tag="signal"):
    to: PeerId  # the recipient
    kind: SignalKind  # offer | answer | reject
    session: SessionId  # hex id of the WebRTC session this signal belongs to
    sdp: Annotated[str, Meta(max_length=MAX_SDP_CHARS)]  # the SDP ("" for reject)
    signature: B64Signature  # base64, over signal_bytes(kind, sender, to, session, sdp)


# ---------------------------------------------------------------- server -> client
class Challenge(WireMessage, frozen=True, tag="challenge"):
    nonce: Annotated[str, Meta(min_length=NONCE_HEX_CHARS, max_length=NONCE_HEX_CHARS)]  # hex, to sign
    protocol: Annotated[int, Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)]  # PROTOCOL_VERSION


class Registered(WireMessage, frozen=True, tag="registered"):
    peer_id: PeerId  # the id the server registered


class DeliveredSignal(WireMessage, frozen=True, tag="signal"):
    to: PeerId  # the recipient (must be us)
    kind: SignalKind  # offer | answer | reject
    session: SessionId  # hex session id
    sdp: Annotated[str, Meta(max_length=MAX_SDP_CHARS)]  # the SDP
    signature: B64Signature  # the sender's signature
    sender: PeerId = msgspec.field(name="from")  # the sender, as the server registered it
    from_key: B64Key  # the sender's key the server verified at registration


class Error(WireMessage, frozen=True, tag="error"):
    reason: Annotated[str, Meta(max_length=500)]  # in words
    session: Annotated[str, Meta(max_length=64)] | None = None  # the session of the refused signal
    to: Annotated[str, Meta(max_length=64)] | None = None  # the recipient of the refused signal


SERVER_REGISTRATION: MessageSet[Register] = MessageSet("signalling register", Register,
                                                       max_size=MAX_MESSAGE_CHARS)
SERVER_INBOUND: MessageSet[SendSignal] = MessageSet("signalling inbound", SendSignal, max_size=MAX_MESSAGE_CHARS)
ClientInbound = Union[Challenge, Registered, DeliveredSignal, Error]
CLIENT_INBOUND: MessageSet[ClientInbound] = MessageSet("signalling client", ClientInbound,
                                                       max_size=MAX_MESSAGE_CHARS)


def _length_prefixed(*parts: bytes) -> bytes:
    return b"".join(struct.pack("!I", len(p)) + p for p in parts)


def registration_bytes(nonce: bytes, public_key: bytes) -> bytes:
    """What a peer signs to register: domain tag, server nonce, its public key."""
    return _length_prefixed(b"polis-register-v1", nonce, public_key)


def signal_bytes(kind: str, sender: str, recipient: str, session: str, sdp: str) -> bytes:
    """What a peer signs for each signal (the SDP carries the DTLS fingerprint)."""
    return _length_prefixed(b"polis-signal-v1", *(s.encode("utf-8") for s in (kind, sender, recipient, session, sdp)))


def b64decode_exact(text: str, size: int, what: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolViolation(f"{what} is not base64") from exc
    if len(raw) != size:
        raise ProtocolViolation(f"{what} has {len(raw)} bytes, expected {size}")
    return raw


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def parse_json(text: Any, messages: MessageSet[Any], max_chars: int) -> Any:
    """Decode and validate one untrusted JSON text frame into its struct."""
    if not isinstance(text, str):
        raise ProtocolViolation("expected a JSON text frame")
    if len(text) > max_chars:
        raise ProtocolViolation(f"message of {len(text)} characters exceeds {max_chars}")
    return messages.decode_json(text)


@dataclass(frozen=True)
class SignalProblem:
    """A signal that could not be delivered (server error) or failed verification.

    sender: the claimed sender (None for server errors about our own signals).
    recipient: for server errors, the peer our signal was meant for.
    """

    reason: str
    session: str | None = None
    kind: str | None = None
    sender: str | None = None
    recipient: str | None = None
    authentication_failed: bool = False


@dataclass(frozen=True)
class SignedSignal:
    """A signal whose signature has been verified against ``sender_key``."""

    kind: str
    sender: str
    sender_key: bytes
    recipient: str
    session: str
    sdp: str


def verify_delivered(message: DeliveredSignal, own_peer_id: str) -> SignedSignal:
    """Check a relayed signal (already decoded): key matches sender id, addressed
    to us, signature covers (kind, sender, recipient, session, sdp)."""
    key = b64decode_exact(message.from_key, PUBLIC_KEY_BYTES, "from_key")
    signature = b64decode_exact(message.signature, SIGNATURE_BYTES, "signature")
    sender = message.sender
    if peer_id_for(key) != sender:
        raise AuthenticationError(f"the key relayed for {sender} does not hash to that peer id")
    if message.to != own_peer_id:
        raise AuthenticationError(f"a signal for {message.to} was delivered to {own_peer_id}")
    verify_signature(key, signal_bytes(message.kind, sender, message.to, message.session, message.sdp), signature)
    return SignedSignal(message.kind, sender, key, message.to, message.session, message.sdp)
