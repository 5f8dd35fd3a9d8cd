"""Profile any model: a factory named ``package.module:function`` or ``path/file.py:function``.

``thinwire analyze profile --model SPEC`` and :func:`profile_factory` accept, beside the
GPT presets, a function of the user's that builds what one training step needs.

The contract of the function:

* It returns ``(model, batch, loss_fn)``, a plain tuple or a :class:`ProfileTarget`:

  - ``model``: an ``nn.Module`` on the device to profile (its trainable parameters are
    what data parallelism communicates);
  - ``batch``: one worker's batch, in whatever form ``loss_fn`` takes;
  - ``loss_fn(model, batch) -> scalar tensor``: runs the forward pass and returns the
    loss; ``model`` may be a DDP wrapper of the model (``--observe-ddp``), so call it,
    do not reach into its attributes.

* It is called with no arguments, or with ``batch_size=N`` when the user asked for a
  batch size (``--batch-size``) and the function has a ``batch_size`` parameter (or
  ``**kwargs``). A function without one decides its batch itself; asking for a batch
  size then is an error rather than silently ignored.
* It may build the model at random (``torch.manual_seed(seed)`` runs first, so two
  profiles of one factory start alike); nothing here downloads anything.

Resolution: ``package.module:function`` is imported with :func:`importlib.import_module`
(the package must be importable: installed, or on ``PYTHONPATH``); a path ending in
``.py`` is loaded from that file, with its folder put first on ``sys.path`` the way
``python path/file.py`` would, so the file can import its neighbours.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from thinwire.analysis.measure import LossFn, observe_ddp_buckets, profile_model
from thinwire.analysis.profile import Profile
from thinwire.errors import ConfigError

__all__ = ["ProfileTarget", "build_target", "load_factory", "profile_factory"]

Factory = Callable[..., Any]


class ProfileTarget(NamedTuple):
    """What a model factory returns: the model, one batch, and the loss function."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn


def _split(spec: str) -> tuple[str, str]:
    where, sep, func = spec.rpartition(":")
    if not sep or not where or not func:
        raise ConfigError(
            f"model factory {spec!r} must read package.module:function or path/file.py:function"
        )
    if not func.isidentifier():
        raise ConfigError(f"model factory {spec!r}: {func!r} is not a function name")
    return where, func


def _raised(exc: BaseException, what: str) -> ConfigError:
    """One line for an error inside the user's code: what raised, and where in their
    file, so they can open it there (their traceback would show thinwire's frames too)."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else "?"
        return ConfigError(f"{what}: syntax error at {where}: {exc.msg}")
    frames = traceback.extract_tb(exc.__traceback__)
    # the deepest frame in the user's code: an error raised inside torch (a shape
    # mismatch) is fixed where their code called it, not in torch's file
    libraries = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
    mine = [f for f in frames if not f.filename.startswith(libraries)] or frames
    where = f" (at {mine[-1].filename}:{mine[-1].lineno})" if mine else ""
    text = str(exc).strip().splitlines()
    said = f": {text[0]}" if text else ""
    return ConfigError(f"{what} raised {type(exc).__name__}{said}{where}")


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"model factory file {path} does not exist")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as `python path/file.py` does: neighbours import
    name = f"thinwire_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        sys.modules.pop(name, None)
        raise ConfigError(f"{path}: an import failed: {exc}") from None
    except Exception as exc:  # the user's module itself failed: say where, in one line
        sys.modules.pop(name, None)
        raise _raised(exc, f"model factory file {path}") from None
    return module


def load_factory(spec: str) -> Factory:
    """The function ``spec`` names (``package.module:function`` or ``path/file.py:function``).

    Raises:
        ConfigError: the module or file cannot be imported (including an import inside
            it that fails, e.g. a missing optional package), the name is absent, or it
            is not callable.
    """
    where, func = _split(spec)
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(
                f"cannot import {where!r} for model factory {spec!r}: {exc}"
            ) from None
        except Exception as exc:
            raise _raised(exc, f"module {where!r} (model factory {spec!r})") from None
    factory = getattr(module, func, None)
    if factory is None:
        raise ConfigError(f"{where} has no function {func!r} (model factory {spec!r})")
    if not callable(factory):
        raise ConfigError(f"{where}:{func} is not a function (it is a {type(factory).__name__})")
    return factory


def _takes_batch_size(factory: Factory) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any(p.name == "batch_size" or p.kind is p.VAR_KEYWORD for p in params)


def _leading_dim(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (its batch size, usually)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        items: Any = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        found = _leading_dim(item)
        if found is not None:
            return found
    return None


def build_target(
    factory: Factory, batch_size: int | None = None, *, name: str = "the model factory"
) -> tuple[ProfileTarget, int | None]:
    """Call ``factory`` per the contract above; returns its target and the batch size.

    The batch size is ``batch_size`` when given, else the leading dimension of the first
    tensor in the batch (``None`` if it has none).
    """
    if batch_size is not None:
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        if not _takes_batch_size(factory):
            raise ConfigError(
                f"{name} has no batch_size parameter, so a batch size of {batch_size} cannot "
                "be applied; drop --batch-size or add the parameter"
            )
    try:
        got = factory() if batch_size is None else factory(batch_size=batch_size)
    except Exception as exc:
        raise _raised(exc, name) from None
    if not isinstance(got, tuple) or len(got) != 3:
        what = f"a tuple of {len(got)}" if isinstance(got, tuple) else type(got).__name__
        raise ConfigError(f"{name} must return (model, batch, loss_fn), got {what}")
    model, batch, loss_fn = got
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{name} returned a {type(model).__name__} as the model, not an nn.Module"
        )
    if not callable(loss_fn):
        raise ConfigError(f"{name} returned a {type(loss_fn).__name__} as loss_fn, not a function")
    size = batch_size if batch_size is not None else _leading_dim(batch)
    return ProfileTarget(model, batch, loss_fn), size


def profile_factory(
    factory: str | Factory,
    batch_size: int | None = None,
    *,
    warmup: int = 2,
    steps: int = 5,
    observe_ddp: bool = False,
    bucket_cap_mb: float | None = None,
    seed: int = 0,
    name: str | None = None,
) -> Profile:
    """Profile the model a factory builds (see the module docstring for the contract).

    ``factory`` is a spec string or the function itself. The model is trained in place
    for ``warmup + steps`` steps by :func:`~thinwire.analysis.measure.profile_model`
    (AdamW at lr 1e-4); with ``observe_ddp`` a copy is first run under a real one-rank
    DDP to record its buckets (``--buckets observed``).
    """
    if isinstance(factory, str):
        label = name or factory
        fn = load_factory(factory)
    else:
        fn = factory
        label = name or getattr(factory, "__qualname__", type(factory).__name__)
    torch.manual_seed(seed)
    target, size = build_target(fn, batch_size, name=label)
    try:
        observed = (
            observe_ddp_buckets(
                target.model, target.batch, target.loss_fn, bucket_cap_mb=bucket_cap_mb
            )
            if observe_ddp
            else None
        )
        prof = profile_model(
            target.model,
            target.batch,
            target.loss_fn,
            warmup=warmup,
            steps=steps,
            name=label,
            batch_size=size,
        )
    except ConfigError:
        raise
    except Exception as exc:  # the user's forward or loss_fn failed on its own batch
        raise _raised(exc, f"training {label}'s model on its batch") from None
    prof.observed_buckets = observed
    return prof
