"""The parser class of thinwire's command tree: old spellings and mode switches.

Every parser under ``thinwire`` is a :class:`CommandParser` (``build_parser`` makes it the
class of the subcommands, and argparse hands a parser's class down to its own verbs). It
adds two things to :class:`argparse.ArgumentParser`:

* ``moved_to``: a command that was renamed stays, hidden, under its old name; when it
  parses, it says the new spelling in one line on stderr and then does what it always did.
  :func:`add_moved` registers one.
* :meth:`CommandParser.add_switch`: a flag that hands the whole command line to another
  parser, so that one command can have modes with options of their own
  (``thinwire compare --async`` and ``--testbed``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["CommandParser", "add_moved", "moved_note"]


def moved_note(old: str, new: str) -> str:
    """The one line an old spelling prints before it runs."""
    return f"thinwire: '{old}' is now '{new}'"


class _WholeSwitch(argparse.Action):
    """Stands for a switch in the help. A switch typed in full never reaches argparse
    (:meth:`CommandParser.parse_known_args` takes it out first), so this runs only for
    an abbreviation, which would otherwise be taken for the switch and ignored."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        raise argparse.ArgumentError(self, f"write it in full: {self.option_strings[0]}")


class CommandParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` that may be an old spelling of another command
    (``moved_to``) and may have switches to other parsers (:meth:`add_switch`)."""

    def __init__(self, *args: Any, moved_to: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moved_to = moved_to
        self._switches: list[tuple[str, argparse.ArgumentParser]] = []

    def add_switch(
        self,
        flag: str,
        target: argparse.ArgumentParser,
        help: str,
        group: argparse._ArgumentGroup | None = None,
    ) -> None:
        """``flag`` anywhere before ``--`` makes ``target`` parse the command line (less
        the flag) instead of this parser. The first switch registered wins when several
        are given; the others are left for ``target`` to parse."""
        (group or self).add_argument(
            flag, action=_WholeSwitch, nargs=0, default=argparse.SUPPRESS, help=help
        )
        self._switches.append((flag, target))

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.moved_to is not None:
            # printed as it parses, so that --help and a usage error carry it too
            print(moved_note(self.prog, self.moved_to), file=sys.stderr)
        argv = list(sys.argv[1:] if args is None else args)
        # what follows "--" belongs to another program (compare --async passes it to train)
        head = argv[: argv.index("--")] if "--" in argv else argv
        for flag, target in self._switches:
            if flag in head:
                argv.remove(flag)  # its first occurrence, which is in head
                return target.parse_known_args(argv, namespace)
        return super().parse_known_args(argv, namespace)

    def error(self, message: str) -> NoReturn:
        """A usage error in one line, naming the problem and where the options are
        listed (argparse's default prints the whole usage block first, 20 lines for
        ``train``, with the message last)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's message lists every name it knows; an unknown command should list
        # the commands of the help, not the hidden old spellings
        if not isinstance(action, argparse._SubParsersAction) or value in (action.choices or ()):
            return super()._check_value(action, value)
        shown = [choice.dest for choice in action._get_subactions()]
        if not shown:  # only hidden verbs here (simulate async): the word is just extra
            self.error(f"unrecognized arguments: {value}")
        listed = ", ".join(repr(name) for name in shown)
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {listed})")


def add_moved(
    subparsers: argparse._SubParsersAction, name: str, moved_to: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """Add ``name`` to ``subparsers`` as a hidden old spelling of ``moved_to``: left out
    of the help (no ``help=``), saying its new spelling when used. The caller adds the
    same arguments and ``func`` as the new spelling has."""
    if "help" in kwargs:
        raise TypeError("an old spelling is hidden: it takes no help=")
    return subparsers.add_parser(name, moved_to=moved_to, **kwargs)
