"""Command-line numbers and options: NaN, infinity, negatives, non-integers, other digits and booleans
are refused by the flag's name; options are typed; every refusal is one line."""

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import refused, run_cli
from primuspipe.algorithms.build import build_schedule

SIM = ["simulate", "--algorithm", "1f1b", "--pp", "4", "-m", "8"]

BAD_NUMBERS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1", "abc", "", "1,,2", "１", "0x10", "1_000"]


@pytest.mark.parametrize("flag", ["--f", "--b", "--w", "--bw"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1,nan", "1e999"])
def test_compute_times(cli, flag, value):
    refused(cli([*SIM, flag, value]), flag.lstrip("-"), case=f"simulate {flag} {value}")


@pytest.mark.parametrize("argv, names", [
    ([*SIM, "--f", "1,2"], ["2 values", "4"]),
    ([*SIM, "--p2p", "nan"], ["--p2p"]),
    ([*SIM, "--p2p", "-0.5"], ["--p2p", ">= 0"]),
    ([*SIM, "--p2p", "inf"], ["--p2p"]),
    ([*SIM, "--memory-limit", "0"], ["--memory-limit", "> 0"]),
    ([*SIM, "--memory-limit", "nan"], ["--memory-limit"]),
    ([*SIM, "--w-retained", "1.5"], ["--w-retained", "<= 1"]),
    ([*SIM, "--w-retained", "nan"], ["--w-retained"]),
    (["validate", "x.json", "--max-in-flight", "inf"], ["--max-in-flight"]),
    (["validate", "x.json", "--w-retained", "-0.1"], ["--w-retained"]),
    (["calibrate", "dump", "--warmup", "-1"], ["--warmup"]),
    (["calibrate", "dump", "--warmup", "1.5"], ["--warmup"]),
    (["vis", "dump", "--iteration", "２"], ["--iteration"]),
])
def test_other_numbers(cli, argv, names):
    refused(cli(argv), *names, case=" ".join(argv))


@pytest.mark.parametrize("flag", ["--pp", "--vpp", "-m"])
@pytest.mark.parametrize("value", ["0", "-1", "2.5", "2.0", "true", "１", "4e0"])
def test_counts(cli, flag, value):
    argv = ["show", "1f1b", "--pp", "4", "-m", "8"]
    argv = [*argv, flag, value] if flag == "--vpp" else [v if argv[i - 1] != flag else value for i, v in enumerate(argv)]
    refused(cli(argv), case=f"show {flag} {value}")


@settings(max_examples=40)
@given(st.sampled_from(["--f", "--b", "--w", "--p2p", "--memory-limit"]),
       st.one_of(st.sampled_from(BAD_NUMBERS), st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False).map(repr),
                 st.text(alphabet="０１２３４５６７８９٠١٢", min_size=1, max_size=3)))
def test_generated_bad_numbers(flag, value):
    refused(run_cli([*SIM, flag, value]), flag.lstrip("-"), case=f"simulate {flag} {value!r}")


@pytest.mark.parametrize("options, names", [
    (["-O", "p2p_time=1e-3"], ["p2p_time", "is gone"]),  # read as a number, then named as a removed option
    (["-O", "nosuch=1"], ["nosuch"]),
    (["-O", "novalue"], ["KEY=VALUE"]),
    (["-O", "=3"], ["KEY=VALUE"]),
    (["-O", "microbatch_group_size=nan"], ["microbatch_group_size"]),
    (["-O", "microbatch_group_size=2.5"], ["microbatch_group_size", "integer"]),
    (["-O", "microbatch_group_size=true"], ["microbatch_group_size"]),
    (["-O", "microbatch_group_size=4", "-O", "microbatch_group_size=5"], ["twice"]),
    (["-O", "microbatch_group_size=0"], ["[min(pp, microbatches)=4, microbatches=8]"]),  # bracketed text survives
])
def test_algorithm_options(cli, options, names):
    argv = ["simulate", "--algorithm", "interleaved-1f1b", "--pp", "4", "-m", "8", *options]
    refused(cli(argv), *names, case=" ".join(argv))


OWN = [name for name, p in inspect.signature(build_schedule).parameters.items() if p.kind is not p.VAR_KEYWORD]
"""``build_schedule``'s own parameters: an ``-O`` of one of these names was passed on beside the command's value."""
SHAPE = ["--pp", "2", "-m", "4"]


@pytest.mark.parametrize("command", [["show", "zbv"], ["export", "zbv", "-o", "-"], ["simulate", "-a", "zbv"],
                                     ["simulate", "-a", "zb-h1", "--memory-limit", "3"]], ids=" ".join)
@pytest.mark.parametrize("key", OWN)
def test_options_that_are_the_commands_own(cli, command, key):
    """Round ten: ``-O vpp=2`` (or ``pp``, ``memory_limit`` beside ``simulate``'s) was a TypeError ("got multiple values
    for keyword argument"); ``export -O communication=false`` wrote a table without its communication."""
    value = "false" if key == "communication" else "2"
    refused(cli([*command, *SHAPE, "-O", f"{key}={value}"]), key, case=f"{' '.join(command)} -O {key}={value}")


def test_option_numbers_are_numbers(cli):
    """``-O p2p_time=1e-3`` reaches the algorithm as the number 0.001 (not the string "1e-3", which gave a
    TypeError), so the message is about the option, not its type."""
    from primuspipe.strict import scalar

    assert scalar("1e-3", "x") == 0.001 and scalar("4", "x") == 4
    outcome = refused(cli([*SIM, "-O", "p2p_time=1e-3"]), "p2p_time", case="simulate -O p2p_time=1e-3")
    assert "TypeError" not in outcome.err


@pytest.mark.parametrize("algorithm", ["nosuch", "1F1B ", "[/x]", "[bold]gpipe"])
def test_unknown_algorithm_names_survive_as_typed(cli, algorithm):
    outcome = refused(cli(["show", algorithm, "--pp", "2", "-m", "2"]), case=f"show {algorithm!r}")
    assert algorithm.strip() in outcome.message, "markup must not eat the user's text"
