"""The auto-replan memory limit a user sets (``PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT``, the Megatron config's
``auto_replan_memory_limit``) is bytes per rank: a figure below 1 MiB -- a limit written in GB or GiB -- left
no candidate fitting, so the run measured, then kept its schedule every time, silently. Refused, naming the
setting; real limits still load."""

import pytest

from hostile_support import record, run_api
from primuspipe.backends.megatron.config import load_config
from primuspipe.calibration.replan import ReplanSettings

TOO_SMALL = ["0.5", "1", "1.5", "80", "192", "1e3", "1048575"]
FINE = ["1048576", "80e9", "1.5e11"]


@pytest.mark.parametrize("value", TOO_SMALL + FINE)
@pytest.mark.parametrize("path", ["environment", "megatron config"])
def test_memory_limit_in_bytes(tmp_path, value, path):
    env = {"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT": value}
    if path == "environment":
        outcome = run_api(ReplanSettings.from_env, env)
        name = "PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT"
    else:
        config = tmp_path / "primuspipe.yaml"
        config.write_text(f"auto_replan: true\nauto_replan_memory_limit: {value}\n")
        outcome = run_api(load_config, config, env={})
        name = "auto_replan_memory_limit"
    case = f"auto_replan memory limit {value} ({path})"
    if value in FINE:
        record("sound" if outcome.kind == "silent" else "refused", case)
        assert outcome.kind == "silent", f"{case}: {outcome.kind}: {outcome.message}"
        return
    record(outcome.kind, case)
    assert outcome.kind == "clear" and name in outcome.message and "bytes" in outcome.message, \
        f"{case}: {outcome.kind}: {outcome.message}"
