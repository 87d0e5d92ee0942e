import pytest

from engine.net.wan_profiles import (
    BUILTIN,
    WanProfile,
    coordinator_impairment,
    link_impairment,
    load_profiles,
    parse_mix,
)


def test_builtin_profiles_carry_the_documented_figures():
    assert (BUILTIN["metro"].rtt_ms, BUILTIN["metro"].loss_percent, BUILTIN["metro"].up_mbps) == (20, 0.1, 200)
    assert (BUILTIN["continental"].rtt_ms, BUILTIN["continental"].loss_percent) == (80, 0.5)
    home = BUILTIN["home"]
    assert (home.rtt_ms, home.loss_percent, home.up_mbps, home.down_mbps) == (150, 1.0, 10, 50)
    assert home.jitter_ms > 0


def test_two_nodes_on_one_profile_see_its_round_trip_loss_and_rate():
    link = link_impairment(BUILTIN["continental"], BUILTIN["continental"])
    assert 2 * link.delay_ms == 80 and link.loss_percent == 0.5 and link.bandwidth_mbps == 50


def test_a_home_node_sends_at_its_uplink_and_receives_at_the_senders_rate_at_most():
    home, metro = BUILTIN["home"], BUILTIN["metro"]
    up, down = link_impairment(home, metro), link_impairment(metro, home)
    assert up.bandwidth_mbps == 10 and down.bandwidth_mbps == 50
    assert up.delay_ms == down.delay_ms == (150 + 20) / 4
    assert up.loss_percent == pytest.approx(0.55)


def test_the_coordinator_link_is_the_nodes_profile_in_full_without_loss():
    up, down = coordinator_impairment(BUILTIN["home"])
    assert up.delay_ms == down.delay_ms == 75
    assert (up.bandwidth_mbps, down.bandwidth_mbps) == (10, 50)
    assert up.loss_percent == down.loss_percent == 0


def test_a_mix_names_one_node_and_defaults_the_rest():
    assert parse_mix("home:1,metro", 4) == ["metro", "home", "metro", "metro"]
    assert parse_mix("continental", 3) == ["continental"] * 3
    assert parse_mix("home:0+2,metro:1-1,continental", 4) == ["home", "metro", "home", "continental"]
    assert parse_mix("home:1-2,metro", 4) == ["metro", "home", "home", "metro"]


@pytest.mark.parametrize("spec, message", [
    ("mars", "unknown WAN profile 'mars'"),
    ("home:7,metro", "out of range"),
    ("home:1", "without a profile"),
    ("home:1,home:1,metro", "named twice"),
    ("home,metro", "two default"),
    ("home:x,metro", "not a node index"),
])
def test_a_bad_mix_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(spec, 4)


def test_users_add_and_override_profiles_in_a_toml_file(tmp_path, monkeypatch):
    path = tmp_path / "links.toml"
    path.write_text("[profiles.satellite]\nrtt_ms = 600\nloss_percent = 1.0\nup_mbps = 5\ndown_mbps = 50\n"
                    "[profiles.metro]\nrtt_ms = 10\nup_mbps = 1000\ndown_mbps = 1000\n")
    profiles = load_profiles(path)
    assert profiles["satellite"] == WanProfile(rtt_ms=600, loss_percent=1.0, up_mbps=5, down_mbps=50)
    assert profiles["metro"].rtt_ms == 10 and profiles["home"] == BUILTIN["home"]
    monkeypatch.setenv("POLIS_WAN_PROFILES", str(path))
    assert "satellite" in load_profiles()
    assert parse_mix("satellite:0,metro", 2, profiles) == ["satellite", "metro"]


@pytest.mark.parametrize("body", [
    "[profiles.bad]\nrtt_ms = -1\nup_mbps = 5\ndown_mbps = 5\n",  # out of bounds
    "[profiles.bad]\nrtt_ms = 10\nup_mbps = 5\n",  # a rate missing
    "[profiles.bad]\nrtt_ms = 10\nup_mbps = 5\ndown_mbps = 5\nlatency = 3\n",  # unknown key
    "[profiles.Bad]\nrtt_ms = 10\nup_mbps = 5\ndown_mbps = 5\n",  # name not lower-case
    "not toml [",
])
def test_an_invalid_profile_file_is_refused_with_its_path(tmp_path, body):
    path = tmp_path / "links.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match="links.toml"):
        load_profiles(path)


def test_a_node_with_a_malformed_relay_address_stops_with_a_clear_error(capsys):
    from engine.cli import main

    assert main(["node", "--coordinator", "http://127.0.0.1:1", "--wan-relay", "nowhere"]) == 2
    assert "--wan-relay: 'nowhere' is not HOST:PORT" in capsys.readouterr().err


def test_the_demo_refuses_an_unknown_profile_before_starting_any_node(tmp_path):
    from engine.swarm.demo import DemoProcesses
    from engine.swarm.wan_swarm import WanRelay

    processes = DemoProcesses(tmp_path)
    with pytest.raises(RuntimeError, match="unknown WAN profile 'mars'"):
        WanRelay.start(processes, tmp_path, "mars", 4, 1)
    assert processes.procs == []


def test_a_relayed_node_joins_through_its_own_proxy_and_names_its_profile():
    from engine.swarm.wan_swarm import WanRelay

    relay = WanRelay(("127.0.0.1", 9000), [9101, 9102], ["metro", "home"])
    assert relay.coordinator_url(1) == "http://127.0.0.1:9102"
    assert relay.node_args(1) == ["--signal-url", "ws://127.0.0.1:9102/signal", "--wan-relay", "127.0.0.1:9000",
                                  "--wan-profile", "home"]
