"""Every numeric field of a cost file (``simulate --cost``) -- compute, cold start, fixed and chunk parts, warm W,
probe window, late work, host times and shared-core terms, p2p, host link, memory -- at NaN, infinity, negative,
1e300 (and beyond a float), text and a mapping, as a scalar and (where the field takes one) inside a per-stage list.
Each must be one line naming the file and the field, before any table is simulated; valid neighbours still simulate."""

import copy

import pytest
import yaml

from hostile_support import refused, run_cli

BASE = {"time_unit": "ms", "compute": {"f": 1.0, "b": 1.0, "w": 1.0}}
HOST = {"cores": 2}
FIELDS = {  # path -> (extra sections the field needs, whether it takes a per-stage list)
    ("compute", "f"): ({}, True), ("compute", "b"): ({}, True), ("compute", "w"): ({}, True),
    ("compute", "bw"): ({}, True), ("compute", "fb_overlap"): ({}, False), ("compute", "w_warm"): ({}, True),
    ("compute", "probe_window"): ({}, False), ("compute", "cold_start", "f"): ({}, True),
    ("compute", "late_w", "time"): ({"compute": {"late_w": {"stage": 3, "first": 2}}}, False),
    ("compute", "fixed", "f"): ({}, True), ("compute", "chunk", "f"): ({"compute": {"fixed": {"f": 0.2}}}, True),
    ("host", "overhead", "f"): ({}, False), ("host", "send"): ({}, False), ("host", "recv"): ({}, False),
    ("host", "cores"): ({}, False), ("host", "background"): ({"host": HOST}, False),
    ("host", "message_cpu"): ({"host": HOST}, False), ("host", "contention"): ({"host": HOST}, False),
    ("host", "speed"): ({"host": HOST}, False), ("host", "step_gap"): ({}, True),
    ("p2p", "message_bytes"): ({}, False), ("p2p", "ranks_per_node"): ({}, False),
    ("p2p", "intra_node", "latency"): ({}, False), ("p2p", "inter_node", "latency"): ({}, False),
    ("p2p", "intra_node", "bandwidth"): ({}, False), ("host_link", "latency"): ({}, False),
    ("host_link", "bandwidth"): ({}, False), ("memory", "w_retained_fraction"): ({}, False),
    ("memory", "offload_fraction"): ({}, False), ("memory", "b_rise_fraction"): ({}, False),
    ("memory", "w_excess_fraction"): ({}, False), ("memory", "activation_bytes"): ({}, True),
    ("memory", "parameter_bytes"): ({}, True), ("memory", "gradient_bytes"): ({}, True),
    ("memory", "optimizer_bytes"): ({}, True),
}
VALUES = [".nan", ".inf", "-.inf", "-1", "1.0e300", "1e999", "abc", "'1e3x'", "{a: 1}", "true"]
NEEDS_BYTES = {"offload_fraction", "b_rise_fraction", "w_excess_fraction", "gradient_bytes", "optimizer_bytes",
               "parameter_bytes"}


def _merge(a, b):
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _file(path, value, as_list):
    extra, _ = FIELDS[path]
    data = _merge(BASE, extra)
    if path[-1] in NEEDS_BYTES or path[-1] == "activation_bytes":
        data = _merge(data, {"memory": {"activation_bytes": 1e9, "w_retained_fraction": 0.94}})
    section = data
    for key in path[:-1]:
        section = section.setdefault(key, {})
    section[path[-1]] = ["VALUE", 1.0, 1.0, 1.0] if as_list else "VALUE"
    return yaml.safe_dump(data).replace("VALUE", value)


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("as_list", [False, True])
def test_every_field(tmp_path, path, value, as_list):
    if as_list and not FIELDS[path][1]:
        return
    if value == "1.0e300" and path[-1] in ("bandwidth", "message_bytes", "activation_bytes", "parameter_bytes",
                                            "gradient_bytes", "optimizer_bytes", "cores"):
        return  # a huge bandwidth or size is a number, not an error (bounded where it multiplies)
    cost = tmp_path / "cost.yaml"
    cost.write_text(_file(path, value, as_list))
    argv = ["simulate", "-a", "1f1b", "--pp", "4", "-m", "8", "--cost", cost, "--json"]
    if path[0] == "host_link":
        argv += ["--offload", "--memory-limit", "2"]
    refused(run_cli(argv), "cost.yaml", path[-1], case=f"cost {'.'.join(path)}={value}{' in a list' if as_list else ''}",
            before_work=True)
