"""LAN discovery over zeroconf (mDNS/DNS-SD): advertise a Polis service and browse for them.

A service of type ``_polis._tcp.local.`` carries TXT properties ``role``
(``coordinator`` or ``node``), ``peer`` (the advertiser's peer id; a coordinator's
run id), ``url`` and ``ver`` (the Polis version), and a coordinator's ``key`` (its
Ed25519 public key, base64url). A coordinator's ``url`` is its base URL,
``http(s)://host:port``; with its key it makes the pinned URL ``polis node
--coordinator`` takes (``http://host:port#key=...``: the node then refuses a
coordinator that cannot prove that key, so nobody can sit between it and the
advertised one; whoever advertises first is still whom a LAN node joins). A node's
``url`` may be a signalling URL (``ws://host:port/path``). Whatever
arrives from the network is untrusted: TXT records are size-checked and parsed
into a :class:`ServiceAdvert` or dropped with a logged reason; a browse keeps at
most ``max_services`` answers.

Everything runs on the caller's asyncio loop (``zeroconf.asyncio``). By default
zeroconf uses every interface (a real LAN); tests and single-machine demos pass
``DiscoveryConfig(interfaces=LOOPBACK_ONLY)`` so that nothing leaves loopback.
Command-line paths (``polis node --lan``, ``polis coordinator --lan``) read
their config from the environment with :meth:`DiscoveryConfig.from_env`:

``POLIS_LAN_INTERFACES``   ``all`` (or unset/empty: every interface), ``loopback``
                           (127.0.0.1 only: nothing leaves this machine, and a
                           hosted coordinator listens on and advertises
                           127.0.0.1), or comma-separated IPv4 addresses.
``POLIS_LAN_SERVICE_TYPE`` the DNS-SD type (default ``_polis._tcp.local.``); a
                           private type keeps separate swarms (or tests) apart.

What this module does not know: what a coordinator does, how to connect to the
URL it finds (signalling), or whether to host a coordinator when none answers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import ifaddr
import zeroconf as zeroconf_errors
from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from engine.net.errors import ProtocolViolation
from engine.net.identity import pin_url, split_pinned_url

log = logging.getLogger(__name__)

SERVICE_TYPE = "_polis._tcp.local."
ROLES = ("coordinator", "node")
#: Interfaces that keep discovery on this machine (tests, demos).
LOOPBACK_ONLY = ("127.0.0.1",)
#: Environment variables read by :meth:`DiscoveryConfig.from_env`.
ENV_INTERFACES = "POLIS_LAN_INTERFACES"
ENV_SERVICE_TYPE = "POLIS_LAN_SERVICE_TYPE"
#: DNS-SD service types: "_" + 1-15 letters, digits or hyphens (RFC 6335) + "._tcp.local."
_SERVICE_TYPE_RE = re.compile(r"_[A-Za-z0-9](?:[A-Za-z0-9-]{0,13}[A-Za-z0-9])?\._tcp\.local\.\Z")
_PEER_ID_RE = re.compile(r"[0-9a-f]{8,64}\Z")
_VERSION_RE = re.compile(r"[0-9A-Za-z.+\-]{1,32}\Z")
_MAX_URL_LEN = 256
_MAX_TXT_KEYS = 16
_MAX_TXT_VALUE = 255


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where and how long to look."""

    #: IPv4 addresses of the interfaces to use; None = all interfaces (a real LAN).
    interfaces: tuple[str, ...] | None = None
    #: DNS-SD service type (tests may use their own to stay apart).
    service_type: str = SERVICE_TYPE
    #: Seconds to wait for one service's records when resolving it.
    resolve_timeout_s: float = 3.0
    #: Most services one browse keeps (the network is untrusted).
    max_services: int = 64

    def __post_init__(self) -> None:
        if self.interfaces is not None:
            for address in self.interfaces:
                ipaddress.IPv4Address(address)  # raises ValueError on garbage
        if self.interfaces is not None and not self.interfaces:
            raise ValueError("interfaces must name at least one address (None = all interfaces)")
        if not _SERVICE_TYPE_RE.match(self.service_type):
            raise ValueError(f"service_type {self.service_type!r} is not a '_name._tcp.local.' type "
                             "(name: 1-15 letters, digits or hyphens)")
        if not 0 < self.resolve_timeout_s <= 60:
            raise ValueError("resolve_timeout_s must be in (0, 60]")
        if not 1 <= self.max_services <= 4096:
            raise ValueError("max_services must be in [1, 4096]")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "DiscoveryConfig":
        """The config the command line uses: ``POLIS_LAN_INTERFACES`` and ``POLIS_LAN_SERVICE_TYPE``.

        Raises ValueError naming the variable when a value is not valid.
        """
        env = os.environ if environ is None else environ
        fields: dict[str, Any] = {}
        raw = env.get(ENV_INTERFACES, "").strip()
        if raw.lower() == "loopback":
            fields["interfaces"] = LOOPBACK_ONLY
        elif raw and raw.lower() != "all":
            addresses = tuple(part.strip() for part in raw.split(",") if part.strip())
            try:
                if not addresses:
                    raise ValueError(raw)
                fields["interfaces"] = tuple(str(ipaddress.IPv4Address(a)) for a in addresses)
            except ValueError:
                raise ValueError(f"{ENV_INTERFACES}={raw[:80]!r}: use 'all', 'loopback' or "
                                 "comma-separated IPv4 addresses") from None
        stype = env.get(ENV_SERVICE_TYPE, "").strip()
        if stype:
            fields["service_type"] = stype
        fields.update(overrides)
        try:
            return cls(**fields)
        except ValueError as exc:
            if "service_type" in str(exc):
                raise ValueError(f"{ENV_SERVICE_TYPE}: {exc}") from None
            raise

    @property
    def loopback_only(self) -> bool:
        """True when discovery never leaves this machine."""
        return self.interfaces is not None and all(ipaddress.IPv4Address(a).is_loopback for a in self.interfaces)

    @property
    def listen_host(self) -> str:
        """Where a service advertised with this config should listen."""
        if self.interfaces is not None and len(self.interfaces) == 1:
            return self.interfaces[0]
        return "0.0.0.0"

    def zeroconf(self) -> AsyncZeroconf:
        interfaces: Any = list(self.interfaces) if self.interfaces is not None else None
        if interfaces is None:
            return AsyncZeroconf(ip_version=IPVersion.V4Only)
        return AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)


def lan_env_problem() -> str | None:
    """Why the ``POLIS_LAN_*`` environment is unusable, or None when it is fine (for CLIs
    that check it before starting anything)."""
    try:
        DiscoveryConfig.from_env()
    except ValueError as exc:
        return str(exc)
    return None


def reachable_address(config: DiscoveryConfig, listen_host: str = "0.0.0.0") -> str:
    """The IPv4 address to put in an advert for a service listening on ``listen_host``.

    A specific listen address is used as is; for a wildcard it is the first configured
    interface, else the address of the interface holding the default route (no packet is
    sent), else the first non-loopback address. Never ``socket.gethostbyname(hostname)``:
    on many Linux systems that is 127.0.1.1, useless to other machines.
    """
    if listen_host not in ("0.0.0.0", "", "::"):
        return listen_host
    if config.interfaces is not None:
        return config.interfaces[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routing lookup only, nothing is sent
            address = probe.getsockname()[0]
        if address and not ipaddress.IPv4Address(address).is_loopback and address != "0.0.0.0":
            return address
    except OSError:
        pass
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.IPv4Address(ip.ip).is_loopback:
                return ip.ip
    return "127.0.0.1"


@dataclass(frozen=True)
class ServiceAdvert:
    """What a Polis service says about itself (its TXT record)."""

    role: str
    peer_id: str
    signalling_url: str
    version: str
    #: a coordinator's Ed25519 public key (TXT ``key``, base64url): nodes pin it and the coordinator
    #: must prove it in its welcome, so no one can take over the session of an advertised coordinator
    coordinator_key: bytes | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ProtocolViolation(f"role {self.role[:20]!r} is not one of {ROLES}")
        if not _PEER_ID_RE.match(self.peer_id):
            raise ProtocolViolation("peer id must be 8-64 lowercase hex characters")
        if not _VERSION_RE.match(self.version):
            raise ProtocolViolation("version must be 1-32 characters of [0-9A-Za-z.+-]")
        _check_url(self.signalling_url)
        if self.coordinator_key is not None and len(self.coordinator_key) != 32:
            raise ProtocolViolation("a coordinator key must be 32 bytes")

    @property
    def port(self) -> int:
        parts = urlsplit(self.signalling_url)
        return parts.port or (443 if parts.scheme in ("wss", "https") else 80)

    @property
    def coordinator_url(self) -> str | None:
        """The base URL to give ``polis node --coordinator`` (a coordinator's http(s) URL, pinning its
        key when the advert names one), else None."""
        parts = urlsplit(self.signalling_url)
        if self.role != "coordinator" or parts.scheme not in ("http", "https"):
            return None
        url = self.signalling_url.rstrip("/")
        return url if self.coordinator_key is None else pin_url(url, self.coordinator_key)

    def to_properties(self) -> dict[str, str]:
        props = {"role": self.role, "peer": self.peer_id, "url": self.signalling_url, "ver": self.version}
        if self.coordinator_key is not None:
            props["key"] = pin_url("", self.coordinator_key).split("=", 1)[1]
        return props

    @classmethod
    def from_properties(cls, properties: Mapping[Any, Any]) -> "ServiceAdvert":
        """Parse untrusted TXT properties (bytes keys/values); raises ProtocolViolation."""
        if len(properties) > _MAX_TXT_KEYS:
            raise ProtocolViolation(f"TXT record has {len(properties)} keys, at most {_MAX_TXT_KEYS}")
        text: dict[str, str] = {}
        for key, value in properties.items():
            if not isinstance(key, bytes) or not isinstance(value, bytes) or len(value) > _MAX_TXT_VALUE:
                continue  # flags (no value) and odd entries are ignored
            try:
                text[key.decode("ascii")] = value.decode("utf-8")
            except UnicodeDecodeError:
                raise ProtocolViolation("TXT record is not valid text") from None
        missing = {"role", "peer", "url", "ver"} - text.keys()
        if missing:
            raise ProtocolViolation(f"TXT record lacks {sorted(missing)}")
        key = None
        if "key" in text:
            try:
                _, key = split_pinned_url("#key=" + text["key"])
            except ValueError as exc:
                raise ProtocolViolation(f"TXT record's key: {exc}") from None
        return cls(role=text["role"], peer_id=text["peer"], signalling_url=text["url"], version=text["ver"],
                   coordinator_key=key)


def _check_url(url: str) -> None:
    if not isinstance(url, str) or not 0 < len(url) <= _MAX_URL_LEN or not url.isprintable() or " " in url:
        raise ProtocolViolation(f"signalling url must be 1-{_MAX_URL_LEN} printable characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ProtocolViolation(f"signalling url is malformed: {exc}") from None
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
        raise ProtocolViolation("signalling url must be ws(s):// or http(s):// with a host")
    if port == 0:
        raise ProtocolViolation("signalling url has port 0")


@dataclass(frozen=True)
class DiscoveredService:
    """A validated answer: the advert plus where the mDNS records say it lives."""

    name: str
    advert: ServiceAdvert
    addresses: tuple[str, ...]
    port: int


def _advertised_addresses(advert: ServiceAdvert, config: DiscoveryConfig) -> list[str]:
    host = urlsplit(advert.signalling_url).hostname or ""
    try:
        return [str(ipaddress.IPv4Address(host))]
    except ValueError:
        pass
    if config.interfaces is not None:
        return list(config.interfaces)
    return [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
            if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]


class LanAdvertiser:
    """Advertises one :class:`ServiceAdvert` until closed (``async with`` works too)."""

    def __init__(self, advert: ServiceAdvert, config: DiscoveryConfig | None = None) -> None:
        self.advert = advert
        self.config = config or DiscoveryConfig()
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    @property
    def name(self) -> str | None:
        """The registered instance name (zeroconf may have changed it to stay unique)."""
        return self._info.name if self._info is not None else None

    async def start(self) -> None:
        if self._zc is not None:
            return
        addresses = _advertised_addresses(self.advert, self.config)
        stype = self.config.service_type
        label = f"polis-{self.advert.role}-{self.advert.peer_id[:16]}"
        self._info = AsyncServiceInfo(
            stype, f"{label}.{stype}", port=self.advert.port, properties=self.advert.to_properties(),
            addresses=[socket.inet_aton(a) for a in addresses], server=f"{label}.local.")
        self._zc = self.config.zeroconf()
        await self._zc.async_register_service(self._info, allow_name_change=True)
        log.info("advertising %s as %s on %s", self.advert.role, self._info.name, addresses)

    async def close(self) -> None:
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            if self._info is not None:
                await zc.async_unregister_service(self._info)
        finally:
            await zc.async_close()

    async def __aenter__(self) -> "LanAdvertiser":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _resolve(zc: AsyncZeroconf, name: str, config: DiscoveryConfig) -> DiscoveredService | None:
    try:
        info = AsyncServiceInfo(config.service_type, name)
        answered = await info.async_request(zc.zeroconf, int(config.resolve_timeout_s * 1000))
    except zeroconf_errors.Error as exc:
        log.info("discovery: cannot resolve %r: %s", name[:80], exc)
        return None
    if not answered:
        log.info("discovery: %r did not answer within %.1f s", name[:80], config.resolve_timeout_s)
        return None
    try:
        advert = ServiceAdvert.from_properties(info.properties or {})
    except ProtocolViolation as exc:
        log.info("discovery: ignoring %r: %s", name[:80], exc)
        return None
    addresses = tuple(a for a in info.parsed_addresses(IPVersion.V4Only))[:8]
    return DiscoveredService(name=name, advert=advert, addresses=addresses, port=int(info.port or 0))


async def browse(timeout_s: float, *, role: str | None = None, config: DiscoveryConfig | None = None,
                 first_only: bool = False,
                 accept: Callable[[DiscoveredService], bool] | None = None) -> list[DiscoveredService]:
    """Services (optionally of one ``role``, and passing ``accept``) found within ``timeout_s`` seconds.

    With ``first_only`` it returns as soon as one matching service is resolved.
    """
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    config = config or DiscoveryConfig()
    loop = asyncio.get_running_loop()
    names: asyncio.Queue[str] = asyncio.Queue()
    seen: set[str] = set()

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            loop.call_soon_threadsafe(names.put_nowait, name)

    found: list[DiscoveredService] = []
    pending: set[asyncio.Task] = set()
    zc = config.zeroconf()
    browser = AsyncServiceBrowser(zc.zeroconf, config.service_type, handlers=[on_change])
    deadline = loop.time() + timeout_s
    try:
        while loop.time() < deadline and not (first_only and found):
            getter = asyncio.create_task(names.get(), name="discovery-next-name")
            done, _ = await asyncio.wait(pending | {getter}, timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
            for task in done - {getter}:
                pending.discard(task)
                result = task.result()
                if result is not None and (role is None or result.advert.role == role) \
                        and (accept is None or accept(result)):
                    found.append(result)
            if getter in done:
                name = getter.result()
                if name not in seen and len(seen) < config.max_services:
                    seen.add(name)
                    pending.add(asyncio.create_task(_resolve(zc, name, config), name=f"discovery-resolve-{len(seen)}"))
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await browser.async_cancel()
        await zc.async_close()
    return found[:1] if first_only else found


def _joinable(service: DiscoveredService) -> bool:
    return service.advert.coordinator_url is not None


async def find_coordinator(timeout_s: float, config: DiscoveryConfig | None = None, *,
                           joinable_only: bool = False) -> DiscoveredService | None:
    """The first coordinator that answers within ``timeout_s``, or None.

    ``joinable_only``: only coordinators whose advert carries an http(s) base URL
    (:attr:`ServiceAdvert.coordinator_url`), which a node can join.
    """
    found = await browse(timeout_s, role="coordinator", config=config, first_only=True,
                         accept=_joinable if joinable_only else None)
    return found[0] if found else None


async def find_coordinators(timeout_s: float, config: DiscoveryConfig | None = None, *,
                            joinable_only: bool = False) -> list[DiscoveredService]:
    """Every coordinator that answers within ``timeout_s`` (this waits the whole time)."""
    return await browse(timeout_s, role="coordinator", config=config, accept=_joinable if joinable_only else None)
