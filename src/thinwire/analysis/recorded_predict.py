"""Predict other algorithms' steps from one recorded run: the demo's and ``validate``'s.

A recorded fp32 run (LAMB or AdamW under DDP, :mod:`thinwire.comm.step_record`) holds
the job's compute as its workers really ran it, sharing the cores and the network. From
it :class:`RecordedPredictor` predicts the step of

* ``ddp``: the run itself, its gradients averaged by DDP in the buckets the record saw,
  overlapped with the backward pass; the reductions priced at this machine's measured
  costs (:func:`thinwire.analysis.costs.machine_costs`); on the record's own link, at
  the rate its collectives achieved (:func:`_as_the_record_saw_it`);
* ``diloco``: the same compute, the whole model averaged once every H steps;
* ``onebit``: a 1-bit optimizer's compression stage, one 1-bit allreduce of the momentum
  after the backward pass. Its own step (the update, the codec and the exchange's waits)
  is not in the record; pass it timed on the job's ranks
  (:mod:`thinwire.analysis.optimizer_step`), and the update and the codec's compute are
  taken from there, with the wait beyond the wire time charged per call; when that
  timing ran the job's own forward and backward passes (a ``thinwire train`` run), so
  are the passes: the record's, run beside DDP's allreduce, came out 12-25% slower than
  the same passes between 1-bit steps on the demo.

Without that timing, ``onebit`` prices the codec at the machine's cost for one process
and keeps the record's update: on a machine whose cores the ranks share that misses by
10-15% (measured on the demo), so the demo and ``validate`` always time it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from thinwire.analysis.costs import AddCost
from thinwire.analysis.network_model import SimResult
from thinwire.analysis.profile import Profile
from thinwire.analysis.validate_compare import Link, predict_step

__all__ = ["RecordedPredictor"]


def _as_the_record_saw_it(rec: Any, link: Link, workers: int) -> Link:
    """``link`` at the rate the record's own collectives achieved, when it is the link
    the record ran on (same workers, the testbed's rate, no set latency) and that rate
    is below the nominal one.

    Why: the nominal link assumes TCP's payload share of the set rate (95.6 Mbit/s of
    100). On the testbed, 4 hosts sharing 2 cores, gloo's ring achieved 87-89 Mbit/s in
    the demo's LAMB runs, and the nominal link predicted their steps 6-11% too fast. With
    a set latency the ring's rounds are priced separately (``alpha``), and the achieved
    rate, which contains them, would count them twice: the nominal link is kept."""
    from thinwire.analysis.recorded import measured, record_rate_bits

    rate = record_rate_bits(rec)
    if link.alpha_per_message_s > 0 or rec.world_size != workers or rate is None:
        return link
    if abs(Link.nominal(rate).bandwidth_gbps / link.bandwidth_gbps - 1) > 0.01:
        return link  # a what-if at another rate
    achieved = measured(rec)["achieved_gbps"]
    if achieved is None or not 0 < achieved < link.bandwidth_gbps:
        return link
    return replace(link, bandwidth_gbps=achieved, source="achieved by the recorded run")


@dataclass
class RecordedPredictor:
    """Predictions from one recorded run (see the module docstring)."""

    profile: Profile
    workers: int
    link: Link
    add: AddCost
    codec_s_per_byte: float
    """The 1-bit codec's compute per byte of gradient (the reductions inside it included)."""
    onebit_link: Link
    """``link`` with the 1-bit exchange's wait beyond the wire, when it was timed."""

    @classmethod
    def from_run(
        cls,
        run_dir: str | Path,
        workers: int,
        link: Link,
        onebit_step: dict[str, float] | None = None,
    ) -> RecordedPredictor:
        """Read ``run_dir``'s record; ``onebit_step`` is a timing's summary
        (:func:`thinwire.analysis.optimizer_step.summarize`), or None."""
        from thinwire.analysis.costs import machine_costs
        from thinwire.analysis.job_passes import job_config
        from thinwire.analysis.recorded import load_record, profile_from_record
        from thinwire.comm.onebit_exchange import onebit_wire_bytes

        rec = load_record(run_dir)
        link = _as_the_record_saw_it(rec, link, workers)
        profile = profile_from_record(rec)
        costs = machine_costs(rec.threads, workers)
        nbytes = sum(p.nbytes for p in profile.params)
        codec, onebit_link = float(costs["codec_s_per_byte"]), link
        if onebit_step is not None:
            wire_s = (
                8 * onebit_wire_bytes(math.ceil(nbytes / 4), workers) / (link.bandwidth_gbps * 1e9)
            )
            wait = max(0.0, onebit_step["wait_s"] - wire_s)
            onebit_link = replace(link, onebit_latency=((float(nbytes), wait),))
            if profile.optimizer_s is not None:
                profile.meta["onebit_optimizer_s"] = onebit_step["update_s"]
            if "passes_s" in onebit_step and job_config(run_dir) is not None:
                # the job's own passes, timed between 1-bit steps (not a stand-in)
                profile.meta["onebit_passes_s"] = onebit_step["passes_s"]
            codec = onebit_step["codec_s"] / max(nbytes, 1)
        return cls(profile, workers, link, costs["add"], codec, onebit_link)

    def step(self, scheme: str, local_steps: int = 1) -> SimResult:
        """The predicted step of ``scheme``: ``ddp``, ``diloco`` (H = ``local_steps``) or
        ``onebit``."""
        if scheme == "onebit":
            # The timed codec holds its reductions: no reduction table on top.
            zero = AddCost.zero()
            return predict_step(
                self.profile, "onebit", self.onebit_link, self.workers, self.codec_s_per_byte, zero
            )
        return predict_step(
            self.profile, scheme, self.link, self.workers, add=self.add, local_steps=local_steps
        )

    def meta(self) -> dict[str, Any]:
        """What the predictions used, for a result file."""
        return {
            "record_steps": self.profile.steps,
            "compute_s": self.profile.iteration_s,
            "onebit_update_s": self.profile.meta.get("onebit_optimizer_s"),
            "codec_s_per_byte": self.codec_s_per_byte,
            "onebit_latency": [list(e) for e in self.onebit_link.onebit_latency],
        }
