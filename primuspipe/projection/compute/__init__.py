"""Compute time of every pass (F, B, W) of every part of the model on one rank, for one microbatch.

Work is counted per rank as in Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM"): a GEMM over ``n`` tokens with a weight of ``p`` elements costs
``2 n p`` FLOPs forward, the same again for the input gradient (B, "dgrad") and for the weight gradient
(W, "wgrad"). Attention scores and their use (``QK^T`` and ``PV``) cost ``2 * 2 b (s/CP) s a d / TP``
forward; causal masking halves that for flash attention, which skips masked tiles (the unfused kernel
computes the full square), and a sliding window keeps only the key blocks it reaches
(:attr:`~.attention.AttentionWork.window_share`); the model FLOPs behind MFU count what the kernels do. Their
backward is in B: twice the forward (two GEMMs per forward GEMM), more with flash attention, which recomputes
the scores (Dao 2022, "FlashAttention-2"): ``(3 d_qk + 2 d_v) / (d_qk + d_v)`` times, 2.5 where the query/key and
value widths are equal (:meth:`~.attention.AttentionWork._attention_core`). Element-wise kernels (norms, residual
adds, rotary embedding, the activation function, the unfused softmax, MoE permutation) are memory-bound: each
reads its inputs and writes its output once, forward; twice that backward, in B.

Times: GEMM and attention FLOPs at ``peak * achievable_fraction`` (half of it in fp32), element-wise
bytes at ``HBM bandwidth * memory_bandwidth_fraction``. Recompute re-runs forward work in B: a whole
layer's under full recompute, the recomputed modules' under selective recompute, the GEMMs and element-wise
kernels torchtitan's op policy does not save under op recompute (:meth:`~.work_model.WorkModel._op_recompute`).

A :class:`~.times.Calibration` scales these analytical times by measured factors, per part and pass: from
the layer benchmark (real megatron-core layers timed on the local device) or from a run's dump.

Modules, from the value types up (each prices one concern; :class:`~.work_model.WorkModel` inherits them all):

* ``work`` -- :class:`~.work.Work` and :class:`~.work.PassWork`, the amounts a pass is priced from, and their
  seconds on a hardware spec;
* ``fp8`` -- FP8 casts and transposes of GEMM operands; ``linear`` -- linear layers and MLPs as GEMMs;
* ``mla`` -- head widths and MLA's latent path; ``dropout`` -- dropout kernels; ``unfused_attention`` --
  megatron-core's local attention; ``attention`` -- projections, attention kernels, ring corrections;
* ``moe`` -- the experts' token copies, permutations, scatters, biases, padding and clamp; ``elementwise`` --
  norms, activation, rotary embedding and the other memory-bound kernels of a layer; ``weight_traffic`` -- FSDP2
  copies and gradient accumulation;
* ``work_model`` -- a layer, the embedding, the head, an MTP module and the model FLOPs, assembled from the above;
* ``times`` -- seconds per part and pass, calibration factors, the MoE kernels' overheads and the optimizer step.

What the rest of the projection uses is imported here.
"""

from primuspipe.projection.compute.times import (
    PARTS,
    PASSES,
    Calibration,
    PartTimes,
    kernel_overheads,
    layer_part,
    optimizer_seconds,
    part_times,
)
from primuspipe.projection.compute.work import PassWork, Work
from primuspipe.projection.compute.work_model import FLOP_CONVENTIONS, WorkModel, model_flops_per_token

__all__ = ["FLOP_CONVENTIONS", "PARTS", "PASSES", "Calibration", "PartTimes", "PassWork", "Work", "WorkModel",
           "kernel_overheads", "layer_part", "model_flops_per_token", "optimizer_seconds", "part_times"]
