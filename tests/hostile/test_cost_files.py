"""Cost model YAML (``simulate --cost``): every number finite and in range, known keys only, no aliases,
bounded; the message names the file and the field. No impossible result (step 24 with NaN message
bytes, bubble NaN) comes out of a bad file any more."""

import copy

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import not_valid_afterwards, refused, run_cli

GOOD = {
    "time_unit": "ms",
    "compute": {"f": 1.0, "b": [1.0, 1.0, 2.0, 1.0], "w": 1.0, "bw": 1.8, "fb_overlap": 0.5},
    "p2p": {"message_bytes": 16777216, "ranks_per_node": 8,
            "intra_node": {"latency": 0.005, "bandwidth": 4.0e8}, "inter_node": {"latency": 0.02}},
    "memory": {"w_retained_fraction": 0.94, "activation_bytes": 2.0e9, "parameter_bytes": 1.0e9},
}
FIELDS = [("compute", "f"), ("compute", "b"), ("compute", "w"), ("compute", "bw"), ("compute", "fb_overlap"),
          ("p2p", "message_bytes"), ("p2p", "ranks_per_node"), ("p2p", "intra_node", "latency"),
          ("p2p", "intra_node", "bandwidth"), ("memory", "w_retained_fraction"), ("memory", "activation_bytes"),
          ("memory", "parameter_bytes")]


def _with(path, value):
    data = copy.deepcopy(GOOD)
    section = data
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value
    return data


def _simulate(tmp_path, text):
    cost = tmp_path / "cost.yaml"
    cost.write_text(text)
    return run_cli(["simulate", "--algorithm", "all", "--pp", "4", "-m", "8", "--cost", cost, "-o", tmp_path / "out"])


def test_the_good_file_runs(tmp_path):
    outcome = _simulate(tmp_path, yaml.safe_dump(GOOD))
    assert outcome.kind == "silent" and outcome.code == 0, outcome.err  # valid input: exit 0 is right


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "-1", "true", "abc"])
def test_every_field_refuses_bad_numbers(tmp_path, path, value):
    text = yaml.safe_dump(_with(path, "VALUE")).replace("VALUE", value)
    outcome = refused(_simulate(tmp_path, text), path[-1], case=f"cost {'.'.join(path)}: {value}")
    assert "cost.yaml" in outcome.message
    not_valid_afterwards(*(tmp_path / "out").glob("*"))


@settings(max_examples=40)
@given(st.sampled_from(FIELDS), st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), True, None, "x", [], {"a": 1}, "1e999"]),
    st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False)))
def test_generated_bad_values(tmp_path_factory, path, value):
    if path[-1] in ("bandwidth", "bw") and value is None:
        return  # documented: null bandwidth is unlimited, null bw is b + w
    tmp = tmp_path_factory.mktemp("cost")
    refused(_simulate(tmp, yaml.safe_dump(_with(path, value))), path[-1], case=f"cost {'.'.join(path)}={value!r}")


@pytest.mark.parametrize("text, names", [
    ("a: &a [1, 1]\nb: &b [*a, *a]\nc: [*b, *b]\n", ["aliases"]),  # a YAML bomb cannot expand
    ("compute: {f: 1, b: 1, w: 1}\ncompute: {f: 2, b: 2, w: 2}\n", ["twice"]),
    ("compute: {f: 1, b: 1}\n", ["compute", "w"]),
    ("compute: {f: 1, b: 1, w: 1, x: 1}\n", ["'x'"]),
    ("compute: {f: 1, b: 1, w: 1}\ncomptue: {}\n", ["comptue", "compute"]),
    ("compute: {f: [1, 2, 3], b: 1, w: 1}\n", ["3 values", "4"]),
    ("compute: {f: 1, b: 1, w: 1}\ntime_unit: hours\n", ["time_unit"]),
    ("compute: {f: 1, b: 1, w: 1}\np2p: {intra_node: {bandwidth: 0}}\n", ["bandwidth"]),
    ("compute: {f: 1, b: 1, w: 1}\np2p: {message_bytes: .nan}\n", ["message_bytes"]),
    ("compute: {f: 1, b: 1, w: 1}\nmemory: {activation_bytes: 1.0e9}\n", ["w_retained_fraction"]),
    ("compute: {f: 1, b: 1, w: 1}\nmemory: {w_retained_fraction: 1.5}\n", ["w_retained_fraction"]),
    ("- 1\n- 2\n", ["mapping"]),
    ("compute: {f: ０.５, b: 1, w: 1}\n", ["f"]),
    ("compute: !!python/object:os.system {}\n", ["YAML"]),
    ("compute: [" * 100 + "]" * 100 + "\n", ["deep"]),
    ("\tcompute:\n", ["YAML"]),
])
def test_documents(tmp_path, text, names):
    refused(_simulate(tmp_path, text), *names, case=f"cost document {text[:24]!r}")
