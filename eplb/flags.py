"""A command-line flag as one record: its names, default and help, and where a command defaults otherwise.

Every flag eplb's parsers share is one :class:`Flag`: the server's EPLB flags are
``eplb.config.SERVER_FLAGS``, the offline commands' own are ``eplb.commands.flags``, and every
parser adds them from there (:meth:`Flag.add_to`), so each has one default and one help text. A
command that cannot use the default (a demo that must rebalance within 300 passes, a replay whose
topology comes from its trace) says so in the flag's record, with the reason (:class:`Default`).

A number is read by :func:`int_in` or :func:`float_in`, the one way a flag's value gets bounded
while it is parsed: NaN, infinities, fractions for counts and values outside the flag's range
are refused there, in one line naming the flag, before anything is sized from them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Default:
    """A default some commands take instead of the flag's, and why the flag's does not serve them."""

    commands: tuple[str, ...]
    """The ``eplb`` subcommands that take it (``simulate``, ``sweep``, ``solve``, ``demo``, ...)."""
    value: Any
    """Their parser's default (None: the command resolves it, as ``shown`` says)."""
    shown: str
    """What their help says the default is."""
    why: str
    """Why the flag's own default does not serve them (documentation; the test of the table
    requires one)."""


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One flag: what ``add_argument`` gets, the default every parser but ``elsewhere``'s takes,
    and the engine adapters' environment variable for it."""

    names: tuple[str, ...]
    """Option strings, the flag's name first (then aliases)."""
    dest: str
    """Attribute of the parsed namespace; for a server flag the ``EplbConfig`` field."""
    help: str
    """What it does; the help a parser shows adds `` (default: ...)`` (:meth:`help_for`)."""
    default: Any = None
    """The default: the server's for a server flag (``EplbConfig``'s field), every command's
    unless ``elsewhere`` names it."""
    shown: str | None = None
    """The default in words for the help; None: ``str(default)``; empty: not said (a switch)."""
    parse: Callable[[str], Any] | None = None
    """``add_argument``'s ``type``: how a value is read."""
    action: str | type[argparse.Action] | None = None
    """``add_argument``'s ``action`` (``store_true``, ``append``, BooleanOptionalAction)."""
    choices: Sequence[Any] | None = None
    """The values it takes, when they are few."""
    nargs: str | int | None = None
    """``add_argument``'s ``nargs``."""
    metavar: str | None = None
    """The value's name in the help."""
    env: str | None = None
    """The ``EPLB_*`` variable through which the engine adapters take this flag (None: none)."""
    elsewhere: tuple[Default, ...] = ()
    """Commands that take another default, each with its reason."""

    @classmethod
    def named(cls, *names: str, **spec: Any) -> Flag:
        """A flag whose destination is argparse's for its first name (``--ep-size``: ``ep_size``)
        unless ``spec`` gives one."""
        spec.setdefault("dest", dest_of(names[0]))
        return cls(names=names, **spec)

    @property
    def name(self) -> str:
        return self.names[0]

    def _other(self, command: str | None) -> Default | None:
        return next((d for d in self.elsewhere if command in d.commands), None)

    def default_for(self, command: str | None) -> Any:
        """The default ``command``'s parser takes (None: the server's parser)."""
        other = self._other(command)
        return self.default if other is None else other.value

    def help_for(self, command: str | None) -> str:
        """The help ``command``'s parser shows: what it does, then its default."""
        other = self._other(command)
        shown = other.shown if other is not None else self.shown
        if shown is None:
            shown = str(self.default)
        text = f"{self.help} (default: {shown})" if shown else self.help
        return text.replace("%", "%%")  # argparse formats help with %

    def add_to(self, parser: argparse._ActionsContainer, command: str | None = None) -> argparse.Action:
        """Add this flag to ``parser`` (or an argument group) as ``command`` takes it."""
        optional: dict[str, Any] = {
            "type": self.parse,
            "action": self.action,
            "choices": self.choices,
            "nargs": self.nargs,
            "metavar": self.metavar,
        }
        return parser.add_argument(
            *self.names,
            dest=self.dest,
            default=self.default_for(command),
            help=self.help_for(command),
            **{key: value for key, value in optional.items() if value is not None},
        )


def dest_of(name: str) -> str:
    """The namespace attribute argparse gives an option string: ``--ep-size`` -> ``ep_size``."""
    return name.removeprefix("--").replace("-", "_")


def add_flags(
    parser: argparse._ActionsContainer, flags: Iterable[Flag], command: str | None = None
) -> list[argparse.Action]:
    """Add each of ``flags`` to ``parser`` as ``command`` takes it (None: as a server does)."""
    return [flag.add_to(parser, command) for flag in flags]


def _shown(text: str) -> str:
    """A value as an error shows it: at most 40 characters (a 5000-digit number is not echoed)."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def _range(low: float | None, high: float | None, *, above: bool = False) -> str:
    """``>= 1``, ``> 0``, ``<= 9``, ``in [0, 1]``, ``in (0, 1]`` or nothing."""
    lo, hi = ("" if x is None else str(x) for x in (low, high))
    if low is not None and high is not None:
        return f"in {'(' if above else '['}{lo}, {hi}]"
    if low is not None:
        return f"{'>' if above else '>='} {lo}"
    return f"<= {hi}" if high is not None else ""


def int_in(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """A flag's ``parse`` for a whole number in [low, high] (None: unbounded on that side).

    Refuses, as argparse's one-line error naming the flag, a fraction, a float spelling, a value
    outside the range and a number of more than 30 digits (Python would take 4300 of them).
    """
    wanted = f"a whole number {_range(low, high)}".rstrip()

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped.lstrip("+-")
        if not digits.isdigit() or not digits.isascii() or len(digits) > 30:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {_shown(text)}")
        value = int(stripped)
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


def float_in(
    low: float | None = None, high: float | None = None, *, above: bool = False
) -> Callable[[str], float]:
    """A flag's ``parse`` for a finite number in [low, high] (``above``: low excluded; None:
    unbounded on that side). NaN and infinities are always refused: no flag means "forever" by
    them, and a NaN compares false with every bound, so it would pass a later range check."""
    wanted = f"a finite number {_range(low, high, above=above)}".rstrip()

    def parse(text: str) -> float:
        try:
            if not text.isascii() or "_" in text:  # float() reads "١" and "1_0"; a flag does not
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {_shown(text)}") from None
        if (
            not math.isfinite(value)
            or (low is not None and (value <= low if above else value < low))
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {_shown(text)}")
        return value

    parse.__name__ = "float"
    return parse
