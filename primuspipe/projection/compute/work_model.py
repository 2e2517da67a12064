"""The model's work per rank and microbatch, assembled from the concerns beside it: a layer of each kind
(attention, MLP or experts, element-wise kernels, dropout, weight traffic, and what recompute repeats), the
embedding, the output layer with its loss, a multi-token-prediction module, and the model FLOPs behind MFU.

:class:`WorkModel` is the one class callers use; each of its bases prices one concern, so a formula is found in
its concern's module and this one only says how a part combines them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from primuspipe.projection.activations import gemm_width, op_gemms
from primuspipe.projection.compute.attention import AttentionWork
from primuspipe.projection.compute.elementwise import ElementwiseWork, elementwise_pass
from primuspipe.projection.compute.weight_traffic import WeightTrafficWork
from primuspipe.projection.compute.work import NO_WORK, PassWork, Work, sum_passes
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.parameters import ParamCount, embedding_params, head_params, layer_params
from primuspipe.projection.training_spec import TrainingSpec

FLOP_CONVENTIONS = ("causal", "full")
"""How model FLOPs count attention: ``causal`` the half of the score square a causal mask keeps (what the
kernels compute), ``full`` the whole square (Narayanan et al. 2021's formula, as NVIDIA's NeMo /
Megatron-Bridge and AMD's Primus report Model TFLOP/s)."""


@dataclass(frozen=True)
class WorkModel(AttentionWork, ElementwiseWork, WeightTrafficWork):
    """Per-rank work of each part of the model for one microbatch."""

    def layer(self, kind: str) -> PassWork:
        """One layer of ``kind``: GEMMs, attention and element-wise work, with what selective recompute repeats."""
        m, t = self.model, self.training
        attention, up_projections = self._attention_projections()
        core = self._attention_core()
        if kind == "dense":
            mlp = self._mlp(self.tokens, m.ffn / t.tp, dense=True)
            mlp_recompute = mlp.forward if t.recomputes("mlp") else Work()
        else:
            local = m.num_experts // t.ep
            per_expert = self.expert_copies * t.load_imbalance / local
            spread = self.load_imbalance / t.load_imbalance  # forced balance's random excess (Gemm.stretch)
            routed = self._mlp(per_expert, m.expert_ffn / t.etp, groups=local, stretch=spread, fp8=t.experts_fp8)
            shared = (self._mlp(self.tokens, m.moe_shared_expert_intermediate_size / t.tp)
                      if m.moe_shared_expert_intermediate_size else None)
            router = (NO_WORK if t.fake_balanced_gate  # AutoModel's fake gate has no GEMM
                      else self._linear(self.residual_tokens, m.hidden_size, m.num_experts, fp8=False))
            bias = [self._expert_input_bias(), self._expert_output_bias()] if m.add_bias_linear else []
            clamp = self._expert_clamp()
            mlp = sum_passes(routed, self._fp8_padding(), router, clamp, *bias, *([shared] if shared else []))
            mlp_recompute = (mlp.forward if t.recomputes("moe") else
                             shared.forward if shared and t.recomputes("shared_experts") else Work())
            if t.recomputes("moe_act") and not t.recomputes("moe"):
                act = self._activation(self.routed_copies, m.expert_ffn / t.etp)
                mlp_recompute = mlp_recompute + act + clamp.forward
        element = sum_passes(self._elementwise(kind), self._unfused_rope(), self.accumulating_scatters(kind),
                             self._local_spec_elements(kind), self._hidden_dropout(sites=2))
        params = sum(layer_params(m, t, kind).values(), ParamCount())
        accumulate = self._grad_accumulation(params)
        copies = self._fsdp2_copies(params.total)
        forward = attention.forward + core.forward + mlp.forward + element.forward + copies.forward
        recompute = (self._op_recompute(kind) if t.recompute_granularity == "op" else
                     (core.recompute if t.recomputes("core_attn") else Work()) + mlp_recompute
                     + (self._norms() if t.recomputes("layernorm") else Work())
                     + (up_projections.forward + Work(memory_bytes=self._mla_rope_elements() * self.e)
                        if t.recomputes("mla_up_proj") and m.multi_latent_attention else Work()))
        backward_input = (attention.backward_input + core.backward_input + mlp.backward_input + element.backward_input
                          + copies.backward_input)
        return PassWork(forward, backward_input, attention.backward_weight + mlp.backward_weight + accumulate
                        + copies.backward_weight, recompute)

    def _op_recompute(self, kind: str) -> Work:
        """What torchtitan's op recompute reruns of one block's forward before its backward: the GEMMs whose outputs
        its policy does not save (:func:`~primuspipe.projection.activations.op_gemms`: wk, wo, w3), with their FP8
        casts, and the element-wise kernels (norms, rotary embedding, the activation, the residual add that makes
        the MLP's input); not the block's last residual add, which the backward needs nothing of (eager
        checkpointing stops its recompute once the last tensor the backward needs is rebuilt, and the compiler's
        partitioner recomputes only what the backward reads). The saved GEMMs and the attention kernel are not rerun.
        Sequence parallelism's all-gathers, also recomputed, are not priced here."""
        gemms = [self._linear(self.tokens, gemm_width(self, fan_in), gemm_width(self, fan_out),
                              norm_fed=fan_in == "hidden",
                              tensor_parallel="column" if fan_in == "hidden" else "row")
                 for _, fan_in, fan_out, saved in op_gemms(self.model.swiglu) if not saved]
        moved = self._elementwise_kernels(kind)
        moved["residual_add"] /= 2
        return sum_passes(*gemms).forward + elementwise_pass(moved).forward + self._unfused_rope().forward

    def embedding(self, shared: bool = False) -> PassWork:
        """Token (and position) lookup: memory-bound; its gradient, a scatter-add, runs in B (split-backward
        runners do not defer it), with the weight gradient it lands in (:meth:`_embedding_weight_gradient`;
        ``shared``: a second lookup of the same tables, a multi-token-prediction module's)."""
        moved = self.hidden_bytes
        # the root's copy-out; its gradient's copy-in stands in the add into the main gradient counted below
        gathered = NO_WORK if shared else PassWork(
            self._fsdp2_copies(embedding_params(self.model, self.training.tp), root=True).forward, Work(), Work())
        return sum_passes(PassWork(Work(memory_bytes=moved), Work(memory_bytes=2 * moved), Work()), gathered,
                          self._hidden_dropout(sites=1, alone=True), self._embedding_weight_gradient(shared))

    def _embedding_weight_gradient(self, shared: bool = False) -> PassWork:
        """The embedding tables' weight gradient, made whole every microbatch, in B. ``F.embedding``'s backward
        (``embedding_dense_backward`` on a GPU: ``embedding_backward_cuda_kernel`` in PyTorch's
        ``aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu``) allocates the gradient of the whole table with
        ``at::zeros`` (a write of ``e`` a parameter) and adds only the looked-up rows into it (the scatter-add
        :meth:`embedding` counts); no ``gradient_accumulation_fusion`` reaches it (that fusion is the linear
        layers' weight-gradient GEMM), so megatron-core's DDP backward hook adds it into the main gradient
        (``param.main_grad.add_(param.grad.data)``: read ``e``, read and write the main gradient), as
        :meth:`_grad_accumulation` counts for unfused weights. The rank's vocabulary shard and learned positions
        (:func:`~primuspipe.projection.parameters.embedding_params`). ``shared``: a second lookup of the same
        tables (megatron-core's multi-token prediction reuses the model's embedding) makes its own zeroed table,
        which autograd sums with the first before the parameter's one accumulation (read two, write one): ``4e``."""
        params = embedding_params(self.model, self.training.tp)
        per_param = 4 * self.e if shared else self.e + self.e + 2 * self.training.main_grad_bytes
        return PassWork(Work(), Work(memory_bytes=params * per_param), Work())

    def head(self) -> PassWork:
        """Final norm, output layer and the vocab-parallel cross entropy."""
        m, t = self.model, self.training
        vocab = m.padded_vocab(t.tp) / t.tp
        output = self._linear(self.tokens, m.hidden_size, vocab, fp8=False)  # Megatron keeps the output layer in bf16
        forward, backward = self._loss_bytes_per_logit()
        logits = self.tokens * vocab
        norm = elementwise_pass({self._norm_kernel: self._norms().memory_bytes / 2})  # the final norm
        copies = self._fsdp2_copies(head_params(m, t.tp), root=True)
        return PassWork(output.forward + Work(memory_bytes=logits * forward) + norm.forward + copies.forward,
                        output.backward_input + Work(memory_bytes=logits * backward) + norm.backward_input,
                        output.backward_weight + self._grad_accumulation(ParamCount(head_params(m, t.tp)))
                        + copies.backward_weight)

    def _loss_bytes_per_logit(self) -> tuple[float, float]:
        """Bytes the vocab-parallel cross entropy moves per logit of the rank's vocabulary shard, forward and
        backward. Unfused (megatron-core's ``VocabParallelCrossEntropy``, ``tensor_parallel/cross_entropy.py``, the
        same at core_r0.8.0 and 0.19): forward, ``calculate_logits_max`` casts the logits to fp32 (read ``e``, write
        4) and takes their maximum (read 4); ``calculate_predicted_logits`` subtracts it in place (read 4, write 4)
        and exponentiates in place (``torch.exp(x, out=x)``: 8) and sums (read 4); ``calculate_cross_entropy_loss``
        divides in place by the sum (8): ``e + 36``. Backward, ``calculate_gradients``' in-place product with the
        loss gradient (8) and autograd's cast of the fp32 gradient back to the logits' dtype (``4 + e``):
        ``e + 12``. With fp32 logits neither cast runs (``.float()`` returns its input): 32 and 8. The picks of
        each token's target logit touch one logit a token (not counted). Held against the aten operations
        megatron-core's functions dispatch (``tests/projection/test_dropout_and_loss.py``).

        Fused (``cross_entropy_loss_fusion``), ``native`` (megatron-core's ``fused_vocab_parallel_cross_entropy``,
        ``fusions/fused_cross_entropy.py``, the same at core_r0.8.0, core_r0.11.0 and 0.19): the unfused
        functions run as four ``@jit_fuser`` (``torch.compile``) regions, forward three with the TP all-reduces
        between them, so at best one kernel each, reading every logit-sized input once and writing every
        logit-sized output or input it mutates once: ``calculate_logits_max`` reads the logits and writes their
        fp32 copy (``e + 4``; ``.float()`` returns fp32 logits themselves: ``e``), ``calculate_predicted_logits``
        subtracts the maximum and exponentiates in place (8), ``calculate_cross_entropy_loss`` divides in place
        (8): ``e + 20``; backward ``calculate_gradients`` reads the saved fp32 softmax, writes it back (the
        in-place product with the loss gradient mutates its input) and writes the gradient, hard-cast to bf16:
        10, plus autograd's cast of that gradient back for logits of another dtype (read 2, write ``e``).
        ``te`` (Transformer Engine's ``parallel_cross_entropy``, ``pytorch/triton/cross_entropy.py`` from 2.7):
        ``online_softmax_kernel`` reads the logits, ``cross_entropy_kernel`` reads them again and writes the
        gradient in place in their dtype, and backward ``element_mul_kernel`` scales it in place: ``3e`` and
        ``2e``.

        PyTorch's ``F.cross_entropy`` (``torch_cross_entropy``, NeMo AutoModel's ``MaskedCrossEntropy``) is
        ``log_softmax`` then ``nll_loss``: forward, the log-softmax reads the logits and writes its output (``2c``,
        ``c`` the bytes of the dtype it runs in: 4 under ``fp32_upcast``, else ``e``), after the upcast's cast
        (read ``e``, write 4) where there is one; the loss picks one element a row (not counted). Backward,
        ``nll_loss_backward`` writes a zero-filled gradient of the logits' size with one element a row set (``c``),
        ``_log_softmax_backward_data`` reads it and the saved output and writes the input gradient (``3c``), and
        autograd casts that back (read 4, write ``e``) after an upcast: ``2c`` (+ ``e + 4``) and ``4c``
        (+ ``e + 4``) -- 4 and 8 bytes a bf16 logit without the upcast, 14 and 22 with it, against megatron-core's
        unfused 38 and 14."""
        e = self.e
        if self.training.torch_cross_entropy is not None:
            upcast = e + 4 if self.training.torch_cross_entropy == "fp32" and e < 4 else 0
            c = 4 if self.training.torch_cross_entropy == "fp32" else e
            return upcast + 2 * c, upcast + 4 * c
        cast = e + 4 if e < 4 else 0
        if self.training.cross_entropy_loss_fusion and self.training.cross_entropy_fusion_impl == "te":
            return 3 * e, 2 * e
        if self.training.cross_entropy_loss_fusion:
            bf16 = e == 2 and self.training.precision != "fp16"
            return (cast or e) + 16, 10 + (0 if bf16 else 2 + e)
        return cast + 32, cast + 8

    def mtp(self) -> PassWork:
        """One multi-token-prediction module: embedding lookup, two norms, the 2H -> H projection, a layer
        of the last layer's kind and another pass through the output layer and loss."""
        m = self.model
        projection = self._linear(self.tokens, 2 * m.hidden_size, m.hidden_size)
        return sum_passes(self.embedding(shared=True), projection, self.layer(m.layer_kinds[-1]), self.head(),
                          elementwise_pass({self._norm_kernel: self._norms().memory_bytes}))

    def part(self, name: str) -> PassWork:
        return {"embedding": self.embedding, "head": self.head, "mtp": self.mtp}.get(name, lambda: self.layer(name))()

    def model_flops(self, attention: str = "causal") -> float:
        """Model FLOPs of one microbatch on one rank, all three passes, no recompute (MFU's numerator):
        GEMMs, and attention counted by ``attention`` (see :data:`FLOP_CONVENTIONS`)."""
        core = self._attention_core()  # the local backend's are GEMMs: counted below by the convention instead
        core_gemms = sum(w.gemm_flops for w in core.passes())

        def useful(work: PassWork, attention_flops: float) -> float:
            return sum(w.gemm_flops for w in work.passes()) + attention_flops * 3

        square = self._attention_square()  # the full convention counts the square in every layer, windowed or not
        counted = square if attention == "full" else 0.5 * square * self.window_share
        layers = Counter(self.model.layer_kinds)
        return (sum(n * (useful(self.layer(k), counted) - core_gemms) for k, n in layers.items())
                + useful(self.head(), 0))


def model_flops_per_token(model: ModelSpec, attention: str = "causal") -> float:
    """Model FLOPs (three passes) per token of the whole model, attention counted by ``attention``."""
    neutral = TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=1)
    return WorkModel(model, neutral).model_flops(attention) / model.seq_length
