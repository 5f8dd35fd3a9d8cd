"""Fuzz tier for the network analysis' inputs: any profile, simulation or link file gives
a result or one ``thinwire: error:`` line with exit status 2, never a traceback.

A seeded generator (no new dependency, the same cases on every run) mutates valid files
at two levels: the JSON tree (a value swapped for another type, a key dropped or added,
a list emptied, a number made huge, negative or non-finite) and the bytes (truncated, a
byte flipped, invalid UTF-8, nesting deeper than the parser allows). Each mutant goes
through the command a user would run, in-process: ``analyze what-if`` for profiles and
``.bk.log`` files, ``analyze report`` for simulations, ``what-if --link`` for link fits.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from thinwire.cli.main import main

SEEDS = range(60)
"""Mutants per file kind: 60 keeps this file near ten seconds on 2 cores."""

PROFILE: dict[str, Any] = {
    "format": "thinwire.profile/1",
    "model": "fuzz",
    "iteration_s": 0.5,
    "backward_s": 0.2,
    "forward_s": 0.1,
    "optimizer_s": 0.05,
    "source": "measured",
    "device": "cpu",
    "batch_size": 4,
    "steps": 5,
    "observed_buckets": None,
    "meta": {
        "add_cost": {"sizes": [1024.0, 65536.0], "seconds": [1e-6, 3e-5], "source": "fuzz"},
        "onebit_codec_s_per_byte": 1e-8,
    },
    "params": [
        {"name": "w1", "index": 0, "nbytes": 65536, "dtype": "float32", "ready_s": 0.19},
        {"name": "b1", "index": 1, "nbytes": 256, "dtype": "float32", "ready_s": 0.18},
        {"name": "w2", "index": 2, "nbytes": 4096, "dtype": "float32", "ready_s": 0.1},
    ],
}

LINK: dict[str, Any] = {
    "format": "thinwire.link/1",
    "fit": {"bandwidth_gbps": 0.8, "alpha_per_message_s": 2e-4, "onebit_latency": [[1e6, 0.01]]},
    "rows": [],
}

_ODD_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    -(10**30),
    10**400,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x" * 50,
    [],
    {},
    [None],
    {"a": []},
]


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON tree, as the keys and indices that reach it."""
    found = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            found += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _paths(v, (*at, i))
    return found


def _mutate_tree(doc: Any, rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        spots = [p for p in _paths(doc) if p]
        if not spots:
            break
        where = rng.choice(spots)
        parent = doc
        for k in where[:-1]:
            parent = parent[k]
        last = where[-1]
        move = rng.random()
        if move < 0.6:
            parent[last] = rng.choice(_ODD_VALUES)
        elif move < 0.8 and isinstance(parent, dict):
            del parent[last]
        elif isinstance(parent, dict):
            parent[f"extra{rng.randint(0, 9)}"] = rng.choice(_ODD_VALUES)
        else:
            parent.clear()
    return doc


def _mutate_bytes(text: str, rng: random.Random) -> bytes:
    raw = bytearray(text.encode())
    move = rng.random()
    if move < 0.3:
        return bytes(raw[: rng.randint(0, len(raw))])
    if move < 0.6:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    if move < 0.8:
        at = rng.randrange(len(raw))
        return bytes(raw[:at] + b"\xc3\x28\xff" + raw[at:])
    if move < 0.9:
        return b"[" * rng.choice([100, 5_000, 200_000])
    # an integer past Python's 4,300-digit limit for int()
    return text.replace("{", '{"big": ' + "9" * 5_000 + ", ", 1).encode()


def _mutant(doc: dict[str, Any], seed: int) -> bytes:
    rng = random.Random(seed)
    if seed % 3 == 2:
        return _mutate_bytes(json.dumps(doc, indent=1), rng)
    return json.dumps(_mutate_tree(doc, rng)).encode()


def _holds(argv: list[str], capsys: pytest.CaptureFixture[str], what: str) -> None:
    """The property: exit 0, or exit 2 with exactly one ``thinwire: error:`` line."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    if code == 0:
        return
    assert code == 2, f"{what}: exit {code}: {err}"
    errors = [ln for ln in err.splitlines() if ln.startswith("thinwire: error:")]
    assert len(errors) == 1 and "Traceback" not in err, f"{what}: {err}"


@pytest.mark.timeout(120)
def test_any_profile_simulates_or_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "p.json", tmp_path / "s.json"
    path.write_text(json.dumps(PROFILE))
    assert main(["analyze", "what-if", str(path), "--workers", "4", "-o", str(out)]) == 0
    for seed in SEEDS:
        path.write_bytes(_mutant(PROFILE, seed))
        argv = ["analyze", "what-if", str(path), "--workers", "4", "-o", str(out)]
        _holds(argv, capsys, f"profile mutant {seed}")


@pytest.mark.timeout(120)
def test_any_simulation_reports_or_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, sim = tmp_path / "p.json", tmp_path / "s.json"
    prof.write_text(json.dumps(PROFILE))
    assert main(["analyze", "what-if", str(prof), "--workers", "4", "-o", str(sim)]) == 0
    valid = json.loads(sim.read_text())
    capsys.readouterr()
    for seed in SEEDS:
        sim.write_bytes(_mutant(valid, seed))
        _holds(["analyze", "report", str(sim)], capsys, f"simulation mutant {seed}")


@pytest.mark.timeout(120)
def test_any_link_fit_is_used_or_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, link, out = tmp_path / "p.json", tmp_path / "link.json", tmp_path / "s.json"
    prof.write_text(json.dumps(PROFILE))
    for seed in SEEDS:
        link.write_bytes(_mutant(LINK, seed))
        argv = ["analyze", "what-if", str(prof), "--workers", "4", "--link", str(link)]
        _holds([*argv, "-o", str(out)], capsys, f"link mutant {seed}")


@pytest.mark.timeout(120)
def test_any_bklog_simulates_or_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "m.bk.log", tmp_path / "s.json"
    rows = "".join(f"{90.5 * i:.3f},{4096 * (i + 1)}\n" for i in range(12))
    valid = f"comment\n1\n12\n{rows}"
    path.write_text(valid)
    argv = ["analyze", "what-if", str(path), "--workers", "4", "--iteration-ms", "50"]
    assert main([*argv, "-o", str(out)]) == 0
    for seed in SEEDS:
        path.write_bytes(_mutate_bytes(valid, random.Random(seed)))
        _holds([*argv, "-o", str(out)], capsys, f"bk.log mutant {seed}")
