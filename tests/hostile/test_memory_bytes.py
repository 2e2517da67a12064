"""Round fifteen: a cost file's memory byte counts (``memory.activation_bytes``, ``parameter_bytes``,
``gradient_bytes``, ``optimizer_bytes``; docs/simulator.md) past any device -- generated over every byte field of
``MemoryCost``, each at magnitudes from past an exabyte to the largest double, alone in a file and built in code.

Each was read, and the simulation ran until its peaks summed past a float: then refused naming
``peak_memory_bytes``, with advice to give smaller times. Now each is one line naming the file and the field,
before any table is simulated."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from hostile_support import accepted, refused, run_api, run_cli
from primuspipe.ir.cost_parts import MAX_BYTES, MemoryCost

FIELDS = [f.name for f in dataclasses.fields(MemoryCost) if f.name.endswith("_bytes")]
MAGNITUDES = [MAX_BYTES * 10, 1e300, 1.7976931348623157e308]


def _cost(tmp_path, field, value):
    memory = {"w_retained_fraction": 0.5, "activation_bytes": 1e6, "parameter_bytes": 1e6, "gradient_bytes": 1e6,
              "optimizer_bytes": 1e6, field: value}
    path = tmp_path / "cost.yaml"
    path.write_text(yaml.safe_dump({"time_unit": "ms", "compute": {"f": 1.0, "b": 1.0, "w": 1.0}, "memory": memory}))
    return path


@pytest.mark.parametrize("value", MAGNITUDES)
@pytest.mark.parametrize("field", FIELDS)
def test_bytes_past_any_device(tmp_path, field, value):
    cost = _cost(tmp_path, field, value)
    refused(run_cli(["simulate", "-a", "zb-h1", "--pp", "2", "-m", "4", "--cost", cost, "--json"]),
            f"memory.{field}", "cost.yaml", case=f"simulate memory.{field}={value:g}", before_work=True)
    refused(run_api(MemoryCost, **{field: (value, value)}, **({} if field == "activation_bytes" else
                                                               {name: (1.0, 1.0) for name in FIELDS if name != field
                                                                and name != "activation_bytes"})),
            f"memory.{field}", case=f"MemoryCost({field}={value:g})")


@pytest.mark.parametrize("field", FIELDS)
def test_bytes_at_the_bound(tmp_path, field):
    """An exabyte is still a size (sound): the bound refuses nothing a device could hold."""
    cost = _cost(tmp_path, field, MAX_BYTES)
    accepted(run_cli(["simulate", "-a", "zb-h1", "--pp", "2", "-m", "4", "--cost", cost, "--json"]),
             case=f"simulate memory.{field}={MAX_BYTES:g}")
