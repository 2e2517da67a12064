"""Every ``PRIMUSPIPE_*`` variable the code reads, listed from the code (the Megatron config's settings, the
re-planning variables, the projection's worker count, the NCCL emulation mode, the config file's name), at the
values an environment can hold by accident: empty, blank, padded, other scripts' digits (``３``, ``٣``, ``²``),
signs, hex, exponents, NaN and infinities, huge counts, control characters, very long text, JSON of the wrong
shape. Each reader either takes the value (sound) or refuses it in one line naming the variable -- never a
traceback or a line that does not say which variable to fix.

Defects this family found: ``PRIMUSPIPE_PROJECT_WORKERS=²`` passed ``str.isdigit`` and then raised int()'s
ValueError (and ``３`` ran three workers, where every other count takes ASCII digits only);
``PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS=nosuch`` and a ``PRIMUSPIPE_CONFIG`` naming no file were refused through the
Megatron config without the variable's name; ``PRIMUSPIPE_PP_COST_F=[]`` was taken (refused on every rank at the
first step instead)."""

import pytest

from hostile_support import Outcome, accepted, refused, run_api
from primuspipe.backends.megatron.config import _ENV_NAMES, load_config
from primuspipe.calibration.replan import ENV_NAMES as REPLAN_NAMES, ReplanSettings
from primuspipe.projection.projection import WORKERS_VARIABLE, project_workers
from primuspipe.runtime import nccl_emulation

VALUES = ["", " ", "\t", " 1 ", "0", "-1", "-0", "+1", "1.0", "1e3", "0x10", "1_000", "３", "٣", "²", "nan", "NaN",
          "inf", "-inf", "1e309", "99999999999999999999999", "true", "TRUE", "null", "[]", "{}", "[1, 2]",
          '{"a": 1}', "\x1b[31m", "a\nb", "é", "x" * 5000, "1ms", "50%"]
"""Values an environment variable may hold by accident."""


def _config(env):
    load_config(env={"PRIMUSPIPE_PATCH": "1", **env}).check()


def _workers(env, monkeypatch):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    project_workers(4)


def _nccl(env, monkeypatch):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    nccl_emulation.mode()


READERS = [*((var, "Megatron config", _config) for var in sorted(set(_ENV_NAMES.values()) - {"PRIMUSPIPE_PATCH"})),
           ("PRIMUSPIPE_PATCH", "Megatron config", lambda env: load_config(env=env)),
           ("PRIMUSPIPE_CONFIG", "Megatron config", lambda env: load_config(env=env)),
           *((var, "TorchPipeline default", lambda env: ReplanSettings.from_env({REPLAN_NAMES["enabled"]: "1", **env}))
             for var in sorted(REPLAN_NAMES.values()) if var != REPLAN_NAMES["enabled"]),
           (WORKERS_VARIABLE, "project", _workers), (nccl_emulation.ENV, "CPU run", _nccl)]
CASES = [(var, reader, fn, value) for var, reader, fn in READERS for value in VALUES]


@pytest.mark.parametrize("var, reader, fn, value", CASES,
                         ids=[f"{r}-{v}={ascii(x)[:14]}" for v, r, _, x in CASES])
def test_taken_or_refused_naming_the_variable(var, reader, fn, value, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a dump_dir or config path the value names stays in the case's folder
    needs_monkeypatch = fn in (_workers, _nccl)
    outcome = run_api(fn, {var: value}, monkeypatch) if needs_monkeypatch else run_api(fn, {var: value})
    case = f"{reader} {var}={ascii(value)[:20]}"
    if outcome.kind == "silent":
        accepted(Outcome("silent", 0, ""), case=case)
    else:
        refused(outcome, var, case=case)
