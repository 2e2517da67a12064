"""--megatron-config never drops an argument silently: every one is modelled, set aside as unable to
change time or memory, or refused (typos with the closest Megatron name); the GPU count comes from the
launcher or must be given; Primus model files are followed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from primuspipe.cli import main
from primuspipe.projection.framework import ConfigError, PrimusPipeError
from primuspipe.projection.megatron_args import read_arguments, read_megatron_config, split_arguments
from primuspipe.projection.megatron_flag_names import MEGATRON_FLAGS
from primuspipe.projection.megatron_flags import defined_flags

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
MODEL_ARGS = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
              "--vocab-size 1000 --micro-batch-size 1 --global-batch-size 16 --bf16 ")


def test_the_shipped_flag_list_is_megatrons():
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "training" / "arguments.py").is_file():
        pytest.skip("this megatron-core has no training/arguments.py")
    assert defined_flags(root) == MEGATRON_FLAGS


def test_typos_and_unmodelled_arguments_are_refused_together():
    with pytest.raises(ConfigError, match=r"run.sh: --pipeline-model-paralel-size is not a Megatron argument "
                                          r"\(did you mean --pipeline-model-parallel-size\?\); --cpu-offloading changes"):
        read_arguments(MODEL_ARGS + "--pipeline-model-paralel-size 4 --cpu-offloading", "run.sh")


def test_cuda_graph_and_capacity_arguments_are_modelled():
    t = read_arguments(MODEL_ARGS + "--cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router", "r").training
    assert (t.cuda_graph_impl, t.cuda_graph_modules) == ("transformer_engine", ("attn", "moe_router"))
    assert read_arguments(MODEL_ARGS + "--enable-cuda-graph", "r").training.cuda_graph_impl == "local"
    assert read_arguments(MODEL_ARGS + "--external-cuda-graph", "r").training.cuda_graph_impl == "transformer_engine"
    t = read_arguments(MODEL_ARGS + "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity", "r").training
    assert (t.moe_expert_capacity_factor, t.moe_pad_expert_input_to_capacity) == (1.0, True)


def test_expert_gemms_run_as_megatron_builds_them():
    moe = MODEL_ARGS + "--num-experts 8 --expert-model-parallel-size 2 --moe-router-topk 2 "
    assert read_arguments(moe, "r").training.moe_expert_gemm == "sequential"  # SequentialMLP, Megatron's default
    assert read_arguments(moe + "--moe-grouped-gemm", "r").training.moe_expert_gemm == "multi_stream"  # TEGroupedMLP
    config = split_arguments(
        {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
         "max_position_embeddings": 128, "vocab_size": 1000, "num_experts": 8, "moe_grouped_gemm": True,
         "moe_expert_gemm": "fused", "gpu_max_hw_queues": 2}, "primus.yaml")
    assert (config.training.moe_expert_gemm, config.training.gpu_max_hw_queues) == ("fused", 2)  # a field named wins


@pytest.mark.parametrize("flag", ["--moe-router-padding-for-fp8", "--moe-router-padding-for-quantization"])
def test_fp8_padding_arguments_decide_whether_the_experts_copy(flag):
    moe = MODEL_ARGS + "--num-experts 8 --expert-model-parallel-size 2 --moe-router-topk 2 --fp8-format e4m3 "
    assert read_arguments(moe + flag, "r").training.moe_router_padding_for_quantization
    assert not read_arguments(moe, "r").training.moe_router_padding_for_quantization
    flex = moe + "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep"
    assert read_arguments(flex, "r").training.moe_flex_dispatcher_backend == "hybridep"


def test_settings_that_change_time_are_modelled_and_the_rest_set_aside():
    config = read_arguments(MODEL_ARGS + "--tp-comm-overlap --overlap-param-gather --mtp-num-layers 1 "
                            "--fp8-format hybrid --fp8-recipe tensorwise --recompute-activations "
                            "--account-for-embedding-in-pipeline-split --lr 3e-4 --data-path /d --log-interval 1", "run")
    t = config.training
    assert (t.tp_comm_overlap, t.overlap_param_gather, t.mtp_num_layers, t.fp8_format, t.fp8_recipe) == (
        True, True, 1, "hybrid", "tensorwise")
    assert t.recompute_granularity == "selective" and t.account_for_embedding_in_pipeline_split
    assert set(config.no_effect) == {"lr", "data_path", "log_interval"}
    layout = read_arguments(MODEL_ARGS + "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*4|t*4L'", "r")
    assert layout.training.pipeline_model_parallel_layout == "Et*4|t*4L"


def test_the_fused_losss_implementation_is_read():
    """``--cross-entropy-fusion-impl`` decides what the fused loss moves (it was set aside as without effect)."""
    native = read_arguments(MODEL_ARGS + "--cross-entropy-loss-fusion", "r")
    assert native.training.cross_entropy_fusion_impl == "native"
    te = read_arguments(MODEL_ARGS + "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te", "r")
    assert te.training.cross_entropy_fusion_impl == "te" and not te.no_effect


def test_gradient_accumulation_fusion_is_megatrons_default_and_turned_off_as_megatron_and_primus_write_it():
    assert read_arguments(MODEL_ARGS, "r").training.gradient_accumulation_fusion
    off = read_arguments(MODEL_ARGS + "--no-gradient-accumulation-fusion", "r")
    assert not off.training.gradient_accumulation_fusion and not off.no_effect
    primus = split_arguments({"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                              "vocab_size": 1000, "gradient_accumulation_fusion": False}, "primus.yaml")
    assert not primus.training.gradient_accumulation_fusion


def test_the_launcher_gives_the_gpu_count_else_it_must_be_asked(tmp_path, capsys):
    config = read_arguments("torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py " + MODEL_ARGS
                            + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", "run")
    assert (config.world_size, config.training.data_parallel_size) == (16, 4)
    assert read_arguments(MODEL_ARGS, "run").world_size is None
    script = tmp_path / "run.sh"
    script.write_text(MODEL_ARGS)
    hardware = str(EXAMPLES / "hardware" / "h100.yaml")
    assert main(["project", "--megatron-config", str(script), "--hardware", hardware, "-a", "1f1b"]) != 0
    assert "give --target-nodes N" in capsys.readouterr().err
    assert main(["project", "--megatron-config", str(script), "--hardware", hardware, "-a", "1f1b",
                 "--target-nodes", "2", "--json"]) == 0


def test_primus_model_files_and_their_bases_are_followed(tmp_path):
    models = tmp_path / "configs" / "models" / "megatron"
    models.mkdir(parents=True)
    (models / "base.yaml").write_text(yaml.safe_dump({"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                                                      "seq_length": 128, "vocab_size": 1000, "swiglu": True}))
    (models / "tiny.yaml").write_text(yaml.safe_dump({"bases": ["base.yaml"], "num_layers": 8}))
    exp = tmp_path / "experiments" / "exp.yaml"
    exp.parent.mkdir()
    exp.write_text(yaml.safe_dump({"work_group": "x", "modules": {"pre_trainer": {
        "framework": "megatron", "config": "pre_trainer.yaml", "model": "${PRIMUS_MODEL:tiny}.yaml",
        "overrides": {"micro_batch_size": 1, "global_batch_size": 16, "pipeline_model_parallel_size": "${PP:2}",
                      "bf16": True, "recompute_num_layers": 0, "recompute_granularity": "selective",
                      "recompute_modules": ["layernorm", "moe_act"]}}}}))
    config = read_megatron_config(exp)
    assert (config.model.num_layers, config.model.swiglu, config.training.pp) == (8, True, 2)
    assert config.training.recompute_modules == ("layernorm", "moe_act") and config.training.recompute_num_layers is None
    (models / "tiny.yaml").unlink()
    with pytest.raises(ConfigError, match="model 'tiny.yaml' not found"):
        read_megatron_config(exp)


def test_megatron_fsdp_sharding_is_modelled_and_an_unknown_strategy_refused():
    config = read_arguments(MODEL_ARGS + "--use-megatron-fsdp --use-distributed-optimizer "
                            "--data-parallel-sharding-strategy optim_grads", "run")
    assert config.training.shards_gradients and not config.training.shards_weights
    zero3 = read_arguments(MODEL_ARGS + "--use-megatron-fsdp --use-distributed-optimizer "
                           "--data-parallel-sharding-strategy optim_grads_params", "run")
    assert zero3.training.shards_gradients and zero3.training.shards_weights
    with pytest.raises(PrimusPipeError, match="data_parallel_sharding_strategy"):
        read_arguments(MODEL_ARGS + "--use-megatron-fsdp --use-distributed-optimizer "
                       "--data-parallel-sharding-strategy optim_grads_param", "run")


def test_first_last_layers_bf16_is_read_with_its_layer_counts():
    config = read_arguments(MODEL_ARGS + "--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 "
                            "--num-layers-at-end-in-bf16 2", "run")
    t = config.training
    assert (t.first_last_layers_bf16, t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16) == (True, 1, 2)
    assert t.bf16_layers(8) == {0, 6, 7}


def test_primus_moe_features_are_modelled_and_turbo_kernels_refused_when_on():
    """Primus's MoE switches as its run scripts pass them (examples/moe_package/run_deepseek_v2_lite_pretrain_mi355x.sh)
    are training fields; Primus-Turbo kernels the projection does not time are refused when turned on and set
    aside when left off; a mistyped Primus name gets the closest one."""
    primus = ("--enable_primus_turbo True --use_turbo_deepep True --turbo_deepep_num_cu 64 "
              "--turbo_deepep_use_comm_stream False --moe_router_dtype fp32 --turbo_sync_free_moe_stage 1 "
              "--use_turbo_attention False --turbo_gemm_backend default --expert_model_parallel_size 8 "
              "--num_moe_experts 8 --moe_ffn_hidden_size 128 --moe_router_topk 2 --manual_gc True ")
    config = read_arguments(MODEL_ARGS + primus, "run.sh")
    t = config.training
    assert (t.enable_primus_turbo, t.use_turbo_deepep, t.turbo_sync_free_moe_stage, t.moe_token_dispatcher_type) == (
        True, True, 1, "flex")
    assert t.moe_use_fused_router_with_aux_score and t.moe_permute_fusion and not t.moe_syncs_free
    assert t.turbo_deepep_num_cu == 64 and t.dispatcher_sms == 64
    assert {"turbo_deepep_use_comm_stream", "use_turbo_attention", "turbo_gemm_backend",
            "manual_gc"} <= set(config.no_effect)
    with pytest.raises(ConfigError, match="--use-turbo-attention changes time or memory"):
        read_arguments(MODEL_ARGS + primus.replace("--use_turbo_attention False", "--use_turbo_attention True"), "r")
    with pytest.raises(ConfigError, match=r"--use-turbo-deeep is not a Megatron argument \(did you mean --use-turbo-deepep\?\)"):
        read_arguments(MODEL_ARGS + "--use_turbo_deeep True", "r")
    with pytest.raises(PrimusPipeError, match="enable_primus_turbo"):
        read_arguments(MODEL_ARGS + "--turbo_sync_free_moe_stage 1", "r")
    fused = read_arguments(MODEL_ARGS + "--moe-permute-fusion --moe-router-fusion", "r").training
    assert fused.moe_permute_fusion and fused.moe_router_fusion


def test_primus_bookkeeping_is_set_aside_and_the_legacy_grouped_gemm_switch_read():
    """Primus's own logging and resuming keys cannot change a step; its legacy grouped GEMM (the
    ``grouped_gemm`` package) takes the same 4-stream path as TE's, either way, and is read (its expert gradients
    are accumulated outside the GEMM). (Group-limited routing, once set aside here, is modelled:
    test_group_routing.py.)"""
    for legacy in ("False", "True"):
        config = read_arguments(MODEL_ARGS + "--stderr_sink_level DEBUG --auto_continue_train False "
                                "--disable_last_saving True --mlflow_run_name x --moe-grouped-gemm "
                                f"--moe_use_legacy_grouped_gemm {legacy} "
                                "--moe_router_force_load_balancing_type even", "r")
        assert set(config.no_effect) == {"stderr_sink_level", "auto_continue_train", "disable_last_saving",
                                         "mlflow_run_name"}
        assert config.training.moe_router_force_load_balancing_type == "even"  # read: test_primus_round_robin.py
        assert config.training.moe_expert_gemm == "multi_stream"
        assert config.training.moe_use_legacy_grouped_gemm == (legacy == "True") == config.training.legacy_grouped_mlp


LOCAL = "--transformer-impl local --no-masked-softmax-fusion"


@pytest.mark.parametrize("flags, backend", [("", "flash"), ("--transformer-impl transformer_engine", "flash"),
                                            (LOCAL, "local"), (LOCAL + " --attention-backend flash", "local")])
def test_the_local_layer_spec_runs_megatrons_own_unfused_attention(flags, backend):
    """``--transformer-impl local`` builds megatron-core's local spec, whose attention is its own unfused
    DotProductAttention whatever --attention-backend says: priced and kept as the ``local`` backend."""
    assert read_arguments(MODEL_ARGS + flags, "run.sh").training.attention_backend == backend


@pytest.mark.parametrize("flags, fp32", [("", False), (" --attention-softmax-in-fp32", True),
                                         (" --apply-query-key-layer-scaling", True)])
def test_the_local_specs_softmax_runs_in_fp32_only_when_megatron_is_told(flags, fp32):
    """Megatron-LM's ``--attention-softmax-in-fp32`` is off by default (``--apply-query-key-layer-scaling`` turns it
    on): the local spec's softmax then runs in the activations' dtype, which moves and holds other bytes."""
    config = read_arguments(MODEL_ARGS + LOCAL + flags, "run.sh")
    assert config.training.attention_softmax_in_fp32 is fp32
    assert not set(config.no_effect) & {"no_masked_softmax_fusion", "attention_softmax_in_fp32",
                                        "apply_query_key_layer_scaling"}  # they matter here


@pytest.mark.parametrize("flags, message", [
    (LOCAL + " --fp8-format hybrid", r"run.sh: --transformer-impl local with FP8"),
    ("--transformer-impl local", r"run.sh: --transformer-impl local with Megatron's fused masked softmax"),
    ("--transformer-impl inference_optimized", r"run.sh: --transformer-impl inference_optimized: only"),
])
def test_layer_implementations_megatron_cannot_train_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        read_arguments(MODEL_ARGS + flags, "run.sh")


PRIMUS_MODEL = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128, "vocab_size": 1000}


def test_arguments_written_at_megatrons_default_are_set_aside_and_others_refused():
    """Primus's language_model.yaml writes every argument out; at Megatron's default (null, a store_true switch off,
    cp_comm_type p2p) it changes nothing; set otherwise it is refused, and so is false for a switch that is on by
    default (it has a --no- form)."""
    quiet = split_arguments({**PRIMUS_MODEL, "fp32_residual_connection": False, "cp_comm_type": "p2p",
                             "hierarchical_context_parallel_sizes": None, "moe_token_drop_policy": "probs"}, "m.yaml")
    assert {"fp32_residual_connection", "cp_comm_type", "moe_token_drop_policy"} <= set(quiet.no_effect)
    for name, value in [("fp32_residual_connection", True), ("cp_comm_type", "a2a"),
                        ("cpu_offloading_activations", False)]:
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} changes time or memory"):
            split_arguments({**PRIMUS_MODEL, name: value}, "m.yaml")


@pytest.mark.parametrize("swiglu, fused", [(True, False), (False, True)])
def test_a_primus_yamls_argparse_destinations_are_read_as_megatron_reads_them(tmp_path, swiglu, fused):
    """``fp8`` is --fp8-format's destination; ``bias_swiglu_fusion: false`` turns the bias-activation fusion off only
    for a SwiGLU model (Megatron's bias_activation_fusion takes the model's own activation's switch)."""
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**PRIMUS_MODEL, "swiglu": swiglu, "bf16": True, "fp8": "hybrid",
                                    "bias_swiglu_fusion": False, "bias_gelu_fusion": True}))
    training = read_megatron_config(path).training
    assert training.fp8_format == "hybrid" and training.bias_activation_fusion is fused


def test_megatron_takes_the_virtual_stages_from_the_layout_and_window_sizes_as_tuples():
    config = read_arguments(MODEL_ARGS + "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                            "'Et*2|t*2|t*2|t*2L' --window-size 127,0", "r")
    assert config.training.virtual_pipeline_model_parallel_size == 2 and config.model.window_size == (127, 0)
    with pytest.raises(ConfigError, match="has 3 stages, not a multiple of --pipeline-model-parallel-size 2"):
        read_arguments(MODEL_ARGS + "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*3|t*3|t*2L'", "r")


def test_a_missing_vocabulary_names_the_tokenizer_and_a_batch_schedule_is_refused():
    with pytest.raises(ConfigError, match=r"no --vocab-size: Megatron reads it from the tokenizer \(--tokenizer-type "
                                          r"Llama2Tokenizer\)"):
        read_arguments(MODEL_ARGS.replace("--vocab-size 1000 ", "") + "--tokenizer-type Llama2Tokenizer", "r")
    with pytest.raises(ConfigError, match="--step-batch-size-schedule sets the global batch step by step"):
        read_arguments(MODEL_ARGS + "--step-batch-size-schedule '0:16 1B:32'", "r")
