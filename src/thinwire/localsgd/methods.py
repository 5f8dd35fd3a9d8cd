"""The methods the paper compares, as settings of one :class:`AsyncConfig`, and their tuned
outer learning rates and momenta.

Liu et al., 2024 ("Asynchronous Local-SGD Training for Language Modeling",
https://arxiv.org/abs/2401.09135) compare, on one budget of inner steps:

* ``sync``: synchronous DiLoCo (every round waits for every worker; Delayed Nesterov
  with ``N = W, c = 0`` makes the W arrivals exactly DiLoCo's outer Nesterov step).
* ``naive``: asynchronous, Nesterov on every arrival.
* ``poly``: naive, each pseudo-gradient scaled by ``(1 + tau)^-1/2`` for its staleness
  ``tau`` (outer updates since its worker pulled).
* ``polythres``: poly, and anything staler than 10 updates is dropped.
* ``buffer``: the asynchronous buffer: N arrivals, then one Nesterov step on their mean;
  theta stands still in between.
* ``dn``: Delayed Nesterov (each arrival's ``g / N`` at once, the momentum every N).
* ``dn-dylu``: Delayed Nesterov with Dynamic Local Updates.

A method is only a choice of server settings: :func:`for_method` sets them on a config,
:func:`method_of` names the method a config runs. Every other setting (inner-state rule,
shards, H, the budget) stays the same across methods, so a comparison is like-for-like.

Outer lr and momentum left unset (None) on :class:`AsyncConfig` take the method's tuned
value from :data:`TUNED`, measured with ``thinwire simulate async --sweep`` on the tiny GPT
(docs/benchmarks.md, "Tuning"). The reasons, in short: methods that make one Nesterov
step per W arrivals (sync, buffer, dn, dn-dylu) share DiLoCo's scale of lr; methods that
step on every arrival (naive, poly, polythres) take W steps where those take one, and
need a far smaller lr.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from thinwire.errors import ConfigError

if TYPE_CHECKING:
    from thinwire.localsgd.config import AsyncConfig

__all__ = ["METHODS", "TUNED", "Tuned", "for_method", "method_of"]

METHODS = ("sync", "naive", "poly", "polythres", "buffer", "dn", "dn-dylu")
"""Every method :func:`for_method` knows, in the paper's order."""

POLY_THRESHOLD = 10
"""``polythres`` drops pseudo-gradients staler than this many outer updates (the paper's)."""


@dataclass(frozen=True)
class Tuned:
    """A method's tuned outer optimizer settings."""

    outer_lr: float
    """Outer learning rate."""
    outer_momentum: float
    """Outer Nesterov momentum."""


TUNED: dict[str, Tuned] = {
    "sync": Tuned(0.3, 0.9),
    "naive": Tuned(0.05, 0.9),
    "poly": Tuned(0.05, 0.9),
    "polythres": Tuned(0.05, 0.9),
    "buffer": Tuned(0.3, 0.9),
    "dn": Tuned(0.3, 0.9),
    "dn-dylu": Tuned(0.3, 0.9),
}
"""Each method's outer lr and momentum, the best of the sweep (docs/benchmarks.md)."""


def for_method(cfg: AsyncConfig, method: str) -> AsyncConfig:
    """``cfg`` set up as one of :data:`METHODS`: outer optimizer, staleness rule, DyLU,
    sync barrier. Everything else, the outer lr and momentum included, is left as it is
    (None there means the method's tuned value)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    outer = {"naive": "nesterov", "poly": "nesterov", "polythres": "nesterov"}
    return replace(
        cfg,
        outer=outer.get(method, "buffer" if method == "buffer" else "dn"),
        staleness="poly" if method in ("poly", "polythres") else "none",
        max_staleness=POLY_THRESHOLD if method == "polythres" else None,
        dylu=method == "dn-dylu",
        sync=method == "sync",
        c=0.0 if method == "sync" else cfg.c,
    )


def method_of(cfg: AsyncConfig) -> str:
    """The method ``cfg`` runs (the nearest of :data:`METHODS`: DyLU with another outer
    optimizer counts as that optimizer's method)."""
    if cfg.sync:
        return "sync"
    if cfg.outer == "nesterov":
        if cfg.staleness == "poly":
            return "polythres" if cfg.max_staleness is not None else "poly"
        return "naive"
    if cfg.outer == "buffer":
        return "buffer"
    return "dn-dylu" if cfg.dylu else "dn"
