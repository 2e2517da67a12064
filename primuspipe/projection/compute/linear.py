"""Linear layers and MLPs as GEMMs: each linear's forward, input-gradient and weight-gradient GEMMs with its FP8
operand casts (:mod:`.fp8`), split or fused as the model's code runs them, and as PyTorch's async TP splits them.

Attention projections, experts, the router and the output layer are all built from :meth:`LinearWork._linear`,
so a GEMM's shape is decided in one place.
"""

from __future__ import annotations

from dataclasses import replace

from primuspipe.projection.compute.fp8 import Fp8CastWork
from primuspipe.projection.compute.work import PassWork, Work, sum_passes
from primuspipe.projection.gemm import Gemm


class LinearWork(Fp8CastWork):
    """The GEMMs of one rank's linear layers for one microbatch."""

    def _linear(self, tokens: float, fan_in: float, fan_out: float, *, groups: float = 1, fp8: bool | None = None,
                norm_fed: bool = False, tensor_parallel: str = "", stretch: float = 1.0,
                split: tuple[float, ...] = ()) -> PassWork:
        """A linear layer over ``tokens``: its forward, input-gradient and weight-gradient GEMMs. Under FP8
        the input and the output gradient are quantized first (:meth:`_quantize_bytes`): ``norm_fed``, the input
        is a norm's output (a LayerNormLinear); ``tensor_parallel`` ``column`` or ``row``, the layer's TP split,
        which says (with sequence parallelism) whether its input or its output gradient is all-gathered;
        ``stretch``, the share of copies the experts hold beyond ``tokens`` (:attr:`Gemm.stretch`); ``split``, the
        output widths (summing to ``fan_out``) of the separate linears that share this input where the model's code
        does not fuse them (:meth:`_separate_linears`): a GEMM each, their input cast once."""
        fp8 = self.training.fp8 if fp8 is None else fp8
        gemms = [Gemm(tokens, width, fan_in, groups, fp8, mxfp8=fp8 and self.training.fp8_recipe == "mxfp8",
                      kernel=self.training.expert_gemm_kernel, streams=self.training.expert_gemm_streams, stretch=stretch)
                 for width in split or (fan_out,)]
        assert abs(sum(g.n for g in gemms) - fan_out) <= 1e-9 * fan_out, "split widths sum to fan_out"
        runs = [self._async_tp_split(gemm, tensor_parallel) for gemm in gemms]
        forward = Work(tuple(f for f, _ in runs))
        dgrad = Work(tuple(d for _, d in runs))
        wgrad = Work(tuple(g.wgrad() for g in gemms))
        if not fp8:
            return PassWork(forward, dgrad, wgrad)
        sp = self.training.sp
        elements = tokens * groups * stretch
        fwd = self._cast(elements * fan_in, norm_fed=norm_fed, gathered=sp and tensor_parallel == "column")
        bwd = self._cast(elements * fan_out, gathered=sp and tensor_parallel == "row")
        return PassWork(forward + fwd, dgrad + bwd, wgrad)

    def _separate_linears(self, *widths: float) -> tuple[float, ...]:
        """The output widths of linears that megatron-core fuses into one GEMM (QKV; SwiGLU's gate and up) where
        the model's code keeps them apart (``model_implementation: torchtitan``: ``wq``, ``wk``, ``wv``; ``w1``,
        ``w3``), else () -- one GEMM."""
        return widths if self.training.model_implementation == "torchtitan" else ()

    def _async_tp_split(self, gemm: Gemm, tensor_parallel: str) -> tuple[Gemm, Gemm]:
        """The forward and input-gradient GEMMs of a linear split over TP as they run: whole, except under PyTorch's
        async TP (``tp_comm_overlap_impl: torch-async-tp``), whose fused collectives run their matmul as ``TP``
        matmuls of ``m / TP`` rows one after another, one per step (``_pipelined_all_gather_and_consume`` calls
        the matmuls once per gathered shard, ``_pipelined_produce_and_all2all`` once per destination rank; torch
        ``distributed/_symmetric_memory``): a column-parallel linear's forward (fed by the gather) and a
        row-parallel linear's forward (feeding the reduce-scatter) and input gradient (fed by the gather of the
        output gradient; see :meth:`~primuspipe.projection.comm.LayerComm.exposed`)."""
        t = self.training
        if not (t.tp_comm_overlap and t.tp_comm_overlap_impl == "torch-async-tp" and t.tp > 1 and tensor_parallel):
            return gemm, gemm.dgrad()
        split = replace(gemm, m=gemm.m / t.tp, groups=gemm.groups * t.tp, kernel="sequential")
        return split, split.dgrad() if tensor_parallel == "row" else gemm.dgrad()

    def _mlp(self, tokens: float, width: float, *, groups: float = 1, dense: bool = False, stretch: float = 1.0,
             fp8: bool | None = None) -> PassWork:
        """Up (gated with SwiGLU) and down projections of an MLP ``width`` wide on this rank; ``dense``: a dense
        layer's MLP, whose up projection takes the pre-MLP norm's output (a LayerNormLinear) and which is split
        over TP column-wise, then row-wise; ``stretch`` and ``fp8``: see :meth:`_linear`."""
        h = self.model.hidden_size
        up, down = ("column", "row") if dense else ("", "")
        gate = self._separate_linears(width, width) if dense and self.model.swiglu else ()
        return sum_passes(self._linear(tokens, h, width * (2 if self.model.swiglu else 1), groups=groups,
                                       norm_fed=dense, tensor_parallel=up, stretch=stretch, fp8=fp8, split=gate),
                          self._linear(tokens, width, h, groups=groups, tensor_parallel=down, stretch=stretch, fp8=fp8))
