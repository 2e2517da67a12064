"""Every subcommand's bad-argument paths, generated from the parser: from a valid command line, each option left
without its value, each number option given text, NaN, infinity or nothing, each choice given a name it does not
offer, each switch given a value, and an option that does not exist. Each is one line naming the option (argparse's
usage line aside) and nothing runs."""

import argparse
from pathlib import Path

import pytest

from hostile_support import NUMBER_TYPES, command_inputs, refused, run_api, run_cli, subcommands
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.projection import Projector, project
from primuspipe.projection.training_spec import load_training

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"


def _valid(tmp) -> dict[str, list]:
    """A command line of each subcommand that runs (the bad argument is appended to it)."""
    return {
        "list": ["list"],
        "show": ["show", "1f1b", "--pp", "2", "-m", "4"],
        "export": ["export", "1f1b", "--pp", "2", "-m", "4", "-o", tmp / "t.json"],
        "validate": ["validate", tmp / "table.json"],
        "simulate": ["simulate", "-a", "1f1b", "--pp", "2", "-m", "4"],
        "vis": ["vis", tmp / "sim" / "1f1b.timeline.json", "--html", tmp / "o.html"],
        "calibrate": ["calibrate", tmp / "dump", "-o", tmp / "c.yaml"],
        "project": ["project", "--model", EXAMPLES / "models" / "llama2-7b.yaml", "--hardware",
                    EXAMPLES / "hardware" / "h100.yaml", "-a", "1f1b"],
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return command_inputs(tmp_path_factory.mktemp("bad_arguments"))


def _cases() -> list[tuple[str, str, tuple[str, ...]]]:
    """(subcommand, option, the bad tokens) for every option of every subcommand."""
    cases = []
    for name, parser in sorted(subcommands().items()):
        cases += [(name, "--nosuch", ("--nosuch",)), (name, "--nosuch", ("--nosuch=1",))]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            option = action.option_strings[-1]
            if action.nargs == 0:
                cases.append((name, option, (f"{option}=x",)))
                continue
            if action.nargs != "?":
                cases.append((name, option, (option,)))
            if action.choices:
                cases.append((name, option, (option, "nosuch")))
            kind = getattr(action.type, "__name__", "")
            if kind.startswith(NUMBER_TYPES):
                cases += [(name, option, (option, value)) for value in ("x", "nan", "inf", "-inf", "", "1e999")]
            if kind.startswith(("integer", "count")):  # past int64 (a huge limit in a number option is no limit)
                cases.append((name, option, (option, "9" * 20)))
    return cases


def test_every_number_option_is_typed():
    """The generator finds number options by their type's name: each option whose help speaks of a count or
    seconds must have one of them (else its bad values would go untested here)."""
    for name, parser in subcommands().items():
        for action in parser._actions:
            if action.option_strings and action.type is not None and action.type is not Path and \
                    not getattr(action.type, "__name__", "").startswith(NUMBER_TYPES):
                raise AssertionError(f"{name} {action.option_strings}: type {action.type!r} not swept")


@pytest.mark.parametrize("command, option, tokens", _cases(), ids=str)
def test_bad_argument(world, command, option, tokens):
    refused(run_cli([*_valid(world)[command], *tokens], watch=world), option,
            case=f"{command} {' '.join(tokens)}", before_work=True)


@pytest.mark.parametrize("names", [["1f1b", "1f1b"], ["zb-h1", "1f1b", "zb-h1", "zb-h1"]])
def test_an_algorithm_named_twice(names):
    """``project -a 1f1b -a 1f1b`` ranked two identical rows (``--algorithm`` is meant to repeat), then one row for
    the two names typed; now the repeat is refused naming it, on the command line and in ``project()``."""
    argv = _valid(Path("."))["project"][:-2] + [t for name in names for t in ("-a", name)] + ["--json"]
    refused(run_cli(argv), "-a", names[0], "twice", case=f"project {' '.join('-a ' + n for n in names)}")
    projector = Projector(load_model(EXAMPLES / "models" / "llama3-8b.yaml"),
                          load_hardware(EXAMPLES / "hardware" / "h100.yaml"))
    refused(run_api(project, projector, load_training(EXAMPLES / "training" / "default.yaml"), algorithms=names),
            names[0], "times", case=f"project(algorithms={names})")
