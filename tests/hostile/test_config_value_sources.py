"""Megatron-config settings whose value is of the right type but refused by a later check -- a range, a
combination with another setting, an unknown algorithm or option, a dump folder that cannot be made -- set by
each source a run has: a ``PRIMUSPIPE_*`` environment variable, a ``primuspipe`` YAML file
(``PRIMUSPIPE_CONFIG``), and ``install(**overrides)``. The refusal is one line that names where the value came
from (the variable or the file), so the user knows what to edit.

Defects this family found: every check made after a value was read (``PrimusPipeConfig.__post_init__`` and
``check``) named only the field, so ``PRIMUSPIPE_PP_ALGORITHM=nope`` was ``no algorithm named 'nope'``, and
``PRIMUSPIPE_OFFLOAD_FRACTION=2``, ``PRIMUSPIPE_COMMUNICATION_METHOD=x``, ``PRIMUSPIPE_PP_MAX_MEM=0``,
``PRIMUSPIPE_PP_COST_F=[1,-2]``, ``PRIMUSPIPE_ALGORITHM_OPTIONS={"zz": 1}``, ... did not say which variable
or file held them. Round thirteen: an ``algorithm_options.cost`` neither a cost file's path nor its mapping (a list,
a number, a switch) passed ``install()`` and was refused on every rank at the first step (a list as a TypeError)."""

import json
import os

import pytest

from hostile_support import refused, run_api
from primuspipe.backends.megatron.config import _ENV_NAMES
from primuspipe.backends.megatron.install import install

FILE_IN_THE_WAY = "{tmp}/a_file/dumps"
BAD = {
    "pp_algorithm": ["nope", "GPIPE", "1f1b ", "ｇｐｉｐｅ", "zb_h1", "auto2"],
    "algorithm_options": [{"zz": 1}, {"microbatch_group_size": 0}, {"microbatch_group_size": "x"},
                          {"cost": "{tmp}/no_such_cost.yaml"}, {"memory_limit": -1}, {"costs": {}},
                          {"cost": [1]}, {"cost": [[1, 2]]}, {"cost": 5}, {"cost": 1.5}, {"cost": True}],
    "communication_method": ["x", "batch_p2p", "ASYNC_P2P", " async_p2p"],
    "offload_ops": ["zz", "attn,zz", "ATTN"],
    "offload_fraction": [2, 1.5, 0, -0.5],
    "pp_cost_f": [[1, -2], -1, [0.5, -0.0001], []],
    "pp_cost_b": [[-1], -3, []],
    "pp_cost_w": [[1, 2, -3]],
    "pp_max_mem": [0, -3, [1, 2]],
    "offload": [True],
    "dump_dir": ["", FILE_IN_THE_WAY],
}
"""Per setting, values its reader takes (the right type) that a later check refuses."""

WITH = {"offload": {"pp_max_mem": None}, "dump_dir": {"dump_pp_data": True},
        "offload_ops": {"offload": True, "pp_max_mem": 2, "offload_fraction": 0.5}}
"""Settings a case needs beside its own so the checked combination is reached (given by the same source)."""

CASES = [(name, value) for name, values in BAD.items() for value in values]


def _fill(value, tmp):
    text = json.dumps(value) if not isinstance(value, str) else value
    return json.loads(text.replace("{tmp}", str(tmp))) if not isinstance(value, str) else text.replace("{tmp}", str(tmp))


def _env_text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return value if isinstance(value, str) else json.dumps(value)


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "a_file").write_text("in the way of a folder")
    return tmp_path


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v}" for n, v in CASES])
@pytest.mark.parametrize("source", ["environment", "config file", "install override"])
def test_refusal_names_the_source(name, value, source, tmp, monkeypatch):
    for var in [v for v in os.environ if v.upper().startswith("PRIMUSPIPE_")]:
        monkeypatch.delenv(var)
    settings = {"patch_primus_pipeline": True, **{k: v for k, v in WITH.get(name, {}).items() if v is not None},
                name: _fill(value, tmp)}
    if source == "environment":
        for key, v in settings.items():
            monkeypatch.setenv(_ENV_NAMES[key], _env_text(v))
        names = [_ENV_NAMES[name]]
        outcome = run_api(install)
    elif source == "config file":
        path = tmp / "primuspipe.yaml"
        path.write_text(json.dumps(settings))  # JSON is YAML
        monkeypatch.setenv("PRIMUSPIPE_CONFIG", str(path))
        names = [str(path)]
        outcome = run_api(install)
    else:  # the caller's value replaces a valid one the environment gave: the variable is not to blame
        monkeypatch.setenv(_ENV_NAMES["pp_algorithm"], "1f1b")
        names = [name]
        outcome = run_api(install, **settings)
    refused(outcome, *names, case=f"{source} {name}={value}")
    if source == "install override":
        assert "PRIMUSPIPE_" not in outcome.message, f"an override's refusal names a variable: {outcome.message}"
