"""Issue 27's re-planning variables misspelt the ways people misspell them, generated from each real name (a letter
dropped, an underscore dropped, a plural's ``S`` dropped or added, lower case, ``AUTOREPLAN`` run together), through
both readers: :meth:`ReplanSettings.from_env` (a ``TorchPipeline``'s default) and the Megatron config's
:func:`load_config`. Each is refused in one line naming the variable and the one it misspells.

Defects this family found: ``ReplanSettings.from_env`` read only the names it knows, so
``PRIMUSPIPE_AUTO_REPLAN_STEP=5`` was ignored and the run measured the default 3 steps; both readers ignored a
lower-case name (``primuspipe_auto_replan=1``: re-planning silently off)."""

import pytest

from hostile_support import accepted, Outcome, refused, run_api
from primuspipe.backends.megatron.config import load_config
from primuspipe.calibration.replan import ENV_NAMES, ReplanSettings

VALUES = {"enabled": "1", "warmup_steps": "2", "measure_steps": "3", "verify_steps": "3", "threshold": "0.05",
          "memory_limit_bytes": "8e10", "algorithms": "1f1b,zb-h1"}


def _misspellings(var: str) -> dict[str, str]:
    tail = var[len("PRIMUSPIPE_"):]
    spellings = {"last letter dropped": var[:-1], "lower case": var.lower(),
                 "run together": var.replace("AUTO_REPLAN", "AUTOREPLAN"),
                 "plural": var + "S" if not var.endswith("S") else var[:-1],
                 "underscore dropped": "PRIMUSPIPE_" + tail.replace("_", "", 1)}
    return {how: s for how, s in spellings.items() if s != var}


CASES = [(field, how, wrong) for field, var in sorted(ENV_NAMES.items()) for how, wrong in _misspellings(var).items()]


@pytest.mark.parametrize("field, how, wrong", CASES, ids=[f"{f}-{h}" for f, h, _ in CASES])
@pytest.mark.parametrize("reader", ["TorchPipeline default", "Megatron environment"])
def test_misspelt_variables(field, how, wrong, reader):
    env = {ENV_NAMES["enabled"]: "1", wrong: VALUES[field]} if field != "enabled" else {wrong: "1"}
    if reader == "TorchPipeline default":
        outcome = run_api(ReplanSettings.from_env, env)
    else:
        outcome = run_api(lambda: load_config(None, env=env).replan_settings())
    names = [wrong] + ([ENV_NAMES[field]] if how != "run together" or field == "enabled" else [])
    refused(outcome, *names, case=f"{reader} {wrong}")


@pytest.mark.parametrize("env", [{"PRIMUSPIPE_PATCH": "1"}, {"PRIMUSPIPE_DUMP_DIR": "/tmp/x", "HOME": "/root"},
                                 {var: VALUES[field] for field, var in ENV_NAMES.items()}])
def test_other_settings_beside_them(env):
    """A TorchPipeline's environment holds the Megatron settings too: those are not re-planning's to refuse."""
    outcome = run_api(ReplanSettings.from_env, env)
    accepted(Outcome("silent" if outcome.kind == "silent" else "refused", 0, ""), case=f"from_env {sorted(env)}")
    assert outcome.kind == "silent", outcome.message
