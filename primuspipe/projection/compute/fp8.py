"""What quantizing a GEMM operand to FP8 moves: Transformer Engine's cast kernels, a per-tensor recipe's transposed
copy, MXFP8's two scaled copies.

Priced apart from the GEMMs because these bytes depend on the recipe, on where the operand comes from (a norm's
output, an all-gathered shard) and on the hardware (Blackwell's FP8 GEMMs take any layout, so make no
transposes), none of which changes the GEMM itself. :mod:`.linear` adds them to every FP8 linear layer.
"""

from __future__ import annotations

from primuspipe.projection.compute.work import Work
from primuspipe.projection.training_spec import MXFP8_BLOCK, RankShape


class Fp8CastWork(RankShape):
    """The FP8 casts of one rank's GEMM operands for one microbatch."""

    def _cast(self, elements: float, *, norm_fed: bool = False, gathered: bool = False) -> Work:
        """The quantization of one GEMM operand as work: :meth:`_quantize_bytes`, MXFP8's as MXFP8 cast bytes,
        a per-tensor recipe's transposed copy (:meth:`_transpose_bytes`) apart from the rest."""
        total = self._quantize_bytes(elements, norm_fed=norm_fed, gathered=gathered)
        if self.training.fp8_recipe == "mxfp8":
            return Work(mxfp8_cast_bytes=total)
        transpose = self._transpose_bytes(elements, norm_fed=norm_fed, gathered=gathered)
        return Work(memory_bytes=total - transpose, fp8_transpose_bytes=transpose)

    def _transpose_bytes(self, elements: float, *, norm_fed: bool = False, gathered: bool = False) -> float:
        """Of :meth:`_quantize_bytes`, what a per-tensor recipe spends on the transposed copy: its write (1 byte per
        element) where the cast kernel makes it alongside the row-wise copy, a read and a write (2) where it is
        made from an FP8 copy afterwards (a delayed-scaling norm's FP8 output, a gathered operand). Hardware whose
        FP8 GEMMs take any layout skips it: Transformer Engine 2.12 quantizes without the transpose where
        ``nvte_is_non_tn_fp8_gemm_supported()`` (compute capability 10.x and 13+: Blackwell; ``csrc/quantizer.cpp``,
        ``with_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported()``)."""
        t = self.training
        if not t.per_tensor_fp8:
            return 0.0
        after = gathered or (norm_fed and t.fp8_recipe == "delayed")
        return (2 if after else 1) * elements

    def _quantize_bytes(self, elements: float, *, norm_fed: bool = False, gathered: bool = False) -> float:
        """HBM bytes Transformer Engine moves to quantize one GEMM operand of ``elements`` (its full size on the
        rank, after any gather) to FP8, row-wise and transposed (Hopper's FP8 GEMMs take both operands K-major,
        so the wgrad and dgrad GEMMs need the transposes).

        Per-tensor scaling as TE 2.x does it (``module/layernorm_linear.py``, ``distributed.py``,
        ``csrc/extensions/normalization.cpp``):

        * a plain operand: one cast-transpose kernel reads bf16 and writes both FP8 copies, 4 bytes per element;
          current scaling (``tensorwise``) first reads the operand once more for its amax: 6;
        * a norm's output (the input of QKV and of the MLP's first linear, LayerNormLinear modules) is quantized
          by the norm kernel: delayed scaling writes FP8 instead of the bf16 the norm is counted with (a byte
          less), then the transpose (read 1, write 1); current scaling has the norm kernel compute the amax and
          then casts (read 2, write 1 and 1);
        * with sequence parallelism an operand that is all-gathered over TP (the input of a column-parallel
          layer, the output gradient of a row-parallel one) is quantized row-wise on the rank's 1/TP shard and
          gathered in FP8 (TE gathers no transposes); the transpose is made from the gathered copy.

        Blockwise scaling: a cast reading 2 and writing 2 bytes per element. MXFP8 (TE 2.12,
        ``common/cast/mxfp8``, ``module/grouped_linear.py``): one kernel reads bf16 and writes the row-wise copy
        with an E8M0 scale per 32 elements along a row and the column-wise copy with one per 32 along a column
        (Blackwell's MMA takes both in place, so the column-wise copy is a second quantization, not a
        transpose), ``2 + 1 + 1 + 2/32`` bytes per element; a grouped linear quantizes every expert's slice
        so (``split_quantize``); a norm's output is not quantized by the norm kernel (``normalization.cpp`` runs
        MXFP8 norms unfused unless ``NVTE_NORM_FWD_USE_CUDNN``), so it is a plain cast too. An operand gathered
        over TP is counted as cast whole and gathered in bf16, where TE casts the 1/TP shard and gathers both
        FP8 copies with their scales (``distributed._all_gather_mxfp8``, 2 + 2/32 bytes an element against bf16's
        2): a simplification worth under 1 % of a TP layer. These bytes run at the hardware's
        ``mxfp8_cast_bandwidth_fraction`` (:class:`Work`)."""
        t = self.training
        if t.fp8_recipe == "mxfp8":
            return (4 + 2 / MXFP8_BLOCK) * elements
        if not t.per_tensor_fp8:
            return 4 * elements
        current = t.fp8_recipe == "tensorwise"
        amax = 2 if current else 0
        if not gathered:
            return elements * ((4 if current else 1) if norm_fed else 4 + amax)
        rowwise = (3 if current else -1) if norm_fed else 3 + amax  # on the shard, before the gather
        return elements * (rowwise / t.tp + 2)
