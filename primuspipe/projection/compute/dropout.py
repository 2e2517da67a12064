"""What dropout moves where it runs as a kernel of its own: over an unfused attention's probabilities
(``attention_dropout``) and over the residual stream (``hidden_dropout``: in the fused bias-dropout-add of a
layer, or the embedding's ``nn.Dropout``).

Fused attention kernels drop inside the kernel instead, which :class:`~primuspipe.projection.compute.work.Work`
prices at the hardware's ``attention_dropout_rate``; a rate of 0 moves nothing.
"""

from __future__ import annotations

from primuspipe.projection.activations import MASK_BYTES
from primuspipe.projection.compute.work import NO_WORK, PassWork, Work
from primuspipe.projection.training_spec import RankShape


class DropoutWork(RankShape):
    """Dropout's memory traffic on one rank for one microbatch."""

    @property
    def _native_dropout_bytes(self) -> float:
        """Bytes ``native_dropout`` moves per element, forward (read ``e``, write ``e`` and the one-byte keep mask)
        and likewise backward (read the gradient and the mask, write the gradient)."""
        return 2 * self.e + MASK_BYTES

    def _score_dropout_bytes(self, scores: float) -> float:
        """Bytes ``attention_dropout`` moves over the probabilities of an attention that is not fused (megatron-core's
        ``DotProductAttention``, Transformer Engine's ``UnfusedDotProductAttention``: ``self.attention_dropout`` on
        the ``scores`` probabilities in the activations' dtype), each way: ``native_dropout`` reads them and
        writes them and the one-byte mask; its backward reads the gradient and the mask and writes the gradient.
        Fused (flash) kernels drop inside the kernel (``HardwareSpec.attention_dropout_rate``)."""
        if self.model.attention_dropout == 0:
            return 0.0
        return scores * self._native_dropout_bytes

    def _hidden_dropout(self, sites: int, alone: bool = False) -> PassWork:
        """What ``hidden_dropout`` adds over the residual stream's ``T_r x H`` elements at each of ``sites``. In a
        layer (two sites: after attention and after the MLP) it runs inside megatron-core's fused
        ``bias_dropout_add`` (``bias_dropout_add_fused_train``, ``jit_fuser``: ``torch.compile`` from torch 2.2),
        whose forward already reads and writes the stream (the ``residual_add`` of :meth:`_elementwise_kernels`):
        dropout adds the one-byte keep mask it writes for backward (the mask :mod:`~primuspipe.projection.activations`
        keeps), and a backward pass of its own that applies the mask to the gradient (read ``e`` and the mask,
        write ``e``; with dropout 0 the gradient passes through the adds untouched, no kernel). ``alone``: the
        embedding's ``torch.nn.Dropout`` (``LanguageModelEmbedding.embedding_dropout``, after the sequence-parallel
        scatter), a kernel of its own, ``native_dropout`` forward (read ``e``, write ``e`` and the mask) and
        ``native_dropout_backward``. Nothing with ``hidden_dropout`` 0 (PyTorch's ``dropout`` returns its input at
        ``p == 0``)."""
        if self.model.hidden_dropout == 0:
            return NO_WORK
        elements = sites * self.residual_tokens * self.model.hidden_size
        forward = self._native_dropout_bytes if alone else MASK_BYTES
        return PassWork(Work(memory_bytes=elements * forward), Work(memory_bytes=elements * self._native_dropout_bytes),
                        Work())
