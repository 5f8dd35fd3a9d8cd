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
value from :data:`TUNED`, measured with ``thinwire simulate --sweep`` on the tiny GPT
(docs/results/localsgd.md, "Tuning the outer lr per method": bundled corpus, 4 workers at the
``very`` speeds, H = 10, 200 inner steps per worker, the ``restart`` inner-state rule,
seeds 0 and 1; the evidence runs use other seeds). What the sweep showed:

* ``sync``: 0.2 (mean final loss 2.617; 0.1: 2.668, 0.3: 2.665, 0.05: 3.06; momentum 0
  at lr 1, plain averaging: 2.77). The seed spread (sd 0.02-0.08) is as large as the
  differences between 0.1 and 0.3, so the optimum is broad; DiLoCo's 0.7 is too hot at
  this H and size (it once sat at the byte-frequency loss).
* ``dn-dylu``: lr 0.5 with momentum 0 (2.603 on two seeds, both better than any
  setting with momentum). With momentum 0.9 the best was 0.1 (2.685; 0.2: 2.721, 0.3:
  2.706 with sd 0.13, 0.05: 2.86). With momentum 0 Delayed Nesterov applies each
  arrival's ``lr * g / N`` at once and nothing else: it is per-arrival SGD at ``lr / N``
  (0.125 here), like tuned ``naive`` (0.3) but with DyLU. At this scale (short runs from
  scratch) the outer momentum did not pay for asynchronous arrivals; pass
  ``outer_momentum=0.9, outer_lr=0.1`` for the paper's Nesterov form.
* ``dn`` (no DyLU): 0.3 with momentum 0.9 (one seed: 3.05; 0.2: 3.32). DN alone barely
  leaves the byte-frequency plateau in this budget at the lrs tried: its slow workers'
  full-H rounds arrive 11-14 updates stale. Its momentum-0 form is ``naive`` at lr/N,
  which the ``naive`` grid covers.
* ``naive``: momentum 0, lr 0.3 (2.612 on two seeds; lr 0.1: 2.68, 0.5: 2.76). With
  momentum 0.9 every lr tried stayed near 3.0 (0.02: 2.98, 0.05: 3.09, 0.1: 3.04): on
  every arrival the momentum replays the stale pseudo-gradients of the others, as the
  paper's notebook also shows. Without momentum per-arrival SGD is a sound method here.
* ``buffer``, ``poly``, ``polythres``: not swept in that round; they keep the values
  chosen by analogy (buffer steps once per N arrivals like ``dn``; Poly and PolyThres
  step on every arrival like ``naive`` with momentum).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from thinwire.errors import ConfigError

if TYPE_CHECKING:
    from thinwire.localsgd.settings import AsyncSettings

S = TypeVar("S", bound="AsyncSettings")

__all__ = ["METHODS", "TUNED", "TUNED_TRAINED", "Tuned", "for_method", "method_of", "tuned"]

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
    "sync": Tuned(0.2, 0.9),
    "naive": Tuned(0.3, 0.0),
    "poly": Tuned(0.05, 0.9),
    "polythres": Tuned(0.05, 0.9),
    "buffer": Tuned(0.3, 0.9),
    "dn": Tuned(0.3, 0.9),
    "dn-dylu": Tuned(0.5, 0.0),
}
"""Each method's outer lr and momentum, the best mean of the sweep (docs/results/localsgd.md);
the module docstring gives the numbers behind each."""

TUNED_TRAINED: dict[str, Tuned] = {
    "dn-dylu": Tuned(0.3, 0.9),
}
"""The methods whose best outer settings differ when the run starts from a trained model
(``pretrain_steps`` or ``init_from``): measured in the long tier (1,000 ordinary steps,
then 3,000 inner steps per worker, H = 50, 4 workers at the ``very`` speeds,
docs/results/localsgd.md). DN + DyLU with momentum 0.9 at lr 0.3 ended below its
momentum-free short-run default (0.5, 0) on every run: the tuning seed at H = 50
(1.5994 against 1.6281) and H = 10 (1.5887 against 1.6169), and the Shakespeare
reporting seeds 0-2 at H = 50 (1.5880, 1.6796, 1.6767 against 1.6131, 1.7534,
1.6901); at 0.2 and 0.5 with momentum 0.9 it did worse (1.6035, 1.6320). The others
keep :data:`TUNED` from a trained model: naive at (0.3, 0) beat the paper's (0.07, 0.9)
by 9% there; sync DiLoCo did better at DiLoCo's 0.7 than at 0.2 on the tuning seed
(H = 50), but the reporting seeds ran 0.7 only and the synchronous trainer shares its
default, so it stays (the tuning guide says to pass 0.7)."""


def tuned(method: str, trained: bool = False) -> Tuned:
    """``method``'s tuned outer settings for a run from scratch, or from a trained model
    (``trained``: :data:`TUNED_TRAINED` where it names the method)."""
    return TUNED_TRAINED.get(method, TUNED[method]) if trained else TUNED[method]


def for_method(cfg: S, method: str) -> S:
    """``cfg`` (an ``AsyncConfig``, or any config with its settings) set up as one of
    :data:`METHODS`: outer optimizer, staleness rule, DyLU, sync barrier. Everything else,
    the outer lr and momentum included, is left as it is (None there means the method's
    tuned value)."""
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


def method_of(cfg: AsyncSettings) -> str:
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
