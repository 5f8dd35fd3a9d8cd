"""``thinwire analyze``: the verbs chained, and bad input as one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from thinwire.cli.main import main


def _golden() -> Path:
    env = os.environ.get("THINWIRE_SHARED")
    base = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared"
    return base / "data" / "training-bottleneck"


@pytest.mark.smoke  # the fast lane's analyzer run
@pytest.mark.timeout(120)
def test_profile_simulate_report_chain(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prof, sim, plots = tmp_path / "profile.json", tmp_path / "sim.json", tmp_path / "plots"
    assert (
        main(
            [
                "analyze",
                "profile",
                "--model",
                "tiny",
                "--batch-size",
                "2",
                "--warmup",
                "1",
                "--steps",
                "2",
                "--observe-ddp",
                "-o",
                str(prof),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "analyze",
                "what-if",
                str(prof),
                "--workers",
                "4",
                "--bandwidth-gbps",
                "0.1",
                "--alpha-us",
                "50",
                "--buckets",
                "observed",
                "--reduction",
                "none",
                "-o",
                str(sim),
            ]
        )
        == 0
    )
    study = json.loads(sim.read_text())
    p = json.loads(prof.read_text())
    assert study["profile"]["grad_bytes"] == sum(x["nbytes"] for x in p["params"])
    assert sum(study["buckets"]["nbytes"]) == study["profile"]["grad_bytes"]
    caps = study["bucket_caps"]
    assert caps and all(0 < c["scaling_factor"] <= 1 for c in caps)
    res = study["result"]
    assert res["scaling_factor"] == pytest.approx(
        res["iteration_s"] / (res["iteration_s"] + res["exposed_s"])
    )
    capsys.readouterr()
    assert main(["analyze", "report", str(sim), "--plots", str(plots)]) == 0
    out = capsys.readouterr().out
    assert "scaling factor" in out and "verdict" in out and "fix" in out
    assert "Gbit/s" in out or "Mbit/s" in out
    for name in ("sf_vs_bandwidth", "sf_vs_compression", "sf_heatmap", "gantt"):
        assert (plots / f"{name}.png").stat().st_size > 1000
    # A CPU profile trains with gloo: two collectives at once unless told NCCL.
    assert study["result"]["config"]["concurrency"] == 2
    wan = ["analyze", "what-if", str(prof), "--workers", "4", "--bandwidth-gbps", "0.1"]
    wan += ["--rtt", "100ms", "--buckets", "observed", "--reduction", "none"]
    exposed = {}
    for backend in ("gloo", "nccl"):
        out_json = tmp_path / f"{backend}.json"
        assert main([*wan, "--backend", backend, "-o", str(out_json)]) == 0
        got = json.loads(out_json.read_text())
        exposed[backend] = got["result"]["exposed_s"]
        assert got["result"]["config"]["concurrency"] == {"gloo": 2, "nccl": 1}[backend]
    assert exposed["gloo"] <= exposed["nccl"]


@pytest.mark.skipif(not (_golden() / "resnet50.bk.log").exists(), reason="paper logs absent")
def test_simulate_paper_log_via_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sim = tmp_path / "r50.json"
    assert (
        main(
            [
                "analyze",
                "what-if",
                str(_golden() / "resnet50.bk.log"),
                "--workers",
                "64",
                "--bandwidth-gbps",
                "10",
                "--buckets",
                "horovod",
                "-o",
                str(sim),
            ]
        )
        == 0
    )
    study = json.loads(sim.read_text())
    assert study["reduction"] == "cuda_vec_add.log"  # found beside the log
    assert study["result"]["scaling_factor"] == pytest.approx(0.54, abs=0.03)
    capsys.readouterr()
    assert main(["analyze", "report", str(sim)]) == 0
    assert "IS the bottleneck" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "workers must be an integer >= 1"),
        (["--bandwidth-gbps", "-5"], "bandwidth must be"),
        (["--compression", "0.5"], "compression ratio must be >= 1"),
        (["--target", "1.5"], "target scaling factor must be in (0, 1]"),
    ],
)
def test_simulate_rejects_impossible_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    log = tmp_path / "m.bk.log"
    log.write_text("c\n1\n2\n100,4000\n200,8000\n")
    code = main(
        [
            "analyze",
            "what-if",
            str(log),
            "--iteration-ms",
            "10",
            "--reduction",
            "none",
            "-o",
            str(tmp_path / "s.json"),
            *args,
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("thinwire: error: ") and message in err and "\n" not in err


def test_malformed_inputs_name_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = tmp_path / "m.bk.log"
    log.write_text("c\n1\n2\n100,4000\n2x0,8000\n")
    assert main(["analyze", "what-if", str(log), "--iteration-ms", "10"]) == 2
    assert f"{log}:5:" in capsys.readouterr().err
    bad = tmp_path / "sim.json"
    bad.write_text('{"format": "thinwire.profile/1"}')
    assert main(["analyze", "report", str(bad)]) == 2
    assert "not a thinwire simulation" in capsys.readouterr().err
    # A link fit whose measured 1-bit waits are not [bytes, seconds] pairs is refused.
    link = tmp_path / "link.json"
    fit = {"bandwidth_gbps": 0.1, "alpha_per_message_s": 0.02, "onebit_latency": [[65536, -1]]}
    link.write_text(json.dumps({"format": "thinwire.link/1", "fit": fit}))
    prof = tmp_path / "p.bk.log"
    prof.write_text("c\n1\n2\n100,4000\n200,8000\n")
    assert main(["analyze", "what-if", str(prof), "--iteration-ms", "10", "--link", str(link)]) == 2
    assert "fit.onebit_latency must be a list of [bytes > 0, seconds >= 0] pairs" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(180)
def test_bench_fits_a_link(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("thinwire.comm.bench", reason="thinwire bench allreduce not installed")
    out = tmp_path / "link.json"
    assert (
        main(
            [
                "analyze",
                "fit",
                "--workers",
                "2",
                "--min-bytes",
                "4K",
                # up to 8 MiB, 5 times each: under load from other processes the
                # small messages' times scatter, and 1 MiB left them level with 4 KiB
                "--max-bytes",
                "8M",
                "--warmup",
                "1",
                "--iters",
                "5",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    fit = doc["fit"]
    assert fit["bandwidth_gbps"] > 0 and fit["alpha_s"] >= 0 and fit["world_size"] == 2
    # The 1-bit call is measured beside fp32, and simulate --link charges what it measured.
    assert {r["method"] for r in doc["rows"]} == {"fp32", "onebit"}
    sizes = sorted(r["size_bytes"] for r in doc["rows"] if r["method"] == "onebit")
    assert [s for s, _ in fit["onebit_latency"]] == sizes
    assert all(w >= 0 for _, w in fit["onebit_latency"])
    assert "1-bit allreduce, wait per call" in capsys.readouterr().out
    prof = tmp_path / "profile.json"
    profile = ["analyze", "profile", "--model", "tiny", "--batch-size", "2", "--warmup", "1"]
    assert main([*profile, "--steps", "1", "-o", str(prof)]) == 0
    sim = tmp_path / "sim.json"
    argv = ["analyze", "what-if", str(prof), "--workers", "4", "--link", str(out)]
    assert main([*argv, "--scheme", "onebit", "-o", str(sim)]) == 0
    config = json.loads(sim.read_text())["result"]["config"]
    assert config["onebit_latency"] == fit["onebit_latency"]
