"""The one-screen answer: is the network the bottleneck, and what would fix it?

:func:`render_report` turns a simulation study (:func:`thinwire.analysis.study.run_study`
or its saved JSON) into plain text that fits one terminal screen: the profile, the
predicted step split into compute and exposed communication, a verdict in words, the
fix, and thinwire's alternatives on the same network side by side.

How the advice is chosen (:func:`recommend`), with ``target`` the scaling factor the
user asked for (default 90%):

1. SF >= target: the network is not the bottleneck; keep plain DDP (fp32).
2. the needed compression is <= 2x: fp16/bf16 gradients suffice.
3. a 1-bit scheme reaches the target (about 28x less traffic: a bit per element and
   a scale per 256; 1-bit Adam / 1-bit LAMB, or the overlapped 1-bit comm hook): use it.
4. otherwise (even 28x is not enough, or latency/reductions dominate so that no ratio
   helps): Local-SGD / DiLoCo, communicating once every H steps, with the smallest H
   that reaches the target.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from thinwire.compress.onebit import onebit_ratio

__all__ = ["fmt_bytes", "fmt_rate", "fmt_time", "recommend", "render_report"]

WIDTH = 100
ONEBIT_RATIO = onebit_ratio()
"""fp32 bytes per 1-bit byte at thinwire's default block of 256 (28.4)."""


def fmt_time(seconds: float) -> str:
    """``1.23 s``, ``45.6 ms`` or ``789 us``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def fmt_bytes(nbytes: float) -> str:
    """Binary units: ``512 B``, ``1.5 KiB``, ``12.4 MiB``, ``1.02 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def fmt_rate(gbps: float) -> str:
    """``10 Gbit/s`` or ``250 Mbit/s``."""
    if gbps >= 1:
        return f"{gbps:.3g} Gbit/s"
    return f"{gbps * 1e3:.3g} Mbit/s"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _find(alts: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    return next((a for a in alts if a["name"].startswith(prefix)), None)


def recommend(study: dict[str, Any]) -> tuple[str, str]:
    """``(verdict, advice)``: two plain sentences for the configured network."""
    res, need, target = study["result"], study["needed"], study["target"]
    cfg = res["config"]
    sf = res["scaling_factor"]
    where = f"{cfg['workers']} workers at {fmt_rate(cfg['bandwidth_gbps'])}"
    if sf >= target:
        return (
            f"The network is NOT the bottleneck for {where}: the predicted scaling factor "
            f"is {_pct(sf)} (target {_pct(target)}).",
            "Plain DDP (fp32 allreduce) is enough; compression would buy at most "
            f"{_pct(1 / sf - 1)} more throughput.",
        )
    verdict = (
        f"The network IS the bottleneck for {where}: each step waits "
        f"{fmt_time(res['exposed_s'])} for communication, so the scaling factor is only "
        f"{_pct(sf)} (target {_pct(target)})."
    )
    alts = study["alternatives"]
    c = need["compression"]
    h = need["local_steps"]
    ev = study.get("evidence") or {}
    ranked_lower = _ranked_lower(ev)
    local = f"Local-SGD / DiLoCo averaging every H = {h} steps reaches the target"
    if "localsgd" in ev and ev["localsgd"]["status"] != "ok":
        local += f" (but {ev['localsgd']['why']} on this model)"
    br = res.get("breakdown", {})
    busy = sum(br.values()) or 1.0
    fixed = (br.get("latency_s", 0.0) + br.get("reduce_s", 0.0) + br.get("codec_s", 0.0)) / busy
    if c is None:
        return verdict, (
            "No compression ratio fixes it: latency, reductions and codec cost alone "
            f"({_pct(fixed)} of the channel time) exceed the budget. {local}; "
            "larger buckets (--bucket-cap-mb) also cut the per-message latency."
        )
    if c <= 2 and "half" not in ranked_lower:
        return verdict, (
            f"A {c:.2f}x smaller gradient volume reaches the target: fp16/bf16 gradient "
            "allreduce (2x) is enough." + _lower_note(ev, ranked_lower)
        )
    onebit = [
        a
        for a in (_find(alts, "1-bit Adam"), _find(alts, "1-bit allreduce"))
        if a is not None
        and a["scaling_factor"] >= target
        and _family_of_row(a["name"]) not in ranked_lower
    ]
    if c <= ONEBIT_RATIO and onebit:
        advice = _onebit_advice(c, onebit[0], alts, local, "onebit-optimizer" in ranked_lower)
        return verdict, advice + _lower_note(ev, ranked_lower)
    if c <= ONEBIT_RATIO and ranked_lower & {"onebit-optimizer", "onebit-hook"}:
        reason = "the 1-bit schemes that would reach it did not train well on this model"
    elif c > ONEBIT_RATIO:
        reason = (
            f"it needs {c:.0f}x compression, more than 1-bit schemes (~{ONEBIT_RATIO:.0f}x) give"
        )
    else:
        reason = "1-bit schemes do not reach it once their latency and codec cost are counted"
    return verdict, f"Compression is not the fix: {reason}. {local}." + _lower_note(
        ev, ranked_lower
    )


def _onebit_advice(
    c: float, best: dict[str, Any], alts: list[dict[str, Any]], local: str, no_adam: bool
) -> str:
    """The advice when a 1-bit scheme reaches the target: ``best``, the first that does;
    ``no_adam``: 1-bit Adam/LAMB failed on this model, so it is not suggested instead."""
    g = best.get("config", {}).get("workers_per_node", 1)
    across = f", FSDP2 inside each node and 1-bit across nodes: --shard-within {g}" if g > 1 else ""
    how = (
        f"1-bit Adam / 1-bit LAMB (they communicate after the backward pass{across})"
        if best["name"].startswith("1-bit Adam")
        else "the overlapped 1-bit allreduce comm hook (1-bit Adam/LAMB alone would "
        "not: they cannot overlap the backward pass)"
    )
    advice = (
        f"Compression of {c:.1f}x reaches the target; use {how}: predicted SF "
        f"{_pct(best['scaling_factor'])}."
    )
    if not best["name"].startswith("1-bit Adam") and not no_adam:
        # Measured on the model zoo: behind 1-bit gradients Adam's second moment
        # loses each element's scale (docs/compression.md).
        adam = _find(alts, "1-bit Adam")
        advice += (
            " Check it against your baseline: behind 1-bit gradients AdamW came within "
            "3% on half of thinwire's model zoo and lost up to 12% on the rest; with "
            "Adam or AdamW use 1-bit Adam instead"
            + (f" (predicted SF {_pct(adam['scaling_factor'])})" if adam else "")
            + f"; or {local}."
        )
    return advice


_ROW_FAMILY = {
    "1-bit Adam": "onebit-optimizer",
    "1-bit allreduce": "onebit-hook",
    "fp16/bf16": "half",
    "Local-SGD": "localsgd",
}


def _family_of_row(name: str) -> str | None:
    """The family of fix (:data:`thinwire.analysis.evidence.FAMILIES`) of a table row."""
    return next((f for prefix, f in _ROW_FAMILY.items() if name.startswith(prefix)), None)


def _ranked_lower(ev: dict[str, Any]) -> set[str]:
    """The families that diverged or lost quality on this model (never recommended)."""
    return {family for family, f in ev.items() if f.get("status") in ("failed", "worse")}


def _lower_note(ev: dict[str, Any], families: set[str]) -> str:
    """One sentence per family ranked lower, with what was seen and where."""
    notes = [
        f" Not recommended here: {ev[f]['why']} ({Path(ev[f]['source']).name})."
        for f in sorted(families)
        if f != "localsgd"
    ]
    return "".join(notes)


def render_report(study: dict[str, Any]) -> str:
    """The one-screen text report of a study."""
    lines = _setting_lines(study)
    lines += _prediction_lines(study["result"])
    lines += _advice_lines(study)
    lines += _needs_lines(study)
    return "\n".join(lines)


def _scheme_name(cfg: dict[str, Any]) -> str:
    """The configured scheme in words (``ring allreduce with 2x compression``)."""
    scheme = {"ring": "ring allreduce", "onebit": "1-bit allreduce", "localsgd": "Local-SGD"}[
        cfg["scheme"]
    ]
    if cfg["scheme"] == "ring" and cfg["compression"] != 1:
        scheme += f" with {cfg['compression']:g}x compression"
    if cfg["scheme"] == "localsgd":
        scheme += f", H={cfg['local_steps']}"
        if cfg.get("fragments", 1) > 1 or cfg.get("fragment_overlap", 0):
            scheme += (
                f", streaming: {cfg['fragments']} fragments, overlap {cfg['fragment_overlap']}"
            )
    return scheme


def _setting_lines(study: dict[str, Any]) -> list[str]:
    """The title line, and what was measured and how reductions are priced."""
    p, cfg, b = study["profile"], study["result"]["config"], study["buckets"]
    scheme = _scheme_name(cfg)
    parts = [
        f"forward {fmt_time(p['forward_s'])}" if p.get("forward_s") else None,
        f"backward {fmt_time(p['backward_s'])}",
        f"optimizer {fmt_time(p['optimizer_s'])}" if p.get("optimizer_s") else None,
    ]
    g = cfg.get("workers_per_node", 1)
    nodes = f" ({g}/node, hierarchical)" if g > 1 else ""
    lines = [
        f"thinwire analyze: {p['model']} on {cfg['workers']} workers{nodes} at "
        f"{fmt_rate(cfg['bandwidth_gbps'])}, {scheme}, "
        f"overlap {'on' if cfg['overlap'] else 'off'}",
        "",
        f"profile     iteration {fmt_time(p['iteration_s'])} on one worker "
        f"({', '.join(x for x in parts if x)})",
        f"            {p['source']} on {p['device']}: {fmt_bytes(p['grad_bytes'])} of gradients "
        f"in {b['count']} {b['kind']} buckets",
        f"            reductions priced by: {study['reduction']}; latency "
        f"{fmt_time(cfg['alpha_s'])} per message; "
        f"{cfg.get('concurrency', 1)} collective(s) in flight at once",
    ]
    if p.get("frozen_params"):
        lines.append(
            f"            {p['frozen_params']} parameters ({fmt_bytes(p['frozen_bytes'])}) never "
            "got a gradient (frozen or unused): not communicated"
        )
    if p["grad_bytes"] == 0:
        lines.append("            no gradient ever became ready: there is nothing to communicate")
    return lines


def _prediction_lines(res: dict[str, Any]) -> list[str]:
    """The predicted step, scaling factor and channel time."""
    br = res.get("breakdown", {})
    return [
        f"predicted   step {fmt_time(res['step_s'])} = compute {fmt_time(res['iteration_s'])}"
        f" + exposed communication {fmt_time(res['exposed_s'])}",
        f"            scaling factor {_pct(res['scaling_factor'])}, link busy "
        f"{_pct(res['link_utilization'])} of the step, " + _bytes_per_step(res),
        "            channel time: "
        + ", ".join(f"{k.removesuffix('_s')} {fmt_time(v)}" for k, v in br.items() if v > 0)
        if any(v > 0 for v in br.values())
        else "            channel time: none",
        "",
    ]


def _bytes_per_step(res: dict[str, Any]) -> str:
    """What crosses per step: per worker, or per tier with nodes."""
    if res["config"].get("workers_per_node", 1) > 1:
        return (
            f"{fmt_bytes(res['wire_bytes'])} across nodes (each node's link) and "
            f"{fmt_bytes(res.get('intra_wire_bytes', 0.0))} inside a node (each worker) per step"
        )
    return f"{fmt_bytes(res['wire_bytes'])} sent per worker per step"


def _advice_lines(study: dict[str, Any]) -> list[str]:
    """The verdict and the fix (with a better DDP bucket cap, if one helps), wrapped."""
    res = study["result"]
    verdict, advice = recommend(study)
    caps = study.get("bucket_caps") or []
    best = max(caps, key=lambda c: c["scaling_factor"], default=None)
    if best is not None and best["scaling_factor"] > res["scaling_factor"] + 0.01:
        advice += (
            f" Tuning alone helps too: DDP with bucket_cap_mb={best['cap_mb']:g} predicts SF "
            f"{_pct(best['scaling_factor'])} (smaller buckets start during the backward pass)."
        )
    lines: list[str] = []
    for label, text in (("verdict", verdict), ("fix", advice)):
        lines += textwrap.wrap(
            text, width=WIDTH, initial_indent=f"{label:12s}", subsequent_indent=" " * 12
        )
    lines.append("")
    return lines


def _needs_lines(study: dict[str, Any]) -> list[str]:
    """What would reach the target, and how the alternatives fare on this network."""
    need = study["needed"]
    c, bw, h = need["compression"], need["bandwidth_gbps"], need["local_steps"]
    needs = [
        f"compression >= {c:.2f}x" if c is not None else "no compression ratio suffices",
        f"bandwidth >= {fmt_rate(bw)}" if bw is not None else "no bandwidth suffices",
        f"Local-SGD H >= {h}" if h is not None else "no Local-SGD period suffices",
    ]
    lines = [f"to reach SF {_pct(study['target'])}: " + ", or ".join(needs)]
    lines.append(
        f"            (infinite compression would give SF {_pct(need['infinite_compression_sf'])})"
    )
    width = max([40] + [len(a["name"]) for a in study["alternatives"]])
    # With nodes the bytes come per tier: each node's link, and inside a node.
    tiers = study["result"]["config"].get("workers_per_node", 1) > 1
    bytes_head = (
        f"{'across/step':>11s} {'per sync':>11s} {'inside/step':>11s}"
        if tiers
        else f"{'wire/step':>11s} {'per sync':>11s}"
    )
    lines += ["", f"{'on this network':{width + 2}s} {'step':>10s} {'SF':>7s} {bytes_head}"]
    ev = study.get("evidence") or {}
    for a in study["alternatives"]:
        finding = ev.get(_family_of_row(a["name"]) or "", {})
        mark = {"failed": "  diverged or far off here", "worse": "  lost quality here"}
        # per sync: what the link carries at once (a round's bytes for DiLoCo, a
        # fragment's for Streaming DiLoCo; studies saved before it was recorded: a step's)
        sync = a.get("sync_wire_bytes", a["wire_bytes"])
        lines.append(
            f"  {a['name']:{width}s} {fmt_time(a['step_s']):>10s} {_pct(a['scaling_factor']):>7s} "
            f"{fmt_bytes(a['wire_bytes']):>11s} {fmt_bytes(sync):>11s}"
            + (f" {fmt_bytes(a.get('intra_wire_bytes', 0.0)):>11s}" if tiers else "")
            + mark.get(finding.get("status", ""), "")
        )
    return lines
