"""Identity: keyring storage, the 0600 file fallback, peer ids, signatures, no key leaks."""

import base64
import logging
import os
import pickle
import sys

import keyring
import keyring.backend
import keyring.backends.fail
import keyring.errors
import pytest

from engine.net.errors import AuthenticationError
from engine.net.identity import (
    KEY_FILE_NAME,
    Identity,
    IdentityStoreConfig,
    fingerprint_for,
    load_or_create_identity,
    peer_id_for,
    verify_signature,
)


class MemoryKeyring(keyring.backend.KeyringBackend):
    """A usable in-memory keyring backend."""

    priority = 10

    def __init__(self):
        super().__init__()
        self.store = {}

    def get_password(self, service, username):
        return self.store.get((service, username))

    def set_password(self, service, username, password):
        self.store[(service, username)] = password

    def delete_password(self, service, username):
        self.store.pop((service, username), None)


class BrokenKeyring(MemoryKeyring):
    """A keyring that looks usable but refuses to store (locked, no D-Bus, ...)."""

    def set_password(self, service, username, password):
        raise keyring.errors.PasswordSetError("locked")


@pytest.fixture
def use_keyring():
    previous = keyring.get_keyring()

    def install(backend):
        keyring.set_keyring(backend)
        return backend

    yield install
    keyring.set_keyring(previous)


def _secret_text(identity: Identity) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = identity._private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())
    return base64.b64encode(raw).decode()


def test_identity_is_kept_in_the_keyring_and_reloaded_with_the_same_peer_id(use_keyring, tmp_path):
    backend = use_keyring(MemoryKeyring())
    config = IdentityStoreConfig(fallback_dir=tmp_path)
    first = load_or_create_identity(config)
    assert first.storage == "keyring" and "keyring" in first.storage_note
    assert len(backend.store) == 1
    assert not (tmp_path / KEY_FILE_NAME).exists()
    again = load_or_create_identity(config)
    assert again.peer_id == first.peer_id and again.public_key == first.public_key


def test_fail_backend_falls_back_to_a_private_file_and_says_so(use_keyring, tmp_path):
    use_keyring(keyring.backends.fail.Keyring())
    config = IdentityStoreConfig(fallback_dir=tmp_path)
    first = load_or_create_identity(config)
    path = tmp_path / KEY_FILE_NAME
    assert first.storage == "file"
    assert str(path) in first.storage_note and "keyring" in first.storage_note
    if sys.platform != "win32":
        assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_identity(config).peer_id == first.peer_id


def test_a_keyring_that_refuses_to_store_falls_back_to_the_file(use_keyring, tmp_path):
    use_keyring(BrokenKeyring())
    identity = load_or_create_identity(IdentityStoreConfig(fallback_dir=tmp_path))
    assert identity.storage == "file"
    assert (tmp_path / KEY_FILE_NAME).exists()


def test_an_existing_file_wins_so_the_peer_id_never_changes_silently(use_keyring, tmp_path):
    use_keyring(keyring.backends.fail.Keyring())
    config = IdentityStoreConfig(fallback_dir=tmp_path)
    original = load_or_create_identity(config)
    use_keyring(MemoryKeyring())
    assert load_or_create_identity(config).peer_id == original.peer_id


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_a_key_file_readable_by_others_is_restricted_to_the_owner(use_keyring, tmp_path):
    use_keyring(keyring.backends.fail.Keyring())
    config = IdentityStoreConfig(fallback_dir=tmp_path)
    load_or_create_identity(config)
    path = tmp_path / KEY_FILE_NAME
    os.chmod(path, 0o644)
    load_or_create_identity(config)
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_corrupt_key_file_is_a_clear_error(use_keyring, tmp_path):
    use_keyring(keyring.backends.fail.Keyring())
    path = tmp_path / KEY_FILE_NAME
    path.write_text("polis-ed25519-v1:not base64!")
    os.chmod(path, 0o600)
    with pytest.raises(AuthenticationError, match="corrupt"):
        load_or_create_identity(IdentityStoreConfig(fallback_dir=tmp_path))


def test_private_key_never_reaches_repr_logs_or_pickle(use_keyring, tmp_path, caplog):
    use_keyring(MemoryKeyring())
    with caplog.at_level(logging.DEBUG):
        identity = load_or_create_identity(IdentityStoreConfig(fallback_dir=tmp_path))
    secret = _secret_text(identity)
    assert secret not in repr(identity) and secret not in str(identity)
    assert secret not in caplog.text
    assert identity.peer_id in caplog.text
    with pytest.raises(TypeError):
        pickle.dumps(identity)


def test_peer_id_and_fingerprint_derive_from_the_public_key():
    a, b = Identity.generate(), Identity.generate()
    assert a.peer_id == peer_id_for(a.public_key) and len(a.peer_id) == 16
    assert a.peer_id != b.peer_id
    assert a.fingerprint == fingerprint_for(a.public_key) and a.fingerprint.count("-") == 7
    with pytest.raises(AuthenticationError):
        peer_id_for(b"short")


def test_signatures_verify_only_for_the_same_message_and_key():
    a, b = Identity.generate(), Identity.generate()
    signature = a.sign(b"offer sdp")
    verify_signature(a.public_key, b"offer sdp", signature)
    a.verify(b"offer sdp", signature)
    with pytest.raises(AuthenticationError):
        verify_signature(a.public_key, b"offer sdP", signature)
    with pytest.raises(AuthenticationError):
        verify_signature(b.public_key, b"offer sdp", signature)
    with pytest.raises(AuthenticationError):
        verify_signature(a.public_key, b"offer sdp", signature[:-1])
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    with pytest.raises(AuthenticationError):
        verify_signature(a.public_key, b"offer sdp", tampered)
