"""How the model is trained: batch sizes, parallelism, recompute, optimizer and kernel choices.

Field names are Megatron's. Every field has a default, and the defaults are the built-in training
setup :func:`load_training` returns without a file (``examples/projection/training/default.yaml``
spells them out): micro-batch 1, global batch 128, pp 4, everything else 1, no recompute, distributed
optimizer, bf16, flash attention.

:func:`check_compatible` is where a model and a training setup meet: heads divisible by TP, layers
enough for pp * vpp, experts divisible by EP, the global batch divisible by micro-batch * DP, ...
Each problem is one :class:`~primuspipe.projection.spec_fields.InputError` naming both files' fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from primuspipe.projection.gemm import GEMM_STREAMS
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.routing import busiest_rank_load
from primuspipe.projection.spec_fields import InputError, check_fields, oversized, read_yaml, spec_from_mapping

RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "moe_act", "mla_up_proj")
"""Megatron's ``recompute_modules``. ``layernorm``, ``moe_act`` and ``mla_up_proj`` run only with Transformer
Engine in megatron-core, so their activation formulas are not checked against a real layer here."""

FLEX_DISPATCHER_SMS = {"deepep": 20, "hybridep": 24}
"""SMs each flex backend's kernels take by default (see ``TrainingSpec.moe_flex_dispatcher_num_sms``)."""
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""Megatron's ``--fp8-recipe``: delayed and tensorwise (current) scaling keep one scale per tensor, blockwise
one per 128x128 weight block and 1x128 activation tile (DeepSeek-V3's), mxfp8 one per 32 elements (needs a
GPU with block-scaled FP8 GEMMs)."""

MXFP8_BLOCK = 32
"""Elements sharing one E8M0 scale in MXFP8 (the OCP Microscaling specification's block)."""

@dataclass(frozen=True)
class TrainingSpec:
    """One training configuration of one model (one pipeline replica's view, times DP replicas)."""

    micro_batch_size: int = 1
    """Samples per microbatch (b)."""
    global_batch_size: int = 128
    """Samples per optimizer step over all data-parallel replicas."""
    tensor_model_parallel_size: int = 1
    """TP: attention heads, MLP width and vocabulary split over this many ranks."""
    pipeline_model_parallel_size: int = 4
    """PP: pipeline ranks."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per pipeline rank for algorithms that take any vpp (interleaved-1f1b uses 2 when this is 1;
    V-shape algorithms always use 2)."""
    local_batch_size: int | None = None
    """Samples one data-parallel replica runs through the pipeline in one schedule, from its warm-up to its drain
    (one pipeline flush); None, the default: the replica's whole share of the global batch, GBS / DP, one flush a
    step, as megatron-core runs it (all of a replica's microbatches in one ``forward_backward_func`` call). Smaller,
    a step runs :attr:`pipeline_flushes` schedules of ``local_batch_size / micro_batch_size`` microbatches one after
    another before the optimizer step, each paying its own warm-up and drain, and holding at its peak the
    activations of one schedule only. The trainers built on ``torch.distributed.pipelining`` do this: their
    gradient-accumulation loop calls ``schedule.step`` once per local batch -- NeMo AutoModel
    (``nemo_automodel/recipes/llm/train_ft.py`` ``_forward_backward_step`` and ``recipes/llm/benchmark.py``'s loop
    over ``GBS / (local_batch_size * DP)`` steps, its schedule built with ``local_batch_size // pp_microbatch_size``
    microbatches in ``components/distributed/pipelining/functional.py`` ``build_pipeline_schedule``, NVIDIA-NeMo/
    Automodel 89e3a9fdd: ``step_scheduler.local_batch_size``) and torchtitan (``torchtitan/train.py``
    ``train_step``, ``training.local_batch_size``). Under such a schedule a DDP-wrapped stage reduces its
    gradients in each schedule's last backward (``torch/distributed/pipelining/stage.py``
    ``backward_maybe_with_nosync``), so each flush also pays the reduction's exposed tail
    (:func:`~primuspipe.projection.comm.gradient_sync`)."""
    expert_model_parallel_size: int = 1
    """EP: routed experts split over this many ranks (carved out of TP * CP * DP)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside experts; None means tensor_model_parallel_size (Megatron's default)."""
    context_parallel_size: int = 1
    """CP: the sequence split over this many ranks."""
    data_parallel_size: int = 1
    """Pipeline replicas; ``--target-nodes`` replaces it with what the nodes hold."""
    sequence_parallel: bool = False
    """Shard norms, dropouts and residuals over TP (needs TP > 1; Megatron requires it for MoE with TP > 1)."""
    recompute_granularity: Literal["full", "selective", "op"] | None = None
    """None: keep every activation; full: recompute whole layers; selective: recompute the modules in recompute_modules;
    op: torchtitan's op-level selective activation checkpointing (``[activation_checkpoint] mode = "selective"``,
    ``selective_ac_option = "op"``, its Llama 3 default), which checkpoints every TransformerBlock with a policy
    that saves the outputs of the ops in its ``_save_list`` (``aten.mm`` but every second one, the SDPA kernels,
    ``reduce_scatter_tensor``, ``max``) and recomputes everything else
    (:data:`~primuspipe.projection.activations.TORCHTITAN_BLOCK_GEMMS`); dense layers of torchtitan's Llama only."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With full recompute: ``uniform`` checkpoints every group of recompute_num_layers layers; ``block``
    checkpoints the first recompute_num_layers layers of every model chunk."""
    recompute_num_layers: int | None = None
    """With full recompute: layers per checkpointed group (uniform) or per chunk (block)."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With selective recompute: which parts are recomputed (some of core_attn, mlp, moe, shared_experts)."""
    op_recompute_compiled: bool = False
    """With op recompute: the checkpointed blocks run under ``torch.compile`` (torchtitan's ``training.compile``,
    which compiles each TransformerBlock). AOTAutograd's partitioner then keeps only the policy's saved outputs the
    backward reads, where eager checkpointing caches every one until the block's recompute: the last GEMM's output
    (``w2``, and its reduce-scatter under sequence parallelism), which feeds only the residual add, is not kept. It
    sets nothing else (the fusions compiling brings are their own fields)."""
    use_distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam moments over data-parallel ranks (ZeRO-1)."""
    use_megatron_fsdp: bool = False
    """Megatron-FSDP in place of DistributedDataParallel; what it shards is ``data_parallel_sharding_strategy``."""
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "no_shard"
    """With Megatron-FSDP: ``optim`` shards the optimizer state over the data-parallel group (as the
    distributed optimizer does), ``optim_grads`` the main gradients too (ZeRO-2): every microbatch's
    gradients are reduce-scattered into the rank's shard as backward produces them, so no rank keeps a
    whole gradient buffer. ``optim_grads_params`` (ZeRO-3) shards the weights too and gathers them layer by
    layer, before the forward and again before the backward."""
    fsdp_implementation: Literal["megatron", "torch"] = "megatron"
    """Whose FSDP the sharding above is. ``torch``: PyTorch's (FSDP2's ``fully_shard``, or FSDP1, with a bf16
    mixed-precision policy), whose shards are the fp32 parameters the optimizer updates, cast to bf16 only as
    a layer is gathered: no bf16 copy of the shard stays beside them, where Megatron-FSDP keeps one (its
    model weights apart from the fp32 main weights); its root unit (embedding, final norm, output layer)
    stays gathered from the forward through the backward; with one microbatch a step its gradients are made
    by the backward (:attr:`gradients_from_backward`). Only with ``optim_grads_params``."""
    fsdp_reshard_after_forward: bool = True
    """PyTorch FSDP2's ``reshard_after_forward`` (``fully_shard``; torchtitan's ``fsdp_reshard_after_forward``, which
    torchtitan turns off for every block under pipeline parallelism: ``apply_fsdp``, ``reshard_after_forward = False``
    when ``pp_enabled``). False: a layer's gathered weights stay from its forward to its backward, so the rank holds
    all its layers' at once and gathers them once a microbatch instead of twice. With PP > 1 PyTorch's pipelining
    keeps them for the whole step and the gradients unsharded too: a stage's backward turns FSDP2's resharding after
    backward and its gradient reduction off until the step's last microbatch (``PipelineStage.
    backward_maybe_with_nosync``: ``set_reshard_after_backward``, ``set_requires_gradient_sync``), and FSDP2
    accumulates the unsharded gradients in its reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``): one
    gather and one reduce-scatter a step (:attr:`gathered_for_step`). Only with ``fsdp_implementation: torch``."""
    torch_fsdp_version: Literal["fsdp2", "fsdp1"] = "fsdp2"
    """Which of PyTorch's FSDPs ``fsdp_implementation: torch`` is: ``fsdp2`` (``fully_shard``; torchtitan, NeMo
    AutoModel) or ``fsdp1`` (``FullyShardedDataParallel`` with a ``MixedPrecision``; AMD's ``train_fsdp.py``). They
    differ in the copies the compute stream runs (:attr:`fsdp2_copies`): FSDP1 gathers into the flat parameter the
    layer reads and reduce-scatters views of its flat gradient. Only with ``fsdp_implementation: torch``."""
    use_precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer: the dtypes below may be narrower than fp32."""
    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    """Master weights the optimizer keeps (4 or 2 bytes a parameter)."""
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    """Main gradients accumulated and reduced (4 or 2 bytes a parameter)."""
    grad_reduce_in_bf16: bool = False
    """Megatron's ``--grad-reduce-in-bf16`` (NeMo / Megatron-Bridge: ``grad_reduce_in_fp32: false``): main
    gradients accumulated and reduced in bf16, 2 bytes a parameter, without the precision-aware optimizer."""
    exp_avg_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    """Adam's first moment."""
    exp_avg_sq_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    """Adam's second moment."""
    master_weights: bool = True
    """The optimizer keeps a master copy of the weights (in ``main_params_dtype``), as every mixed-precision
    Megatron run does. False: the optimizer steps the bf16 / fp16 weights themselves and the kept gradients take
    their dtype (:attr:`kept_grad_bytes`), as plain PyTorch optimizers do over a model built in bf16. Adam's
    moments are then ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` without the precision-aware optimizer: bf16 for
    ``torch.optim.AdamW`` (``zeros_like`` the parameter), so torchtitan's ``training.dtype = "bfloat16"`` is
    ``master_weights: false`` with both moments bf16 (``Training.dtype``, ``torchtitan/config/job_config.py`` at
    v0.2.2: "put all parameters, gradients, and optimizer states in bfloat16, without an extra copy of fp32
    weights"; the model is built under ``set_default_dtype`` of it, ``train.py``); fp32, the default, for Transformer
    Engine's ``FusedAdam`` at its defaults (``master_weights=False``, ``exp_avg_dtype=torch.float32``). The
    gradients are still *reduced* at :attr:`main_grad_bytes` (torchtitan's FSDP2 reduces in fp32,
    ``mixed_precision_reduce``); only what the rank keeps narrows."""
    gradient_accumulation_fusion: bool = True
    """Megatron's default (``--no-gradient-accumulation-fusion`` turns it off): Transformer Engine's linears
    accumulate their weight gradients into the fp32 main gradients inside the weight-gradient GEMM
    (``fuse_wgrad_accumulation=config.gradient_accumulation_fusion``, megatron-core
    ``extensions/transformer_engine.py``). Off, each writes a fresh bf16 ``param.grad`` that the data-parallel
    wrapper's backward hook adds into the main gradient, a separate pass over every weight per microbatch
    (``param.main_grad.add_(param.grad.data)``, ``distributed/distributed_data_parallel.py``). AMD's Primus MoE
    experiment files turn it off (``examples/moe_package/configs/MI355X/deepseek_v2*-pretrain-baseline.yaml``)."""
    defer_embedding_wgrad_compute: bool = False
    """megatron-core's ``defer_embedding_wgrad_compute`` (NeMo 2's performance mode turns it on): the last pipeline
    stage's output layer keeps each microbatch's input (``embedding_activation_buffer``, the sequence-parallel
    shard) and output gradient (``grad_output_buffer``, ``T V / TP``) instead of running its weight-gradient GEMM
    in that microbatch's backward (``tensor_parallel/layers.py``), and ``finish_embedding_wgrad_compute`` runs
    every buffered GEMM after the last backward, before the gradients are finalised
    (``pipeline_parallel/schedules.py``, ``utils.drain_embedding_wgrad_compute``): in the flush, where the
    last rank would otherwise wait. Megatron refuses it without a pipeline or without gradient accumulation
    fusion (``ModelParallelConfig.__post_init__``)."""
    wgrad_deferral_limit: int = 0
    """With ``defer_embedding_wgrad_compute`` (megatron-core's ``--wgrad-deferral-limit``): how many microbatches of
    a pipeline schedule the output layer defers; 0 (its default) defers every one. Below the schedule's microbatch
    count, the first this many defer and every later one runs its weight-gradient GEMM in its own backward: the
    forward buffers its input while ``len(embedding_activation_buffer) < wgrad_deferral_limit``
    (``ColumnParallelLinear.forward``), the backward its output gradient while ``len(grad_output_buffer) <
    wgrad_deferral_limit`` and otherwise runs the GEMM at once
    (``LinearWithGradAccumulationAndAsyncCommunication.backward``, ``tensor_parallel/layers.py``, megatron-core
    core_v0.8.0 to core_v0.12.x), and ``finish_embedding_wgrad_compute`` drains the buffered ones after the last
    backward (``pipeline_parallel/schedules.py``). NeMo's performance recipes set 22 (Llama 3 70B, Nemotron-4
    340B) or 50 (Llama 3.1 405B); NVIDIA's MLPerf NeMo code 50 or 65. The projection prices the later
    microbatches' last-stage W with the head's GEMM (:class:`~primuspipe.ir.cost_parts.LateWork`) and drains the
    first ones' (:attr:`deferred_microbatches`)."""
    moe_use_legacy_grouped_gemm: bool = False
    """Megatron's legacy ``GroupedMLP`` for the experts (``--moe-use-legacy-grouped-gemm``; Primus keeps it as
    ``DeprecatedGroupedMLP``, ``primus/backends/megatron/core/transformer/moe/deprecated_20251209/experts.py``): its
    expert weights are plain parameters that the ``grouped_gemm`` package's ``gg.ops.gmm`` multiplies, so their
    gradients always reach the main gradients through ``param.grad`` and the data-parallel hook, whatever
    ``gradient_accumulation_fusion`` says. Its GEMMs take the same 4-stream path as Transformer Engine's."""
    cross_entropy_loss_fusion: bool = False
    """Fused vocab-parallel cross entropy (``cross_entropy_fusion_impl`` says which)."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Which fused loss ``cross_entropy_loss_fusion`` runs (megatron-core's ``--cross-entropy-fusion-impl``, default
    ``native``; megatron-core up to 0.11, the NeMo 1 and NeMo 2 containers, has only ``native``): ``native``,
    megatron-core's ``fused_vocab_parallel_cross_entropy``, four ``torch.compile`` regions that still make and keep
    the fp32 softmax; ``te``, Transformer Engine's Triton ``parallel_cross_entropy``, which writes the gradient in
    place in the logits' dtype (Megatron-Bridge's performance scripts and Primus's configurations set it). See
    ``WorkModel._loss_bytes_per_logit``."""
    torch_cross_entropy: Literal["fp32", "native"] | None = None
    """The loss is PyTorch's ``F.cross_entropy`` over the whole logits, as NeMo AutoModel's ``MaskedCrossEntropy``
    runs it (nemo_automodel/components/loss/masked_ce.py: ``logits.float()`` when ``fp32_upcast``, then
    ``F.cross_entropy``), not megatron-core's vocab-parallel loss: ``fp32``, its default ``fp32_upcast: true``;
    ``native``, ``fp32_upcast: false`` (the logits' own dtype). None: megatron-core's loss
    (``cross_entropy_loss_fusion`` says which of its two). See ``WorkModel._loss_bytes_per_logit``."""
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """Mixed bf16/fp16 keeps fp32 main grads and master weights; fp32 trains in fp32 throughout; ``fp8`` is
    shorthand for bf16 with FP8 GEMMs (``fp8_format: hybrid`` unless given)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline rank (all its chunks); the rest split evenly."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline rank."""
    attention_backend: Literal["flash", "fused", "unfused", "local"] = "flash"
    """flash/fused keep Q, K, V, the output and per-row softmax statistics; unfused/local (megatron-core's
    local DotProductAttention) keep the full softmax probabilities."""
    attention_kernel: str | None = None
    """Which fused-attention kernel the run's container ran, by a name the hardware file lists under
    ``attention_kernels`` (H100: ``flash1`` and ``flash2``, FlashAttention 1 and 2; ``cudnn-2024``, cuDNN's as of
    mid-2024): its attention is timed at that kernel's published rates. None: the hardware file's own attention
    rates (today's kernels)."""
    attention_softmax_in_fp32: bool = True
    """Unfused attention computes (and keeps) the probabilities in fp32, plus a low-precision copy."""
    bias_activation_fusion: bool = True
    """Fused SwiGLU/GeLU keeps only its input; unfused keeps every intermediate."""
    squared_relu_fusion: bool = True
    """A squared-ReLU model's activation (``squared_relu``) runs as one compiled kernel each way: megatron-core's
    ``squared_relu`` is ``@jit_fuser`` (``torch.compile`` from PyTorch 2.2; ``megatron/core/activations.py``), as is
    NeMo 1's (``nemo/collections/nlp/modules/common/megatron/utils.py`` at v2.0.0, which NeMo-Framework-Launcher
    runs). False: NeMo 2's own ``squared_relu``, which ``NemotronConfig`` passes as ``activation_func``
    (``nemo/collections/llm/fn/activation.py`` at v2.1.0 and v2.2.0: ``torch.pow(F.relu(x), 2)`` with its
    ``@torch.jit.script`` commented out, "remove until we have serialization"), runs eager: two kernels forward, four
    backward (:data:`~primuspipe.projection.compute.elementwise.BACKWARD_BYTES_PER_FORWARD_BYTE`)."""
    elementwise_kernels: Literal["fused", "torchtitan-eager"] = "fused"
    """How the layers' norms, SwiGLU and rotary embedding run: ``fused``, one kernel each way per norm and activation
    (megatron-core's, Transformer Engine's, or what torch.compile makes); ``torchtitan-eager``, torchtitan's Llama code
    run without torch.compile (``training.compile`` false), every PyTorch op its own kernel: its ``RMSNorm``
    (``norm_type`` rmsnorm, ``torchtitan/models/norms.py`` at 9dec370: ``x.float()``, ``pow(2).mean``, ``rsqrt``, the
    product, ``type_as``, the weight), ``F.silu(w1(x)) * w3(x)`` and the complex-number ``apply_rotary_emb``
    (``torchtitan/models/llama/model.py``), priced by what each aten op reads and writes forward and backward
    (:data:`~primuspipe.projection.compute.elementwise.EAGER_RMSNORM_BYTES` and its neighbours). LayerNorm models
    keep one kernel (eager ``nn.LayerNorm`` is ``native_layer_norm``). Needs ``bias_activation_fusion`` and
    ``apply_rope_fusion`` false and a 2-byte activation dtype."""
    model_implementation: Literal["megatron", "torchtitan"] = "megatron"
    """Whose code builds a dense layer's linears: ``megatron``, megatron-core's (one fused QKV GEMM and one fused
    gate/up GEMM; a sequence-parallel column-parallel linear saves its input shard and all-gathers it again for its
    weight gradient, ``LinearWithGradAccumulationAndAsyncCommunication``); ``torchtitan``, torchtitan's Llama
    (``torchtitan/models/llama/model.py`` at 9dec370, ``llama3`` at 820504e, ROCm's 31007c3: ``wq``, ``wk``, ``wv``
    and ``w1``, ``w3`` separate ``nn.Linear``, so separate GEMMs), tensor-parallel by DTensor
    (``parallelize_llama.apply_tp``: ``PrepareModuleInput`` gathers the attention's and the MLP's input once,
    ``ColwiseParallel`` / ``RowwiseParallel`` linears): autograd records the linears over the gathered
    (``Replicate``) DTensor and saves it, so the weight gradient reads the saved gathered input (TP times the
    shard) and nothing is gathered again -- unless the norm's output is recomputed (torchtitan's op-level SAC,
    ``recompute_granularity: op``, or a recompute of the norms: its policy does not save ``all_gather_into_tensor``,
    so the backward's recompute gathers again and nothing gathered is kept)."""
    apply_rope_fusion: bool = True
    """Fused rotary embedding; unfused keeps the cos/sin tables it multiplies queries and keys by."""
    overlap_grad_reduce: bool = True
    """Gradient reduce-scatter/all-reduce hidden behind backward compute (only its tail is exposed)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """How MoE layers move token copies to their experts (the communication model treats all as all-to-alls;
    ``flex`` is DeepEP's or HybridEP's, which send each token once to every rank holding one of its experts --
    once per node across nodes, spread over NVLink there -- and copy it per expert on arrival)."""
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] = "deepep"
    """The flex dispatcher's backend (Megatron's default ``deepep``). Under FP8, HybridEP's dispatch pads each
    local expert's token copies to the quantization alignment itself (megatron-core ``_HybridEPManager.dispatch``:
    ``pad_multiple = get_align_size_for_quantization``), so the experts never pad them again
    (``RankShape.fp8_padding_copies``)."""
    moe_flex_dispatcher_num_sms: int | None = None
    """SMs the flex dispatcher's kernels hold while they run (Megatron's ``moe_flex_dispatcher_num_sms``; aliases
    ``moe_deepep_num_sms`` and ``moe_hybridep_num_sms``, which megatron-core routes to it). None: the backend's
    default -- DeepEP's 20 (``deep_ep.Buffer.num_sms = 20``, deepseek-ai/DeepEP ``deep_ep/buffer.py``; megatron-core's
    historical ``moe_deepep_num_sms`` default 20, as DeepSeek-V3's report gives its dispatch and combine 20 SMs,
    3.2.2), HybridEP's 24 (megatron-core's ``moe_hybridep_num_sms`` default). Under the EP overlap the compute
    beside them runs on the other SMs (:meth:`~primuspipe.projection.comm.LayerComm.exposed`)."""
    moe_router_padding_for_quantization: bool = False
    """megatron-core (alias ``moe_router_padding_for_fp8``): under FP8 the router routes extra copies so that every
    expert's count is a multiple of the quantization alignment (``pad_routing_map``), so the experts never pad
    them (``RankShape.fp8_padding_copies``); the extra copies (fewer than the alignment per expert and source rank)
    are not modelled. Primus's sync-free MoE turns it on under FP8."""
    fp8_format: Literal["e4m3", "hybrid"] | None = None
    """FP8 GEMMs (Transformer Engine) for the linear layers: e4m3 everywhere, or hybrid (e5m2 gradients);
    None: the GEMMs run in ``precision``. Weights, optimizer and the other kernels keep ``precision``."""
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """How FP8 tensors are scaled (see :data:`FP8_RECIPES`); current-scaling recipes add an amax pass per cast."""
    fp8_param_gather: bool = False
    """Keep the model weights in FP8 (their master copy stays fp32 in the optimizer): 1 byte per weight."""
    first_last_layers_bf16: bool = False
    """Megatron: under FP8, the first ``num_layers_at_start_in_bf16`` and last ``num_layers_at_end_in_bf16``
    transformer layers run their GEMMs in ``precision`` (Megatron-Bridge's FP8 current-scaling recipe turns
    this on with one layer at each end)."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    tp_comm_overlap: bool = False
    """Tensor-parallel communication overlap: each layer's all-gather/reduce-scatter runs in chunks under the GEMM
    it feeds or follows; only what outlasts that GEMM (and one chunk) is exposed. Which collectives it covers is
    ``tp_comm_overlap_impl``'s."""
    tp_comm_overlap_impl: Literal["te-userbuffers", "torch-async-tp"] = "te-userbuffers"
    """Which implementation overlaps TP (with ``tp_comm_overlap``; :meth:`~primuspipe.projection.comm.LayerComm.exposed`
    says what each hides): ``te-userbuffers``, Transformer Engine's userbuffers as Megatron-Bridge configures them
    per GEMM (every all-gather and reduce-scatter of F and B, W's re-gathers beside the other backward GEMM);
    ``torch-async-tp``, PyTorch's async TP (torchtitan's ``enable_async_tensor_parallel``: inductor's
    ``micro_pipeline_tp`` pass over symmetric memory), which fuses an all-gather only into the matmuls that
    consume it and a reduce-scatter only into the one matmul that produces it, and sums the reduce-scatter's
    partials in a kernel of its own."""
    cp_implementation: Literal["te-p2p", "torch-allgather", "torch-alltoall"] = "te-p2p"
    """How context parallelism's ring attention exchanges keys and values (what
    :meth:`~primuspipe.projection.comm.LayerComm.exposed` hides under which attention step). ``te-p2p``: Transformer
    Engine's ring (``AttnFuncWithCPAndKVP2P``, megatron-core): each step's KV block travels under the step before it,
    the dK/dV blocks likewise in B. PyTorch's experimental ``context_parallel`` (torchtitan's
    ``context_parallel_rotate_method``; torch ``distributed/tensor/experimental/_attention.py``,
    ``_templated_ring_attention`` and ``_templated_ring_attention_backward``) runs ``CP`` SDPA steps of equal work
    (head-tail load balance, no masked block computed) and: ``torch-allgather`` (``_AllGatherRotater``, torchtitan's
    default) all-gathers the whole KV once, launched before step 0 and awaited after it, so only step 0's attention
    hides it; the backward all-gathers KV again the same way and passes each step's fp32 dK/dV to the next rank
    (``_AllToAllRotater``), awaited after the next step's attention, the last one after the loop (exposed);
    ``torch-alltoall`` (``_AllToAllRotater`` for KV too) passes each step's KV block to the next rank, awaited
    after that step's attention, and dK/dV as under ``torch-allgather``. The ring moves the K, V SDPA is given:
    with ``model_implementation: torchtitan`` the KV heads repeated to the query heads (``repeat_kv``)."""
    cp_compiled: bool = False
    """With a ``torch-*`` ``cp_implementation``: the ring runs inside ``torch.compile``'d blocks (torchtitan's
    ``training.compile``, each TransformerBlock compiled with ``fullgraph=True``, so the SDPA call and the ring
    torch's context-parallel dispatch runs for it are traced into the block's graph). A functional collective
    traced so is waited where it is issued (torch ``distributed/_functional_collectives.py``,
    ``_maybe_wrap_tensor``: ``wait_tensor`` at once when ``_are_we_tracing()``, the asynchronous wrapper only in
    eager), and inductor moves no wait later unless ``reorder_for_compute_comm_overlap`` is set (``False`` by
    default, ``torch/_inductor/config.py``): every KV and dK/dV transfer of the ring shows whole."""
    overlap_param_gather: bool = False
    """Distributed optimizer: the weight all-gather runs under the next step's forward, bucket by bucket."""
    align_param_gather: bool = False
    """megatron-core's DDP ``align_param_gather``: the forward pre-hook no longer launches the next bucket's
    weight gather, leaving all of them to the pipeline schedule (``finish_param_sync(skip_next_bucket_dispatch=
    True)``, ``distributed/distributed_data_parallel.py``). Only the interleaved schedule launches them
    (``param_sync_func``, ``pipeline_parallel/schedules.py``); under any other each bucket's gather is launched
    by its own pre-hook and waited on at once, none hidden -- why Megatron-LM's ``arguments.py`` turns it off
    without the interleaved schedule, which code that fills the DDP config itself (NeMo 2) does not."""
    ddp_bucket_size: int | None = None
    """Parameters per data-parallel bucket (megatron-core's ``DistributedDataParallelConfig.bucket_size``; None:
    its default, max(40M, 1M x DP)). A bucket closes only after a whole tensor, so a tiny one is a tensor a
    bucket. Priced only where each bucket's collective shows (``align_param_gather`` above)."""
    overlap_moe_expert_parallel_comm: bool = False
    """EP all-to-all overlap (Megatron's 1F1B A2A overlap): one microbatch's dispatch/combine runs under
    another microbatch's compute; only what outlasts that compute is exposed."""
    moe_expert_gemm: Literal["multi_stream", "fused", "sequential"] = "multi_stream"
    """How a rank's expert GEMMs run (:mod:`~primuspipe.projection.gemm` cites the code): ``multi_stream``, one
    GEMM per expert over 4 streams (megatron-core's ``TEGroupedMLP`` with ``--moe-grouped-gemm``: Transformer
    Engine's default ``GroupedLinear`` path; also the legacy ``grouped_gemm`` package); ``fused``, one grouped
    kernel whose waves hold tiles of all experts (Primus-Turbo's CK grouped GEMM, ``--use_turbo_grouped_gemm``;
    TE's opt-in CUTLASS / cuBLASLt grouped GEMMs); ``sequential``, one expert after another (megatron-core's
    ``SequentialMLP``, Megatron's default without ``--moe-grouped-gemm``)."""
    gpu_max_hw_queues: int | None = None
    """ROCm's ``GPU_MAX_HW_QUEUES``: the hardware queues HIP gives a device's streams (ROCm/clr
    ``rocclr/utils/flags.hpp``, default 4; AMD's Primus launcher sets 2, ``runner/helpers/envs/base_env.sh``).
    Streams beyond it share queues, so a ``multi_stream`` grouped GEMM runs at most this many experts at once.
    None: the runtime's default (no limit below the 4 streams; CUDA has no such setting)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """The router's logits and probabilities in fp32 / fp64; None: the activations' dtype (Megatron's default).
    The probabilities weight each token copy in the experts (see ``WorkModel.probs_bytes``)."""
    moe_router_force_load_balancing: bool = False
    """Route tokens evenly (benchmarks do): no expert gets more than its share."""
    moe_router_force_load_balancing_type: Literal["uniform", "even"] = "uniform"
    """How forced balance routes: ``uniform``, megatron-core's random logits (each token draws its experts at
    random, balanced on average only: :mod:`~primuspipe.projection.routing`); ``even``, Primus's round-robin, token
    ``t`` of a rank to experts ``t k`` ... ``t k + k - 1`` (mod the expert count) -- exactly balanced, a token's
    experts consecutive -- after the router has run (AMD-AGI/Primus ``PrimusTopKRouter.routing``,
    primus/backends/megatron/core/transformer/moe/router.py, and the Turbo DeepEP dispatcher's
    ``dispatch_preprocess``, primus/backends/megatron/core/extensions/primus_turbo.py: Primus's only forced balance
    until the flag came in July 2026, its module default since, primus/configs/modules/megatron/
    primus_megatron_module.yaml). A Primus configuration read by ``--megatron-config`` takes ``even`` unless it
    says otherwise."""
    fake_balanced_gate: bool = False
    """NeMo AutoModel's ``fake_balanced_gate`` (its MoE ``BackendConfig``; ``FakeBalancedGate`` in
    nemo_automodel/components/moe/layers.py): no router -- token ``i`` goes to experts ``i k`` ... ``i k + k - 1``
    (mod the expert count) with equal weights, so every expert gets the same share and a token's ``k`` experts are
    consecutive, on as few EP ranks as they can be (one where ``k`` divides the experts per rank). Megatron's
    ``moe_router_force_load_balancing`` balances by random logits instead (experts drawn at random)."""
    expert_kernels: Literal["megatron", "automodel-deepep"] = "megatron"
    """Whose code runs the routed experts' element-wise work around their grouped GEMMs: ``megatron``,
    megatron-core's ``TEGroupedMLP`` (the first bias in the grouped GEMM, the second added by ``_apply_bias``, a
    clamped GLU's clamps as eager ops outside the fused activation); ``automodel-deepep``, NeMo AutoModel's
    ``GroupedExpertsDeepEP`` (``nemo_automodel/components/moe/layers.py`` at 89e3a9fdd, its DeepEP path): the
    grouped GEMMs are ``grouped_gemm``'s ``ops.gmm``, without a bias, so both biases are added by its per-expert
    ``_apply_bias`` loop and concatenation, and the clamped GLU is one function compiled by ``torch.compile``
    (``quick_geglu_deepep``: the clamps inside the activation's kernel). Needs the flex dispatcher (DeepEP)."""
    moe_expert_load_imbalance: float | None = None
    """The busiest expert group's tokens over the mean (>= 1): expert GEMMs and the all-to-all take that much
    longer on the rank that holds it. None: 1 (uniform routing; no public figure for trained routers is
    shipped, so set it from your own router statistics)."""
    moe_expert_capacity_factor: float | None = None
    """Token drop: each expert takes at most this many times its share of the token copies (None: dropless)."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: every expert computes its full capacity (padded), so sizes are known in advance
    and the dispatcher never waits for token counts on the host."""
    moe_permute_fusion: bool = False
    """megatron-core's fused permutation (Transformer Engine's ``moe_permute`` / ``moe_unpermute`` / ``moe_sort_chunks_by_index``):
    one kernel for each permutation of the token copies where the unfused path issues several (the host's
    work, :mod:`~primuspipe.projection.host`; the copies' bytes are the same)."""
    moe_router_fusion: bool = False
    """megatron-core's fused router: the score function and top-k in one kernel (the auxiliary loss stays apart)."""
    enable_primus_turbo: bool = False
    """Primus: turn on Primus-Turbo (AMD's kernels, ``primus/configs/modules/megatron/primus_turbo.yaml``); every
    ``use_turbo_*`` / ``turbo_*`` setting below needs it, as Primus asserts."""
    turbo_sync_free_moe_stage: int = 0
    """Primus's sync-free MoE (0-3; ``rocm_arg_validation.py``, ``_get_sync_free_moe_options``): each stage turns
    other settings on as Primus does -- 1: ``moe_use_fused_router_with_aux_score`` and ``moe_permute_fusion``; 2:
    also ``use_turbo_deepep`` and ``use_turbo_grouped_gemm`` (which it requires), and DeepEP sized for the worst
    case (``num_worst_tokens``) with the token counts kept on the GPU, so no MoE layer waits for the host;
    3: also ``use_turbo_fused_act_with_probs``."""
    moe_use_fused_router_with_aux_score: bool = False
    """Primus-Turbo's fused router: score function, top-k and the auxiliary loss's scores in one kernel."""
    use_turbo_deepep: bool = False
    """Primus-Turbo's DeepEP dispatcher (it replaces megatron-core's flex dispatcher, so
    ``moe_token_dispatcher_type`` becomes ``flex`` as Primus sets it); needs ``moe_router_dtype: fp32``."""
    turbo_deepep_num_cu: int = 32
    """Compute units Primus-Turbo's DeepEP kernels run on (Primus's ``turbo_deepep_num_cu``: 32 by default,
    ``primus/configs/modules/megatron/primus_turbo.yaml``; the MoE package's launch scripts pass 64, the Qwen3-30B
    FP8 recipe 80). DeepEP's intranode kernels move rows with the units they hold, so where the hardware file
    gives their rate (``deepep_sm_bandwidth_bytes_per_s``) this bounds the dispatch's speed
    (:func:`~primuspipe.projection.comm.layer_comm`); it is the dispatcher's SM count with ``use_turbo_deepep``."""
    use_turbo_grouped_gemm: bool = False
    """Primus-Turbo's grouped GEMM: all local experts in one kernel launch instead of one GEMM per expert, whose
    waves hold tiles of all experts (the ``fused`` path of ``moe_expert_gemm``, whatever that field says)."""
    use_turbo_fused_act_with_probs: bool = False
    """Primus-Turbo: the experts' activation and the routing-probability weighting in one kernel."""
    cuda_graph_impl: Literal["none", "local", "transformer_engine", "full_iteration"] = "none"
    """Megatron's CUDA graphs (``--enable-cuda-graph`` is ``local``, ``--external-cuda-graph``
    ``transformer_engine``): captured regions replay with one launch, which removes their host time."""
    cuda_graph_modules: tuple[str, ...] = ()
    """Regions of each layer captured (``attn``, ``mlp``, ``moe``, ``moe_router``, ``moe_preprocess``); empty:
    the whole layer, as Megatron reads it."""
    mtp_num_layers: int | None = None
    """DeepSeek-V3's multi-token prediction: this many extra layers (each with its own projection and the
    shared output head) on the last pipeline stage."""
    pipeline_model_parallel_layout: str | None = None
    """Megatron's explicit layout, e.g. ``"Et|(tt|)*30mL"``: one ``|``-separated stage per pp * vpp, in model
    order, ``t`` a transformer layer, ``E`` the embedding, ``m`` an MTP module, ``L`` the loss."""
    account_for_embedding_in_pipeline_split: bool = False
    """Megatron: the embedding counts as one layer when layers are split over pipeline stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Megatron: the output layer and loss count as one layer when layers are split over pipeline stages."""
    source: str = "<built-in defaults>"
    """Where the values came from; named in error messages."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.precision == "fp8":
            object.__setattr__(self, "precision", "bf16")
            object.__setattr__(self, "fp8_format", self.fp8_format or "hybrid")
        if self.recompute_num_layers == 0 and self.recompute_granularity != "full":
            object.__setattr__(self, "recompute_num_layers", None)  # Megatron recipes write 0 for "unset"
        if self.recompute_granularity is None and self.recompute_method is not None and not self.recompute_num_layers:
            object.__setattr__(self, "recompute_method", None)
        self._check()
        self._enable_sync_free_moe()

    def _enable_sync_free_moe(self) -> None:
        """What Primus's ``turbo_sync_free_moe_stage`` and ``use_turbo_deepep`` turn on, set as Primus sets it
        (``rocm_arg_validation.py``: the stage's options after its checks; the DeepEP patch: the flex dispatcher)."""
        for name in SYNC_FREE_MOE_OPTIONS[self.turbo_sync_free_moe_stage]:
            object.__setattr__(self, name, True)
        if self.turbo_sync_free_moe_stage and self.fp8:
            object.__setattr__(self, "moe_router_padding_for_quantization", True)
        if self.use_turbo_deepep:
            object.__setattr__(self, "moe_token_dispatcher_type", "flex")

    @property
    def moe_syncs_free(self) -> bool:
        """No MoE layer waits for token counts on the host: Primus's sync-free stage 2 and up size DeepEP's
        receive buffer for the worst case and keep the counts on the GPU for the grouped GEMM."""
        return self.turbo_sync_free_moe_stage >= 2

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (Megatron ignores the flag at TP = 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def dense_data_parallel_size(self) -> int:
        """Ranks holding the same dense parameters (gradients reduced and optimizer state sharded over them)."""
        return self.dp * self.cp

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts: a stage's TP * CP * DP ranks over the ETP * EP that split them."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def microbatches(self) -> int:
        """Microbatches one pipeline runs per step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def pipeline_flushes(self) -> int:
        """Pipeline schedules (flushes) one step runs, one per :attr:`local_batch_size` of each replica."""
        return 1 if self.local_batch_size is None else self.global_batch_size // (self.local_batch_size * self.dp)

    @property
    def microbatches_per_flush(self) -> int:
        """Microbatches of one pipeline schedule: the step's when it runs one."""
        return self.microbatches // self.pipeline_flushes

    @property
    def deferred_microbatches(self) -> int:
        """Microbatches of one pipeline schedule whose output-layer weight-gradient GEMM
        ``defer_embedding_wgrad_compute`` runs after the schedule's last backward: the first
        ``wgrad_deferral_limit`` of them (every one at 0), none without it."""
        if not self.defer_embedding_wgrad_compute:
            return 0
        m = self.microbatches_per_flush
        return m if self.wgrad_deferral_limit == 0 else min(m, self.wgrad_deferral_limit)

    def with_microbatches(self, microbatches: int) -> TrainingSpec:
        """This configuration (one flush) with ``microbatches`` per replica, as a shorter pipeline simulated in
        its place (:func:`~primuspipe.projection.projection.sampled_microbatches`) runs it: the global batch
        scaled, and under a partial deferral the same microbatches at the end running the output layer's GEMM
        in their own backward, the limit moving with the count (the shorter pipeline leaves out deferred
        microbatches, never those)."""
        assert self.pipeline_flushes == 1, "a shorter pipeline stands for one flush"
        late = self.microbatches - self.deferred_microbatches if self.defer_embedding_wgrad_compute else 0
        assert not late or microbatches > late, f"{microbatches} microbatches cannot end with {late} undeferred"
        return dataclasses.replace(self, global_batch_size=microbatches * self.micro_batch_size * self.dp,
                                   wgrad_deferral_limit=microbatches - late if late else self.wgrad_deferral_limit)

    def one_flush(self) -> TrainingSpec:
        """This configuration with the global batch of one of its pipeline flushes: what one schedule runs."""
        if self.pipeline_flushes == 1:
            return self
        return dataclasses.replace(self, global_batch_size=self.local_batch_size * self.dp, local_batch_size=None)

    def bf16_layers(self, num_layers: int) -> frozenset[int]:
        """Indices of the transformer layers that keep their GEMMs out of FP8 (``first_last_layers_bf16``)."""
        if not (self.fp8 and self.first_last_layers_bf16):
            return frozenset()
        start = min(num_layers, self.num_layers_at_start_in_bf16)
        end = min(num_layers, self.num_layers_at_end_in_bf16)
        return frozenset(range(start)) | frozenset(range(num_layers - end, num_layers))

    def without_fp8(self) -> TrainingSpec:
        """These settings with every GEMM in ``precision`` (for the layers ``first_last_layers_bf16`` keeps)."""
        return dataclasses.replace(self, fp8_format=None, fp8_recipe="delayed", fp8_param_gather=False,
                                   first_last_layers_bf16=False)

    @property
    def fp8(self) -> bool:
        """Linear-layer GEMMs run in FP8."""
        return self.fp8_format is not None

    @property
    def expert_gemm_kernel(self) -> str:
        """The kernel path of the experts' GEMMs (:mod:`~primuspipe.projection.gemm`): Primus-Turbo's grouped
        GEMM is one kernel over all experts (``fused``); otherwise ``moe_expert_gemm``."""
        return "fused" if self.use_turbo_grouped_gemm else self.moe_expert_gemm

    @property
    def legacy_grouped_mlp(self) -> bool:
        """The experts run as the legacy ``GroupedMLP``: it is asked for with grouped GEMMs on and Primus-Turbo's
        grouped GEMM off (Primus's ``grouped_mlp_modules``, ``transformer_engine_spec_provider.py``)."""
        return self.moe_use_legacy_grouped_gemm and self.moe_expert_gemm != "sequential" and not self.use_turbo_grouped_gemm

    @property
    def experts_fp8(self) -> bool:
        """Whether the routed experts' GEMMs run in FP8: under FP8, unless they run as the legacy ``GroupedMLP``,
        whose GEMMs are the ``grouped_gemm`` package's ``gg.ops.gmm`` -- a BF16 GEMM per expert with no FP8 path
        (Primus's ``DeprecatedGroupedMLP``, ``primus/backends/megatron/core/transformer/moe/deprecated_20251209/
        experts.py``, which its ``grouped_mlp_modules`` picks for ``moe_use_legacy_grouped_gemm`` without
        Primus-Turbo's grouped GEMM; the ROCm ``grouped_gemm`` its containers build, caaatch22/grouped_gemm
        branch rocm, calls ``cublasGemmEx`` on BF16 operands). Fp8_autocast does not reach it, so the experts
        run in BF16 (and pad nothing) while the attention, shared-expert and dense linears run in FP8."""
        return self.fp8 and not self.legacy_grouped_mlp

    @property
    def expert_gemm_streams(self) -> int:
        """Expert GEMMs that run at once on the ``multi_stream`` path: the framework's streams, or fewer
        hardware queues on ROCm (``gpu_max_hw_queues``: streams beyond it share queues)."""
        return min(GEMM_STREAMS, self.gpu_max_hw_queues or GEMM_STREAMS)

    @property
    def fp8_alignment(self) -> int:
        """Rows an FP8 GEMM's token dimension must be a multiple of: 32 for MXFP8 (one scale per 32 rows of the
        column-wise copy), 16 for the other recipes (megatron-core ``fp8_utils.get_fp8_align_size``, which
        ``get_align_size_for_quantization`` returns for FP8)."""
        return MXFP8_BLOCK if self.fp8_recipe == "mxfp8" else 16

    @property
    def per_tensor_fp8(self) -> bool:
        """FP8 with one scale per tensor (delayed or current scaling), whose operands Transformer Engine
        quantizes in norm kernels and on sequence-parallel shards (``WorkModel._quantize_bytes``)."""
        return self.fp8 and self.fp8_recipe in ("delayed", "tensorwise")

    @property
    def main_grad_bytes(self) -> int:
        """Bytes of one main-gradient element (what is accumulated, kept and reduced)."""
        if self.precision == "fp32":
            return 4
        return 2 if self.grad_reduce_in_bf16 or self.main_grads_dtype == "bf16" else 4

    @property
    def kept_grad_bytes(self) -> int:
        """Bytes of one gradient element the rank keeps for the optimizer step: Megatron's main gradient
        (:attr:`main_grad_bytes`); under PyTorch's FSDP the sharded parameter's dtype, whatever the reduction ran in
        -- FSDP casts the reduced shard back to it (FSDP2's ``foreach_reduce``: ``_to_dtype_if_needed(reduce_output,
        orig_dtype)``; FSDP1's ``_cast_grad_to_param_dtype``), fp32 in mixed precision; and without a master copy
        (:attr:`master_weights` false) the bf16 parameter's, as PyTorch keeps ``.grad``."""
        if not self.master_weights:
            return 2
        return 4 if self.fsdp_implementation == "torch" else self.main_grad_bytes

    @property
    def shards_gradients(self) -> bool:
        """Main gradients live sharded over the data-parallel group (Megatron-FSDP ``optim_grads`` and
        ``optim_grads_params``), unless PyTorch's pipelining keeps them whole for the step (:attr:`gathered_for_step`)."""
        return (self.use_megatron_fsdp and self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
                and not self.gathered_for_step)

    @property
    def gathered_for_step(self) -> bool:
        """PyTorch FSDP2 under PyTorch's pipelining with ``fsdp_reshard_after_forward`` off: each stage's weights stay
        gathered and its gradients unsharded from the step's first forward to its last backward."""
        return not self.fsdp_reshard_after_forward and self.pp > 1

    @property
    def fsdp2_copies(self) -> bool:
        """FSDP2 copies each gathered layer on the compute stream: ``wait_for_unshard`` runs
        ``foreach_all_gather_copy_out`` (``split_with_sizes_copy`` of the all-gather buffer into the parameters)
        on the current stream, in the layer's pre-forward and again in its pre-backward after a reshard, and
        ``foreach_reduce`` packs the layer's unsharded gradients into the reduce dtype's buffer (``torch.cat`` /
        ``_chunk_cat``) before the reduce-scatter, the compute stream waiting for it (pytorch/pytorch
        ``torch/distributed/_composable/fsdp/_fsdp_param_group.py`` and ``_fsdp_collectives.py`` at 012c62d6 and
        01d66d21, the 2024 layout: the copy-in on the reduce-scatter stream with
        ``current_stream.wait_event(copy_in_event)``;
        ``torch/distributed/fsdp/_fully_shard/`` at 002a76fb: on the current stream). Once a microbatch, as FSDP2
        gathers and reduces every microbatch, unless PyTorch's pipelining keeps the stage gathered for the step
        (:attr:`gathered_for_step`: once a schedule, not priced)."""
        return (self.fsdp_implementation == "torch" and self.torch_fsdp_version == "fsdp2" and self.shards_weights
                and not self.gathered_for_step)

    @property
    def shards_weights(self) -> bool:
        """The weights live sharded too (Megatron-FSDP ``optim_grads_params``, ZeRO-3): each layer's are gathered
        when its forward or backward runs."""
        return self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads_params"

    @property
    def gradients_from_backward(self) -> bool:
        """No gradient is there while the step's forward runs: PyTorch's FSDP with one microbatch per step. The
        training loop frees them before the next step (``optimizer.zero_grad()``, ``set_to_none=True`` since
        torch 2.0; torchtitan calls it as the step begins) and the backward makes each layer's sharded gradient
        as that layer's gradients are reduce-scattered (FSDP2's ``foreach_reduce`` assigns ``sharded_param.grad``
        where it is None), so the gradients grow as the backward frees the activations. Megatron's gradient
        buffers stay allocated; a second microbatch's forward holds the first one's gradients."""
        return self.fsdp_implementation == "torch" and self.microbatches == 1

    @property
    def balanced(self) -> bool:
        """Every expert gets its share of the token copies: forced balance (Megatron) or AutoModel's fake gate."""
        return self.moe_router_force_load_balancing or self.fake_balanced_gate

    @property
    def round_robin_routing(self) -> bool:
        """Token ``t`` goes to experts ``t k`` ... ``t k + k - 1`` (mod the expert count): AutoModel's fake gate, or
        Primus's ``even`` forced balance."""
        return self.fake_balanced_gate or (self.moe_router_force_load_balancing
                                           and self.moe_router_force_load_balancing_type == "even")

    @property
    def load_imbalance(self) -> float:
        """Busiest expert group's load over the mean as set (forced balance: 1, its random spread is
        :attr:`RankShape.load_imbalance`'s); under token drop the capacity caps it, and padding to capacity makes
        every expert compute all of it."""
        return self.capped_load(1.0 if self.balanced or self.moe_expert_load_imbalance is None
                                else self.moe_expert_load_imbalance)

    def capped_load(self, load: float) -> float:
        """``load`` (busiest expert group over the mean) as token drop leaves it: capped at the capacity factor,
        or the capacity itself when every expert is padded to it."""
        if self.moe_expert_capacity_factor is None:
            return load
        return self.moe_expert_capacity_factor if self.moe_pad_expert_input_to_capacity else min(
            load, self.moe_expert_capacity_factor)

    @property
    def dispatcher_sms(self) -> int:
        """SMs the flex dispatcher's kernels hold (``moe_flex_dispatcher_num_sms`` or its backend's default; Primus-Turbo's
        DeepEP: ``turbo_deepep_num_cu``); 0 for the all-to-all and all-gather dispatchers, whose NCCL kernels' share
        is not modelled."""
        if self.moe_token_dispatcher_type != "flex":
            return 0
        if self.use_turbo_deepep:
            return self.turbo_deepep_num_cu
        if self.moe_flex_dispatcher_num_sms is not None:
            return self.moe_flex_dispatcher_num_sms
        return FLEX_DISPATCHER_SMS[self.moe_flex_dispatcher_backend]

    @property
    def flash_attention(self) -> bool:
        return self.attention_backend in ("flash", "fused")

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def hybridep(self) -> bool:
        """The MoE all-to-alls run on HybridEP (the flex dispatcher's ``hybridep`` backend)."""
        return self.moe_token_dispatcher_type == "flex" and self.moe_flex_dispatcher_backend == "hybridep"

    @property
    def keeps_gathered_inputs(self) -> bool:
        """The column-parallel linears keep their sequence-parallel input as gathered for the backward (torchtitan's
        DTensor TP without a recompute of the norms; see ``model_implementation``) instead of its shard."""
        return (self.model_implementation == "torchtitan" and self.sp and not self.recomputes("layernorm")
                and self.recompute_granularity != "op")

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers ``module``."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def captures(self, region: str) -> bool:
        """Whether CUDA graphs capture ``region`` (attn, mlp, moe, moe_router, moe_preprocess) of a layer."""
        if self.cuda_graph_impl == "full_iteration":
            return True
        if self.cuda_graph_impl == "none":
            return False
        return not self.cuda_graph_modules or region in self.cuda_graph_modules

    def _fail(self, names: tuple[str, ...], problem: str, fix: str):
        raise InputError([(self.source, n, getattr(self, n)) for n in names], problem, fix)

    def _check(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
                     "data_parallel_size", "recompute_num_layers", "decoder_first_pipeline_num_layers",
                     "decoder_last_pipeline_num_layers", "mtp_num_layers", "local_batch_size"):
            if getattr(self, name) == 0:
                self._fail((name,), "must be at least 1", "give a positive number (or leave it out for the default)")
        if large := oversized(self, MAX_COUNT, MAX_COUNTS):
            self._fail((large[0],), f"is larger than {large[1]:,}, beyond any run this projects (the layout and the "
                       "arithmetic would not end or not be numbers)", "check the value")
        if self.turbo_deepep_num_cu < 1:
            self._fail(("turbo_deepep_num_cu",), "Primus-Turbo's DeepEP kernels need at least one compute unit",
                       "give the compute units DeepEP runs on (Primus's default is 32)")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            self._fail(("ddp_bucket_size",), "a data-parallel bucket holds at least one parameter",
                       "give a positive number of parameters, or leave it out for megatron-core's default")
        if self.moe_flex_dispatcher_num_sms is not None and self.moe_flex_dispatcher_num_sms < 1:
            self._fail(("moe_flex_dispatcher_num_sms",), "the flex dispatcher's kernels need at least one SM",
                       "give the SMs DeepEP / HybridEP run on (or leave it out for the backend's default)")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            self._fail(("global_batch_size", "micro_batch_size", "data_parallel_size"),
                       "the global batch does not split into whole microbatches per data-parallel replica",
                       f"make global_batch_size a multiple of micro_batch_size * data_parallel_size = "
                       f"{self.micro_batch_size * self.dp}")
        if self.local_batch_size is not None and (self.local_batch_size % self.micro_batch_size
                                                  or self.global_batch_size % (self.local_batch_size * self.dp)):
            self._fail(("local_batch_size", "micro_batch_size", "global_batch_size", "data_parallel_size"),
                       "a replica's global-batch share does not split into whole local batches of whole microbatches",
                       f"make local_batch_size a multiple of micro_batch_size and a divisor of global_batch_size / "
                       f"data_parallel_size = {self.global_batch_size / self.dp:g}, or leave it out (one flush a step)")
        if self.recompute_granularity == "full" and (self.recompute_method is None or self.recompute_num_layers is None):
            self._fail(("recompute_granularity", "recompute_method", "recompute_num_layers"),
                       "full recompute needs a method and a layer count",
                       "set recompute_method (uniform or block) and recompute_num_layers, as Megatron requires")
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers):
            self._fail(("recompute_granularity", "recompute_method", "recompute_num_layers"),
                       "recompute_method and recompute_num_layers apply to full recompute only",
                       "set recompute_granularity: full, or remove them")
        if self.op_recompute_compiled and self.recompute_granularity != "op":
            self._fail(("op_recompute_compiled", "recompute_granularity"), "op_recompute_compiled applies to op "
                       "recompute only", "set recompute_granularity: op, or remove op_recompute_compiled")
        if unknown := set(self.recompute_modules) - set(RECOMPUTE_MODULES):
            self._fail(("recompute_modules",), f"{sorted(unknown)} are not modelled",
                       f"use some of {', '.join(RECOMPUTE_MODULES)}")
        if (self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split) and (
                self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers):
            self._fail(("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"),
                       "Megatron takes either explicit first/last stage layer counts or the embedding/loss accounting",
                       "keep one of the two")
        beside = [name for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                                    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                  if getattr(self, name)]
        if self.pipeline_model_parallel_layout and beside:
            # megatron-core's TransformerConfig raises for it; the layout won here, the other fields unread
            self._fail(("pipeline_model_parallel_layout", *beside), "a layout places every layer itself; Megatron "
                       "refuses it beside other pipeline split settings", "keep the layout or the split settings")
        if self.grad_reduce_in_bf16 and self.precision == "fp32":
            self._fail(("grad_reduce_in_bf16", "precision"), "bf16 gradient reduction is a mixed-precision setting",
                       "set precision: bf16, or remove grad_reduce_in_bf16")
        if self.data_parallel_sharding_strategy != "no_shard" and not (
                self.use_megatron_fsdp and self.use_distributed_optimizer):
            self._fail(("data_parallel_sharding_strategy", "use_megatron_fsdp", "use_distributed_optimizer"),
                       "the sharding strategy applies to Megatron-FSDP only, which needs the distributed optimizer",
                       "set use_megatron_fsdp: true and use_distributed_optimizer: true, or remove the strategy")
        if not self.fsdp_reshard_after_forward and self.fsdp_implementation != "torch":
            self._fail(("fsdp_reshard_after_forward", "fsdp_implementation"),
                       "fsdp_reshard_after_forward is PyTorch FSDP2's setting", "set fsdp_implementation: torch, or remove it")
        if self.torch_fsdp_version != "fsdp2" and self.fsdp_implementation != "torch":
            self._fail(("torch_fsdp_version", "fsdp_implementation"),
                       "torch_fsdp_version says which of PyTorch's FSDPs ran",
                       "set fsdp_implementation: torch, or remove it")
        if self.fsdp_implementation == "torch" and not self.shards_weights:
            self._fail(("fsdp_implementation", "data_parallel_sharding_strategy"),
                       "PyTorch's FSDP is modelled only as it shards everything (FULL_SHARD / fully_shard)",
                       "set use_megatron_fsdp: true and data_parallel_sharding_strategy: optim_grads_params, or "
                       "fsdp_implementation: megatron")
        if not self.master_weights:
            self._check_no_master_copy()
        narrow = (self.main_params_dtype, self.main_grads_dtype) != ("fp32",) * 2 or (
            (self.exp_avg_dtype, self.exp_avg_sq_dtype) != ("fp32",) * 2 and self.master_weights)
        if narrow and not self.use_precision_aware_optimizer:
            self._fail(("use_precision_aware_optimizer", "main_params_dtype", "main_grads_dtype", "exp_avg_dtype",
                        "exp_avg_sq_dtype"), "narrower optimizer dtypes need the precision-aware optimizer (Megatron's rule)",
                       "set use_precision_aware_optimizer: true (or master_weights: false for a PyTorch optimizer's "
                       "own moment dtypes) or keep the dtypes fp32")
        if self.gpu_max_hw_queues is not None and self.gpu_max_hw_queues < 1:
            self._fail(("gpu_max_hw_queues",), "a device needs at least one hardware queue",
                       "give ROCm's GPU_MAX_HW_QUEUES of the run (e.g. 2 or 4), or leave it out")
        if self.moe_expert_load_imbalance is not None and self.moe_expert_load_imbalance < 1:
            self._fail(("moe_expert_load_imbalance",), "the busiest experts cannot carry less than the mean",
                       "give a factor >= 1 (1 = uniform routing)")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            self._fail(("moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"),
                       "padding to capacity needs a capacity (Megatron's rule)",
                       "set moe_expert_capacity_factor (e.g. 1.0) or remove moe_pad_expert_input_to_capacity")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor >= MIN_CAPACITY_FACTOR:
            self._fail(("moe_expert_capacity_factor",),
                       f"a capacity factor must be at least {MIN_CAPACITY_FACTOR:g} (below, experts keep almost no "
                       "token and the priced GEMMs hold fractions of one)",
                       "give e.g. 1.0, or leave it out")
        if unknown := set(self.cuda_graph_modules) - {"attn", "mlp", "moe", "moe_router", "moe_preprocess"}:
            self._fail(("cuda_graph_modules",), f"{sorted(unknown)} are not regions of a transformer layer",
                       "use some of attn, mlp, moe, moe_router, moe_preprocess (empty: the whole layer)")
        if "moe_preprocess" in self.cuda_graph_modules and "moe_router" not in self.cuda_graph_modules:
            self._fail(("cuda_graph_modules",), "moe_preprocess is captured only together with moe_router (Megatron's rule)",
                       "add moe_router")
        if self.fp8_format is None and self.first_last_layers_bf16:
            self._fail(("first_last_layers_bf16", "fp8_format"), "BF16 first and last layers only mean something under FP8",
                       "set fp8_format, or remove first_last_layers_bf16")
        if self.fp8_format is None and (self.fp8_param_gather or self.fp8_recipe != "delayed"):
            self._fail(("fp8_format", "fp8_recipe", "fp8_param_gather"), "an FP8 recipe or FP8 weights without FP8",
                       "set fp8_format (e4m3 or hybrid), or remove fp8_recipe / fp8_param_gather")
        if self.torch_cross_entropy is not None and (self.cross_entropy_loss_fusion or self.tp > 1):
            self._fail(("torch_cross_entropy", "cross_entropy_loss_fusion", "tensor_model_parallel_size"),
                       "PyTorch's cross entropy is a loss of its own over unsharded logits",
                       "remove cross_entropy_loss_fusion (Megatron's loss) and keep TP 1, "
                       "or remove torch_cross_entropy")
        if self.cp_compiled and self.cp_implementation == "te-p2p":
            self._fail(("cp_compiled", "cp_implementation"), "cp_compiled is PyTorch's ring traced by torch.compile",
                       "set cp_implementation to torch-allgather or torch-alltoall, or remove cp_compiled")
        if self.cp_implementation != "te-p2p" and self.context_parallel_size == 1:
            self._fail(("cp_implementation", "context_parallel_size"), "a context-parallel implementation without CP",
                       "set context_parallel_size above 1, or remove cp_implementation")
        if self.tp_comm_overlap_impl != "te-userbuffers" and not (self.tp_comm_overlap and self.sp):
            self._fail(("tp_comm_overlap_impl", "tp_comm_overlap", "sequence_parallel"),
                       "PyTorch's async TP overlaps the all-gathers and reduce-scatters of sequence parallelism",
                       "set tp_comm_overlap and sequence_parallel true, or remove tp_comm_overlap_impl")
        if self.elementwise_kernels == "torchtitan-eager" and (
                self.bias_activation_fusion or self.apply_rope_fusion or self.activation_bytes != 2):
            self._fail(("elementwise_kernels", "bias_activation_fusion", "apply_rope_fusion", "precision"),
                       "torchtitan's eager element-wise ops are unfused and priced for 2-byte activations",
                       "set bias_activation_fusion and apply_rope_fusion false with precision bf16, or remove elementwise_kernels")
        if self.expert_kernels == "automodel-deepep" and self.moe_token_dispatcher_type != "flex":
            self._fail(("expert_kernels", "moe_token_dispatcher_type"),
                       "AutoModel's GroupedExpertsDeepEP runs on DeepEP",
                       "set moe_token_dispatcher_type: flex, or remove expert_kernels")
        if self.fp8_format is not None and self.precision == "fp32":
            self._fail(("fp8_format", "precision"), "FP8 GEMMs need mixed precision", "set precision: bf16")
        self._check_primus_turbo()
        if self.defer_embedding_wgrad_compute and (self.pp == 1 or not self.gradient_accumulation_fusion):
            self._fail(("defer_embedding_wgrad_compute", "pipeline_model_parallel_size", "gradient_accumulation_fusion"),
                       "deferring the output layer's weight gradients needs a pipeline and gradient accumulation "
                       "fusion (megatron-core refuses it otherwise)",
                       "remove defer_embedding_wgrad_compute, or set pipeline_model_parallel_size > 1 and "
                       "gradient_accumulation_fusion: true")
        if (self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers) and self.pp == 1:
            self._fail(("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                        "pipeline_model_parallel_size"), "uneven first/last stages need a pipeline",
                       "remove them or set pipeline_model_parallel_size > 1")

    def _check_no_master_copy(self) -> None:
        """Pure low-precision training (``master_weights: false``) is a setting of plain PyTorch optimizers only."""
        if self.precision == "fp32":
            self._fail(("master_weights", "precision"), "fp32 weights are their own master copy",
                       "remove master_weights, or set precision: bf16 for pure bf16 training")
        if self.use_precision_aware_optimizer:
            self._fail(("master_weights", "use_precision_aware_optimizer"), "Megatron's precision-aware optimizer "
                       "always keeps a master copy (main_params_dtype fp32 or fp16)",
                       "keep master_weights true (main_params_dtype: fp16 narrows the copy), or remove "
                       "use_precision_aware_optimizer")
        if self.fp8_param_gather:
            self._fail(("master_weights", "fp8_param_gather"), "FP8 weights are quantized from a master copy",
                       "keep master_weights true, or remove fp8_param_gather")
        if (self.main_params_dtype, self.main_grads_dtype) != ("fp32", "fp32"):
            self._fail(("master_weights", "main_params_dtype", "main_grads_dtype"), "without a master copy there is no "
                       "main weight or main gradient to narrow (the gradients keep the weights' dtype)",
                       "remove main_params_dtype and main_grads_dtype")

    def _check_primus_turbo(self) -> None:
        """Primus's own rules for its MoE features (``rocm_arg_validation.py``, ``validate_args_on_rocm``)."""
        if self.turbo_sync_free_moe_stage not in SYNC_FREE_MOE_OPTIONS:
            self._fail(("turbo_sync_free_moe_stage",), "Primus's sync-free MoE has stages 0-3", "give 0, 1, 2 or 3")
        turbo = [n for n in PRIMUS_TURBO_FIELDS if getattr(self, n)]
        if turbo and not self.enable_primus_turbo:
            self._fail(("enable_primus_turbo", *turbo), "Primus-Turbo features need Primus-Turbo turned on (Primus asserts it)",
                       "set enable_primus_turbo: true, or remove them")
        if self.turbo_sync_free_moe_stage > 1 and not self.use_turbo_grouped_gemm:
            self._fail(("turbo_sync_free_moe_stage", "use_turbo_grouped_gemm"),
                       "sync-free MoE stages 2 and 3 need Primus-Turbo's grouped GEMM (Primus raises otherwise)",
                       "set use_turbo_grouped_gemm: true, or use stage 1")
        deepep = self.use_turbo_deepep or self.turbo_sync_free_moe_stage > 1
        if deepep and self.moe_router_dtype != "fp32":
            self._fail(("use_turbo_deepep", "turbo_sync_free_moe_stage", "moe_router_dtype"),
                       "Primus-Turbo's DeepEP takes float32 probabilities only (Primus asserts it)",
                       "set moe_router_dtype: fp32")
        if deepep and self.ep * self.etp <= 1:
            self._fail(("use_turbo_deepep", "turbo_sync_free_moe_stage", "expert_model_parallel_size"),
                       "the DeepEP dispatcher needs expert (or expert-tensor) parallelism above 1 (Primus raises otherwise)",
                       "set expert_model_parallel_size > 1, or turn DeepEP off")


SYNC_FREE_MOE_OPTIONS: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("moe_use_fused_router_with_aux_score", "moe_permute_fusion"),
    2: ("moe_use_fused_router_with_aux_score", "moe_permute_fusion", "use_turbo_deepep", "use_turbo_grouped_gemm"),
    3: ("moe_use_fused_router_with_aux_score", "moe_permute_fusion", "use_turbo_deepep", "use_turbo_grouped_gemm",
        "use_turbo_fused_act_with_probs"),
}
"""The settings each of Primus's sync-free MoE stages turns on (``_get_sync_free_moe_options``; under FP8 every
stage also sets ``moe_router_padding_for_quantization``, :meth:`TrainingSpec._enable_sync_free_moe`)."""

PRIMUS_TURBO_FIELDS = ("turbo_sync_free_moe_stage", "moe_use_fused_router_with_aux_score", "use_turbo_deepep",
                       "use_turbo_grouped_gemm", "use_turbo_fused_act_with_probs")
"""Training fields that only act with ``enable_primus_turbo``."""


@dataclass(frozen=True)
class RankShape:
    """What one rank sees of one microbatch: the sizes the memory, time and communication formulas share."""

    model: ModelSpec
    training: TrainingSpec

    @property
    def e(self) -> int:
        """Bytes of one activation element."""
        return self.training.activation_bytes

    @property
    def tokens(self) -> float:
        """T: tokens of one microbatch on one context-parallel rank."""
        return self.training.micro_batch_size * self.model.seq_length / self.training.cp

    @property
    def residual_tokens(self) -> float:
        """T_r: tokens of the residual stream on one rank (sequence parallelism shards it over TP)."""
        return self.tokens / (self.training.tp if self.training.sp else 1)

    @property
    def hidden_bytes(self) -> float:
        """One residual-stream tensor on one rank (T_r x H)."""
        return self.residual_tokens * self.model.hidden_size * self.e

    @property
    def load_imbalance(self) -> float:
        """Busiest expert-parallel rank's token copies over the mean, which every MoE layer waits for. Megatron's
        forced balance draws each token's experts at random (:mod:`~primuspipe.projection.routing`), balanced on
        average only: the expected busiest of the EP ranks' random loads (:func:`~primuspipe.projection.routing.
        busiest_rank_load`, over the microbatch's tokens of the whole EP group), as token drop caps it. A round-robin
        (AutoModel's fake gate, Primus's ``even`` forced balance) is exactly even, and otherwise the set figure holds
        (:attr:`TrainingSpec.load_imbalance`)."""
        t = self.training
        if not self.model.is_moe or not t.moe_router_force_load_balancing or t.round_robin_routing:
            return t.load_imbalance
        tokens = self.residual_tokens * t.etp * t.ep
        return t.capped_load(busiest_rank_load(self.model, t.ep, tokens))

    @property
    def fp8_padding_copies(self) -> bool:
        """Whether the experts copy their token copies into a padded buffer and back under FP8.

        FP8 GEMMs need every expert's token count to be a multiple of the quantization alignment
        (``TrainingSpec.fp8_alignment``). megatron-core's experts pad
        them themselves under FP8 (``TEGroupedMLP.forward``: ``Fp8Padding`` before the first linear,
        ``Fp8Unpadding`` after the second; ``SequentialMLP`` per expert), and Transformer Engine's ``Fp8Padding``
        copies only when some count is not aligned (``fp8_padding.py``: ``if m_splits == padded_m_splits: return``;
        ``fused_multi_row_padding`` otherwise) -- megatron-core core_r0.16 and TE 2.12, the NeMo 26.02 container's.
        The counts arrive aligned, and nothing is copied, where the router pads the routing map
        (``moe_router_padding_for_quantization``), where HybridEP's dispatch pads them
        (``moe_flex_dispatcher_backend: hybridep``), and where every expert is padded to a capacity that is a
        multiple of the alignment (``get_capacity``: ``ceil(T_r k / E * factor)`` per source rank). A round-robin
        (:attr:`TrainingSpec.round_robin_routing`) sends every expert ``floor`` or ``ceil`` of ``T_r k / E`` copies
        from each of the ``EP x ETP`` source ranks alike, so an expert's count is that many times one of the two:
        aligned only where both are. Otherwise (dropless, megatron-core's forced balance, whose counts are random)
        some count is not aligned. Primus-Turbo's grouped GEMM (``use_turbo_grouped_gemm``) is not megatron-core's
        ``TEGroupedMLP`` and is left out."""
        m, t = self.model, self.training
        if not (t.experts_fp8 and m.is_moe) or t.use_turbo_grouped_gemm or t.moe_router_padding_for_quantization:
            return False
        if t.moe_token_dispatcher_type == "flex" and t.moe_flex_dispatcher_backend == "hybridep":
            return False
        if t.moe_expert_capacity_factor is not None and t.moe_pad_expert_input_to_capacity:
            capacity = math.ceil(self.residual_tokens * m.moe_router_topk / m.num_experts * t.moe_expert_capacity_factor)
            return capacity % t.fp8_alignment != 0
        if t.round_robin_routing:
            sent = int(self.residual_tokens) * m.moe_router_topk
            counts = (sent // m.num_experts, -(-sent // m.num_experts))
            return any(t.ep * t.etp * count % t.fp8_alignment for count in counts)
        return True

    @property
    def rope_fused(self) -> bool:
        """Whether queries and keys are rotated by Transformer Engine's fused kernel: ``apply_rope_fusion``, unless
        the rotary cos and sin carry a concentration factor (YaRN's), which megatron-core's ``apply_rotary_pos_emb``
        hands to its unfused ``_apply_rotary_pos_emb_bshd`` ("mscale ... is not supported by TE's fused RoPE",
        ``megatron/core/models/common/embeddings/rope_utils.py`` line 279 at the Megatron-LM commits Megatron-Bridge
        26.02 and 26.02.01 pin, b0cc270 and 55ac708; core_v0.15.0 still ran the fused kernel and dropped the
        factor). Never for torchtitan's Llama (``model_implementation: torchtitan``): its ``apply_rotary_emb``
        multiplies complex numbers (``view_as_complex``), and inductor generates no code for complex operators
        (``torch/_inductor/lowering.py`` ``unsupported_input_tensor``: "Torchinductor does not support code generation
        for complex operators", the warning torchtitan's compiled Llama prints, pytorch/torchtitan issue 15, open since
        2024-01; opt-in complex compilation only from torch 2.14), so compiled or not it runs as aten kernels."""
        return (self.training.apply_rope_fusion and self.model.rope_concentration == 1.0
                and self.training.model_implementation != "torchtitan")


MIN_CAPACITY_FACTOR = 0.01
"""Smallest ``moe_expert_capacity_factor``: 1 % of an expert's share of the tokens; smaller ones drop nearly every
token, and the projection, which prices token counts as real numbers, would time GEMMs of a fraction of a row
(at 1e-4, a step slower than dropless)."""
MAX_COUNT = 2**31
"""Largest batch, parallel size or kernel count a training setup may give (no run is near)."""
MAX_COUNTS = {name: 100_000 for name in ("recompute_num_layers", "decoder_first_pipeline_num_layers",
                                         "decoder_last_pipeline_num_layers", "mtp_num_layers")}
"""Layer counts: as the model's num_layers (the projection keeps one entry per layer)."""


def load_training(path: str | Path | None) -> TrainingSpec:
    """A :class:`TrainingSpec` from a training YAML file, or the built-in defaults when ``path`` is None."""
    if path is None:
        return TrainingSpec()
    return spec_from_mapping(TrainingSpec, read_yaml(path, "training"), str(path))


def check_compatible(model: ModelSpec, training: TrainingSpec) -> None:
    """Raise one :class:`InputError` for the first way ``training`` cannot train ``model``."""
    def fail(model_fields: tuple[str, ...], training_fields: tuple[str, ...], problem: str, fix: str):
        places = [(model.source, n, getattr(model, n)) for n in model_fields]
        places += [(training.source, n, getattr(training, n)) for n in training_fields]
        raise InputError(places, problem, fix)

    tp, pp, vpp = training.tp, training.pp, training.vpp
    if model.num_attention_heads % tp or model.query_groups % tp:
        fail(("num_attention_heads", "num_query_groups"), ("tensor_model_parallel_size",),
             "attention heads and key/value groups must split evenly over TP ranks",
             f"use a TP that divides both (one of {_divisors(_gcd(model.num_attention_heads, model.query_groups))})")
    if model.ffn % tp:
        fail(("ffn_hidden_size",), ("tensor_model_parallel_size",), "the MLP width must split evenly over TP ranks",
             f"use a TP that divides {model.ffn}")
    slots = training.account_for_embedding_in_pipeline_split + training.account_for_loss_in_pipeline_split
    if training.pipeline_model_parallel_layout:
        slots = pp * vpp  # the layout says which stages hold no transformer layer
    if model.num_layers + slots < pp * vpp:
        fail(("num_layers",), ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"),
             f"{model.num_layers} layers cannot fill pp * vpp = {pp * vpp} pipeline stages",
             "lower pp or vpp so that every stage holds at least one layer")
    if model.seq_length % (2 * training.cp) and training.cp > 1:
        fail(("seq_length",), ("context_parallel_size",), "context parallelism splits the sequence into 2 * CP chunks",
             f"use a CP with seq_length divisible by 2 * CP ({model.seq_length} is not)")
    # Megatron builds the expert grid (and checks it tiles) for dense models too
    if (tp * training.cp * training.dp) % (training.etp * training.ep):
        fail((), ("expert_model_parallel_size", "expert_tensor_parallel_size", "tensor_model_parallel_size",
                  "context_parallel_size", "data_parallel_size"),
             "expert parallel groups (ETP * EP ranks) must tile the TP * CP * DP ranks of a pipeline stage",
             "make TP * CP * DP a multiple of ETP * EP (e.g. raise data_parallel_size)")
    if model.is_moe:
        if model.num_experts % training.ep:
            fail(("num_experts",), ("expert_model_parallel_size",), "experts must split evenly over EP ranks",
                 f"use an EP that divides {model.num_experts} (one of {_divisors(model.num_experts)})")
        if model.expert_ffn % training.etp or (model.moe_shared_expert_intermediate_size or 0) % tp:
            fail(("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"),
                 ("expert_tensor_parallel_size", "tensor_model_parallel_size"),
                 "expert widths must split evenly over their tensor-parallel ranks", "pick divisors of the widths")
        if training.captures("moe") and not training.moe_pad_expert_input_to_capacity:
            fail((), ("cuda_graph_impl", "cuda_graph_modules", "moe_pad_expert_input_to_capacity"),
                 "CUDA graphs capture an MoE layer only when its experts are padded to capacity (Megatron's rule)",
                 "capture attn / moe_router / moe_preprocess only, or set moe_expert_capacity_factor and "
                 "moe_pad_expert_input_to_capacity")
        if (training.moe_expert_load_imbalance or 1) > model.num_experts / model.moe_router_topk:
            fail(("num_experts", "moe_router_topk"), ("moe_expert_load_imbalance",),
                 "an expert cannot get more than every token (each token picks moe_router_topk distinct experts), "
                 f"so the busiest carries at most num_experts / moe_router_topk = "
                 f"{model.num_experts / model.moe_router_topk:g} times the mean",
                 "give your router's measured busiest-over-mean load (>= 1), or leave it out for uniform routing")
        if tp > 1 and not training.sequence_parallel:
            fail(("num_experts",), ("tensor_model_parallel_size", "sequence_parallel"),
                 "Megatron requires sequence parallelism for MoE layers with TP > 1", "set sequence_parallel: true")
    elif training.ep > 1:
        fail(("num_experts",), ("expert_model_parallel_size",), "a dense model has no experts to spread",
             "set expert_model_parallel_size: 1")
    if training.recompute_granularity == "op":
        beyond = [(m, t) for m, t, out in ((("num_experts",), (), model.is_moe),
                                           (("multi_latent_attention",), (), model.multi_latent_attention),
                                           ((), ("context_parallel_size",), training.cp > 1),
                                           ((), ("attention_backend",), not training.flash_attention)) if out]
        if beyond:
            fail(beyond[0][0], ("recompute_granularity", *beyond[0][1]),
                 "op recompute is modelled for torchtitan's dense Llama block (wq, wk, wv, wo, w1, w3, w2) with a "
                 "flash attention kernel and without context parallelism only",
                 "use selective or full recompute for this model or layout")
    if training.recompute_granularity == "full" and training.recompute_num_layers > max(1, model.num_layers // (pp * vpp)):
        fail(("num_layers",), ("recompute_num_layers", "pipeline_model_parallel_size"),
             "recompute_num_layers exceeds the layers of one model chunk",
             f"use at most {model.num_layers // (pp * vpp)}")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
