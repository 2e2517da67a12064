"""Every single-valued option of every ``primuspipe`` command refuses a second, different value (argparse would
keep the last one silently: ``simulate -a zb-h1 -a zbv`` simulated zbv alone), and takes the same value twice."""

from __future__ import annotations

import argparse

import pytest

from primuspipe.cli import build_parser

CANDIDATES = (("1", "2"), ("0.5", "0.25"), ("1,2", "3"), ("a.yaml", "b.yaml"), ("1f1b", "zbv"), ("a", "b"))


def _commands() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return {"": root, **sub.choices}


def _two_values(action: argparse.Action) -> tuple[str, str] | None:
    """Two different values the option's type takes, or None where none of the candidates does."""
    if action.choices:
        choices = [str(c) for c in action.choices]
        return (choices[0], choices[1]) if len(choices) > 1 else None
    for pair in CANDIDATES:
        try:
            converted = [action.type(v) if action.type else v for v in pair]
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            continue
        if converted[0] != converted[1]:
            return pair
    return None


CASES = [(name, action.option_strings[-1], pair)
         for name, parser in _commands().items() for action in parser._actions
         if type(action).__name__ == "_StoreOnce" and action.option_strings and action.nargs is None
         and (pair := _two_values(action))]


def test_every_command_is_covered():
    assert {name for name, _, _ in CASES} == set(_commands()) - {"", "list"}  # list takes no option


@pytest.mark.parametrize("command, option, values", CASES, ids=[f"{c or 'root'} {o}" for c, o, _ in CASES])
def test_a_second_different_value_is_refused_and_the_same_one_passes(command, option, values, capsys):
    prefix = [command] if command else []
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(prefix + [option, values[0], option, values[1]])
    assert stop.value.code == 2
    assert f"{option} " in (err := capsys.readouterr().err) and "both given" in err
    try:  # the same value twice is no conflict (other required arguments may still be missing)
        build_parser().parse_args(prefix + [option, values[0], option, values[0]])
    except SystemExit:
        assert "both given" not in capsys.readouterr().err


def test_the_repeatable_options_still_repeat():
    args = build_parser().parse_args(["project", "--hardware", "h.yaml", "-a", "1f1b", "-a", "zbv"])
    assert args.algorithm == ["1f1b", "zbv"]


@pytest.mark.parametrize("command", ["show", "export", "simulate"])
def test_megatron_names_of_the_shape(command):
    """--pp and --vpp answer to Megatron-LM's flags, as examples/train_gpt.py's do: a Megatron command line's
    values paste in; both spellings of one option given different values are refused like a repeat."""
    parser = _commands()[command]
    extra = ["-a", "zbv"] if command == "simulate" else ["zbv"]
    extra += ["-o", "x.json"] if command == "export" else []
    ours = parser.parse_args([*extra, "--pp", "4", "--vpp", "2", "-m", "8"])
    for pp, vpp in (("--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"),
                    ("--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size")):
        megatron = parser.parse_args([*extra, pp, "4", vpp, "2", "-m", "8"])
        assert (megatron.pp, megatron.vpp) == (ours.pp, ours.vpp) == (4, 2)
    with pytest.raises(SystemExit):
        parser.parse_args([*extra, "--pp", "4", "--pipeline-model-parallel-size", "8", "-m", "8"])
