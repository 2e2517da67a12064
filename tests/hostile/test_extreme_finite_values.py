"""Every number option of every subcommand (found from the parser) at values that are finite, in range and
extreme: the largest double, 1e308, the smallest normal and the smallest subnormal double, and for counts the
largest count the command line reads (18 digits) -- each from command lines that reach the option's use (a memory
limit under zb-auto and ``-a all``, an offload under a limit, a retained share under an in-flight limit); and the
API's ``build_schedule(memory_limit=...)`` for every registered algorithm. Each runs (exit 0, figures finite) or is
refused in one line: never a traceback, never Infinity.

Defects this family found: ``simulate -a zb-auto --memory-limit 1e308`` (and ``-a all``) was an OverflowError
traceback: the limit times vpp chunks was infinity, which zb-auto then rounded to a count (``int(inf)``).
"""

import json
import math

import pytest

from hostile_support import NUMBER_TYPES, accepted, command_inputs, refused, run_api, run_cli, subcommands
from primuspipe.algorithms import list_algorithms
from primuspipe.algorithms.build import build_schedule

FLOATS = ["1.7976931348623157e308", "1e308", "2.2250738585072014e-308", "5e-324"]
COUNTS = ["9" * 18]


def _bases(tmp) -> dict[str, list[list]]:
    """Command lines of each subcommand that run, and that reach the options depending on another."""
    return {
        "show": [["show", "zb-h1", "--pp", "2", "-m", "4"]],
        "export": [["export", "zb-h1", "--pp", "2", "-m", "4", "-o", tmp / "t.json"]],
        "validate": [["validate", tmp / "table.json"]],
        "simulate": [["simulate", "-a", "zb-auto", "--pp", "2", "-m", "4", "--json"],
                     ["simulate", "-a", "all", "--pp", "2", "-m", "4", "--json"]],
        "vis": [["vis", tmp / "sim" / "1f1b.timeline.json", "--json"]],
        "calibrate": [["calibrate", tmp / "dump", "-o", tmp / "c.yaml"]],
        "project": [["project", "--pp", "2", "-a", "1f1b", "--json"]],
    }


NEEDS = {"--offload": ["--memory-limit", "2"], "--w-retained": ["--max-in-flight", "2"]}
"""Options that mean something only beside another (given a plain value, so the extreme one is the option's)."""


def _cases():
    for command, parser in sorted(subcommands().items()):
        for action in parser._actions:
            kind = getattr(action.type, "__name__", "")
            if not action.option_strings or not kind.startswith(NUMBER_TYPES):
                continue
            for value in COUNTS if kind.startswith(("integer", "count")) else FLOATS:
                yield command, action.option_strings[-1], value


CASES = list(_cases())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return command_inputs(tmp_path_factory.mktemp("extreme"))


def _finite(data) -> bool:
    if isinstance(data, float):
        return math.isfinite(data)
    if isinstance(data, dict):
        return all(map(_finite, data.values()))
    return all(map(_finite, data)) if isinstance(data, list) else True


def _ran_or_refused(outcome, case: str) -> None:
    if outcome.kind == "silent" and outcome.code == 0:
        accepted(outcome, case=case)
        if outcome.out.lstrip().startswith("{"):
            assert _finite(json.loads(outcome.out)), f"{case}: a figure is not a number"
    else:
        refused(outcome, case=case)


@pytest.mark.parametrize("command, option, value", CASES, ids=[f"{c} {o} {v}" for c, o, v in CASES])
def test_extreme_finite_values(world, command, option, value):
    for base in _bases(world)[command]:
        argv = [*base, *NEEDS.get(option, []), option, value]
        _ran_or_refused(run_cli(argv), f"{' '.join(map(str, base[:3]))} {option} {value}")


@pytest.mark.parametrize("limit", [1e308, float.fromhex("0x1.fffffffffffffp+1023")])
@pytest.mark.parametrize("algorithm", [a.name for a in list_algorithms()])
def test_api_memory_limit_at_the_largest_double(algorithm, limit):
    outcome = run_api(build_schedule, algorithm, 2, 4, memory_limit=limit)
    if outcome.kind == "silent":
        accepted(outcome, case=f"build_schedule {algorithm} memory_limit={limit:g}")
    else:
        refused(outcome, case=f"build_schedule {algorithm} memory_limit={limit:g}")
