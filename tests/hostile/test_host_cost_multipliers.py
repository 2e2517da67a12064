"""Cost files' ``host`` section (the shared-cores simulator's terms): each time is bounded like the compute
times, and the factors that multiply them (``speed`` divides every node's time, ``contention`` multiplies
crowded work) are bounded so that no finite file gives a step of 1e302 -- ``host.step_gap`` (a time per
rank) and ``host.message_cpu`` were left out of the bound on times, and ``speed`` and ``contention`` had
none. Each is refused before any table is simulated, naming the field."""

import copy
import json
import math

import pytest
import yaml

from hostile_support import accepted, refused, run_cli

GOOD = {"time_unit": "ms",
        "compute": {"f": 1.0, "b": [1.0, 1.0, 2.0, 1.0], "w": 1.0},
        "host": {"cores": 2, "background": 0.05, "contention": 0.1, "speed": 0.9, "message_cpu": 0.001,
                 "step_gap": 0.1},
        "p2p": {"message_bytes": 16777216, "ranks_per_node": 8, "intra_node": {"latency": 0.005, "bandwidth": 4.0e8}}}
HOSTILE = {"step_gap": [1e300, 1e20, [0, 0, 0, 1e300], [0.1, 0.1, 0.1, 1e13]], "message_cpu": [1e13, 1e300],
           "speed": [1e-300, 1e-12, 1e-4], "contention": [1e300, 1e20, 2.0**31, 1e4]}
SANE = {"step_gap": [0, 10.0, [0, 1, 2, 3]], "speed": [1e-3, 0.5, 1], "contention": [0, 1.0, 1e3]}


def _simulate(tmp_path, field, value, algorithm):
    data = copy.deepcopy(GOOD)
    data["host"][field] = value
    cost = tmp_path / "cost.yaml"
    cost.write_text(yaml.safe_dump(data))
    return run_cli(["simulate", "-a", algorithm, "--pp", "4", "-m", "8", "--cost", cost, "--json"])


@pytest.mark.parametrize("algorithm", ["1f1b", "zbv", "interleaved-1f1b"])
@pytest.mark.parametrize("field, value", [(f, v) for f, values in HOSTILE.items() for v in values])
def test_host_terms_past_a_step(tmp_path, field, value, algorithm):
    refused(_simulate(tmp_path, field, value, algorithm), f"host.{field}", "cost.yaml",
            case=f"simulate {algorithm} host.{field}={value}", before_work=True)


@pytest.mark.parametrize("field, value", [(f, v) for f, values in SANE.items() for v in values])
def test_host_terms_in_range_still_simulate(tmp_path, field, value):
    outcome = accepted(_simulate(tmp_path, field, value, "1f1b"), case=f"simulate host.{field}={value}")
    for row in json.loads(outcome.out)["results"]:
        assert math.isfinite(row["step_time"]) and row["step_time"] < 1e9
