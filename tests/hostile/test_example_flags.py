"""Every number flag of ``examples/train_gpt.py`` and ``examples/train_torch.py``, listed from their parsers, at
values no run can use: zero and below, NaN and the infinities, fractions for counts, other scripts' digits, words.

Defects this family found: the flags were argparse's ``int``/``float``, so ``--lr nan`` (and ``inf``) trained
every weight to NaN and printed it as a result, ``--iterations 0`` trained nothing and then ended in a
StatisticsError (no median step time), ``--layers 0`` / ``--hidden-size -1`` reached the model builders, and ``３``
(a full-width digit) read as 3. Each is now argparse's one-line error naming the flag, before any process group
starts; the values the examples document still parse."""

import argparse
import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

from hostile_support import Outcome, accepted, refused

EXAMPLES = Path(__file__).parents[2] / "examples"
REQUIRED = ["--pp", "2", "--microbatches", "4"]
BAD = ["-1", "nan", "inf", "-inf", "1e999", "３", "x", ""]
"""Values no number flag of the examples takes (0 is refused by the counts but means "off" for two flags)."""
BAD_COUNTS = ["1.5", "2.0", "1e3", "0x10"]
"""And the counts' other spellings of numbers."""


def _parser(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def _number_flags(name: str) -> list[tuple[str, str]]:
    """``(flag, "integer" or "number")`` for each flag whose value is a number, from the example's parser
    (argparse's ``int``/``float`` are a defect)."""
    actions = []
    parse = _parser(name)
    original = argparse.ArgumentParser.parse_args

    def capture(parser, args=None, namespace=None):
        actions.extend(parser._actions)
        return original(parser, args, namespace)

    argparse.ArgumentParser.parse_args = capture
    try:
        parse(REQUIRED)
    finally:
        argparse.ArgumentParser.parse_args = original
    flags = []
    for action in actions:
        kind = getattr(action.type, "__name__", None)
        assert action.type not in (int, float), f"{name} {action.option_strings[0]} is read by argparse's {kind}"
        if kind in ("integer", "number"):
            flags.append((action.option_strings[0], kind))
    return flags


def _parse(name: str, argv: list[str]) -> Outcome:
    """``parse_args(argv)`` classified as the CLI's runs are: argparse's exit 2 with one error line is clear."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _parser(name)(argv)
        except SystemExit as exc:
            lines = [line for line in err.getvalue().splitlines() if ": error: " in line]
            kind = "clear" if exc.code == 2 and len(lines) == 1 else "garbled"
            return Outcome(kind, exc.code, lines[0] if lines else err.getvalue())
    return Outcome("silent", 0, "")


CASES = [(name, flag, value) for name in ("train_gpt", "train_torch") for flag, kind in _number_flags(name)
         for value in BAD + (BAD_COUNTS if kind == "integer" else [])]


@pytest.mark.parametrize("name, flag, value", CASES, ids=[f"{n}-{f}={v!r}" for n, f, v in CASES])
def test_number_flags(name, flag, value):
    given = {**dict(zip(REQUIRED[::2], REQUIRED[1::2])), flag: value}
    refused(_parse(name, [part for pair in given.items() for part in pair]), flag, case=f"{name}.py {flag} {value!r}")


@pytest.mark.parametrize("name, argv", [
    ("train_gpt", ["--lr", "0", "--manual-gc-interval", "0", "--mtp-num-layers", "0", "--moe-aux-loss-coeff", "0"]),
    ("train_gpt", ["--lr", "1e-3", "--iterations", "1", "--vpp", "2", "--num-layers", "+8"]),
    ("train_torch", ["--lr", "0", "--iterations", "1", "--vpp", "2", "--hidden", "16"]),
])
def test_documented_values_still_parse(name, argv):
    accepted(_parse(name, [*REQUIRED, *argv]), case=f"{name}.py {' '.join(argv)}")


@pytest.mark.parametrize("name, algorithm", [("train_gpt", "pp_algorithm"), ("train_torch", "algorithm")])
def test_examples_take_each_others_and_megatrons_names(name, algorithm):
    """A user moving between the two examples (and from a Megatron command line) is not told 'unrecognized
    arguments': both take --pp-algorithm / --algorithm / -a and Megatron's --pipeline-model-parallel-size,
    --num-virtual-stages-per-pipeline-rank and --micro-batch-size."""
    parse = _parser(name)
    for flag in ("--pp-algorithm", "--algorithm", "-a"):
        args = parse(["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                      "--microbatches", "4", "--micro-batch-size", "2", flag, "zbv"])
        assert (args.pp, args.vpp, getattr(args, algorithm)) == (2, 2, "zbv"), flag
