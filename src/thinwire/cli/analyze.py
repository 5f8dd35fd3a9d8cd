"""``thinwire analyze``: is the network the bottleneck of this training job?

Four verbs, each writing the JSON the next one reads::

    thinwire analyze profile --model small --batch-size 8 -o profile.json
    thinwire analyze profile --model mypkg.models:make_bert -o profile.json   # your model
    thinwire analyze fit --workers 2 -o link.json              # optional: fit a link
    thinwire analyze what-if profile.json --workers 4 --bandwidth-gbps 1 -o sim.json
    thinwire analyze report sim.json --plots plots/

A run recorded while it trained (``thinwire train`` records every run to
``OUT/record.jsonl``; your own loop with :func:`thinwire.comm.step_record.record_run`)
needs no profile: ``thinwire analyze run OUT/ [--workers 16 --bandwidth-gbps 0.1]``
prints its what-if report from the record.

``what-if`` also reads the paper's ``.bk.log`` profiles directly. ``validate`` checks the
prediction against steps measured on the testbed. ``analyze bench`` and ``analyze
simulate``, the old spellings of ``fit`` and ``what-if``, still work.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from thinwire.analysis.formats import link_document, load_link, load_study, reduction_cost
from thinwire.analysis.memory import check_bench_memory, check_profile_memory
from thinwire.cli.analyze_validate import add_validate_verb
from thinwire.cli.parser import add_moved
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.rundir import writable_dir, writable_file
from thinwire.units import parse_size

__all__ = ["register"]


def _write_json(data: dict[str, Any], path: str) -> Path:
    out = writable_file(path)
    atomic_write_text(out, json.dumps(data, indent=1) + "\n")
    return out


def _profile_model(args: argparse.Namespace) -> Any:
    """A GPT preset, or the user's factory ``package.module:function`` / ``file.py:function``."""
    from thinwire.analysis.measure import profile_gpt
    from thinwire.analysis.user_model import profile_factory
    from thinwire.train.model import PRESETS

    common = dict(
        warmup=args.warmup,
        steps=args.steps,
        observe_ddp=args.observe_ddp,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    if args.model in PRESETS:
        batch = args.batch_size if args.batch_size is not None else 8
        return profile_gpt(args.model, batch, **common)
    if ":" not in args.model:
        raise ConfigError(
            f"unknown model {args.model!r}; choose one of {', '.join(PRESETS)}, or name your "
            "own factory as package.module:function or path/file.py:function"
        )
    return profile_factory(args.model, args.batch_size, **common)


def _cmd_profile(args: argparse.Namespace) -> int:
    from thinwire.analysis.bklog import read_bklog
    from thinwire.analysis.profile import save_profile
    from thinwire.analysis.report import fmt_bytes, fmt_time

    writable_file(args.out)
    if args.from_bklog:
        it = args.iteration_ms / 1e3 if args.iteration_ms is not None else None
        prof = read_bklog(args.from_bklog, iteration_s=it)
    else:
        from thinwire.train.model import PRESETS

        if args.model in PRESETS:  # a user's factory sizes its own batch
            batch = args.batch_size if args.batch_size is not None else 8
            check_profile_memory(args.model, batch)
        if args.threads is not None:
            import torch

            if args.threads < 1:
                raise ConfigError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        prof = _profile_model(args)
    if not args.from_bklog:
        from thinwire.analysis.costs import AddCost, measure_codec_cost

        # Price the machine's adds and 1-bit compute now, on the profiled device, so
        # every later simulation of this profile uses the same figures.
        prof.meta["add_cost"] = AddCost.measure().to_json()
        prof.meta["onebit_codec_s_per_byte"] = measure_codec_cost(world_size=4)
    out = save_profile(prof, args.out)
    s = prof.summary()
    print(
        f"{s['model']}: iteration {fmt_time(s['iteration_s'])}, backward "
        f"{fmt_time(s['backward_s'])}, {s['params']} parameters, "
        f"{fmt_bytes(s['grad_bytes'])} of gradients"
    )
    if s["frozen_params"]:
        print(f"  {s['frozen_params']} parameters never got a gradient (frozen or unused)")
    if not s["grad_bytes"]:
        print("  no parameter gets a gradient: data parallelism has nothing to communicate")
    if prof.observed_buckets:
        print(f"  DDP launched {len(prof.observed_buckets)} buckets")
    print(f"wrote {out}")
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from thinwire.analysis.fit import bench_link
    from thinwire.analysis.report import fmt_bytes, fmt_rate, fmt_time

    low, high = parse_size(args.min_bytes, "--min-bytes"), parse_size(args.max_bytes, "--max-bytes")
    if low < 4 or high < low:
        raise ConfigError(f"need 4 <= --min-bytes <= --max-bytes, got {low}, {high}")
    check_bench_memory(high, args.workers)
    writable_file(args.out)
    sizes = []
    s = low
    while s <= high:
        sizes.append(s)
        s *= 2
    rows, fit = bench_link(sizes, workers=args.workers, warmup=args.warmup, iters=args.iters)
    print(f"{'size':>10s} {'time':>10s} {'busbw':>14s} {'fit':>10s}")
    for r in (r for r in rows if r["method"] == "fp32"):
        print(
            f"{fmt_bytes(r['size_bytes']):>10s} {fmt_time(r['time_s']):>10s} "
            # The benchmark reports GB/s (the nccl-tests unit); links are sold in Gbit/s.
            f"{fmt_rate(8 * r['busbw_gbps']):>14s} {fmt_time(fit.predict(r['size_bytes'])):>10s}"
        )
    print(
        f"fit: alpha {fmt_time(fit.alpha_s)} per allreduce "
        f"({fmt_time(fit.alpha_per_message_s)} per message), effective bandwidth "
        f"{fmt_rate(fit.bandwidth_gbps)}, worst relative error {fit.max_rel_error:.0%}"
    )
    if fit.onebit_latency:
        waits = ", ".join(f"{fmt_time(w)} at {fmt_bytes(s)}" for s, w in fit.onebit_latency)
        print(f"1-bit allreduce, wait per call beyond wire and compute: {waits}")
    out = _write_json(link_document(fit.to_json(), rows), args.out)
    print(f"wrote {out}")
    return 0


def _cmd_what_if(args: argparse.Namespace) -> int:
    from thinwire.analysis.buckets import make_buckets
    from thinwire.analysis.report import fmt_rate, fmt_time
    from thinwire.analysis.study import run_study

    writable_file(args.out)
    path = Path(args.profile)
    prof, cpu = _what_if_profile(args, path)
    cfg, onebit_codec = _what_if_network(args, prof, cpu)
    buckets = make_buckets(
        prof,
        args.buckets,
        bucket_cap_mb=args.bucket_cap_mb,
        cycle_ms=args.cycle_ms,
        fusion_mb=args.fusion_mb,
    )
    study = run_study(
        prof,
        buckets,
        cfg,
        reduction_cost(args.reduction, path, prof.meta),
        target=args.target,
        bucket_kind=args.buckets,
        onebit_codec_s_per_byte=onebit_codec,
    )
    study["profile_path"] = str(path)
    res = study["result"]
    if prof.grad_bytes == 0:
        # A "100% scaling factor" would read as a verdict on the network; there is none.
        print(
            f"{prof.model}: no parameter gets a gradient, so data parallelism has nothing to "
            "communicate and the network cannot be the bottleneck"
        )
        print(f"wrote {_write_json(study, args.out)}")
        return 0
    print(
        f"{prof.model}: {cfg.workers} workers at {fmt_rate(cfg.bandwidth_gbps)}: step "
        f"{fmt_time(res['step_s'])}, exposed communication {fmt_time(res['exposed_s'])}, "
        f"scaling factor {res['scaling_factor']:.1%}, link busy {res['link_utilization']:.0%}"
    )
    c = study["needed"]["compression"]
    print(
        f"compression needed for SF {args.target:.0%}: "
        + (f"{c:.2f}x" if c is not None else "none suffices")
    )
    out = _write_json(study, args.out)
    print(f"wrote {out}")
    return 0


def _what_if_profile(args: argparse.Namespace, path: Path) -> tuple[Any, bool]:
    """The profile (a thinwire profile or a paper's ``.bk.log``), with ``--iteration-ms``
    applied, and whether it was taken on CPU."""
    from thinwire.analysis.bklog import read_bklog
    from thinwire.analysis.profile import load_profile

    cpu = False
    if path.name.endswith(".bk.log"):
        it = args.iteration_ms / 1e3 if args.iteration_ms is not None else None
        prof = read_bklog(path, iteration_s=it)
    else:
        prof = load_profile(path)
        cpu = prof.device == "cpu"
        if args.iteration_ms is not None:
            if not args.iteration_ms > 0:
                raise ConfigError(f"--iteration-ms must be > 0, got {args.iteration_ms}")
            prof.iteration_s = args.iteration_ms / 1e3
    return prof, cpu


def _what_if_network(args: argparse.Namespace, prof: Any, cpu: bool) -> tuple[Any, float | None]:
    """The network to model (flags, then a fitted ``--link``), and the 1-bit codec's
    measured cost per byte (None when unknown)."""
    from thinwire.analysis.costs import measure_codec_cost
    from thinwire.analysis.network_model import BACKEND_CONCURRENCY, NetworkConfig

    bandwidth, alpha, onebit_latency = args.bandwidth_gbps, args.alpha_us, ()
    if args.rtt is not None:
        if alpha is not None:
            raise ConfigError("give --rtt or --alpha-us, not both (they set the same term)")
        from thinwire.testbed.wan import parse_duration

        # gloo sends a message only once its receiver has announced the buffer, so each
        # ring message costs a round trip, not a one-way latency (docs/testbed.md).
        alpha = parse_duration(args.rtt, "--rtt") * 1e6
    if args.link:
        fit = load_link(args.link)
        bandwidth = bandwidth if bandwidth is not None else float(fit["bandwidth_gbps"])
        alpha = alpha if alpha is not None else float(fit["alpha_per_message_s"]) * 1e6
        onebit_latency = tuple((float(s), float(w)) for s, w in fit.get("onebit_latency", []))
    codec = args.codec_ns_per_byte * 1e-9 if args.codec_ns_per_byte is not None else 0.0
    saved = prof.meta.get("onebit_codec_s_per_byte")
    onebit_codec = float(saved) if saved is not None else None
    if args.measure_codec:
        if onebit_codec is None:
            onebit_codec = measure_codec_cost(world_size=4)
        codec = onebit_codec
    cfg = NetworkConfig(
        workers=args.workers,
        workers_per_node=args.workers_per_node,
        intra_node_gbps=args.intra_node_gbps,
        bandwidth_gbps=bandwidth if bandwidth is not None else 10.0,
        alpha_s=(alpha or 0.0) * 1e-6,
        compression=args.compression,
        codec_s_per_byte=codec,
        overlap=not args.no_overlap,
        scheme=args.scheme,
        local_steps=args.local_steps,
        fragments=args.fragments,
        fragment_overlap=args.fragment_overlap,
        # a CPU profile trains with gloo, a GPU one (and the paper's logs) with NCCL
        onebit_latency=onebit_latency,
        concurrency=BACKEND_CONCURRENCY[
            args.backend if args.backend != "auto" else "gloo" if cpu else "nccl"
        ],
    )
    return cfg, onebit_codec


def _cmd_report(args: argparse.Namespace) -> int:
    from thinwire.analysis.report import render_report

    if args.plots:
        writable_dir(args.plots, "--plots")
    study = load_study(args.simulation)
    try:
        text = render_report(study)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        # Deeper fields than load_study checks: a file edited by hand, or of another version.
        raise ConfigError(
            f"{args.simulation}: malformed simulation ({type(exc).__name__}: {exc}); re-run "
            "thinwire analyze what-if"
        ) from None
    print(text)
    if args.plots:
        from thinwire.analysis.plots import write_plots

        paths = write_plots(study, args.plots)
        print("\nplots: " + ", ".join(str(p) for p in paths))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from thinwire.analysis.recorded import analyze_record, load_record
    from thinwire.analysis.report import fmt_rate, fmt_time, render_report
    from thinwire.testbed.wan import parse_duration

    writable_file(args.out)
    rec = load_record(args.run)
    rtt = parse_duration(args.rtt, "--rtt") if args.rtt else 0.0
    study = analyze_record(
        rec,
        workers=args.workers,
        bandwidth_gbps=args.bandwidth_gbps,
        rtt_s=rtt,
        target=args.target,
        skip=args.skip,
        evidence=args.evidence,
        zoo_model=args.zoo_model,
    )
    seen, head = study["recorded"], rec.header
    achieved = seen["achieved_gbps"]
    print(
        f"recorded: {head.get('model')} on {rec.world_size} workers ({head.get('backend')}, "
        f"{head.get('device')}), {seen['steps']} steps read: step {fmt_time(seen['step_s'])} "
        f"= compute {fmt_time(seen['compute_s'])} + waiting {fmt_time(seen['exposed_s'])}"
        + (f"; collectives achieved {fmt_rate(achieved)}" if achieved else "")
    )
    split = seen.get("onebit_exchange")
    if split:
        print(
            f"the 1-bit exchange ({int(split['steps'])} compressing steps): update "
            f"{fmt_time(split['update_s'])}, codec {fmt_time(split['codec_s'])}, waiting "
            f"{fmt_time(split['wait_s'])} per step"
        )
    check = study["self_check"]
    if check is not None:
        print(
            f"predicted for the recorded setting: step {fmt_time(check['predicted_step_s'])} "
            f"({check['error_pct']:+.0f}% against the measured one)"
        )
    elif split:
        print("no self-check: DDP's buckets carried nothing in the compressing steps")
    elif not any(s.get("buckets") for s in rec.steps):
        print(
            "no bucket timings in this record (its optimizer communicates inside its step, "
            "or the DDP hook was registered before the recorder): no self-check"
        )
    if study["evidence_sources"]:
        print("how the fixes trained on this model, from: " + ", ".join(study["evidence_sources"]))
    print()
    print(render_report(study))
    print(f"\nwrote {_write_json(study, args.out)}")
    return 0


def _add_run_arguments(rn: argparse.ArgumentParser) -> None:
    rn.add_argument("run", help="a run directory (OUT/ of thinwire train) or a record file")
    rn.add_argument(
        "--workers", type=int, default=None, help="workers to predict (default: the run's own)"
    )
    rn.add_argument(
        "--bandwidth-gbps",
        type=_number,
        default=None,
        help="link to predict (default: the run's testbed rate, else what it achieved)",
    )
    rn.add_argument("--rtt", default=None, help="round trip between hosts, e.g. 20ms")
    rn.add_argument("--target", type=_number, default=0.9, help="scaling factor to aim for")
    rn.add_argument("--skip", type=int, default=2, help="first steps left out (warmup)")
    rn.add_argument(
        "--evidence",
        action="append",
        default=[],
        metavar="FILE",
        help="a comparison.json or zoo.json on this model: a fix that diverged or lost "
        "quality there is ranked lower (OUT/../comparison.json is read by itself)",
    )
    rn.add_argument("--zoo-model", default=None, help="the model of a zoo.json to read")
    rn.add_argument("--out", default="run-study.json", help="the study as JSON")
    rn.set_defaults(func=_cmd_run)


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(v):
        raise argparse.ArgumentTypeError("NaN is not a value")
    return v


def register(subparsers: Any) -> None:
    """Add ``thinwire analyze validate|profile|fit|what-if|run|report``, and ``bench`` and
    ``simulate``, the hidden old spellings of ``fit`` and ``what-if``."""
    p = subparsers.add_parser(
        "analyze",
        help="is the network the bottleneck? profile, fit, what-if, run, report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    add_validate_verb(verbs)
    _add_profile_arguments(
        verbs.add_parser("profile", help="time one worker's step and gradient ready times")
    )
    fit_help = "measure allreduce times and fit latency + bandwidth"
    _add_fit_arguments(verbs.add_parser("fit", help=fit_help, description=fit_help))
    _add_fit_arguments(add_moved(verbs, "bench", "thinwire analyze fit", description=fit_help))
    what_if_help = "predict the step on another network"
    _add_what_if_arguments(verbs.add_parser("what-if", help=what_if_help, description=what_if_help))
    _add_what_if_arguments(
        add_moved(verbs, "simulate", "thinwire analyze what-if", description=what_if_help)
    )
    run_help = "the what-if of a recorded run (thinwire train records OUT/record.jsonl)"
    _add_run_arguments(verbs.add_parser("run", help=run_help, description=run_help))
    rp = verbs.add_parser("report", help="the one-screen answer, and plots")
    rp.add_argument("simulation", help="sim.json from 'analyze what-if'")
    rp.add_argument("--plots", metavar="DIR", help="write the four PNG figures here")
    rp.set_defaults(func=_cmd_report)


def _add_profile_arguments(pr: argparse.ArgumentParser) -> None:
    pr.add_argument(
        "--model",
        default="tiny",
        metavar="MODEL",
        help="a GPT preset (tiny, mini, small, base), or your own factory returning (model, batch, "
        "loss_fn): package.module:function or path/file.py:function (see docs/analysis.md)",
    )
    pr.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per worker (presets: default 8; a factory gets it as batch_size=N)",
    )
    pr.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    pr.add_argument("--steps", type=int, default=5, help="measured steps; medians (default 5)")
    pr.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    pr.add_argument(
        "--observe-ddp",
        action="store_true",
        help="also record the buckets a real DDP (1-rank gloo group) launches",
    )
    pr.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP cap for --observe-ddp")
    pr.add_argument("--from-bklog", metavar="PATH", help="convert a paper .bk.log instead")
    pr.add_argument("--iteration-ms", type=float, default=None, help="iteration time for a log")
    pr.add_argument("-o", "--out", default="profile.json")
    pr.set_defaults(func=_cmd_profile)


def _add_fit_arguments(be: argparse.ArgumentParser) -> None:
    """``analyze fit`` (old spelling: ``analyze bench``)."""
    be.add_argument("--workers", type=int, default=2, help="local ranks if not under torchrun")
    # sizes are read by thinwire.units.parse_size when the verb runs, so that a bad one is
    # the usual one-line error naming the flag
    be.add_argument(
        "--min-bytes",
        default=4096,
        help="smallest message: bytes or e.g. 4KiB, 1.5M (K/M/G 1024-based; default 4096)",
    )
    be.add_argument(
        "--max-bytes", default=16 * 2**20, help="largest message, doubling up to it (default 16MiB)"
    )
    be.add_argument("--warmup", type=int, default=3)
    be.add_argument("--iters", type=int, default=10)
    be.add_argument("-o", "--out", default="link.json")
    be.set_defaults(func=_cmd_fit)


def _add_what_if_arguments(si: argparse.ArgumentParser) -> None:
    """``analyze what-if`` (old spelling: ``analyze simulate``): the network, then how the
    gradients are sent (:func:`_add_sending_arguments`)."""
    si.add_argument("profile", help="profile.json from 'analyze profile', or a paper .bk.log")
    si.add_argument("--workers", type=int, default=8, help="data-parallel workers n (>= 1)")
    si.add_argument(
        "--bandwidth-gbps",
        type=_number,
        default=None,
        help="link rate per worker, Gbit/s (default 10, or the --link fit)",
    )
    si.add_argument(
        "--alpha-us",
        type=_number,
        default=None,
        help="latency per message, microseconds (default 0, or the --link fit)",
    )
    si.add_argument(
        "--rtt",
        default=None,
        metavar="DURATION",
        help="measured round trip between workers, e.g. 100ms (what ping shows; twice the "
        "testbed's --delay): the latency of each ring message with gloo (sets alpha)",
    )
    si.add_argument(
        "--workers-per-node",
        type=int,
        default=1,
        help="g > 1: hierarchical allreduce; --bandwidth-gbps is then each node's link",
    )
    si.add_argument(
        "--intra-node-gbps", type=_number, default=800.0, help="link rate inside a node"
    )
    si.add_argument("--link", help="link.json from 'analyze fit' (bandwidth and alpha)")
    _add_sending_arguments(si)
    si.add_argument(
        "--iteration-ms", type=float, default=None, help="override the single-worker iteration time"
    )
    si.add_argument("--target", type=float, default=0.9, help="target scaling factor (0, 1]")
    si.add_argument("-o", "--out", default="sim.json")
    si.set_defaults(func=_cmd_what_if)


def _add_sending_arguments(si: argparse.ArgumentParser) -> None:
    """The what-if options of how gradients are sent: compression, scheme, buckets, and
    the costs of the adds and of the codec."""
    si.add_argument(
        "--compression",
        type=_number,
        default=1.0,
        help="ratio c >= 1 dividing the wire bytes (inf allowed)",
    )
    si.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="gloo runs two collectives at once, NCCL one (auto: gloo for a CPU profile)",
    )
    si.add_argument("--scheme", default="ring", choices=("ring", "onebit", "localsgd"))
    si.add_argument("--local-steps", type=int, default=1, help="H for --scheme localsgd")
    si.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="--scheme localsgd: Streaming DiLoCo's fragments, each 1/P of the model per sync",
    )
    si.add_argument(
        "--fragment-overlap",
        type=int,
        default=0,
        help="--scheme localsgd: steps of compute each fragment's exchange runs behind",
    )
    si.add_argument(
        "--no-overlap",
        action="store_true",
        help="communicate after the backward pass, not during it",
    )
    si.add_argument("--buckets", default="ddp", choices=("ddp", "horovod", "observed"))
    si.add_argument(
        "--bucket-cap-mb",
        type=_number,
        default=None,
        help="DDP bucket cap (default DDP's: 25 MiB, first bucket 1 MiB)",
    )
    si.add_argument("--cycle-ms", type=_number, default=5.0, help="Horovod cycle")
    si.add_argument("--fusion-mb", type=_number, default=64.0, help="Horovod threshold")
    si.add_argument(
        "--reduction",
        default="auto",
        help="cost of the adds: auto, cpu (measure now), none, or a bytes,seconds "
        "table file (auto: cuda_vec_add.log beside a .bk.log, else the table measured "
        "at profile time)",
    )
    si.add_argument(
        "--codec-ns-per-byte",
        type=_number,
        default=None,
        help="compress+decompress cost per uncompressed byte, ns",
    )
    si.add_argument(
        "--measure-codec",
        action="store_true",
        help="charge the compute of thinwire's 1-bit allreduce (measured at profile "
        "time, else now)",
    )
