"""``--lan`` plumbing without sockets: the env config, advertised URLs, and the hosting race."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.net import discovery
from engine.net.discovery import (
    LOOPBACK_ONLY,
    SERVICE_TYPE,
    DiscoveredService,
    DiscoveryConfig,
    ServiceAdvert,
    reachable_address,
)
from engine.swarm import local_swarm


def test_from_env_defaults_to_every_interface_and_the_polis_type():
    config = DiscoveryConfig.from_env({})
    assert config.interfaces is None and config.service_type == SERVICE_TYPE
    assert DiscoveryConfig.from_env({"POLIS_LAN_INTERFACES": "all"}).interfaces is None
    assert config.listen_host == "0.0.0.0" and not config.loopback_only


def test_from_env_loopback_keeps_everything_on_127_0_0_1():
    config = DiscoveryConfig.from_env({"POLIS_LAN_INTERFACES": "loopback",
                                       "POLIS_LAN_SERVICE_TYPE": "_pt1._tcp.local."})
    assert config.interfaces == LOOPBACK_ONLY and config.service_type == "_pt1._tcp.local."
    assert config.loopback_only and config.listen_host == "127.0.0.1"
    assert reachable_address(config, config.listen_host) == "127.0.0.1"


def test_from_env_takes_a_list_of_addresses():
    config = DiscoveryConfig.from_env({"POLIS_LAN_INTERFACES": "10.0.0.5, 192.168.1.7"})
    assert config.interfaces == ("10.0.0.5", "192.168.1.7") and config.listen_host == "0.0.0.0"
    assert reachable_address(config) == "10.0.0.5"
    assert reachable_address(config, "192.168.1.7") == "192.168.1.7"


@pytest.mark.parametrize("env, variable", [
    ({"POLIS_LAN_INTERFACES": "eth0"}, "POLIS_LAN_INTERFACES"),
    ({"POLIS_LAN_INTERFACES": "10.0.0.300"}, "POLIS_LAN_INTERFACES"),
    ({"POLIS_LAN_INTERFACES": " , "}, "POLIS_LAN_INTERFACES"),
    ({"POLIS_LAN_SERVICE_TYPE": "polis"}, "POLIS_LAN_SERVICE_TYPE"),
    ({"POLIS_LAN_SERVICE_TYPE": "_much-too-long-a-name._tcp.local."}, "POLIS_LAN_SERVICE_TYPE"),
])
def test_from_env_names_the_bad_variable(env, variable):
    with pytest.raises(ValueError, match=variable):
        DiscoveryConfig.from_env(env)


def test_only_a_coordinators_http_url_is_joinable():
    assert ServiceAdvert("coordinator", "ab" * 6, "http://10.0.0.5:8700/", "0.1.0").coordinator_url \
        == "http://10.0.0.5:8700"
    assert ServiceAdvert("coordinator", "ab" * 6, "ws://10.0.0.5:8700/signal", "0.1.0").coordinator_url is None
    assert ServiceAdvert("node", "ab" * 6, "http://10.0.0.5:8700", "0.1.0").coordinator_url is None


def _service(run_id: str, port: int) -> DiscoveredService:
    return DiscoveredService(name=f"c{port}", addresses=("127.0.0.1",), port=port,
                             advert=ServiceAdvert("coordinator", run_id, f"http://127.0.0.1:{port}", "0.1.0"))


class _FakeHosted:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True


def _race(monkeypatch, ours: str, rivals: list[DiscoveredService], first: DiscoveredService | None = None):
    hosted = _FakeHosted(ours)

    async def find_coordinator(timeout_s, config, joinable_only=False):
        return first

    async def find_coordinators(timeout_s, config, joinable_only=False):
        return [_service(ours, 9000), *rivals]  # a browse also sees our own advert

    async def host(args, lan, discovery=None):
        return hosted, "http://127.0.0.1:9000"

    monkeypatch.setattr(discovery, "find_coordinator", find_coordinator)
    monkeypatch.setattr(discovery, "find_coordinators", find_coordinators)
    monkeypatch.setattr(local_swarm, "host_local_coordinator", host)
    said: list[str] = []
    result = asyncio.run(local_swarm.find_or_host_lan(SimpleNamespace(), DiscoveryConfig(interfaces=LOOPBACK_ONLY),
                                                      said.append))
    return hosted, result, said


def test_a_coordinator_found_at_once_is_joined_without_hosting(monkeypatch):
    hosted, (mine, url), said = _race(monkeypatch, "bbbbbbbbbbbb", [], first=_service("cccccccccccc", 9100))
    assert mine is None and url == "http://127.0.0.1:9100" and "joining" in said[0]


def test_two_nodes_hosting_at_once_converge_on_the_smaller_run_id(monkeypatch):
    hosted, (mine, url), _ = _race(monkeypatch, "bbbbbbbbbbbb", [_service("aaaaaaaaaaaa", 9100)])
    assert mine is None and hosted.stopped and url == "http://127.0.0.1:9100"
    hosted, (mine, url), said = _race(monkeypatch, "bbbbbbbbbbbb", [_service("cccccccccccc", 9100)])
    assert mine is hosted and not hosted.stopped and url == "http://127.0.0.1:9000" and "hosting" in said[0]
