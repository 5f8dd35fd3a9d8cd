"""The ``thinwire train`` options as a :class:`~thinwire.train.config.TrainConfig`.

Flags and a settings file (``--config FILE``, see :mod:`thinwire.train.config_file`)
meet here. The order of precedence is: a flag typed on the command line, then the file,
then the defaults ``thinwire train`` picks (the tuned ``lr`` of the algorithm, the
``runs/ALGO`` output directory). To know which flags were typed rather than defaulted,
:func:`track_explicit` makes each option record its own use: comparing against default
values would miss ``--steps 300`` typed on purpose over a file that says 600.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from thinwire.errors import ConfigError
from thinwire.train.algorithms import DEFAULT_LR, TRAINED_LR, default_lr
from thinwire.train.config import FILE_ONLY, TrainConfig
from thinwire.train.config_file import read_config_file

__all__ = ["EXPLICIT", "config_from_args", "lr_given", "note_trained_lr", "track_explicit"]

EXPLICIT = "explicit_flags"
"""The namespace attribute that holds the destinations of the options typed."""

# Option destinations whose TrainConfig field has another name.
_FIELD_OF = {
    "out": "out_dir",
    "grace": "grace_s",
    "dead_after": "dead_after_s",
    "no_progress": "progress",
}


@functools.cache
def _tracking(cls: type[argparse.Action]) -> type[argparse.Action]:
    def __call__(
        self: argparse.Action,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen = getattr(namespace, EXPLICIT, None)
        if seen is None:
            seen = set()
            setattr(namespace, EXPLICIT, seen)
        seen.add(self.dest)
        cls.__call__(self, parser, namespace, values, option_string)

    return type(f"Explicit{cls.__name__}", (cls,), {"__call__": __call__})


def track_explicit(parser: argparse.ArgumentParser) -> None:
    """Make every option of ``parser`` add its destination to ``args.explicit_flags``
    when it appears on the command line."""
    for action in parser._actions:
        if action.dest != "help" and not type(action).__name__.startswith("Explicit"):
            action.__class__ = _tracking(type(action))


def _trained(args: argparse.Namespace) -> bool:
    """Whether the run starts from a trained model (its default lr may differ)."""
    return bool(getattr(args, "pretrain_steps", 0) or getattr(args, "init_from", None))


def _from_flags(args: argparse.Namespace) -> TrainConfig:
    """The config the flags alone describe. Each field not in ``FILE_ONLY`` has a flag
    whose destination is the field's name (or :data:`_FIELD_OF`'s); a flag left at None
    keeps the field's default, so every default is the dataclass's own."""
    if args.shards is not None and args.shards < 1:
        raise ConfigError(f"--shards must be >= 1, got {args.shards}")
    dest_of = {name: dest for dest, name in _FIELD_OF.items()}
    values: dict[str, Any] = {}
    for f in fields(TrainConfig):
        if f.name in FILE_ONLY:
            continue
        value = getattr(args, dest_of.get(f.name, f.name))
        if value is not None:
            values[f.name] = value
    values["progress"] = not args.no_progress
    if args.lr is None:
        values["lr"] = default_lr(args.algo, _trained(args))
    values.setdefault("out_dir", f"runs/{args.algo}")
    return TrainConfig(**values)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run the options describe: flags typed, over ``--config FILE``, over defaults."""
    flags = _from_flags(args)
    path = getattr(args, "config", None)
    if path is None:
        return flags
    from_file = read_config_file(path)
    typed = {_FIELD_OF.get(d, d) for d in getattr(args, EXPLICIT, ())}
    merged = flags.to_dict()
    merged.update({k: v for k, v in from_file.items() if k not in typed})
    # Defaults that depend on the algorithm follow the algorithm the file chose.
    if "lr" not in typed and "lr" not in from_file:
        trained = bool(merged.get("pretrain_steps") or merged.get("init_from"))
        merged["lr"] = default_lr(merged["algo"], trained)
    if "out_dir" not in typed and "out_dir" not in from_file:
        merged["out_dir"] = f"runs/{merged['algo']}"
    return TrainConfig.from_dict(merged)


def lr_given(args: argparse.Namespace) -> bool:
    """Whether the user chose the lr (a flag typed, or the config file's ``lr``)."""
    path = getattr(args, "config", None)
    return "lr" in getattr(args, EXPLICIT, ()) or (
        path is not None and "lr" in read_config_file(path)
    )


def note_trained_lr(algos: Iterable[str], cfg: TrainConfig) -> None:
    """Say in one line (rank 0) when an algorithm's default lr is its trained-start one."""
    if not (cfg.pretrain_steps or cfg.init_from) or os.environ.get("RANK", "0") != "0":
        return
    for algo in dict.fromkeys(algos):
        if algo in TRAINED_LR:
            print(
                f"thinwire: {algo} starts from a trained model: peak lr {TRAINED_LR[algo]:g} "
                f"(from scratch {DEFAULT_LR[algo]:g}; --lr sets another)",
                file=sys.stderr,
            )
