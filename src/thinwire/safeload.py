"""Loading checkpoints and results without running code from the file.

A pickle can name any importable function and have the loader call it, so a crafted
``model.pt`` or ``localsgd_server.pt`` handed to ``--resume`` could run anything as the
user. thinwire therefore never loads with ``torch.load(weights_only=False)``: every load
goes through :func:`safe_load` (a file) or :func:`safe_loads` (bytes), which use
PyTorch's restricted unpickler. It rebuilds tensors, numbers, strings, bytes, ``None``
and lists, tuples, dicts and sets of them, and refuses every other global unless it is on
:data:`SAFE_TYPES`, the explicit allow-list of thinwire's own state types.

thinwire's checkpoints (the trainer's ``model.pt`` and ``rank{r}.pt``, the asynchronous
server's ``localsgd_server.pt``) and the results that spawned ranks send back hold only
those plain values, so the allow-list is empty today. A new state type goes on it only
if rebuilding it runs no code beyond setting its fields; state is better stored as a
dict of plain values (see how the PowerSGD state is saved in
:mod:`thinwire.comm.peer_hooks`).

This module imports nothing from the rest of thinwire but :mod:`thinwire.errors`, so
every layer (``train``, ``localsgd``, ``comm``) may use it.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from thinwire.errors import ConfigError, first_line

__all__ = ["SAFE_TYPES", "UnsafeContentError", "safe_load", "safe_loads"]

SAFE_TYPES: tuple[type, ...] = ()
"""Classes, beyond PyTorch's plain-data defaults, that a thinwire file may contain."""


class UnsafeContentError(ConfigError):
    """The file names a function or class that is not on the allow-list; nothing of it
    was executed."""


def _load(source: Any, where: str) -> Any:
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(SAFE_TYPES)):
            # A foreign pickle protocol draws a UserWarning before the refusal; the
            # refusal (one line) is what the user needs to see.
            warnings.simplefilter("ignore")
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # The restricted unpickler names the global it refused ("... unsupported GLOBAL
        # posix.system ..."); report that, not PyTorch's advice to turn the check off.
        refused = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if refused is None:  # not a pickle we understand: damaged or foreign bytes
            raise ConfigError(f"{where} is corrupt or unreadable (not a torch file)") from None
        raise UnsafeContentError(
            f"{where} is not plain data: it asks to call {refused.group(1)}, which thinwire "
            "never loads (nothing of it ran); load only files thinwire wrote, from sources "
            "you trust"
        ) from None
    except Exception as exc:  # torch raises several types for damaged files
        raise ConfigError(f"{where} is corrupt or unreadable ({first_line(exc)})") from None


def safe_load(path: Path | str, what: str = "checkpoint file") -> Any:
    """Load a file thinwire wrote with ``torch.save``, refusing anything but plain data.

    Raises:
        ConfigError: the file is missing, truncated or not a torch file (one line).
        UnsafeContentError: the file asks to import or call something off the
            allow-list (a crafted or foreign pickle); nothing of it ran.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {path} is missing")
    return _load(path, f"{what} {path}")


def safe_loads(data: bytes, what: str = "data") -> Any:
    """:func:`safe_load` for bytes in memory (e.g. a spawned rank's result)."""
    return _load(io.BytesIO(data), what)
