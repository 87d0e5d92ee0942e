"""A node's Ed25519 identity: key pair, peer id, fingerprint, signatures, storage.

The private key lives in the OS keyring (``keyring``, service ``"polis"``). Where
the only keyring backend is keyring's fail/null backend (priority <= 0, e.g. a
headless Linux box) or the keyring refuses to store, the key is kept in a file
readable only by its owner (mode 0600) in the user data directory, and
:attr:`Identity.storage` / :attr:`Identity.storage_note` say so, so the GUI can
tell the user.

* peer id  = the first 16 hex digits of sha256(raw 32-byte public key);
* fingerprint = the first 128 bits of that hash, grouped for humans;
* a pinned URL (:func:`pin_url` / :func:`split_pinned_url`): a coordinator's URL whose fragment
  ``#key=<base64url public key>`` names the key the coordinator must prove it holds (the
  fragment never reaches the server);
* a service key (:func:`load_or_create_key_file`): a coordinator's own identity, in a 0600 file
  next to its database (never the OS keyring entry of the machine's node identity).

Keys never reach logs: ``repr``/``str`` show the peer id only and an identity
refuses to be pickled. This module knows nothing about sockets or signalling;
callers build their own domain-separated messages to sign.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from engine.atomic_file import atomic_write_text
from engine.net.errors import AuthenticationError

log = logging.getLogger(__name__)

KEYRING_SERVICE = "polis"
KEYRING_USERNAME = "node-identity-ed25519"
KEY_FILE_NAME = "identity-ed25519.key"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_HEX_CHARS = 16
_SECRET_PREFIX = "polis-ed25519-v1:"


def peer_id_for(public_key: bytes) -> str:
    """The peer id of a raw 32-byte Ed25519 public key."""
    if not isinstance(public_key, (bytes, bytearray)) or len(public_key) != PUBLIC_KEY_BYTES:
        raise AuthenticationError("public key must be 32 raw bytes")
    return hashlib.sha256(bytes(public_key)).hexdigest()[:PEER_ID_HEX_CHARS]


def fingerprint_for(public_key: bytes) -> str:
    """A human-comparable fingerprint: 8 groups of 4 hex digits."""
    digest = hashlib.sha256(bytes(public_key)).hexdigest()[:32].upper()
    return "-".join(digest[i:i + 4] for i in range(0, 32, 4))


PIN_PREFIX = "key="


def pin_url(url: str, public_key: bytes) -> str:
    """``url`` with the fragment that pins ``public_key`` (replacing any fragment it had)."""
    key = base64.urlsafe_b64encode(bytes(public_key)).decode().rstrip("=")
    return url.split("#", 1)[0] + "#" + PIN_PREFIX + key


def split_pinned_url(url: str) -> tuple[str, bytes | None]:
    """``(url without its fragment, pinned public key or None)``; a malformed pin raises ValueError."""
    bare, _, fragment = url.partition("#")
    if not fragment:
        return bare, None
    if not fragment.startswith(PIN_PREFIX):
        raise ValueError("the swarm URL's '#' part must be 'key=<the coordinator's public key>'")
    text = fragment[len(PIN_PREFIX):]
    try:
        key = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, binascii.Error) as exc:
        raise ValueError("the swarm URL's pinned key is not base64url") from exc
    if len(key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"the swarm URL's pinned key must be {PUBLIC_KEY_BYTES} bytes")
    return bare, key


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Raise :class:`AuthenticationError` unless ``signature`` is ``public_key``'s over ``message``."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        raise AuthenticationError("signature must be 64 bytes")
    if not isinstance(public_key, (bytes, bytearray)) or len(public_key) != PUBLIC_KEY_BYTES:
        raise AuthenticationError("public key must be 32 raw bytes")
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(message))
    except (InvalidSignature, ValueError) as exc:
        raise AuthenticationError("signature does not match the public key") from exc


def _encode_secret(private_key: Ed25519PrivateKey) -> str:
    raw = private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
    return _SECRET_PREFIX + base64.b64encode(raw).decode("ascii")


def _decode_secret(text: str, where: str) -> Ed25519PrivateKey:
    text = text.strip()
    if not text.startswith(_SECRET_PREFIX):
        raise AuthenticationError(f"the stored identity in {where} is not a Polis Ed25519 key")
    try:
        raw = base64.b64decode(text[len(_SECRET_PREFIX):], validate=True)
        return Ed25519PrivateKey.from_private_bytes(raw)
    except ValueError as exc:
        raise AuthenticationError(f"the stored identity in {where} is corrupt") from exc


class Identity:
    """An Ed25519 key pair with its peer id. Create with :meth:`generate` or
    :func:`load_or_create_identity`."""

    __slots__ = ("_private_key", "public_key", "peer_id", "fingerprint", "storage", "storage_note")

    def __init__(self, private_key: Ed25519PrivateKey, *, storage: str = "memory",
                 storage_note: str = "The identity exists only in memory (not stored).") -> None:
        self._private_key = private_key
        #: raw 32-byte public key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.peer_id: str = peer_id_for(self.public_key)
        self.fingerprint: str = fingerprint_for(self.public_key)
        #: "keyring", "file" or "memory"
        self.storage: str = storage
        #: one sentence for humans saying where the private key is kept
        self.storage_note: str = storage_note

    @classmethod
    def generate(cls) -> "Identity":
        """A fresh identity kept only in memory (tests, benches, throw-away peers)."""
        return cls(Ed25519PrivateKey.generate())

    def sign(self, message: bytes) -> bytes:
        """Sign ``message``; returns the 64-byte signature."""
        return self._private_key.sign(bytes(message))

    def verify(self, message: bytes, signature: bytes) -> None:
        """Check a signature made by this identity (raises AuthenticationError)."""
        verify_signature(self.public_key, message, signature)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id}, storage={self.storage})"

    __str__ = __repr__

    def __reduce__(self):  # never let a private key travel by pickle (or into a log by accident)
        raise TypeError("an Identity cannot be pickled; load it in each process")

    def __getstate__(self):
        raise TypeError("an Identity cannot be pickled; load it in each process")


@dataclass(frozen=True)
class IdentityStoreConfig:
    """Where :func:`load_or_create_identity` keeps the private key.

    service, username: the keyring entry (service ``"polis"``).
    fallback_dir: directory of the 0600 fallback file; None = ``engine.paths.user_data_dir()``.
    """

    service: str = KEYRING_SERVICE
    username: str = KEYRING_USERNAME
    fallback_dir: Path | None = None

    def key_file(self) -> Path:
        if self.fallback_dir is not None:
            directory = Path(self.fallback_dir)
            directory.mkdir(parents=True, exist_ok=True)
        else:
            from engine.paths import user_data_dir

            directory = user_data_dir()
        return directory / KEY_FILE_NAME


def _usable_keyring():
    """The active keyring backend, or None when it is the fail/null backend."""
    import keyring

    backend = keyring.get_keyring()
    try:
        priority = float(backend.priority)
    except Exception:  # a backend whose priority probe itself fails is unusable
        return None
    return backend if priority > 0 else None


def _read_key_file(path: Path) -> Ed25519PrivateKey:
    if sys.platform != "win32":
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("identity file %s was readable by others (mode %o); restricting it to 0600", path, mode)
            os.chmod(path, 0o600)
    return _decode_secret(path.read_text(encoding="ascii"), str(path))


def _write_key_file(path: Path, private_key: Ed25519PrivateKey) -> None:
    """Write atomically with 0600 permissions from the first byte on."""
    atomic_write_text(path, _encode_secret(private_key) + "\n", mode=0o600, encoding="ascii")


def _file_identity(path: Path, reason: str) -> Identity:
    if path.exists():
        key = _read_key_file(path)
        created = False
    else:
        key = Ed25519PrivateKey.generate()
        _write_key_file(path, key)
        created = True
    note = (f"{reason} Your identity key is stored in {path}, readable only by your user account.")
    identity = Identity(key, storage="file", storage_note=note)
    log.info("identity %s %s from file %s (%s)", identity.peer_id, "created" if created else "loaded",
             path, reason)
    return identity


def load_or_create_key_file(path: Path, what: str = "coordinator") -> Identity:
    """A service's identity kept in the 0600 file ``path`` (created on first use)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _file_identity(path, f"The {what} keeps its own key.")


def load_or_create_identity(config: IdentityStoreConfig | None = None) -> Identity:
    """Load this node's identity, creating and storing one on first use.

    Order: an existing fallback file wins (so the peer id never changes silently);
    then the OS keyring; when the keyring is the fail backend or refuses to store,
    a 0600 file.
    """
    import keyring.errors

    config = config or IdentityStoreConfig()
    path = config.key_file()
    if path.exists():
        return _file_identity(path, "An identity file from an earlier run exists.")
    backend = _usable_keyring()
    if backend is None:
        return _file_identity(path, "No usable OS keyring was found (keyring's fail backend is active).")
    where = f"the OS keyring ({type(backend).__name__})"
    try:
        secret = backend.get_password(config.service, config.username)
        if secret is not None:
            identity = Identity(_decode_secret(secret, where), storage="keyring",
                                storage_note=f"Your identity key is stored in {where}.")
            log.info("identity %s loaded from %s", identity.peer_id, where)
            return identity
        key = Ed25519PrivateKey.generate()
        backend.set_password(config.service, config.username, _encode_secret(key))
        if backend.get_password(config.service, config.username) is None:
            raise keyring.errors.KeyringError("the keyring did not keep the stored key")
    except Exception as exc:  # keyring backends raise their own (dbus, OS) errors too
        log.warning("keyring unusable (%s); falling back to a private file", type(exc).__name__)
        return _file_identity(path, f"The OS keyring could not store the key ({type(exc).__name__}).")
    identity = Identity(key, storage="keyring", storage_note=f"Your identity key is stored in {where}.")
    log.info("identity %s created and stored in %s", identity.peer_id, where)
    return identity
