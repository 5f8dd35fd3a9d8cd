"""The settings of one validation run (:func:`thinwire.analysis.validate.run_validation`).

Every field has its default and a note on tuning it; :meth:`ValidationConfig.check`
refuses, in one line, a config that could not produce a comparison (one host, an
unlimited rate, no compressing steps, a link fit without two sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.errors import ConfigError

__all__ = ["ValidationConfig"]


@dataclass(frozen=True)
class ValidationConfig:
    """One validation: a model, a cluster size, the rates, and how long to train."""

    model: str = "small"
    """GPT preset trained and profiled (``tiny``, ``small``)."""
    batch_size: int = 8
    """Sequences per host per step, as in training."""
    hosts: int = 4
    """Testbed hosts (>= 2); each gets ``cores // hosts`` threads."""
    rates: tuple[str, ...] = ("50mbit", "100mbit", "1gbit")
    """Link rates, one cluster each."""
    steps: int = 30
    """Training steps per run; ~30 keeps a run at 50 Mbit/s near 3 minutes."""
    freeze_step: int = 10
    """Steps of fp32 warmup of the 1-bit optimizer; the rest compress."""
    skip_steps: int = 5
    """First DDP steps left out of its mean (bucket rebuild, allocator warm-up)."""
    local_steps: int = 10
    """DiLoCo's H (steps between model averages) for its run; 0 leaves DiLoCo out. The
    measured step is the mean over whole rounds after ``skip_steps``, so ``steps`` should
    be a multiple of it."""
    delay: str | None = None
    """One-way delay between the testbed hosts (``"50ms"``; round trips are twice it), or
    None for a LAN. The fitted link measures the latency it adds; the nominal link takes
    the round trip as each message's latency (:meth:`Link.nominal`)."""
    onebit_algo: str = "onebit-adam"
    """``onebit-adam`` (optimizer cost close to the profile's AdamW) or ``onebit-lamb``."""
    profile_warmup: int = 2
    """Untimed steps per profile (allocator growth, first-touch pages)."""
    profile_steps: int = 6
    """Timed steps per profile; medians, so 5-10 resist one slow step."""
    fit: bool = True
    """Fit alpha and bandwidth with ``thinwire bench allreduce`` per rate (else nominal)."""
    fit_min_bytes: int = 64 * 1024
    """Smallest benchmarked allreduce. Tuning: cover the job's bucket sizes and little
    else; small messages bend the fit (on the testbed at 1 Gbit/s, 64 KiB-16 MiB fitted
    1.06 Gbit/s + 4 ms and under-predicted 16 MiB by 16%; 1-16 MiB fitted 873 Mbit/s)."""
    fit_max_bytes: int = 16 * 2**20
    """Largest benchmarked allreduce: at least the largest bucket."""
    timeout_s: float = 1200.0
    """Per training run and per profile."""

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first setting that cannot work."""
        from thinwire.testbed.rates import parse_rate
        from thinwire.train.algorithms import check_algorithm

        if self.hosts < 2:
            raise ConfigError(f"hosts must be >= 2 to communicate, got {self.hosts}")
        if not self.rates:
            raise ConfigError("no link rates to validate")
        for r in self.rates:
            if parse_rate(r) is None:
                raise ConfigError(f"rate {r!r} is unlimited: the model needs a link rate")
        if self.onebit_algo not in ("onebit-adam", "onebit-lamb"):
            raise ConfigError(
                f"onebit algo must be onebit-adam or onebit-lamb, got {self.onebit_algo}"
            )
        check_algorithm(self.onebit_algo)
        if not 1 <= self.freeze_step <= self.steps - 3:
            raise ConfigError(
                f"freeze-step must be in [1, steps - 3] to leave compressing steps, "
                f"got {self.freeze_step} of {self.steps}"
            )
        if self.delay is not None and not self.rtt_s > 0:
            raise ConfigError(f"delay must be a positive duration like 50ms, got {self.delay!r}")
        if self.local_steps < 0 or (
            self.local_steps and self.diloco_span()[1] - self.diloco_span()[0] < 1
        ):
            raise ConfigError(
                f"local-steps must be 0 (no DiLoCo run) or leave a whole round after "
                f"skip-steps {self.skip_steps} within {self.steps} steps, got {self.local_steps}"
            )
        if not 0 <= self.skip_steps <= self.steps - 3:
            raise ConfigError(f"skip-steps must be in [0, steps - 3], got {self.skip_steps}")
        if self.fit and not 4 <= 2 * self.fit_min_bytes <= self.fit_max_bytes:
            raise ConfigError(
                f"the link fit needs two sizes >= 4 bytes: min {self.fit_min_bytes}, "
                f"max {self.fit_max_bytes} (max >= 2 x min)"
            )
        if self.profile_steps < 1 or self.profile_warmup < 0:
            raise ConfigError("profile steps must be >= 1 and profile warmup >= 0")

    @property
    def rtt_s(self) -> float:
        """The round trip :attr:`delay` sets, in seconds (0 without one)."""
        from thinwire.testbed.wan import parse_duration

        return 2 * parse_duration(self.delay) if self.delay else 0.0

    def diloco_span(self) -> tuple[int, int]:
        """First and last step of the whole DiLoCo rounds after ``skip_steps``."""
        h = self.local_steps
        return h * -(-self.skip_steps // h) + 1, h * (self.steps // h)

    @property
    def algos(self) -> tuple[str, ...]:
        """The runs trained per rate, in order."""
        return ("adamw", self.onebit_algo) + (("diloco",) if self.local_steps else ())
