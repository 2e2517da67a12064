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
``grad_reduce_in_bf16`` keeps 2-byte main gradients. Megatron-FSDP's ``optim_grads`` strategy shards the main gradients as well (ZeRO-2);
``optim_grads_params`` the weights too (ZeRO-3), and holds two layers' weights gathered at a time (the one
computing and the next one, prefetched: Megatron-FSDP's double buffer); PyTorch FSDP2 without resharding after
forward (``fsdp_reshard_after_forward: false``) holds all of the rank's, and under PyTorch's pipelining its whole
gradients as well (``TrainingSpec.gathered_for_step``).
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

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def static_memory(params: ParamCount, training: TrainingSpec, layers: int = 1) -> StaticMemory:
    """Weights (1 byte with ``fp8_param_gather``), main gradients and optimizer state (master weight and
    two moments, in the precision-aware optimizer's dtypes when it is on); ``layers``: the rank's transformer
    layers, the unit sharded weights are gathered in. PyTorch's FSDP keeps no weight shard of its own: its
    shard is the master weight."""
    t = training
    if t.precision == "fp32":
        weight, grad, state = 4, 4, 8
    else:
        weight = (2 + 2 / MXFP8_BLOCK if t.fp8_recipe == "mxfp8" else 1) if t.fp8_param_gather else 2
        grad = t.main_grad_bytes
        state = _BYTES[t.main_params_dtype] + _BYTES[t.exp_avg_dtype] + _BYTES[t.exp_avg_sq_dtype]
    gradients = sharded_params(params, training) if t.shards_gradients else params.total
    # the layer computing and the next one, prefetched; all of them where FSDP2 keeps them from forward to backward
    gathered = 2 * params.total / max(1, layers) if t.fsdp_reshard_after_forward else params.total
    shard = 0.0 if t.fsdp_implementation == "torch" else sharded_params(params, training)  # torch's is the fp32 one
    weights = shard + gathered if t.shards_weights else params.total
    return StaticMemory(weight * min(weights, params.total), grad * gradients, state * optimizer_params(params, training))


def optimizer_params(params: ParamCount, training: TrainingSpec) -> float:
    """Parameters whose optimizer state (and update) one rank holds: its shard under the distributed optimizer."""
    return sharded_params(params, training) if training.use_distributed_optimizer else params.total


def sharded_params(params: ParamCount, training: TrainingSpec) -> float:
    """One rank's shard of its parameters: dense ones over the data-parallel group, expert ones over the
    expert-data-parallel group."""
    t = training
    return params.dense / t.dense_data_parallel_size + params.expert / t.expert_data_parallel_size
