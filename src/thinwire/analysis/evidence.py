"""What is known about how each fix trains on *this* model, for the analyzer's verdict.

The network model says how fast each alternative would run; it knows nothing of whether
the alternative still trains. A verdict that recommends 1-bit LAMB on a model where
1-bit LAMB diverged is worse than none. :func:`gather` reads what runs on the same model
showed and sorts it by family of fix (the rows of the report's "on this network" table):

* ``onebit-optimizer``: 1-bit Adam and 1-bit LAMB (``onebit-adam``, ``onebit-lamb``);
* ``onebit-hook``: the 1-bit allreduce comm hook (``adamw-onebit``,
  ``adamw-onebit-sync``, the zoo's ``adamw-onebit-hook``);
* ``half``: fp16/bf16 gradient allreduce (``adamw-fp16``);
* ``localsgd``: DiLoCo and asynchronous Local-SGD (``diloco``, ``async-diloco``, the
  zoo's ``async``).

Sources: the recorded run itself (:func:`from_run`: a run that skipped more than
:data:`SKIPPED_SHARE` of its steps was unstable), a ``comparison.json`` of ``thinwire
compare`` (a run that diverged never wrote
a summary; one whose final loss is more than :data:`WORSE_RATIO` times its reference's
lost quality; one that skipped more than :data:`SKIPPED_SHARE` of its steps was unstable)
and a zoo result, ``zoo.json`` of ``thinwire bench zoo`` (a piece that failed its
verdict against its uncompressed baseline, on the model named). Each family keeps its
worst finding. The report then ranks a family with a finding lower, says why in the
advice, and never recommends a family that failed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import read_input

__all__ = ["FAMILIES", "WORSE_RATIO", "Finding", "family_of", "from_run", "gather"]

FAMILIES: dict[str, str] = {
    "onebit-optimizer": "1-bit Adam/LAMB",
    "onebit-hook": "1-bit allreduce",
    "half": "fp16/bf16 allreduce",
    "localsgd": "Local-SGD/DiLoCo",
}
"""Each family of fix, and the prefix of its rows in the report's alternatives table."""

_MEMBERS = {
    "onebit-adam": "onebit-optimizer",
    "onebit-lamb": "onebit-optimizer",
    "adamw-onebit": "onebit-hook",
    "adamw-onebit-sync": "onebit-hook",
    "adamw-onebit-hook": "onebit-hook",
    "adamw-fp16": "half",
    "diloco": "localsgd",
    "async-diloco": "localsgd",
    "async": "localsgd",
}

WORSE_RATIO = 1.03
"""A final loss more than this times the reference's counts as lost quality (the zoo's
tolerance of 3%)."""

SKIPPED_SHARE = 0.01
"""A run that skipped more than this share of its steps (non-finite updates) was unstable."""

_RANK = {"ok": 0, "worse": 1, "failed": 2}


@dataclass(frozen=True)
class Finding:
    """How one family of fix fared on this model."""

    family: str
    status: str
    """``failed`` (diverged, or far off), ``worse`` (trained, but lost quality) or ``ok``."""
    why: str
    """One clause saying what was seen (``onebit-lamb ended 8.1% above lamb``)."""
    source: str
    """The file it came from."""

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def family_of(name: str) -> str | None:
    """The family of an algorithm or zoo piece (a run spec's ``@...`` is ignored)."""
    return _MEMBERS.get(name.split("@", 1)[0])


def _from_comparison(data: dict[str, Any], source: str) -> list[Finding]:
    runs, ref = data.get("runs"), data.get("reference")
    if not isinstance(runs, dict) or ref not in runs:
        raise ConfigError(f"{source}: not a thinwire comparison (no runs and reference)")
    base = runs[ref].get("final_val_loss")
    out = []
    for label, run in runs.items():
        family = family_of(str(run.get("algo", label)))
        if family is None or not isinstance(run, dict):
            continue
        loss, summary = run.get("final_val_loss"), run.get("summary") or {}
        steps = max(1, int(summary.get("steps") or run.get("config", {}).get("steps") or 1))
        skipped = int(summary.get("skipped_steps") or 0)
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            out.append(
                Finding(family, "failed", f"{label} did not finish with a finite loss", source)
            )
        elif isinstance(base, (int, float)) and base > 0 and loss > WORSE_RATIO * base:
            why = f"{label} ended {100 * (loss / base - 1):.1f}% above {ref}"
            out.append(Finding(family, "failed" if loss > 1.1 * base else "worse", why, source))
        elif skipped > SKIPPED_SHARE * steps:
            out.append(
                Finding(family, "worse", f"{label} skipped {skipped} of {steps} steps", source)
            )
        else:
            out.append(Finding(family, "ok", f"{label} within 3% of {ref}", source))
    return out


def _from_zoo(data: dict[str, Any], model: str | None, source: str) -> list[Finding]:
    verdicts = data.get("verdicts")
    if not isinstance(verdicts, list):
        raise ConfigError(f"{source}: not a zoo result (no verdicts)")
    out = []
    for v in verdicts:
        if not isinstance(v, dict) or (model is not None and v.get("model") != model):
            continue
        family = family_of(str(v.get("piece")))
        if family is None:
            continue
        gap = v.get("gap")
        gap_text = f"{100 * gap:+.1f}%" if isinstance(gap, (int, float)) else "a gap"
        what = f"{v.get('piece')} on {v.get('model')}: {gap_text} against {v.get('baseline')}"
        if v.get("passed") or v.get("excused"):
            out.append(Finding(family, "ok", what, source))
        else:
            far = isinstance(gap, (int, float)) and abs(gap) > 0.1
            out.append(Finding(family, "failed" if far else "worse", what, source))
    return out


def from_run(run_dir: str | Path) -> list[Finding]:
    """What a ``thinwire train`` run shows of its own algorithm: unstable when it skipped
    more than :data:`SKIPPED_SHARE` of its steps (its last logged ``skipped_steps``), as
    the recorded run of ``thinwire analyze run`` may be a 1-bit run itself. Nothing when
    its files say nothing (no summary, another algorithm family)."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError):
        return []
    family = family_of(str(summary.get("algo", "")))
    if family is None:
        return []
    skipped = 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("skipped_steps"), int):
            skipped = record["skipped_steps"]
            break
    steps = max(1, int(summary.get("steps") or 1))
    source = str(run_dir / "metrics.jsonl")
    if skipped > SKIPPED_SHARE * steps:
        why = f"the recorded {summary['algo']} run skipped {skipped} of {steps} steps"
        return [Finding(family, "worse", why, source)]
    return [Finding(family, "ok", f"the recorded {summary['algo']} run trained", source)]


def gather(
    paths: list[str | Path], model: str | None = None, runs: Sequence[str | Path] = ()
) -> dict[str, Finding]:
    """The worst finding per family in ``paths`` (comparison or zoo JSON files) and in the
    run directories ``runs`` (:func:`from_run`); ``model`` picks a zoo result's model
    (None: all of them). A file that is neither is one line."""
    items = [f for run in runs for f in from_run(run)]
    for path in paths:
        text = read_input(path, "evidence")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{path}: not JSON: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a comparison.json or zoo.json object")
        if "verdicts" in data:
            items += _from_zoo(data, model, str(path))
        else:
            items += _from_comparison(data, str(path))
    found: dict[str, Finding] = {}
    for f in items:
        if f.family not in found or _RANK[f.status] > _RANK[found[f.family].status]:
            found[f.family] = f
    return found
