"""Asynchronous Local-SGD (Delayed Nesterov + DyLU) on a Hugging Face GPT-2, with one worker
killed mid-run and brought back from a fresh process.

What it shows: ``thinwire.localsgd.run_async`` training a model thinwire did not build, a
GPT-2 from a ``GPT2Config`` (random init, nothing downloaded), on raw bytes of text with
Hugging Face dict batches (``{"input_ids", "labels"}``) and the model's own loss. The
user's pieces go into a ``Task`` (model factory, inner AdamW, one batch source per data
shard, loss, an evaluation that names two metrics) and every knob into one
``AsyncConfig``. Rank 0 serves (theta, Delayed Nesterov, evaluation, checkpoint); ranks
1.. train. Worker 2 emulates a machine half as fast (``slowdown``), and Dynamic Local
Updates give it half the steps per round, so no one waits.

``--kill-worker 2 --kill-at-step K``: worker 2's process exits hard at its K-th inner step,
mid-round. The server notices its heartbeat stop, hands the lost round out again and
trains on with the others. The dying worker prints how to bring it back: the same command
plus ``--rejoin 2``, in a fresh process that knows only the run's MASTER_ADDR/MASTER_PORT.
That process calls ``rejoin_async`` with the same factories and config, and the server
admits it as a new *incarnation* of worker 2. For this demo only, the other workers pause
once worker 2 is gone until the new one has started its first round (at most
``--rejoin-wait-s``; 0 turns the pause off), so that even a run of a few seconds is sure
to show the rejoined worker's pushes. A real run keeps training meanwhile.

Run::

    export THINWIRE_RUN_TOKEN=$(python -c "import secrets; print(secrets.token_hex(32))")
    torchrun --standalone --nproc_per_node 3 examples/async_localsgd_hf.py \\
        --kill-worker 2 --kill-at-step 40
    # worker 2 prints the rejoin command; in another terminal, with the same token:
    MASTER_ADDR=localhost MASTER_PORT=<port> python examples/async_localsgd_hf.py \\
        --kill-worker 2 --kill-at-step 40 --rejoin 2
    python examples/async_localsgd_hf.py --tiny    # thinwire's spawner: 1 server + 2 workers

Dying under torchrun: torchrun stops every rank of its group as soon as one exits with an
error, so there the killed worker leaves with ``os._exit(0)``: no clean-up, no goodbye,
its links just close, which the server cannot tell from a crash. Under thinwire's spawner
(``may_fail``) it kills itself with SIGKILL. Where machines may really die, start each
rank as a process of its own (docs/localsgd.md, "Fault tolerance").

Admission: the run admits only processes that hold its token. Give it yourself in
``THINWIRE_RUN_TOKEN`` (as above) to every rank and to the rejoining process; without one,
rank 0 generates a token and keeps it in ``OUT/run.token`` (``--out``), which a rejoin on
the same host reads with ``THINWIRE_RUN_TOKEN_FILE=OUT/run.token``. :func:`rejoin` below
is where the rejoining process hands it over (marked "ADMISSION").

It prints the evaluation loss and next-byte accuracy (``evaluate`` returns both, the loss
named ``"loss"``), each worker incarnation's accepted pushes, the joins, the trained model
(``load_trained`` from ``run_async``'s summary) saved with ``save_pretrained`` and checked
to be the server's final model, and all bytes on the wire (``thinwire.comm.accounting``)
against an fp32 allreduce on every inner step. Needs ``pip install 'thinwire[hf]'``.

Tuning: H (``--local-steps``) 20-50 to start; the outer lr and momentum are left to
thinwire's tuned values for the method (``thinwire.localsgd.TUNED``). DyLU is the setting
for uneven machines. ``dead_after_s`` is how fast a death is noticed: a few seconds on a
quiet cluster, more where hosts stall (docs/localsgd.md, "Tuning guide").
"""

from __future__ import annotations

import argparse
import gzip
import os
import shlex
import signal
import sys
import tempfile
import time
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.launch import spawn
from thinwire.localsgd import AsyncConfig, Task, load_trained, rejoin_async, run_async

SIZES = {  # GPT-2 shapes: --tiny for tests, the default for a run of a few minutes
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, seq=32, batch=8),
    "small": dict(n_layer=4, n_embd=128, n_head=4, seq=64, batch=16),
}


def corpus() -> torch.Tensor:
    """The works of Shakespeare bundled with thinwire (public domain), as byte ids."""
    raw = gzip.decompress((resources.files("thinwire") / "data/shakespeare.txt.gz").read_bytes())
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class ByteShard:
    """Data shard ``index``: random blocks of a contiguous slice of the training bytes.

    The batch of step ``step`` depends only on (shard, step), so a shard that changes
    hands (a dead worker's, say) continues the same stream. ``len()`` is its byte count:
    the server plans shards in proportion to it.
    """

    def __init__(self, data: torch.Tensor, index: int, batch: int, seq: int) -> None:
        self.data, self.index, self.batch, self.seq = data, index, batch, seq

    def __len__(self) -> int:
        return len(self.data)

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.index << 32) + step)
        starts = torch.randint(0, len(self.data) - self.seq, (self.batch,), generator=gen)
        ids = torch.stack([self.data[s : s + self.seq] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids}  # GPT-2 shifts the labels itself


class HeldOut:
    """The server's metrics on fixed blocks of the held-out tail of the text: the mean loss
    (named ``"loss"``: thinwire reports it as ``val_loss``) and next-byte accuracy."""

    def __init__(self, data: torch.Tensor, blocks: int, seq: int) -> None:
        self.ids = data[: blocks * seq].view(blocks, seq)

    def __call__(self, model: nn.Module) -> dict[str, float]:  # run_async: eval, no_grad
        losses, hits = [], 0
        for b in self.ids.split(16):
            out = model(input_ids=b, labels=b)
            losses.append(float(out.loss))
            hits += int((out.logits[:, :-1].argmax(-1) == b[:, 1:]).sum())
        predicted = self.ids.numel() - len(self.ids)  # every byte but each block's first
        return {"loss": sum(losses) / len(losses), "accuracy": hits / predicted}


def make_model(size: dict[str, int]) -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the server's model is the initial theta: seed it
    cfg = GPT2Config(
        vocab_size=256,  # raw bytes, no tokenizer
        n_positions=size["seq"],
        n_layer=size["n_layer"],
        n_embd=size["n_embd"],
        n_head=size["n_head"],
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


class Drill:
    """The demo's fault, run in a worker process once per inner step (from the loss).

    ``victim``: exits hard at its ``at``-th inner step, after a note in the run's store.
    ``survivor``: once the note is there, pauses until the rejoined worker has begun its
    first round, for at most ``wait_s``. ``rejoined``: marks its first inner step.
    """

    def __init__(self, role: str, args: argparse.Namespace, rank: int) -> None:
        self.role, self.rank, self.victim = role, rank, args.kill_worker
        self.at, self.wait_s, self.rejoin_cmd = args.kill_at_step, args.rejoin_wait_s, args.cmd
        self.steps, self.paused = 0, args.rejoin_wait_s <= 0
        self.store: dist.Store | None = None
        self.keys = [f"async_localsgd_hf/{what}/{self.victim}" for what in ("killed", "back")]

    def __call__(self) -> None:
        self.steps += 1
        if self.store is None:  # the run's store (torchrun's agent, or the spawner's rank 0)
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            self.store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30))
        if self.role == "victim" and self.steps == self.at:
            self.store.set(self.keys[0], "1")
            # The run's address, and this process's thread count (torchrun sets 1 per
            # rank; a fresh shell would give the new process every core, to fight over).
            env = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
            addr = " ".join(f"{k}={os.environ[k]}" for k in env if k in os.environ)
            print(f"worker {self.rank} exits hard at its inner step {self.at}, mid-round")
            print(
                f"rejoin it from a fresh process, with the run's THINWIRE_RUN_TOKEN: {addr} "
                f"{self.rejoin_cmd}",
                flush=True,
            )
            if "TORCHELASTIC_RUN_ID" in os.environ:
                os._exit(0)  # see the module docstring: torchrun ends the group on an error
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.role == "rejoined" and self.steps == 1:
            self.store.set(self.keys[1], "1")
        elif self.role == "survivor" and not self.paused and self.store.check([self.keys[0]]):
            self.paused = True
            print(f"worker {self.rank} pauses until worker {self.victim} is back", flush=True)
            deadline = time.monotonic() + self.wait_s
            while not self.store.check([self.keys[1]]):
                if time.monotonic() > deadline:
                    print(f"worker {self.rank} trains on without worker {self.victim}", flush=True)
                    return
                time.sleep(0.1)


def make_task(args: argparse.Namespace, drill: Drill | None = None) -> Task:
    """The user's pieces; the same on the server, every worker and a rejoining process."""
    hf_logging.set_verbosity_error()  # (in every process) no notices or progress bars
    hf_logging.disable_progress_bar()
    size = SIZES[args.size]
    data = corpus()
    train, held_out = data[: len(data) * 9 // 10], data[len(data) * 9 // 10 :]

    def shards(n: int) -> list[ByteShard]:
        cut = len(train) // n
        return [
            ByteShard(train[i * cut : (i + 1) * cut], i, size["batch"], size["seq"])
            for i in range(n)
        ]

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if drill is not None:
            drill()
        return lm_loss(model, batch)

    return Task(
        model=lambda: make_model(size),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        shards=shards,
        loss=loss,
        evaluate=HeldOut(held_out, args.eval_blocks, size["seq"]),
    )


def make_config(args: argparse.Namespace, checkpoint_dir: str | None = None) -> AsyncConfig:
    return AsyncConfig(
        steps=args.steps,
        local_steps=args.local_steps,
        outer="dn",  # Delayed Nesterov: W arrivals make one DiLoCo outer step
        dylu=True,  # worker w runs H * v_w / max v steps per round
        slowdown=args.slowdown,
        # Two shards per worker: a worker takes the free shard with the least progress, so
        # a fast worker does not run its own shard far past its lr schedule, and a dead
        # worker's shard is picked up by the others.
        shards=2 * len(args.slowdown),
        warmup_steps=args.steps // 10,
        eval_interval=args.steps // 4,
        checkpoint_dir=checkpoint_dir,  # the server writes theta here at the end
        dead_after_s=args.dead_after_s,
        connect_timeout_s=30.0,
    )


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the run, under torchrun or thinwire's spawner (rank 0 serves)."""
    drill = None
    if args.kill_worker and rank > 0:
        drill = Drill("victim" if rank == args.kill_worker else "survivor", args, rank)
    out = (args.out or tempfile.mkdtemp(prefix="async-hf-")) if rank == 0 else None
    task, cfg = make_task(args, drill), make_config(args, out)
    if rank != 0:
        res = run_async(task, cfg)
        print(f"worker {rank}: {res['rounds']} rounds, {res['steps']} inner steps", flush=True)
        return res
    printed: list[int] = []

    def on_eval(rec: dict[str, Any]) -> None:  # steps summed over the workers
        if rec["step"] not in printed:  # the final evaluation may repeat the last one
            printed.append(rec["step"])
            print(
                f"step {rec['step']:5d}  eval loss {rec['val_loss']:.4f}  "
                f"accuracy {rec['accuracy']:.3f}",
                flush=True,
            )

    summary = run_async(task, cfg, on_eval=on_eval)
    report(summary, task, args, Path(out))
    return {k: summary[k] for k in ("final_val_loss", "updates_applied", "comm_bytes")}


def report(summary: dict[str, Any], task: Task, args: argparse.Namespace, out: Path) -> None:
    """Rank 0: who pushed what, who joined when, the saved model, the bytes."""
    for j in summary["joins"]:
        print(f"join: worker {j['worker']} incarnation {j['incarnation']} at {j['time_s']:.1f} s")
    for u in summary["updates_by_incarnation"]:
        print(
            f"pushes accepted from worker {u['worker']}, incarnation {u['incarnation']}: "
            f"{u['updates']} ({u['inner_steps']} inner steps)"
        )
    print(f"dead at the end: {summary['dead_workers'] or 'none'}")

    # The trained model: the server's final parameters (the ones it evaluated last) into
    # a fresh GPT-2 from the same factory, saved the Hugging Face way. Another process
    # could load them from the checkpoint instead: load_trained(make_model(...), out).
    model = load_trained(task.model(), summary)
    model.save_pretrained(out / "model")
    saved = GPT2LMHeadModel.from_pretrained(out / "model").eval()
    held_out = task.evaluate
    assert isinstance(held_out, HeldOut)
    with torch.no_grad():
        saved_loss = held_out(saved)["loss"]
    same = torch.equal(parameters_to_vector(saved.parameters()), summary["theta"])
    final = summary["final_val_loss"]
    print(
        f"saved model ({out / 'model'}) is the server's final theta: {same}, "
        f"eval loss {saved_loss:.6f} (server {final:.6f}), "
        f"accuracy {summary['final_metrics']['accuracy']:.3f}"
    )

    # Every byte of the run crosses the server once (a pull or a push); synchronous data
    # parallelism would have each of the W workers send a ring allreduce's share per step.
    workers, params = summary["workers"], summary["parameters"]
    every_step = workers * ring_allreduce_bytes(4 * params, workers) * args.steps
    sent = summary["comm_bytes"]
    print(f"final eval loss {final:.4f}")
    print(
        f"bytes on the wire: {sent:,} over {summary['inner_steps']} inner steps on {workers} "
        f"workers; an fp32 allreduce every step: {every_step:,} "
        f"({every_step / max(sent, 1):.1f}x more)"
    )
    by_op = {op: s["wire_bytes"] for op, s in summary["comm_by_op"].items()}
    pulls, ctrl = by_op.get("localsgd.pull", 0), by_op.get("localsgd.ctrl", 0)
    print(
        f"server sent {pulls:,} in theta pulls and {ctrl:,} in headers; received "
        f"{sent - pulls - ctrl:,} (pushes and their headers)"
    )


def rejoin(args: argparse.Namespace) -> None:
    """A fresh process takes the place of the killed worker ``args.rejoin``."""
    drill = Drill("rejoined", args, args.rejoin) if args.kill_worker == args.rejoin else None
    task, cfg = make_task(args, drill), make_config(args)
    # ---- ADMISSION ----------------------------------------------------------------------
    # The run's address comes from MASTER_ADDR/MASTER_PORT (or host=, port=). A run that
    # admits workers with a per-run secret (a token rank 0 generates or is given, e.g. in
    # THINWIRE_RUN_TOKEN) needs that secret here, passed to rejoin_async with the factories
    # and config; and only a worker the server already counts as dead (silent for
    # dead_after_s) can be replaced.
    res = rejoin_async(task, cfg, args.rejoin)
    # --------------------------------------------------------------------------------------
    print(
        f"worker {res['worker']} rejoined as incarnation {res['incarnation']}: "
        f"{res['rounds']} rounds, {res['steps']} inner steps",
        flush=True,
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    ap.add_argument("--local-steps", type=int, default=20, help="H, steps per round")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr")
    ap.add_argument("--slowdown", default="1,2", help="per-worker step-time factors >= 1")
    ap.add_argument("--kill-worker", type=int, default=0, help="worker rank to kill (0: none)")
    ap.add_argument("--kill-at-step", type=int, default=0, help="its inner step to die at")
    ap.add_argument("--rejoin", type=int, default=None, help="rejoin the run as this worker")
    ap.add_argument(
        "--rejoin-wait-s",
        type=float,
        default=120.0,
        help="longest pause of the other workers for the rejoin (demo only; 0: none)",
    )
    ap.add_argument("--dead-after-s", type=float, default=5.0, help="heartbeat silence = dead")
    ap.add_argument("--out", default=None, help="checkpoint and saved model (default: temp)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    args.size, args.eval_blocks = ("tiny", 32) if args.tiny else ("small", 128)
    if args.tiny:
        args.steps, args.local_steps, args.dead_after_s = 48, 8, 3.0
    try:
        args.slowdown = tuple(float(s) for s in args.slowdown.split(","))
    except ValueError:
        ap.error(f"--slowdown takes comma-separated numbers, got {args.slowdown!r}")
    if args.kill_worker and not 1 <= args.kill_at_step < args.steps:
        ap.error(f"--kill-at-step must be between 1 and --steps - 1 ({args.steps - 1})")
    if args.kill_worker and not 1 <= args.kill_worker <= len(args.slowdown):
        ap.error(f"--kill-worker must be a worker rank, 1..{len(args.slowdown)}")
    # The command that brings the killed worker back: this one, plus --rejoin.
    args.cmd = shlex.join(["python", sys.argv[0], *sys.argv[1:], "--rejoin", str(args.kill_worker)])
    return args


def main() -> None:
    args = parse_args()
    if args.rejoin is not None:
        rejoin(args)
    elif "RANK" in os.environ:  # torchrun --standalone --nproc_per_node 3 ...
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:  # 1 server + one process per --slowdown factor; workers may die
        workers = len(args.slowdown)
        spawn(train, workers + 1, (args,), timeout_s=3600, may_fail=range(1, workers + 1))


if __name__ == "__main__":
    main()
