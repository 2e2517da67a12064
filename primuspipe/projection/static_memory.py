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
    if t.precision == "fp32":
        weight, grad, state = 4, 4, 8
    else:
        weight = (2 + 2 / MXFP8_BLOCK if t.fp8_recipe == "mxfp8" else 1) if t.fp8_param_gather else 2
        grad = t.main_grad_bytes
        state = _BYTES[t.main_params_dtype] + _BYTES[t.exp_avg_dtype] + _BYTES[t.exp_avg_sq_dtype]
    gradients = sharded_params(params, training) if t.shards_gradients else params.total
    if t.fsdp_implementation == "torch":  # the shard is the fp32 one; the root unit stays gathered
        in_layers = params.total - outside_layers
        # the layer computing and the next one, prefetched; all of them where FSDP2 keeps them from forward to backward
        gathered = (2 * in_layers / max(1, layers) if t.fsdp_reshard_after_forward else in_layers) + outside_layers
        shard = 0.0
    else:  # the layer computing and the next one, prefetched
        gathered, shard = 2 * params.total / max(1, layers), sharded_params(params, training)
    weights = shard + gathered if t.shards_weights else params.total
    return StaticMemory(weight * min(weights, params.total), grad * gradients, state * optimizer_params(params, training),
                        t.gradients_from_backward)


def optimizer_params(params: ParamCount, training: TrainingSpec) -> float:
    """Parameters whose optimizer state (and update) one rank holds: its shard under the distributed optimizer."""
    return sharded_params(params, training) if training.use_distributed_optimizer else params.total


def sharded_params(params: ParamCount, training: TrainingSpec) -> float:
    """One rank's shard of its parameters: dense ones over the data-parallel group, expert ones over the
    expert-data-parallel group."""
    t = training
    return params.dense / t.dense_data_parallel_size + params.expert / t.expert_data_parallel_size
