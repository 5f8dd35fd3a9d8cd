"""The ``thinwire`` command's entry point (and ``python -m thinwire``'s).

Commands that start local ranks (``train`` without torchrun, ``compare``) start the
ranks' fork server before anything imports torch (:func:`thinwire.prestart.warm_up`):
its imports then overlap the command's own. Every other command goes straight to
:func:`thinwire.cli.main.main`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["main", "starts_ranks"]

_RANK_COMMANDS = ("train", "compare")


def starts_ranks(argv: Sequence[str]) -> bool:
    """Whether the command line ``argv`` (without the program) will fork local ranks."""
    if not argv or argv[0] not in _RANK_COMMANDS or "RANK" in os.environ:
        return False  # under torchrun every process is a rank already
    return not {"-h", "--help"} & set(argv)


def main() -> int:
    if starts_ranks(sys.argv[1:]):
        from thinwire.prestart import warm_up

        warm_up()
    from thinwire.cli.main import main as cli_main

    return cli_main()
