"""What an MoE layer moves besides its expert GEMMs: the token copies the busiest rank's experts process, their
permutations and accumulating scatters, the routing probabilities' width, the experts' biases where the grouped
GEMM does not add them, FP8 padding copies and GPT-OSS's activation clamp.

Each follows one dispatcher's or expert kernel's code (megatron-core's, DeepEP's and HybridEP's, AutoModel's),
which is why they are priced one by one rather than as a factor on the expert GEMMs.
"""

from __future__ import annotations

from primuspipe.projection.compute.work import NO_WORK, PassWork, Work
from primuspipe.projection.training_spec import RankShape


class MoEWork(RankShape):
    """The routed experts' token copies and the memory-bound kernels around them, on one rank."""

    @property
    def expert_copies(self) -> float:
        """Token copies the experts of one rank process per microbatch (uniform routing)."""
        return self.residual_tokens * self.model.moe_router_topk * self.training.etp

    @property
    def routed_copies(self) -> float:
        """Token copies the busiest rank's experts process per microbatch: :attr:`expert_copies` times the
        load imbalance (the set figure, or forced balance's random excess), which every MoE layer waits for."""
        return self.expert_copies * self.load_imbalance

    @property
    def permutations(self) -> int:
        """Times every token copy is permuted and unpermuted (each a read and a write of it) per MoE layer:
        once into expert order before the dispatch; megatron-core's all-to-all dispatcher permutes the
        received copies a second time, from source-rank order into local-expert order, when a rank holds
        more than one expert, and undoes that before the combine (``MoEAlltoAllTokenDispatcher``'s
        ``dispatch_postprocess`` / ``combine_preprocess``: ``sort_chunks_by_idxs``, or a transposing
        copy when padded to capacity). HybridEP (the flex dispatcher's ``hybridep`` backend) permutes none
        apart: megatron-core's ``_HybridEPManager`` returns the dispatched rows as they come
        (``get_permuted_hidden_states_by_experts`` / ``get_restored_hidden_states_by_experts`` pass them through),
        because its ``HybridEPDispatch`` / ``HybridEPCombine`` call DeepEP hybrid-ep's ``dispatch_with_permute`` /
        ``combine_with_unpermute`` ("permute + dispatch a2a + permute", ``fused_a2a.py`` at the Megatron-LM commit
        Megatron-Bridge 26.02.01 pins, 55ac708): the copy out of its receive buffer writes expert order (DeepEP's
        ``deep_ep/hybrid_ep_buffer.py``, ``dispatch_with_permute``: "If we use permute kernel, the output tensor
        will be permuted. the result can be directly used in the gemm"; ``csrc/hybrid_ep/extension/permute.cu``),
        and :func:`~primuspipe.projection.comm.layer_comm` prices that copy with the all-to-all."""
        t = self.training
        if t.hybridep:
            return 0
        second = t.moe_token_dispatcher_type == "alltoall" and t.ep > 1 and self.model.num_experts // t.ep > 1
        return 2 if second else 1

    def accumulating_scatters(self, kind: str) -> PassWork:
        """The accumulating scatters of megatron-core's unfused MoE permutation (``moe_permute_fusion`` off; the
        all-to-all and DeepEP dispatchers alike, ``moe_utils.permute`` / ``unpermute`` at the Megatron-LM commit
        Primus pins, 84778176): ``unpermute`` returns the copies to token order with ``scatter_add_`` forward, and
        ``permute``'s ``index_select`` has ``index_add_`` as its backward; each adds every copy's row into its
        token's (a token's ``k`` copies meet in one row, so they cannot be plain stores). Of the permutation's
        traffic (:attr:`permutations`) these are the unpermutation's forward half and the permutation's
        backward half; Transformer Engine's fused kernels (``moe_unpermute`` and the fused permutation's
        backward) reduce a token's copies in registers and store once, so with fusion there are none."""
        t, m = self.training, self.model
        if kind != "moe" or t.moe_permute_fusion or t.hybridep:  # HybridEP: no permutation apart (permutations)
            return NO_WORK
        elements = self.routed_copies * m.hidden_size
        scatter = Work(scatter_add_elements=elements, scatter_add_bytes=2 * elements * self.e)
        return PassWork(scatter, scatter, Work())

    @property
    def probs_bytes(self) -> int:
        """Bytes of one routing probability as the experts receive it: DeepEP and HybridEP (the flex dispatcher)
        take fp32 probabilities only, and megatron-core casts them (``MoEFlexTokenDispatcher``: "HybridEP only
        supports float32 probs"); the other dispatchers pass the router's dtype on."""
        t = self.training
        if t.moe_token_dispatcher_type == "flex":
            return 4
        return {"fp32": 4, "fp64": 8}.get(t.moe_router_dtype or "", self.e)

    def _expert_output_bias(self) -> PassWork:
        """The experts' second bias (``add_bias_linear``), which megatron-core's ``TEGroupedMLP`` adds outside the
        grouped GEMM (``skip_bias_add``, then ``_apply_bias``): per local expert the bias times each copy's
        probability plus that expert's slice of the output, then one concatenation and a cast back. Each step
        is an element-wise pass over the ``copies x H`` output in the promoted dtype ``r`` of the activations and
        the probabilities: forward ``b*p`` written, the sum read and written, the concatenation read and
        written, the cast read and written (none when ``r`` is the activations' dtype); backward the casts'
        gradients, and per factor of ``b*p`` a product written and read back for its reduction (the bias's
        gradient over the tokens, the probability's over ``H``)."""
        e, r = self.e, max(self.e, self.probs_bytes)
        elements = self.routed_copies * self.model.hidden_size
        casts = (r + e) if r != e else 0
        forward = r + (e + 2 * r) + 2 * r + casts
        backward = 2 * casts + 2 * 3 * r
        return PassWork(Work(memory_bytes=forward * elements), Work(memory_bytes=backward * elements), Work())

    def _expert_input_bias(self) -> PassWork:
        """The experts' first bias where the grouped GEMM does not add it (``expert_kernels: automodel-deepep``:
        ``ops.gmm`` has no bias, AutoModel's ``_apply_bias`` adds it): per local expert the bias plus that expert's
        slice of the first linear's output (``copies x 2F`` with a gated activation), then one concatenation, in
        the activations' dtype (no probabilities, no cast): forward the sum and the concatenation each read and
        written, backward the bias's gradient, a reduction over the copies that reads the output gradient once (the
        concatenation's and the sum's gradients pass through as views). megatron-core adds it in the grouped GEMM:
        nothing here."""
        m, t, e = self.model, self.training, self.e
        if t.expert_kernels != "automodel-deepep":
            return NO_WORK
        elements = self.routed_copies * (2 if m.swiglu else 1) * m.expert_ffn / t.etp
        return PassWork(Work(memory_bytes=4 * e * elements), Work(memory_bytes=e * elements), Work())

    def _fp8_padding(self) -> PassWork:
        """The experts' FP8 padding copies (:attr:`~primuspipe.projection.training_spec.RankShape.fp8_padding_copies`) as memory traffic: forward, the token copies
        read and written into the padded buffer and the second linear's output read and written back out of it,
        and the routing probabilities padded likewise; backward, the same copies of the gradients the other way.
        The padding rows themselves (fewer than the alignment per expert) are not counted in the GEMMs."""
        if not self.fp8_padding_copies:
            return NO_WORK
        copies = self.routed_copies
        moved = 2 * 2 * copies * self.model.hidden_size * self.e + 2 * copies * self.probs_bytes
        return PassWork(Work(memory_bytes=moved), Work(memory_bytes=moved), Work())

    def _expert_clamp(self) -> PassWork:
        """The clamp of the experts' gated activation (``activation_func_clamp_value``, GPT-OSS), which megatron-core
        runs as eager element-wise ops outside its fused activation kernel over the first expert linear's
        ``copies x 2F`` output (``weighted_bias_quick_geglu_impl`` in ``megatron/core/fusions/fused_bias_geglu.py``,
        lines 410-442, the same at core_v0.15.0, core_v0.16.0 and the Megatron-LM commit 55ac708 that
        Megatron-Bridge 26.02.01 pins; the unfused path, ``glu`` in ``TEGroupedMLP.forward``, clamps the same halves
        without the concatenation). Bytes per element of one half (``copies x F``), ``e`` the activations' dtype:

        * forward: the gate half clamped from above and the linear half from both sides, each read and written
          (4e), and with ``bias_activation_fusion`` the two concatenated into the fused kernel's input (4e);
        * backward (autograd's ``clamp_backward``): the gate half's mask (read e, write a 1-byte bool) and the
          ``where`` that applies it (read the mask and the gradient, write it: 1 + 2e); the linear half's two masks,
          their ``logical_and_`` (read 2, write 1) and its ``where``; then ``chunk``'s gradient, a concatenation of
          the two halves' gradients (read 2e, write 2e): 11e + 8.

        Held against the aten operations megatron-core's own function dispatches (``tests/projection/
        test_time_model.py``). A recompute of ``moe_act`` repeats the forward's (the checkpoint reruns the whole
        function)."""
        m, t, e = self.model, self.training, self.e
        if m.activation_func_clamp_value is None or t.expert_kernels == "automodel-deepep":  # compiled with the GLU
            return NO_WORK
        elements = self.routed_copies * m.expert_ffn / t.etp
        forward = 4 * e + (4 * e if t.bias_activation_fusion else 0)
        backward = 11 * e + 8
        return PassWork(Work(memory_bytes=forward * elements), Work(memory_bytes=backward * elements), Work())
