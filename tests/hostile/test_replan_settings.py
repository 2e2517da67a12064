"""Issue 27's ``auto_replan`` settings from every entry point -- the :class:`ReplanSettings` a ``TorchPipeline`` or
a caller passes, the ``PRIMUSPIPE_AUTO_REPLAN*`` environment variables (``TorchPipeline``'s default), the Megatron
config file and its environment, ``install()``'s :class:`PrimusPipeConfig` -- at negative, NaN, infinite, huge,
fractional and non-numeric values. Each is refused in one line naming the setting as that entry point spells it.
Defects this family found: ``ReplanSettings(enabled="no")`` kept the text, which is truthy (re-planning on);
step counts had no bound (``1e30`` warm-up steps: a run that measures for ever); ``algorithms=5`` was a
TypeError; a config's ``auto_replan_steps: 0`` and memory limits were refused without the file's name, and
``PrimusPipeConfig``'s under the settings object's names; ``PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS`` refusals did not
name the variable; a ``TorchPipeline`` whose candidates are of another layout was refused only at its first step."""

import pytest
import torch

from hostile_support import accepted, record, refused, run_api, Outcome
from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.megatron.config import PrimusPipeConfig, load_config
from primuspipe.calibration.replan import ENV_NAMES, ReplanSettings

COUNTS = ["warmup_steps", "measure_steps", "verify_steps"]
CONFIG_KEYS = {"warmup_steps": "auto_replan_warmup", "measure_steps": "auto_replan_steps",
               "verify_steps": "auto_replan_verify", "threshold": "auto_replan_threshold",
               "memory_limit_bytes": "auto_replan_memory_limit", "algorithms": "auto_replan_algorithms"}
BAD = {
    "count": [-1, 2.5, float("nan"), float("inf"), True, "abc", None, 10**30, 100_001, [3]],
    "threshold": [-0.1, 1.5, float("nan"), float("inf"), True, "x", None, 1e300],
    "memory_limit_bytes": [0, -1, float("nan"), float("inf"), True, "x", [1e9]],
    "probe": [-1, 2.5, float("nan"), True, "x", None],
    "algorithms": ["", ",", "nosuch", "1f1b,,zb-h1", 5, ["1f1b", 3]],
    "enabled": ["maybe", 2, None, 1.5],
}
BAD_TEXT = {
    "count": ["-1", "2.5", "nan", "inf", "abc", "", "1e30", "100001", "99999999999999999999", "１", "0x10"],
    "threshold": ["-0.1", "1.5", "nan", "inf", "x", "", "1e999"],
    "memory_limit_bytes": ["nan", "inf", "-1", "0", "x", "80GB", ""],
    "algorithms": [",", "nosuch", "1f1b,,zb-h1"],
    "enabled": ["maybe", "2", "-1"],
}
BAD_YAML = {
    "count": ["-1", "2.5", ".nan", ".inf", "abc", "1.0e300", "100001", "[1]", "{a: 1}", "true"],
    "threshold": ["-0.1", "1.5", ".nan", ".inf", "abc", "true", "[0.1]"],
    "memory_limit_bytes": [".nan", ".inf", "-1", "0", "abc", "80", "true"],
    "algorithms": ["5", "nosuch", "[1f1b]", "','"],
}


def _kind(field: str) -> str:
    return "count" if field in COUNTS else field


def _api_cases():
    return [(f, v) for f in [*COUNTS, "threshold", "memory_limit_bytes", "probe", "algorithms", "enabled"]
            for v in BAD[_kind(f)]]


@pytest.mark.parametrize("field, value", _api_cases(), ids=str)
def test_settings_object(field, value):
    """What ``TorchPipeline(auto_replan=ReplanSettings(...))`` and the re-planner take."""
    settings = {"enabled": True, field: value}
    name = "auto_replan" if field == "enabled" else field
    refused(run_api(ReplanSettings, **settings), name, case=f"ReplanSettings {field}={value!r}")


def test_enabled_text_means_what_it_says():
    """``enabled="no"`` kept the text, which is truthy: re-planning ran though the caller said no."""
    outcome = run_api(lambda: ReplanSettings(enabled="no").enabled is False or (_ for _ in ()).throw(AssertionError))
    record("sound" if outcome.kind == "silent" else outcome.kind, "ReplanSettings enabled='no'")
    assert outcome.kind == "silent", outcome.message
    assert ReplanSettings(enabled="no").enabled is False and ReplanSettings(enabled="yes").enabled is True


def _env_cases():
    return [(f, v) for f in [*COUNTS, "threshold", "memory_limit_bytes", "algorithms", "enabled"]
            for v in BAD_TEXT[_kind(f)]]


@pytest.mark.parametrize("field, text", _env_cases(), ids=str)
@pytest.mark.parametrize("reader", ["TorchPipeline default", "Megatron environment"])
def test_environment(field, text, reader):
    var = ENV_NAMES[field]
    env = {ENV_NAMES["enabled"]: "1", var: text}
    if reader == "TorchPipeline default":
        outcome = run_api(ReplanSettings.from_env, env)
    else:
        outcome = run_api(lambda: load_config(None, env=env).replan_settings())
    refused(outcome, var if reader == "TorchPipeline default" or field != "algorithms" else "auto_replan",
            case=f"{reader} {var}={text!r}")


def _yaml_cases():
    return [(f, v) for f in [*COUNTS, "threshold", "memory_limit_bytes", "algorithms"] for v in BAD_YAML[_kind(f)]]


@pytest.mark.parametrize("field, text", _yaml_cases(), ids=str)
def test_config_file(tmp_path, field, text):
    key = CONFIG_KEYS[field]
    path = tmp_path / "primuspipe.yaml"
    path.write_text(f"patch_primus_pipeline: true\nauto_replan: true\n{key}: {text}\n")
    outcome = refused(run_api(load_config, path, env={}), "auto_replan" if field == "algorithms" else key,
                      case=f"config {key}: {text}")
    if field != "algorithms":
        assert "primuspipe.yaml" in outcome.message, outcome.message


@pytest.mark.parametrize("field, value", [(f, v) for f in COUNTS for v in (-1, 10**30, float("nan"), "x")]
                         + [("threshold", v) for v in (2.0, float("inf"))]
                         + [("memory_limit_bytes", v) for v in (80, float("nan"))], ids=str)
def test_install_options(field, value):
    """``install(PrimusPipeConfig(...))``: the config object checks its settings when made."""
    key = CONFIG_KEYS[field]
    refused(run_api(PrimusPipeConfig, True, "1f1b", auto_replan=True, **{key: value}), key,
            case=f"PrimusPipeConfig {key}={value!r}")


@pytest.mark.parametrize("settings", [
    {"warmup_steps": 0, "measure_steps": 1, "verify_steps": 0}, {"measure_steps": 100_000}, {"threshold": 0.0},
    {"threshold": 1.0}, {"memory_limit_bytes": 1e300}, {"probe": 0}, {"probe": 10**30},
    {"algorithms": " 1f1b , zb-h1 "}])
def test_edges_are_accepted(settings):
    accepted(Outcome("silent" if run_api(ReplanSettings, True, **settings).kind == "silent" else "refused", 0, ""),
             case=f"ReplanSettings {settings}")


@pytest.mark.parametrize("option, env, names", [
    ("yes", {}, ["auto_replan"]), (1, {}, ["auto_replan"]), (0.0, {}, ["auto_replan"]), ({}, {}, ["auto_replan"]),
    (None, {"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_STEPS": "0"}, ["PRIMUSPIPE_AUTO_REPLAN_STEPS"]),
    (None, {"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_WARMUP": "1e30"}, ["PRIMUSPIPE_AUTO_REPLAN_WARMUP"]),
    (None, {"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_THRESHOLD": "nan"},
     ["PRIMUSPIPE_AUTO_REPLAN_THRESHOLD"]),
    (None, {"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS": "zbv"}, ["zbv"]),
])
def test_torch_pipeline_option(one_rank_group, monkeypatch, option, env, names):
    """``TorchPipeline(auto_replan=...)``: True/False or settings, else the environment; a candidate of another
    layout (zbv for an interleaved table) is refused at construction, before any step."""
    from primuspipe.backends.torch import TorchPipeline

    for var, text in env.items():
        monkeypatch.setenv(var, text)
    table = build_schedule("1f1b", 1, 4)
    refused(run_api(TorchPipeline, table, {0: torch.nn.Linear(4, 4)}, loss_fn=torch.nn.functional.mse_loss,
                    auto_replan=option), *names, case=f"TorchPipeline auto_replan={option!r} env={env}")
