"""Megatron ``install()``: every setting is checked when installing, not on every rank at step 1 --
finite watchdog timeout, a known algorithm taking the given options, a writable dump directory, no
misspelt ``PRIMUSPIPE_*`` variable, a config file that cannot expand (YAML bomb) or hide keys."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from hostile_support import record, refused, run_api  # noqa: E402
from primuspipe.backends.megatron import PrimusPipeConfig, install, is_installed, load_config, uninstall  # noqa: E402
from primuspipe.backends.megatron.config import _FLAGS, SETTINGS  # noqa: E402
from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    enable_cpu_mode()  # megatron's pipeline package imports triton (stubbed in CPU mode)
    for var in [v for v in os.environ if v.startswith("PRIMUSPIPE_")]:
        monkeypatch.delenv(var)
    yield
    uninstall()


@pytest.mark.parametrize("settings, names", [
    ({"watchdog_timeout_s": float("nan")}, ["watchdog_timeout_s", "finite"]),
    ({"watchdog_timeout_s": float("inf")}, ["watchdog_timeout_s", "finite"]),
    ({"watchdog_timeout_s": -1.0}, ["watchdog_timeout_s"]),
    ({"watchdog_timeout_s": "10"}, []),  # text is read as a number: accepted below, not here
    ({"watchdog_timeout_s": True}, ["watchdog_timeout_s"]),
    ({"pp_algorithm": "nosuch"}, ["nosuch"]),
    ({"pp_algorithm": ""}, ["pp_algorithm"]),
    ({"pp_algorithm": "gpipe", "algorithm_options": {"microbatch_group_size": 2}}, ["microbatch_group_size"]),
    ({"pp_algorithm": "interleaved-1f1b", "algorithm_options": {"microbatch_group_size": "4"}}, ["integer"]),
    ({"pp_algorithm": "interleaved-1f1b", "algorithm_options": {"microbatch_group_sise": 4}},
     ["did you mean 'microbatch_group_size'"]),
    ({"algorithm_options": {"p2p_time": 1e-3}}, ["p2p_time"]),
    ({"algorithm_options": [1, 2]}, ["algorithm_options"]),
    ({"dump_pp_data": True, "dump_dir": None}, ["dump_dir"]),
    ({"dump_pp_data": True, "dump_dir": ""}, ["dump_dir"]),
    ({"dump_pp_data": "yes please"}, ["dump_pp_data"]),
    ({"dump_pp_data": 1.5}, ["dump_pp_data"]),
    # values no shape takes, and cost mappings, fail at install, not on every rank at the first step
    ({"pp_algorithm": "interleaved-1f1b", "algorithm_options": {"microbatch_group_size": 0}}, ["microbatch_group_size"]),
    ({"pp_algorithm": "interleaved-1f1b", "algorithm_options": {"microbatch_group_size": -3}},
     ["microbatch_group_size"]),
    ({"pp_algorithm": "zb-h1", "algorithm_options": {"cost": {"compute": {"f": 1, "b": 1}}}}, ["w"]),
    ({"pp_algorithm": "zb-h1", "algorithm_options": {"cost": {"compute": {"f": -1, "b": 1, "w": 1}}}}, ["f"]),
    ({"pp_algorithm": "zb-h1", "algorithm_options": {"cost": {"compute": {"f": 1, "b": 1, "w": 1}, "colour": 1}}},
     ["colour"]),
    ({"pp_algorithm": "zb-h1", "algorithm_options": {"cost": {"compute": {"f": 1e300, "b": 1, "w": 1}}}}, ["1e+12"]),
    ({"pp_algorithm": "zb-h1", "algorithm_options": {"cost": {"compute": {"f": [1, 2, "x"], "b": 1, "w": 1}}}},
     ["f"]),
])
def test_bad_settings(settings, names):
    if settings == {"watchdog_timeout_s": "10"}:
        assert install(PrimusPipeConfig(True, "gpipe", **settings)) is not None and is_installed()
        return
    outcome = refused(run_api(lambda: install(PrimusPipeConfig(True, **settings))), *names, case=f"install {settings}")
    assert not is_installed(), outcome


def test_dump_dir_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("x")
    for where in (tmp_path / "file", tmp_path / "file" / "below"):
        refused(run_api(install, PrimusPipeConfig(True, "1f1b", dump_pp_data=True, dump_dir=str(where))), "dump_dir",
                case=f"install dump_dir {where.name}")
    assert not is_installed()


@pytest.mark.parametrize("env, names", [
    ({"PRIMUSPIPE_PP_ALGORTHM": "gpipe"}, ["PRIMUSPIPE_PP_ALGORTHM", "did you mean PRIMUSPIPE_PP_ALGORITHM"]),
    ({"PRIMUSPIPE_WATCHDOG_TIMEOUT": "5"}, ["did you mean PRIMUSPIPE_WATCHDOG_TIMEOUT_S"]),
    ({"PRIMUSPIPE_DUMPDIR": "/tmp"}, ["PRIMUSPIPE_DUMPDIR"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_WATCHDOG_TIMEOUT_S": "nan"}, ["PRIMUSPIPE_WATCHDOG_TIMEOUT_S"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_WATCHDOG_TIMEOUT_S": "inf"}, ["PRIMUSPIPE_WATCHDOG_TIMEOUT_S"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_WATCHDOG_TIMEOUT_S": "３０"}, ["PRIMUSPIPE_WATCHDOG_TIMEOUT_S"]),
    ({"PRIMUSPIPE_PATCH": "2"}, ["PRIMUSPIPE_PATCH"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_ALGORITHM_OPTIONS": "{bad json"}, ["PRIMUSPIPE_ALGORITHM_OPTIONS"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_ALGORITHM_OPTIONS": "[1, 2]"}, ["PRIMUSPIPE_ALGORITHM_OPTIONS"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_ALGORITHM_OPTIONS": '{"a": NaN}'}, ["NaN"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_PP_ALGORITHM": "zb-h1", "PRIMUSPIPE_ALGORITHM_OPTIONS": '{"x": 1}'},
     ["'x'"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_DUMP_PP_DATA": "1", "PRIMUSPIPE_DUMP_DIR": ""}, ["dump_dir"]),
    ({"PRIMUSPIPE_CONFIG": "/nonexistent/pp.yaml"}, ["does not exist"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_PP_COST_W": "[1, NaN]"}, ["pp_cost_w"]),
    ({"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_PP_MAX_MEM": "Infinity"}, ["pp_max_mem"]),
])
def test_environment(monkeypatch, env, names):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    refused(run_api(install), *names, case=f"install env {env}")
    assert not is_installed()


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9))


@pytest.mark.parametrize("text, names", [
    (BOMB, ["aliases"]),
    ("patch_primus_pipeline: true\npp_algoritm: gpipe\n", ["pp_algoritm", "did you mean 'pp_algorithm'"]),
    ("patch_primus_pipeline: true\npatch_primus_pipeline: false\n", ["twice"]),
    ("patch_primus_pipeline: true\nwatchdog_timeout_s: .nan\n", ["watchdog_timeout_s"]),
    ("patch_primus_pipeline: true\nwatchdog_timeout_s: .inf\n", ["watchdog_timeout_s"]),
    ("patch_primus_pipeline: true\ndump_pp_data: true\ndump_dir: null\n", ["dump_dir"]),
    ("patch_primus_pipeline: true\nalgorithm_options: 4\n", ["algorithm_options"]),
    ("- patch_primus_pipeline\n", ["mapping"]),
    ("patch_primus_pipeline: true\npp_cost_f: .nan\n", ["pp_cost_f"]),
    ("patch_primus_pipeline: true\npp_cost_b: [1, .inf]\n", ["pp_cost_b[1]"]),
    ("patch_primus_pipeline: true\npp_max_mem: .nan\n", ["pp_max_mem"]),
    ("patch_primus_pipeline: true\npp_cost_w: fast\n", ["pp_cost_w"]),
    ("patch_primus_pipeline: [" * 64 + "]" * 64 + "\n", ["deep"]),
])
def test_config_file(tmp_path, monkeypatch, text, names):
    path = tmp_path / "primuspipe.yaml"
    path.write_text(text)
    monkeypatch.setenv("PRIMUSPIPE_CONFIG", str(path))
    refused(run_api(install), *names, case=f"install config {text[:24]!r}")
    assert not is_installed()


def test_good_settings_still_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMUSPIPE_PATCH", "1")
    monkeypatch.setenv("PRIMUSPIPE_PP_ALGORITHM", "interleaved-1f1b")
    monkeypatch.setenv("PRIMUSPIPE_ALGORITHM_OPTIONS", '{"microbatch_group_size": 4}')
    monkeypatch.setenv("PRIMUSPIPE_DUMP_PP_DATA", "1")
    monkeypatch.setenv("PRIMUSPIPE_DUMP_DIR", str(tmp_path / "dumps"))
    monkeypatch.setenv("PRIMUSPIPE_DEMO_DIR", "out")  # scripts/demo.sh's, not a setting, not refused
    assert install() is not None and (tmp_path / "dumps").is_dir()
    assert load_config().algorithm_options == {"microbatch_group_size": 4}


def _misspellings(name: str) -> list[str]:
    """The typing slips of a setting's name: a letter dropped, two swapped, one doubled."""
    i = len(name) // 2
    return [name[:i] + name[i + 1:], name[:i] + name[i + 1] + name[i] + name[i + 2:], name[:i] + name[i] + name[i:]]


TYPOS = [(name, typo) for name in SETTINGS for typo in _misspellings(name) if typo not in SETTINGS]


@pytest.mark.parametrize("name, typo", TYPOS, ids=[t for _, t in TYPOS])
def test_misspelt_keywords(name, typo):
    """``install(patch_primus_pipline=True)`` was a TypeError from the dataclass: now one line naming the closest
    setting, for every setting's slips (listed from the settings)."""
    refused(run_api(install, patch_primus_pipeline=True, **{typo: 1}), typo, name, case=f"install({typo}=1)")
    assert not is_installed()


@pytest.mark.parametrize("flag", _FLAGS)
@pytest.mark.parametrize("text, value", [("off", False), ("no", False), ("false", False), ("0", False),
                                          ("on", True), ("yes", True)])
def test_switches_given_as_text_are_read(flag, text, value):
    """A switch given as text in code (as the environment gives it) is read, not kept: ``offload="off"`` stayed the
    text, which is truthy -- the offload pass, the dumps, the debug table ran though switched off."""
    config = PrimusPipeConfig(**{flag: text}, pp_max_mem=2)  # offload: true needs a limit
    record("sound" if getattr(config, flag) is value else "silent", f"PrimusPipeConfig({flag}={text!r})")
    assert getattr(config, flag) is value


@pytest.mark.parametrize("ops, names", [(5, ["offload_ops"]), (["attn", 3], ["offload_ops"]), ({"attn": 1}, ["offload_ops"]),
                                        ("atn", ["'attn'"]), (["attn", "row_paralel_gemm"], ["row_parallel_gemm"])])
def test_offload_ops_values(ops, names):
    """``offload_ops`` of another type was read as its text (``[]`` as the op ``'[]'``); a misspelt op is named with
    the closest."""
    refused(run_api(PrimusPipeConfig, offload_ops=ops), *names, case=f"offload_ops={ops!r}")


def test_offload_ops_as_a_list():
    config = PrimusPipeConfig(offload_ops=["attn", "basic_gemm"])
    record("sound" if config.offload_op_list == ("attn", "basic_gemm") else "refused", "offload_ops as a list")
    assert config.offload_op_list == ("attn", "basic_gemm")


@pytest.mark.parametrize("value", ["", None, 5, "a\nb"])
def test_dump_dir_read_when_dumps_are_off(value):
    """``dump_dir`` was checked only with ``dump_pp_data`` on: ``install(dump_dir=5)`` passed, the config file's
    ``dump_dir: ''`` did not."""
    refused(run_api(PrimusPipeConfig, dump_dir=value), "dump_dir", case=f"dump_dir={value!r}")
