"""Bytes of weights, gradients and optimizer state per rank, as megatron-core keeps them.

Mixed precision (bf16/fp16, Megatron's ``DistributedDataParallel`` with fp32 gradient accumulation and
its ``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params``; Rajbhandari et al. 2020, "ZeRO")
keeps per parameter: the 2-byte weight, a 4-byte fp32 main gradient, and for Adam a 4-byte fp32
master weight and two 4-byte moments. The distributed optimizer shards the 12 optimizer bytes over the
data-parallel group -- DP * CP ranks for dense parameters, the expert-data-parallel group
(TP * CP * DP / (ETP * EP) ranks) for expert parameters -- giving Megatron's ``6 + 12/d`` bytes per
parameter; without it every rank keeps all 18. fp32 training keeps a 4-byte weight and gradient and
8 bytes of moments (the weight is its own master copy). Megatron's precision-aware optimizer narrows
the master weight, main gradient and moments to the dtypes given; FP8 weights (``fp8_param_gather``)
take 1 byte, MXFP8 ones ``2 + 2/32``: Transformer Engine keeps an FP8 weight for both GEMM orientations
(``module/base.py``, ``reset_parameters``: ``set_usage(rowwise=True, columnwise=...)``), and MXFP8's column-wise
copy is a second quantization with its own E8M0 scales, not a view of the row-wise one (megatron-core gathers
MXFP8 weights in bf16 into the gradient buffer, ``reuse_grad_buf_for_mxfp8_param_ag``, so no bf16 copy stays);
``grad_reduce_in_bf16`` keeps 2-byte main gradients. Without a master copy (``master_weights: false``: a PyTorch
optimizer over a bf16 model) the optimizer steps the 2-byte weights and keeps 2-byte gradients; torchtitan's pure
bf16 (``training.dtype = "bfloat16"``) has bf16 moments too. Megatron-FSDP's ``optim_grads`` strategy shards the main gradients as well (ZeRO-2);
``optim_grads_params`` the weights too (ZeRO-3), and holds two layers' weights gathered at a time (the one
computing and the next one, prefetched: Megatron-FSDP's double buffer); PyTorch FSDP2 without resharding after
forward (``fsdp_reshard_after_forward: false``) holds all of the rank's, and under PyTorch's pipelining its whole
gradients as well (``TrainingSpec.gathered_for_step``). Under PyTorch's FSDP with one microbatch per step the
gradients are made by the backward, so they never meet the forward's activations
(:attr:`~primuspipe.projection.training_spec.TrainingSpec.gradients_from_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass

from primuspipe.projection.parameters import ParamCount
from primuspipe.projection.training_spec import MXFP8_BLOCK, TrainingSpec


@dataclass(frozen=True)
class StaticMemory:
    """One rank's bytes that live for the whole step."""

    weights: float
    gradients: float
    optimizer: float
    gradients_from_backward: bool = False
    """The gradients appear during the backward as the activations go (PyTorch's FSDP, one microbatch per
    step): the rank's two moments are its activations' peak beside weights and optimizer state
    (:attr:`beside_activations`) and the end of the backward, every gradient and no activation (:attr:`total`)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def gradients_beside_activations(self) -> float:
        """The gradients under the activations' peak. Each layer's backward frees its saved inputs and adds its
        gradient shard, so between the two moments the sum moves one way and the peak is at one of them."""
        return 0.0 if self.gradients_from_backward else self.gradients

    @property
    def beside_activations(self) -> float:
        return self.weights + self.gradients_beside_activations + self.optimizer


_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def static_memory(params: ParamCount, training: TrainingSpec, layers: int = 1, outside_layers: float = 0.0
                  ) -> StaticMemory:
    """Weights (1 byte with ``fp8_param_gather``), main gradients and optimizer state (master weight and
    two moments, in the precision-aware optimizer's dtypes when it is on); ``layers``: the rank's transformer
    layers, the unit sharded weights are gathered in; ``outside_layers``: of ``params``, those outside them
    (embedding, final norm, output layer). PyTorch's FSDP keeps no weight shard of its own: its shard is the
    master weight; and its root unit, which holds what lies outside the layers when each layer is wrapped
    alone (torchtitan's ``apply_fsdp``, ``transformer_auto_wrap_policy``), stays gathered from the forward
    through the backward: FSDP1's ``_post_forward_reshard`` frees nothing of the root ("with the intention that
    they are immediately used for backward"), nor does FSDP2 (``FSDPState._lazy_init``: the root's
    ``post_forward_mesh_info = None``)."""
    t = training
    weight, grad = weight_bytes(t), t.kept_grad_bytes
    state = master_bytes(t) + moment_bytes(t)
    gradients = sharded_params(params, training) if t.shards_gradients else params.total
    if t.fsdp_implementation == "torch":  # the shard is what the optimizer steps (master_bytes); the root stays gathered
        in_layers = params.total - outside_layers
        # the layer computing and the next one, prefetched; all of them where FSDP2 keeps them from forward to backward
        gathered = (2 * in_layers / max(1, layers) if t.fsdp_reshard_after_forward else in_layers) + outside_layers
        shard = 0.0
    else:  # the layer computing and the next one, prefetched
        gathered, shard = 2 * params.total / max(1, layers), sharded_params(params, training)
    weights = shard + gathered if t.shards_weights else params.total
    return StaticMemory(weight * min(weights, params.total), grad * gradients, state * optimizer_params(params, training),
                        t.gradients_from_backward)


def weight_bytes(training: TrainingSpec) -> float:
    """Bytes of one model weight: 4 in fp32 training, 1 with ``fp8_param_gather`` (MXFP8: both orientations and
    their scales), 2 otherwise."""
    t = training
    if t.precision == "fp32":
        return 4
    return (2 + 2 / MXFP8_BLOCK if t.fp8_recipe == "mxfp8" else 1) if t.fp8_param_gather else 2


def master_bytes(training: TrainingSpec) -> float:
    """Bytes of the optimizer's own copy of one weight: the master weight in ``main_params_dtype``; in fp32
    training none (the weight is its own master); without a master copy (``master_weights: false``) none,
    except under PyTorch's FSDP, where the sharded weight the optimizer steps is the only copy the rank keeps
    (:func:`static_memory` counts no shard beside it) and so stands here at the weight's bytes."""
    t = training
    if t.precision == "fp32" or not t.master_weights:
        return weight_bytes(t) if t.fsdp_implementation == "torch" else 0
    return _BYTES[t.main_params_dtype]


def moment_bytes(training: TrainingSpec) -> float:
    """Bytes of Adam's two moments of one parameter, in ``exp_avg_dtype`` and ``exp_avg_sq_dtype`` (fp32 in fp32
    training)."""
    t = training
    return _BYTES[t.exp_avg_dtype] + _BYTES[t.exp_avg_sq_dtype] if t.precision != "fp32" else 8


def optimizer_step_bytes(training: TrainingSpec) -> float:
    """HBM bytes Adam's step moves per parameter it updates: it reads the gradient (fp32 unless the precision-aware
    optimizer or PyTorch's optimizer reads the kept one, ``kept_grad_bytes``), the master weight and the two
    moments and writes the last three back; with a master copy in mixed precision it also writes the model
    weight (2 bytes: megatron-core copies the updated master into the bf16 parameter); without one (pure bf16,
    fp32 training) it reads and writes the weight itself -- under PyTorch's FSDP that weight is the shard counted
    as its master. Mixed precision with Megatron's defaults: 4 + 4 + 8 read, 4 + 8 + 2 written, 30 bytes."""
    t = training
    master = master_bytes(t)
    # megatron-core's optimizer steps an fp32 copy of each main-gradient shard (``shard_model_grad.float()``) unless
    # Transformer Engine's precision-aware Adam reads it in place (``decoupled_grad``)
    decoupled = t.use_precision_aware_optimizer and (t.main_params_dtype != "fp32" or not t.fp8 or t.fp8_recipe == "delayed")
    grad = t.kept_grad_bytes if decoupled or t.fsdp_implementation == "torch" or not t.master_weights else 4
    if not master:  # the optimizer steps the weight itself, read and written in place
        weight = 2 * weight_bytes(t)
    else:  # the master is the weight (PyTorch's FSDP), or the bf16 weight is written from it
        weight = 0 if t.fsdp_implementation == "torch" else 2
    return grad + 2 * (master + moment_bytes(t)) + weight


def optimizer_params(params: ParamCount, training: TrainingSpec) -> float:
    """Parameters whose optimizer state (and update) one rank holds: its shard under the distributed optimizer."""
    return sharded_params(params, training) if training.use_distributed_optimizer else params.total


def sharded_params(params: ParamCount, training: TrainingSpec) -> float:
    """One rank's shard of its parameters: dense ones over the data-parallel group, expert ones over the
    expert-data-parallel group."""
    t = training
    return params.dense / t.dense_data_parallel_size + params.expert / t.expert_data_parallel_size
