"""Testbed pieces that need neither root nor namespaces: parsing, names, results, CLI errors."""

from __future__ import annotations

import os

import pytest

from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.testbed import Cluster, HostResult, NicCounters, RunResult, format_rate, parse_rate
from thinwire.testbed import netns as nx


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("2.5gbit", 2_500_000_000),
        ("500kbit", 500_000),
        ("1GBIT", 1_000_000_000),
        (10_000_000, 10_000_000),
        ("unlimited", None),
        ("none", None),
    ],
)
def test_parse_rate(text: str | int, bits: int | None) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["100mbps", "fast", "1 gbit", "-5mbit", "10bit", "100gbit", ""])
def test_parse_rate_rejects_bad_input_in_one_line(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_rate(bad)
    assert "\n" not in str(err.value) and "rate" in str(err.value)


def test_format_rate_round_trips() -> None:
    for text in ("100mbit", "1gbit", "2.5gbit", "500kbit"):
        assert format_rate(parse_rate(text)) == text
    assert format_rate(None) == "unlimited"


@pytest.mark.parametrize("bad", ["", "-n", "a b", "x;rm", "UPPER", "a" * 13, "../etc", "é"])
def test_cluster_id_is_validated(bad: str) -> None:
    with pytest.raises(ConfigError, match="cluster id"):
        nx.validate_cluster_id(bad)
    with pytest.raises(ConfigError):
        Cluster(2, "1gbit", cluster_id=bad)


def test_commands_refuse_namespaces_that_are_not_ours() -> None:
    # Checked before anything runs, so this holds without root too.
    for name in ("default", "thinwire-x", "thinwire-ab-h0;x", "other-ab-br", "thinwire-AB-br"):
        with pytest.raises(ConfigError, match="not a thinwire testbed namespace"):
            nx.ip("link", "show", netns=name)


def test_names_addresses_and_environment() -> None:
    c = Cluster(3, "100mbit", cluster_id="abc123", master_port=29555)
    assert c.namespaces == ["thinwire-abc123-h0", "thinwire-abc123-h1", "thinwire-abc123-h2"]
    assert c.bridge_namespace == "thinwire-abc123-br"
    assert c.addresses == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    env = c.host_env(2)
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "3" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "10.213.0.1" and env["MASTER_PORT"] == "29555"
    assert env["GLOO_SOCKET_IFNAME"] == "tw0"


def test_placeholders_for_torchrun_style_commands() -> None:
    c = Cluster(4, "1gbit", cluster_id="t1")
    argv = [
        "torchrun",
        "--nnodes",
        "{hosts}",
        "--node-rank",
        "{rank}",
        "--master-addr",
        "{master_addr}",
        "--master-port={master_port}",
        "-c",
        "print({})",
    ]
    out = c._argv_for(argv, 3)
    assert out[:8] == [
        "torchrun",
        "--nnodes",
        "4",
        "--node-rank",
        "3",
        "--master-addr",
        "10.213.0.1",
        "--master-port=29500",
    ]
    assert out[-1] == "print({})"  # other braces are left alone


@pytest.mark.parametrize("hosts", [0, -1, 65, 2.0, True])
def test_host_count_is_validated(hosts: object) -> None:
    with pytest.raises(ConfigError, match="hosts"):
        Cluster(hosts, "1gbit")  # type: ignore[arg-type]


def test_run_refuses_a_cluster_that_is_not_up() -> None:
    with pytest.raises(ConfigError, match="not up"):
        Cluster(2, "1gbit").run(["true"])


def test_run_result_utilization_and_summary() -> None:
    nic = NicCounters(tx_bytes=12_500_000, rx_bytes=1, tx_packets=1, rx_packets=1)
    hosts = [
        HostResult(0, "thinwire-a-h0", "10.213.0.1", 0, "/tmp/h0.log", nic),
        HostResult(1, "thinwire-a-h1", "10.213.0.2", -15, "/tmp/h1.log", nic, terminated=True),
    ]
    r = RunResult(["x"], 100_000_000, 2.0, hosts, "/tmp")
    assert r.utilization(0) == pytest.approx(0.5)  # 100 Mbit in 2 s at 100 Mbit/s
    assert not r.ok and r.returncode == 1
    assert r.tx_bytes == 25_000_000
    text = r.summary()
    assert "-15*" in text and "50.0%" in text
    assert RunResult(["x"], None, 2.0, hosts[:1], "/tmp").utilization(0) is None
    assert r.to_dict()["hosts"][0]["utilization"] == pytest.approx(0.5)


def test_without_root_every_verb_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert nx.unavailable_reason() is not None
    for argv in (
        ["testbed", "status"],
        ["testbed", "down"],
        ["testbed", "up", "--hosts", "2"],
        ["testbed", "run", "--hosts", "2", "--", "true"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("thinwire: error: ") and "needs root" in err
        assert err.count("\n") == 1


def test_cli_rejects_bad_rate_and_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["testbed", "run", "--rate", "100mbps", "--", "true"]) == 2
    assert "rate '100mbps' is invalid" in capsys.readouterr().err
    assert main(["testbed", "run", "--hosts", "2"]) == 2
    assert "no command given" in capsys.readouterr().err
