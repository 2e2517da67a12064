"""What a part's weights cost each microbatch beyond its GEMMs: FSDP2's copies of the gathered parameters and
of their gradients on the compute stream, and the adds of fresh weight gradients into the main gradients where
the weight-gradient GEMMs do not accumulate in place.

Apart because it scales with the part's parameters on the rank, not with its tokens.
"""

from __future__ import annotations

from primuspipe.projection.comm import gathered_weight_bytes
from primuspipe.projection.compute.work import NO_WORK, PassWork, Work
from primuspipe.projection.parameters import ParamCount
from primuspipe.projection.training_spec import RankShape


class WeightTrafficWork(RankShape):
    """Weight copies and gradient accumulation of one rank for one microbatch."""

    def _grad_accumulation(self, params: ParamCount) -> Work:
        """The W pass's adds of fresh weight gradients into their main gradients, for the part's ``params`` on the
        rank: one element-wise pass each (megatron-core's DDP backward hook, ``param.main_grad.add_(param.grad.data)``)
        reading the gradient in the parameters' dtype and reading and writing the main gradient. Every weight
        without ``gradient_accumulation_fusion``; with it only the legacy ``GroupedMLP``'s expert weights (its GEMMs
        cannot accumulate in place); the rest accumulate inside their weight-gradient GEMMs."""
        t = self.training
        unfused = params.total if not t.gradient_accumulation_fusion else params.expert if t.legacy_grouped_mlp else 0
        return Work(memory_bytes=unfused * (self.e + 2 * t.main_grad_bytes))

    def _fsdp2_copies(self, params: float, *, root: bool = False) -> PassWork:
        """FSDP2's copies of ``params`` gathered parameters on the compute stream, once a microbatch
        (:attr:`TrainingSpec.fsdp2_copies`): the all-gather copy-out reads the gathered buffer and writes the
        parameters (the gathered dtype each way: bf16, or one byte under a float8 all-gather), in F and, where
        the layer was resharded after its forward, again in B; the reduce-scatter copy-in reads the bf16 gradients
        and writes the reduce dtype's buffer (fp32 unless told otherwise), in W. ``root``: the root unit's
        (embedding, final norm, output layer), which FSDP2 does not reshard after the forward and whose weights
        are never float8-gathered."""
        t = self.training
        if not t.fsdp2_copies:
            return NO_WORK
        resharded = t.fsdp_reshard_after_forward and not root
        copy_out = Work(memory_bytes=2 * (self.e if root else gathered_weight_bytes(t)) * params)
        copy_in = Work(memory_bytes=(self.e + t.main_grad_bytes) * params)
        return PassWork(copy_out, copy_out if resharded else Work(), copy_in)
