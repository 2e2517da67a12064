"""primuspipe's Megatron settings (YAML + environment) and the Megatron flags it refuses."""

import importlib.util

import pytest

from primuspipe.backends.megatron.config import PrimusPipeConfig, load_config
from primuspipe.errors import ConfigError, UnknownAlgorithmError


def test_yaml_then_environment_overrides(tmp_path):
    path = tmp_path / "pp.yaml"
    path.write_text("patch_primus_pipeline: true\npp_algorithm: gpipe\nalgorithm_options: {microbatch_group_size: 4}\n"
                    "watchdog_timeout_s: 12\n")
    cfg = load_config(path, env={"PRIMUSPIPE_PP_ALGORITHM": "interleaved-1f1b", "PRIMUSPIPE_DUMP_PP_DATA": "yes"})
    assert cfg == PrimusPipeConfig(True, "interleaved-1f1b", {"microbatch_group_size": 4}, True, "pp_data", 12.0)
    assert load_config(env={"PRIMUSPIPE_CONFIG": str(path)}).pp_algorithm == "gpipe"
    assert load_config(env={}) == PrimusPipeConfig() and not PrimusPipeConfig().patch_primus_pipeline
    assert load_config(env={"PRIMUSPIPE_ALGORITHM_OPTIONS": '{"a": 1}'}).algorithm_options == {"a": 1}
    assert PrimusPipeConfig().algorithm_for(1) == "1f1b" and PrimusPipeConfig().algorithm_for(2) == "interleaved-1f1b"


@pytest.mark.parametrize("text,env,match", [
    ("pp_algoritm: gpipe\n", {}, "unknown key"),
    ("", {"PRIMUSPIPE_PATCH": "maybe"}, "PRIMUSPIPE_PATCH.*not a boolean"),
    ("", {"PRIMUSPIPE_WATCHDOG_TIMEOUT_S": "-1"}, "watchdog_timeout_s"),
    ("- a list\n", {}, "expected a mapping"),
])
def test_bad_settings_are_config_errors(tmp_path, text, env, match):
    path = tmp_path / "pp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path, env=env)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
class TestMegatronFlags:
    @pytest.fixture(scope="class")
    def make_config(self):
        from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
        from primuspipe.testing.megatron.tiny_models import TINY_MODELS, transformer_config

        enable_cpu_mode()
        return lambda **kw: transformer_config(TINY_MODELS["tiny-gpt"], 2, 1, **kw)

    @pytest.mark.parametrize("flag,value", [("variable_seq_lengths", True),
                                            ("num_microbatches_with_partial_activation_checkpoints", 2)])
    def test_incompatible_flag_is_named(self, make_config, flag, value):
        from primuspipe.backends.megatron.compat import check_megatron_config
        from primuspipe.algorithms.build import build_schedule

        table = build_schedule("1f1b", pp=2, microbatches=4)
        check_megatron_config(make_config(), table, [object()])
        config = make_config()
        setattr(config, flag, value)  # after __post_init__, which refuses some combinations on its own
        with pytest.raises(ConfigError, match=flag):
            check_megatron_config(config, table, [object()])

    def test_tables_megatron_cannot_run(self, make_config):
        from primuspipe.backends.megatron.compat import check_megatron_config
        from primuspipe.passes.communication import add_communication
        from primuspipe.ir.node import BW, F
        from primuspipe.ir.placement import Placement
        from primuspipe.algorithms.build import build_schedule
        from primuspipe.ir.table import ScheduleTable
        from primuspipe.passes.validation import validate

        rows = [[F(0, 0), F(1, 0), F(0, 1), F(1, 1), BW(0, 1), BW(1, 1), BW(0, 0), BW(1, 0)] for _ in range(2)]
        vshape = validate(add_communication(ScheduleTable.build(Placement.vshape(2), 2, rows)))
        with pytest.raises(ConfigError, match="interleaved"):
            check_megatron_config(make_config(), vshape, [object(), object()])
        swapped = [[F(1, 0), F(0, 0), BW(1, 0), BW(0, 0)] for _ in range(2)]
        table = validate(add_communication(ScheduleTable.build(Placement.interleaved(2), 2, swapped)))
        with pytest.raises(ConfigError, match="microbatch order"):
            check_megatron_config(make_config(), table, [object()])
        with pytest.raises(ConfigError, match="vpp=1"):
            check_megatron_config(make_config(), build_schedule("1f1b", pp=2, microbatches=2), [object(), object()])

    def test_install_rejects_unknown_algorithm(self):
        from primuspipe.backends.megatron import install, is_installed

        with pytest.raises(UnknownAlgorithmError):
            install(PrimusPipeConfig(True, "no-such-schedule"))
        assert not is_installed()
