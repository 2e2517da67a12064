"""The console script's argument parser: argparse's, except that an option taking one value refuses a second one.

argparse keeps the last of a repeated option (``-a zb-h1 -a zbv`` simulates zbv alone), which reads as if both
were taken. Every option that stores a value here notes the value it was given; the same option given again with
another value ends the program with argparse's usage error naming both. The same value again, and flags (which
can only say the same thing twice), are harmless and pass -- except for an option that names what the command
runs (``simulate -a``, ``action="single"``), where a repeat reads as a list whose second name was meant to be
another. Options meant to repeat say so with ``action="append"`` (``project --algorithm``, ``--option``); the same
value twice there is refused (``project -a 1f1b -a 1f1b`` ranked one row where two names were typed).
"""

from __future__ import annotations

import argparse

from primuspipe import strict

_GIVEN = "_primuspipe_values_given"
"""The namespace attribute the actions note their values in during one parse (removed before the parse returns)."""


class _StoreOnce(argparse._StoreAction):
    """argparse's ``store``, refusing a second, different value in one parse."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault(_GIVEN, {})
        if self.dest in given and given[self.dest][0] != values:
            earlier, flag = given[self.dest]
            parser.error(f"{flag} {earlier!r} and {option_string} {values!r} both given, and only one would be "
                         f"used: give it once")
        given[self.dest] = (values, option_string)
        super().__call__(parser, namespace, values, option_string)


class _Single(_StoreOnce):
    """:class:`_StoreOnce` for an option that names what the command runs: given twice, even with one value, it is
    refused (``simulate -a zbv -a zbv`` simulated one algorithm where the user wrote two names)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.get(_GIVEN, {})
        if self.dest in given and given[self.dest][0] == values:
            parser.error(f"{option_string} {values!r} given twice; it takes one value: give it once")
        super().__call__(parser, namespace, values, option_string)


class _AppendDistinct(argparse._AppendAction):
    """argparse's ``append``, refusing a value it already holds: a repeatable option's list is what the user
    counted, and a value given twice was run once without a word (``project -a 1f1b -a 1f1b``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values in (getattr(namespace, self.dest, None) or ()):
            parser.error(f"{option_string} {values!r} given twice; give each value once")
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose single-valued options refuse two different values; sub-command
    parsers made by :meth:`add_subparsers` are of this class too.

    ``intermixed``: the positionals may stand on both sides of options, as a shell user writes them (``calibrate
    run1 -o c.yaml run2``: argparse takes one run of positionals and called ``run2`` an unrecognized argument)."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.register("action", "single", _Single)
        self.register("action", "append", _AppendDistinct)
        self._intermixed = intermixed

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixed:  # argparse's intermixed parse calls this method back for each of its two passes
            self._intermixed = False
            try:
                parsed, extras = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._intermixed = True
        else:
            parsed, extras = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_GIVEN, None)
        return parsed, extras

    def error(self, message: str):
        """argparse's usage error, one line: its messages quote what the user typed (an unknown argument
        holding a newline or an escape sequence), printed escaped."""
        super().error(strict.one_line(message))
