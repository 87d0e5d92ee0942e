"""The signalling wire protocol: message schemas, what gets signed, how it is verified.

Messages are JSON text frames on a websocket, size-capped and validated against
the ``*_SCHEMA`` constants before use:

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
import json
import struct
from dataclasses import dataclass
from typing import Any

from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, peer_id_for, verify_signature
from engine.net.schema import Int, Schema, SchemaRegistry, Str

PROTOCOL_VERSION = 1
SIGNAL_KINDS = ("offer", "answer", "reject")
NONCE_HEX_CHARS = 64
SESSION_HEX_CHARS = 32
MAX_SDP_CHARS = 48 * 1024
_PEER_ID = Str(16, 16)
_B64_KEY = Str(1, 64)
_B64_SIG = Str(1, 128)

# client -> server
REGISTER_SCHEMA = Schema("register", {"peer_id": _PEER_ID, "public_key": _B64_KEY, "signature": _B64_SIG})
SEND_SCHEMA = Schema("signal", {
    "to": _PEER_ID, "kind": Str(choices=SIGNAL_KINDS), "session": Str(SESSION_HEX_CHARS, SESSION_HEX_CHARS),
    "sdp": Str(0, MAX_SDP_CHARS), "signature": _B64_SIG})
# server -> client
CHALLENGE_SCHEMA = Schema("challenge", {"nonce": Str(NONCE_HEX_CHARS, NONCE_HEX_CHARS),
                                        "protocol": Int(PROTOCOL_VERSION, PROTOCOL_VERSION)})
REGISTERED_SCHEMA = Schema("registered", {"peer_id": _PEER_ID})
DELIVER_SCHEMA = Schema("signal", {**SEND_SCHEMA.fields, "from": _PEER_ID, "from_key": _B64_KEY})
ERROR_SCHEMA = Schema("error", {"reason": Str(0, 500), "session": Str(0, 64, required=False, nullable=True),
                                "to": Str(0, 64, required=False, nullable=True)})

SERVER_REGISTRATION = SchemaRegistry([REGISTER_SCHEMA])
SERVER_INBOUND = SchemaRegistry([SEND_SCHEMA])
CLIENT_INBOUND = SchemaRegistry([CHALLENGE_SCHEMA, REGISTERED_SCHEMA, DELIVER_SCHEMA, ERROR_SCHEMA])


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


def parse_json(text: Any, registry: SchemaRegistry, max_chars: int) -> dict:
    """Parse and validate one untrusted JSON text frame."""
    if not isinstance(text, str):
        raise ProtocolViolation("expected a JSON text frame")
    if len(text) > max_chars:
        raise ProtocolViolation(f"message of {len(text)} characters exceeds {max_chars}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolViolation(f"not valid JSON ({type(exc).__name__})") from exc
    return registry.validate(value)


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


def verify_delivered(message: dict, own_peer_id: str) -> SignedSignal:
    """Check a relayed signal (already schema-valid): key matches sender id, addressed
    to us, signature covers (kind, sender, recipient, session, sdp)."""
    key = b64decode_exact(message["from_key"], PUBLIC_KEY_BYTES, "from_key")
    signature = b64decode_exact(message["signature"], SIGNATURE_BYTES, "signature")
    sender = message["from"]
    if peer_id_for(key) != sender:
        raise AuthenticationError(f"the key relayed for {sender} does not hash to that peer id")
    if message["to"] != own_peer_id:
        raise AuthenticationError(f"a signal for {message['to']} was delivered to {own_peer_id}")
    verify_signature(key, signal_bytes(message["kind"], sender, message["to"], message["session"],
                                       message["sdp"]), signature)
    return SignedSignal(message["kind"], sender, key, message["to"], message["session"], message["sdp"])
