"""Which Megatron arguments the projection reads, which cannot change time or memory, and which it refuses.

An argument list (or a Primus YAML) says much more than the projection needs. Every argument falls in
exactly one class, so none is dropped silently:

* **modelled** -- a model or training field (same name), or one of :data:`ALIASES`;
* **no effect** -- cannot change step time or memory as the projection models them: paths, logging,
  checkpointing, the learning-rate schedule and optimizer hyper-parameters, data loading, evaluation,
  fault tolerance, inference-only and other-model-family settings (:data:`NO_EFFECT_PREFIXES`,
  :data:`NO_EFFECT`); docs/projection.md lists them;
* **refused** -- everything else Megatron defines: it would change time or memory in a way the
  projection does not model, so projecting with it would be a silent wrong answer; the error names it.

Names Megatron does not define at all are refused with the closest defined name (typos).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from primuspipe.projection.megatron_flag_names import MEGATRON_FLAGS

ALIASES = {
    "disable_bias_linear": ("model", "add_bias_linear", False),
    "no_rope_fusion": ("training", "apply_rope_fusion", False),
    "no_bias_swiglu_fusion": ("training", "bias_activation_fusion", False),
    "no_bias_gelu_fusion": ("training", "bias_activation_fusion", False),
    "no_gradient_accumulation_fusion": ("training", "gradient_accumulation_fusion", False),
    "bf16": ("training", "precision", "bf16"),
    "fp16": ("training", "precision", "fp16"),
    "use_flash_attn": ("training", "attention_backend", "flash"),
    "use_rotary_position_embeddings": ("model", "position_embedding_type", "rope"),
    "recompute_activations": ("training", "recompute_granularity", "selective"),
    "checkpoint_activations": ("training", "recompute_granularity", "selective"),
    "num_moe_experts": ("model", "num_experts", None),
    "gated_linear_unit": ("model", "swiglu", None),
    "num_layers_in_first_pipeline_stage": ("training", "decoder_first_pipeline_num_layers", None),
    "num_layers_in_last_pipeline_stage": ("training", "decoder_last_pipeline_num_layers", None),
    "fp8_param": ("training", "fp8_param_gather", None),
    "enable_cuda_graph": ("training", "cuda_graph_impl", "local"),
    "external_cuda_graph": ("training", "cuda_graph_impl", "transformer_engine"),
    "moe_grouped_gemm": ("training", "moe_expert_gemm", "multi_stream"),
    "moe_router_padding_for_fp8": ("training", "moe_router_padding_for_quantization", None),
    "moe_deepep_num_sms": ("training", "moe_flex_dispatcher_num_sms", None),
    "moe_hybridep_num_sms": ("training", "moe_flex_dispatcher_num_sms", None),
}
"""Megatron arguments whose name is not the field they set: ``flag -> (spec, field, value)``; value None:
the argument's own value."""

RESOLVED = frozenset({"num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                      "group_query_attention", "optimizer", "transformer_impl", "megatron_fsdp_main_grads_dtype"})
"""Arguments the reader resolves itself (they set other fields)."""

NO_EFFECT_PREFIXES = (
    "adam_", "adlr_", "app_tag", "async_", "auto_detect_ckpt", "bert", "biencoder", "calculate_per_token_loss",
    "check_", "ckpt_", "classes_fraction", "consumed_", "data_", "dataloader", "decoupled_lr", "decoupled_min_lr",
    "dino", "distill", "distributed_timeout", "dist_ckpt", "dump_", "enable_ft", "enable_one_logger",
    "end_weight_decay", "error_injection", "eval_", "exit_", "export_", "fault_", "finetune", "flash_decode",
    "ft_", "full_validation", "grpo", "hf_", "hidden_dropout_", "hysteresis", "ict_", "img_", "inference_",
    "inprocess_", "init_method", "initial_loss_scale", "iter_per_epoch", "iterations_to_skip", "kitchen_",
    "langrl", "legacy_tokenizer", "load", "local_rank", "log", "loss_scale", "lr", "manual_gc", "mask_",
    "merge_file", "min_loss_scale", "min_lr", "mmap", "mock_data", "msc", "no_load", "no_save",
    "non_persistent", "num_classes", "num_dataset_builder_threads", "num_workers", "object_storage",
    "one_logger", "override_opt", "patch_dim", "perform_rl", "pretrained", "profile", "qk_l2_norm_eps",
    "rampup", "record_memory", "rerun_", "reset_", "result_rejected", "retro", "rl_", "s3_", "sample_rate",
    "save", "seed", "sft", "sgd_", "short_seq_prob", "skip_train", "split", "start_weight_decay", "straggler",
    "swin_", "t5_", "tensorboard", "test_data", "tiktoken", "timing", "tokenizer", "train_data",
    "train_iters", "train_samples", "trust_remote_code", "use_checkpoint", "use_dist_ckpt", "use_one_logger",
    "use_persistent_ckpt", "valid_data", "vision", "vocab_extra_ids", "vocab_file", "wandb", "warmup",
    "weight_decay", "wd_", "write_", "fim_", "flight_recorder", "disable_flight_recorder", "no_flight_recorder",
    "filter_warnings", "disable_filter_warnings", "no_filter_warnings", "muon_", "lion_", "mup_", "yarn_",
    "rope_scaling", "use_rope_scaling", "rotary_interleaved", "retriever_", "titles_", "evidence_", "block_data",
    "embedding_path", "query_in_block", "use_one_sent", "pytorch_profiler", "record_shapes", "memory_snapshot",
    "nvtx", "timers", "run_workload", "config_logger", "set_level", "modules_to_filter", "runtime_time_unit",
    "throughput_window", "memory_keys", "per_dataset", "per_split", "multiple_validation", "validation_set",
    "phase_transition", "test_mode", "verify_integrity", "use_tokenizer_model", "disable_use_tokenizer",
    "no_use_tokenizer", "null_tokenizer", "chat_template", "no_tokenizer", "disable_tokenizer", "no_data_sharding",
    "no_mmap", "no_create_attention_mask", "mid_level_dataset", "use_same_sampling", "no_one_logger", "calc_ft",
    "gpu_sniff", "train_sync", "hetereogenous_dist", "most_recent_k", "override_ckpt", "persistent_save", "no_ckpt",
    "disable_ckpt", "stream_ckpt", "disable_stream", "no_stream", "strict_fsdp", "disable_strict", "no_strict",
    "disable_load", "disable_save", "disable_log", "no_log", "no_check_for_nan", "disable_check_for_nan",
    "no_barrier", "disable_manual_gc", "no_manual_gc", "replication", "start_eval", "wsd_", "head_lr_mult",
    "no_weight_decay", "use_mp_args", "fake_process_group", "yaml_cfg", "output_bert", "num_channels",
    "moe_routing_trace", "moe_upcycling", "moe_use_upcycling", "indexer_", "tp_comm_", "no_tp_comm",
    "disable_tp_comm", "batch_p2p", "no_batch_p2p", "disable_batch_p2p", "ddp_", "use_te_rng",
    "moe_hybridep", "moe_ncclep", "high_priority", "symmetric_ar_type",
    "disable_symmetric", "use_nccl_ub", "nccl_all_reduce_for_prefill", "sharp_enabled_group", "create_all_gather",
    "disable_gloo", "disable_jit_fuser", "disable_bf16_reduced_precision_matmul", "no_rope_freq",
    "no_yarn", "mamba_inference", "enable_chunked_prefill", "decode_only", "num_speculative_tokens",
    "max_tokens_to_oom", "decrease_batch_size", "mlp_chunks_for_prefill", "cache_mla_latents",
    "use_inference_optimized", "use_legacy_static_engine", "moe_pad_experts_for_cuda_graph_inference",
    "refit_method", "use_kitchen", "kitchen", "fp4_quantizer", "fp8_quantizer", "te_precision_config",
    "quant_recipe", "app_tag", "distrib_optim_fully_reshardable", "no_pin_cpu",
    "no_gradient_reduce_div", "param_sync_func", "grad_sync_func", "no_sync_func", "grad_scale_func",
    "moe_grad_scale_func", "mtp_grad_scale_func", "finalize_model_grads_func", "embedding_init",
    "output_layer_init", "no_initialization", "onnx_safe", "use_torch_optimizer_for_cpu_offload",
)
"""Argument-name prefixes of the no-effect class. (``--step-batch-size-schedule`` is not one: it sets the global
batch step by step in place of ``--global-batch-size``, which Megatron then refuses, so the step to project is not
one batch: refused.)"""

NO_EFFECT = frozenset({
    "clip_grad", "distributed_backend", "eod_mask_loss", "exp_name",
    "init_model_with_meta_device",
    "lazy_mpu_init", "masked_softmax_fusion", "no_masked_softmax_fusion", "micro_batch_size_rampup",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_router_load_balancing_type",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_topk_scaling_factor",
    "moe_input_jitter_eps", "moe_per_layer_logging", "moe_enable_deepep",
    "moe_shared_expert_overlap", "mtp_loss_scaling_factor", "norm_epsilon",
    "overlap_p2p_comm", "rope_type", "softmax_scale", "allow_ambiguous_pad_tokens", "apply_wd_to_qk_layernorm",
    "disable_msc", "enable_msc", "disable_straggler_on_startup", "use_pytorch_profiler",
    "no_overlap_p2p_communication", "relative_attention_max_distance", "relative_attention_num_buckets",
    "experimental_attention_variant_loss_scale_func", "no_overlap_p2p_comm", "persist_layer_norm", "no_persist_layer_norm",
    "rotary_base", "rotary_percent", "rotary_scaling_factor", "rotary_seq_len_interpolation_factor",
    "tokenizer_type", "use_cpu_initialization", "use_mcore_models", "use_legacy_models",
    "deterministic_mode", "softmax_type", "qk_l2_norm", "qk_clip_alpha", "qk_clip_threshold",
    "empty_unused_memory_level", "mtp_detach_heads", "moe_shared_expert_gate", "quick_geglu",
    "openai_gelu", "apply_layernorm_1p", "deallocate_pipeline_outputs", "pipeline_dtype", "params_dtype",
    "pipeline_model_parallel_comm_backend", "use_ring_exchange_p2p", "overlap_p2p_communication_warmup_flush",
    "no_align_grad_reduce", "no_align_param_gather", "disable_align_grad_reduce", "moe_router_force_biased",
    "moe_apply_probs_on_input", "mrope_section", "use_te_activation_func", "use_fused_weighted_squared_relu",
    "rotary_base", "no_position_embedding", "glu_linear_offset",
    "clone_scatter_output_in_embedding", "no_clone_scatter_output_in_embedding",
    "disable_clone_scatter_output_in_embedding", "attention_output_gate", "no_attention_softmax_in_fp32",
    "disable_attention_softmax_in_fp32", "fused_residual_rmsnorm",
    "memory_efficient_layer_norm", "mla_down_proj_fusion", "fused_single_qkv_rope", "batch_size",
    "disable_parameter_transpose_cache", "keep_fp8_transpose_cache", "moe_single_grouped_weight",
    "moe_single_grouped_bias", "moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size",
    "pad_vocab_size", "no_pad_vocab_size", "disable_pad_vocab_size", "spec", "tp_only_amax_red",
    "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm",
    "init_method_std", "bias_dropout_fusion", "no_bias_dropout_fusion", "te_rng_tracker", "enable_experimental",
    "qk_clip", "ddp_bucket_size", "ddp_average_in_collective", "use_tp_pp_dp_mapping", "delay_wgrad_compute",
    "attention_softmax_in_fp32", "accumulate_allreduce_grads_in_fp32", "fp8_margin", "fp8_interval",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "no_fp8_wgrad", "tp_comm_bootstrap_backend",
    "tp_comm_overlap_cfg", "num_distributed_optimizer_instances", "align_param_gather", "align_grad_reduce",
    "use_sharp", "nccl_communicator_config_path", "sequence_parallel_size_rampup",
    "fsdp_double_buffer", "fsdp_manual_registration", "cuda_graph_warmup_steps",
})
"""Further no-effect arguments, each by name. (Kernel-fusion switches whose effect the projection does
model are fields or aliases instead, e.g. ``no_bias_swiglu_fusion``; ``attention_softmax_in_fp32`` matters
only to the unfused kernel, whose backend the projection reads from ``attention_backend``.)"""


PRIMUS_NO_EFFECT_PREFIXES = ("mlflow_", "torch_profiler_", "use_rocm_mem_info")
PRIMUS_NO_EFFECT = frozenset({
    "stderr_sink_level", "file_sink_level", "auto_continue_train", "disable_last_saving", "disable_tensorboard",
    "disable_wandb", "disable_mlflow", "generate_tracelens_report", "disable_compile_dependencies", "pp_warmup",
    "deprecated_use_mcore_models", "perform_initialization", "barrier_with_L1_time", "add_position_embedding",
    "original_max_position_embeddings", "bias_swiglu_fusion", "bias_gelu_fusion",
})
"""Primus's own arguments (``primus/configs/modules/megatron/primus_megatron_module.yaml``) that cannot change a
step's time or memory: logging sinks and trackers, profiler options, resuming and the last checkpoint, the
first iteration's pipeline warm-up; and the argparse destinations Primus's model files write for Megatron
switches that cannot change a step (``primus/configs/models/megatron/language_model.yaml``: ``perform_initialization``
of ``--no-initialization``, ``add_position_embedding`` of ``--no-position-embedding``, ``deprecated_use_mcore_models``
of ``--use-mcore-models``, ``barrier_with_L1_time`` of an older Megatron's timers; ``original_max_position_embeddings``
is Llama 3.1's RoPE scaling, as ``rope_scaling`` is). (How forced balance routes, ``moe_router_force_load_balancing_type``, is a
training field: Primus's ``even`` round-robin is exactly balanced and sends a token to fewer ranks than random
picks do. The legacy grouped GEMM switch, ``moe_use_legacy_grouped_gemm``, is a training field: its GEMMs take the
same 4-stream path as Transformer Engine's, but its expert weights' gradients are accumulated outside the GEMM.)"""

PRIMUS_FLAGS = frozenset({
    "use_turbo_autotune", "turbo_gemm_backend", "turbo_grouped_gemm_backend", "mxfp4_gradient_stochastic_rounding",
    "use_turbo_attention", "use_sink_attention", "sink_sliding_window", "sink_window_even_layers_only",
    "enable_turbo_attention_float8", "use_turbo_gemm", "turbo_grouped_gemm_without_padding",
    "turbo_deepep_use_comm_stream", "use_turbo_mega_moe", "turbo_mega_moe_precision", "use_turbo_rms_norm",
    "use_turbo_norm_te_linear",
    # Primus's model-file keys (primus/configs/models/megatron/primus_megatron_model.yaml, language_model.yaml)
    "disable_primus_topk_router", "use_deprecated_20241209_moe_layer", "final_logit_softcapping",
    "attn_logit_softcapping", "router_logit_softcapping", "lfm_layer_types", "conv_L_cache", "conv_bias",
    "model_type", "moe_extended_tp", "encoder_tensor_model_parallel_size", "encoder_pipeline_model_parallel_size",
    "pipeline_model_parallel_split_rank", "microbatch_group_size_per_vp_stage",
    # Primus features set in its experiment files: per-layer recompute, TE's FP8 weight-transpose cache patched off
    "recompute_layer_ids", "no_fp8_weight_transpose_cache",
})
"""Primus-Turbo's own arguments (``primus/configs/modules/megatron/primus_turbo.yaml``) that are not training
fields: their kernels' speed is not modelled, so each is refused when
it turns something on, and set aside when it leaves Primus's default path (``false``, ``default``; :func:`primus_default`). The modelled ones
(``enable_primus_turbo``, ``turbo_sync_free_moe_stage``, ``use_turbo_deepep``, ...) are training fields."""

REFUSAL_REASONS = {
    "step_batch_size_schedule": "sets the global batch step by step, so the step to project has no one batch; give "
                                "--global-batch-size (the batch of the step to project) in its place",
    "use_torch_fsdp2": "wraps Megatron's bf16 model in PyTorch FSDP2 beside Megatron's own optimizer, a memory "
                       "layout not modelled (fsdp_implementation: torch is torchtitan's fp32-sharded FSDP2); remove it "
                       "to project the distributed optimizer, or use --use-megatron-fsdp",
    "enable_gpt_oss": "(Megatron-LM newer than megatron-core 0.19.2) sets GPT-OSS's attention sinks, YaRN and clamped "
                      "GLU at once; give them as their own arguments",
}
"""Why an argument is refused, where the general reason would say less (``enable_gpt_oss`` is newer than the
shipped flag list, so it would read as no Megatron argument at all)."""

PRIMUS_DESTS = {"fp8": "fp8_format"}
"""A Primus YAML's keys are Megatron's argparse destinations, which are not always its flags' names (``fp8`` is
``--fp8-format``'s). The store_false pair ``bias_swiglu_fusion`` / ``bias_gelu_fusion`` (``--no-bias-swiglu-fusion``,
``--no-bias-gelu-fusion``) is read by the model's activation (:func:`~primuspipe.projection.megatron_args.read_megatron_config`)."""

PRIMUS_DEFAULT_VALUES = {"turbo_gemm_backend": "default", "turbo_grouped_gemm_backend": "default",
                         "turbo_mega_moe_precision": "bf16", "conv_L_cache": 3, "model_type": "gpt",
                         "encoder_tensor_model_parallel_size": 0, "encoder_pipeline_model_parallel_size": 0}

MEGATRON_DEFAULT_VALUES = {"cp_comm_type": "p2p", "moe_token_drop_policy": "probs", "outer_dp_sharding_strategy": "no_shard",
                           "megatron_fsdp_main_params_dtype": "fp32", "megatron_fsdp_grad_comm_dtype": "auto"}
"""Megatron's own defaults of arguments the projection refuses otherwise (``megatron/core/transformer_config.py``:
``cp_comm_type`` p2p, the ring the projection prices for CP; ``moe_token_drop_policy`` probs;
``megatron/core/distributed/distributed_data_parallel_config.py``: ``outer_dp_sharding_strategy`` no_shard, no
hybrid sharding; ``megatron/training/arguments.py``: ``--megatron-fsdp-main-params-dtype`` fp32, the master copy the
projection counts, ``--megatron-fsdp-grad-comm-dtype`` auto, the main gradients' dtype): a file that writes a default out (Primus's ``language_model.yaml`` writes every argument, Megatron-LM's
CI cases some) runs what the projection models."""


def megatron_default(name: str, value) -> bool:
    """A Megatron argument written at its default: unset (``null``), a ``store_true`` switch ``false`` (one with a
    ``no_`` / ``disable_`` form defaults to on, so false there is a choice), or :data:`MEGATRON_DEFAULT_VALUES`."""
    if name not in MEGATRON_FLAGS:
        return False
    if value is None or value == MEGATRON_DEFAULT_VALUES.get(name, ()):
        return True
    return value is False and f"no_{name}" not in MEGATRON_FLAGS and f"disable_{name}" not in MEGATRON_FLAGS


def primus_default(name: str, value) -> bool:
    """A Primus-Turbo argument that leaves the default path: a switch off or a backend ``default``."""
    return name in PRIMUS_FLAGS and (value is False or value is None or value == PRIMUS_DEFAULT_VALUES.get(name))


def no_effect(name: str) -> bool:
    return (name in NO_EFFECT or name.startswith(NO_EFFECT_PREFIXES) or name in PRIMUS_NO_EFFECT
            or name.startswith(PRIMUS_NO_EFFECT_PREFIXES))


def closest(name: str, names) -> str | None:
    """The defined argument a mistyped one most likely meant."""
    import difflib

    match = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.75)
    return match[0] if match else None


def defined_flags(megatron_root: Path) -> set[str]:
    """The argument names (underscored) a megatron-core source tree defines: every ``add_argument`` of
    ``training/arguments.py`` and every field of the config dataclasses its parser is built from (with
    their ``arg_names`` renames and the ``no_`` / ``disable_`` forms of fields that default to True).
    Read from the source (no import: megatron needs triton and a GPU stack to import)."""
    names: set[str] = set()
    arguments = ast.parse((megatron_root / "training" / "arguments.py").read_text())
    for node in ast.walk(arguments):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names |= {a.value[2:].replace("-", "_") for a in node.args
                      if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")}
    factories = set(re.findall(r"ArgumentGroupFactory\((\w+)", (megatron_root / "training" / "arguments.py").read_text()))
    factories |= {"ModelParallelConfig"}  # TransformerConfig's base
    sources = [megatron_root / "core" / "transformer" / "transformer_config.py",
               megatron_root / "core" / "model_parallel_config.py", megatron_root / "core" / "fault_injector.py",
               *sorted((megatron_root / "training" / "config").glob("*.py"))]
    for source in sources:
        for cls in ast.walk(ast.parse(source.read_text())):
            if isinstance(cls, ast.ClassDef) and cls.name in factories:
                names |= _dataclass_flags(cls)
    return names


def _dataclass_flags(cls: ast.ClassDef) -> set[str]:
    names = set()
    for statement in cls.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        name, value = statement.target.id, statement.value
        if name.startswith("_"):
            continue
        default, renamed = (value.value if isinstance(value, ast.Constant) else None), None
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
            for keyword in value.keywords:
                if keyword.arg == "default" and isinstance(keyword.value, ast.Constant):
                    default = keyword.value.value
                if keyword.arg == "metadata":
                    try:
                        renamed = ast.literal_eval(keyword.value).get("argparse_meta", {}).get("arg_names")
                    except ValueError:
                        renamed = None
        if renamed:
            names |= {a[2:].replace("-", "_") for a in renamed}
            continue
        names.add(name)
        if default is True:
            names |= {f"no_{name}", f"disable_{name}"}
    return names
