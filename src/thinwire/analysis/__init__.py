"""Is the network the bottleneck? Profiling, what-if simulation and reports.

The pipeline (also ``thinwire analyze profile|bench|simulate|report``):

1. :func:`profile_model` (any ``nn.Module``), :func:`profile_factory` (a function
   returning ``(model, batch, loss_fn)``), :func:`profile_gpt` (thinwire's GPT), or
   :func:`read_bklog` for the paper's logs -> a :class:`Profile` of one worker's step and
   per-parameter gradient ready times;
2. :func:`make_buckets` -> the buckets DDP or Horovod would all-reduce;
3. :func:`simulate` with a :class:`NetworkConfig` -> a :class:`SimResult` (exposed
   communication, scaling factor, link utilization), and :func:`required_compression`,
   :func:`required_bandwidth`, :func:`required_local_steps` for a target;
4. :func:`run_study` -> the JSON behind :func:`render_report` and :func:`write_plots`.

:func:`fit_link` / :func:`bench_link` fit latency and bandwidth to measured allreduces.
"""

from thinwire.analysis.bklog import PAPER_ITERATION_S, read_bklog, read_vec_add_table
from thinwire.analysis.buckets import (
    Bucket,
    ddp_buckets,
    horovod_buckets,
    make_buckets,
    observed_buckets,
)
from thinwire.analysis.costs import AddCost, measure_codec_cost
from thinwire.analysis.fit import LinkFit, bench_link, fit_link
from thinwire.analysis.measure import gpt_loss, observe_ddp_buckets, profile_gpt, profile_model
from thinwire.analysis.network_model import (
    NetworkConfig,
    SimResult,
    required_bandwidth,
    required_compression,
    required_local_steps,
    simulate,
)
from thinwire.analysis.plots import write_plots
from thinwire.analysis.profile import ParamTiming, Profile, load_profile, save_profile
from thinwire.analysis.report import recommend, render_report
from thinwire.analysis.study import run_study
from thinwire.analysis.user_model import ProfileTarget, build_target, load_factory, profile_factory

__all__ = [
    "PAPER_ITERATION_S",
    "AddCost",
    "Bucket",
    "LinkFit",
    "NetworkConfig",
    "ParamTiming",
    "Profile",
    "ProfileTarget",
    "SimResult",
    "bench_link",
    "build_target",
    "ddp_buckets",
    "fit_link",
    "gpt_loss",
    "horovod_buckets",
    "load_factory",
    "load_profile",
    "make_buckets",
    "measure_codec_cost",
    "observe_ddp_buckets",
    "observed_buckets",
    "profile_factory",
    "profile_gpt",
    "profile_model",
    "read_bklog",
    "read_vec_add_table",
    "recommend",
    "render_report",
    "required_bandwidth",
    "required_compression",
    "required_local_steps",
    "run_study",
    "save_profile",
    "simulate",
    "write_plots",
]
