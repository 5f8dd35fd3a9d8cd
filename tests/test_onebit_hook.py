"""The 1-bit DDP comm hook: equals plain DDP in warmup, trains after it, overlaps backward
with the same result as the synchronous hook, pickles, resumes bit for bit."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm import COUNTER, spawn
from thinwire.comm.onebit_allreduce import NonFiniteError
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook

WARMUP = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 8, generator=gen)
    w = torch.arange(8, dtype=torch.float32) / 8
    return x, (x @ w).unsqueeze(1).sin()


def _train(rank: int, hook: bool, steps: int, opt_name: str) -> tuple[list, list, object]:
    # A tiny bucket cap gives several buckets, so per-bucket residuals are exercised.
    ddp = DDP(_model(), bucket_cap_mb=0.0002)
    state = None
    if hook:
        state = OneBitHookState(warmup_steps=WARMUP)
        ddp.register_comm_hook(state, onebit_hook)
    opt_cls = torch.optim.Adam if opt_name == "adam" else torch.optim.SGD
    opt = opt_cls(ddp.parameters(), lr=0.01 if opt_name == "adam" else 0.1)
    x, y = _data(rank)
    grads, losses = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        losses.append(loss.item())
        opt.step()
    return grads, losses, state


def _hook_body(rank: int, world: int, opt_name: str) -> dict:
    plain_grads, _, _ = _train(rank, hook=False, steps=WARMUP, opt_name=opt_name)
    COUNTER.reset()
    grads, losses, state = _train(rank, hook=True, steps=60, opt_name=opt_name)
    # Global loss: average over ranks, so the check does not depend on one shard.
    start = torch.tensor([losses[WARMUP]])
    end = torch.tensor([sum(losses[-5:]) / 5])
    dist.all_reduce(start)
    dist.all_reduce(end)
    blob = pickle.dumps(state)
    restored = pickle.loads(blob)
    return {
        "warmup_equal": all(
            torch.allclose(a, b, rtol=1e-6, atol=1e-7)
            for step_a, step_b in zip(plain_grads, grads[:WARMUP], strict=True)
            for a, b in zip(step_a, step_b, strict=True)
        ),
        "compressed_grads": grads[-1],
        "start": start.item() / world,
        "end": end.item() / world,
        "buckets": len(state.state_dict()["buckets"]),
        "iteration": restored.iteration,
        "restored_pg": restored.process_group,
        "restored_buckets": len(restored.state_dict()["buckets"]),
        "onebit_calls": COUNTER.snapshot().get("onebit.phase1", {}).get("calls", 0),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_hook_matches_ddp_in_warmup_then_trains(opt_name: str) -> None:
    reports = spawn(_hook_body, 2, args=(opt_name,), timeout_s=220)
    for rep in reports:
        assert rep["warmup_equal"]
        assert rep["end"] < 0.5 * rep["start"], (rep["start"], rep["end"])
        assert rep["buckets"] >= 2
        assert rep["onebit_calls"] == rep["buckets"] * (60 - WARMUP)
        assert rep["iteration"] == 60 and rep["restored_pg"] is None
        assert rep["restored_buckets"] == rep["buckets"]
    # After warmup the compressed gradients are identical on every rank.
    for a, b in zip(reports[0]["compressed_grads"], reports[1]["compressed_grads"], strict=True):
        assert torch.equal(a, b)


def _nonfinite_body(rank: int, world: int) -> tuple[bool, bool]:
    ddp = DDP(_model())
    # One plain step first: DDP rebuilds its buckets after it (residuals of the first
    # layout would be moot).
    state = OneBitHookState(warmup_steps=1)
    ddp.register_comm_hook(state, onebit_hook)
    x, y = _data(rank)
    for _ in range(2):
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    before = state.state_dict()["buckets"]
    ddp.zero_grad()
    bad = x.clone()
    if rank == 1:
        bad[0, 0] = float("inf")
    torch.nn.functional.mse_loss(ddp(bad), y).backward()
    after = state.state_dict()["buckets"]
    has_nonfinite = any(not torch.isfinite(p.grad).all() for p in ddp.parameters())
    unchanged = all(
        torch.equal(before[i][k], after[i][k])
        for i in before
        for k in ("worker_error", "server_error")
    )
    return has_nonfinite, unchanged


@pytest.mark.timeout(120)
def test_nonfinite_gradients_pass_through_and_keep_residuals() -> None:
    for has_nonfinite, unchanged in spawn(_nonfinite_body, 2, timeout_s=100):
        assert has_nonfinite and unchanged


def test_state_validates_options() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        OneBitHookState(warmup_steps=-1)
    with pytest.raises(ValueError, match="nonfinite"):
        OneBitHookState(nonfinite="skip")


# --- overlap: the hook returns before its collective ends, with the same result ----------


def _steps(
    rank: int,
    overlap: bool,
    steps: int,
    *,
    nonfinite: str = "allreduce",
    bad_step: int | None = None,
    state: OneBitHookState | None = None,
    start: dict | None = None,
) -> dict:
    """Adam on the 1-bit hook with several buckets; every step's gradients and events.

    ``start``: model, optimizer and hook state saved by an earlier run (a resume).
    ``bad_step``: rank 1's input holds an Inf at that step.
    """
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.0002)
    state = state or OneBitHookState(warmup_steps=2, nonfinite=nonfinite, overlap=overlap)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
        state.load_state_dict(start["hook"])
    returned_pending: list[bool] = []

    # Unannotated: DDP rejects the string annotations this module's future import makes.
    def probe(st, bucket):  # type: ignore[no-untyped-def]
        compressed = st.iteration >= st.warmup_steps
        fut = onebit_hook(st, bucket)
        if compressed:
            returned_pending.append(not fut.done())
        return fut

    ddp.register_comm_hook(state, probe)
    x, y = _data(rank)
    grads, errors = [], []
    for step in range(steps):
        xb = x.clone()
        if step == bad_step and rank == 1:
            xb[0, 0] = float("inf")
        opt.zero_grad()
        try:
            torch.nn.functional.mse_loss(ddp(xb), y).backward()
        except RuntimeError as exc:
            errors.append((step, str(exc).splitlines()[0]))
            continue
        grads.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    return {
        "grads": grads,
        "errors": errors,
        "pending": returned_pending,
        "saved": saved,
        "state": state,
    }


def _slow_collectives(delay_s: float) -> list[str]:
    """Make every 1-bit call take ``delay_s`` longer; returns the calling threads' names."""
    import threading
    import time

    from thinwire.comm.onebit_allreduce import OneBitAllreduce

    names: list[str] = []
    original = OneBitAllreduce.__call__

    def slow(self: OneBitAllreduce, *args: object, **kwargs: object) -> torch.Tensor:
        names.append(threading.current_thread().name)
        time.sleep(delay_s)
        return original(self, *args, **kwargs)

    OneBitAllreduce.__call__ = slow  # type: ignore[method-assign]
    return names


def _overlap_body(rank: int, world: int) -> dict:
    names = _slow_collectives(0.02)
    sync = _steps(rank, overlap=False, steps=8)
    sync_threads = list(names)
    names.clear()
    over = _steps(rank, overlap=True, steps=8)
    thread = over["state"].worker().thread
    over["state"].close()
    return {
        "equal": all(
            torch.equal(a, b)
            for sa, sb in zip(sync["grads"], over["grads"], strict=True)
            for a, b in zip(sa, sb, strict=True)
        ),
        "residuals_equal": all(
            torch.equal(sync["saved"]["hook"]["buckets"][i][k], v[k])
            for i, v in over["saved"]["hook"]["buckets"].items()
            for k in ("worker_error", "server_error")
        ),
        "buckets": len(over["saved"]["hook"]["buckets"]),
        "sync_pending": sync["pending"],
        "over_pending": over["pending"],
        "sync_threads": set(sync_threads),
        "over_threads": set(names),
        "thread_alive": thread.is_alive(),
    }


@pytest.mark.timeout(120)
def test_overlapped_hook_returns_at_once_and_equals_the_synchronous_one() -> None:
    for rep in spawn(_overlap_body, 3, timeout_s=100):
        assert rep["buckets"] >= 2
        assert rep["equal"] and rep["residuals_equal"]
        # Every compressed bucket's future was still running when the hook returned...
        assert rep["over_pending"] and all(rep["over_pending"])
        # ...on the hook's own thread; without overlap it is done inside the hook.
        assert rep["over_threads"] == {"thinwire-onebit-hook"}
        assert rep["sync_pending"] and not any(rep["sync_pending"])
        assert rep["sync_threads"] == {"MainThread"}
        assert not rep["thread_alive"]  # close() stopped it


def _raise_body(rank: int, world: int) -> dict:
    out = {}
    for overlap in (False, True):
        run = _steps(rank, overlap, steps=7, nonfinite="raise", bad_step=4)
        out[overlap] = run["grads"], run["errors"]
    return out


@pytest.mark.timeout(120)
def test_nonfinite_raise_reaches_backward_on_every_rank_and_training_goes_on() -> None:
    for rep in spawn(_raise_body, 2, timeout_s=100):
        (sync_grads, sync_errors), (grads, errors) = rep[False], rep[True]
        for errs in (sync_errors, errors):
            assert [step for step, _ in errs] == [4]
            assert "NonFiniteError" in errs[0][1] and "rank(s) [1]" in errs[0][1]
        # The bad step changed nothing: the steps after it are those of the reference.
        assert len(grads) == len(sync_grads) == 6
        for sa, sb in zip(sync_grads, grads, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(sa, sb, strict=True))


def _resume_body(rank: int, world: int) -> dict:
    straight = _steps(rank, overlap=True, steps=8)
    first = _steps(rank, overlap=True, steps=4)
    # Through bytes, as a checkpoint file would be; a new state, model, DDP and optimizer.
    blob = io.BytesIO()
    torch.save(first["saved"], blob)
    blob.seek(0)
    start = torch.load(blob, weights_only=False)
    resumed = _steps(rank, overlap=True, steps=4, start=start)
    return {
        "buckets": len(start["hook"]["buckets"]),
        "equal": all(
            torch.equal(a, b)
            for sa, sb in zip(straight["grads"][4:], resumed["grads"], strict=True)
            for a, b in zip(sa, sb, strict=True)
        ),
        "params_equal": all(
            torch.equal(straight["saved"]["model"][k], v)
            for k, v in resumed["saved"]["model"].items()
        ),
    }


@pytest.mark.timeout(120)
def test_resumed_hook_continues_bit_for_bit() -> None:
    for rep in spawn(_resume_body, 2, timeout_s=100):
        # Several saved buckets, met first as DDP's one pre-rebuild bucket, then as their own.
        assert rep["buckets"] >= 2
        assert rep["equal"] and rep["params_equal"]


def test_hook_worker_runs_in_order_passes_errors_and_stops() -> None:
    import gc

    from thinwire.comm.hook_worker import HookWorker

    worker = HookWorker()
    done: list[int] = []
    buf = torch.zeros(3)

    def work(i: int) -> Callable[[], None]:
        def run() -> None:
            if i == 2:
                raise NonFiniteError("bucket 2")
            done.append(i)

        return run

    futs = [worker.submit(buf, work(i)) for i in range(5)]
    for i, fut in enumerate(futs):
        if i == 2:
            with pytest.raises(RuntimeError, match="NonFiniteError: bucket 2"):
                fut.wait()
        else:
            assert fut.wait() is buf
    assert done == [0, 1, 3, 4]
    worker.stop()
    worker.thread.join(timeout=10)
    assert not worker.thread.is_alive()
    # A state's thread ends with the state.
    state = OneBitHookState()
    thread = state.worker().thread
    del state
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
