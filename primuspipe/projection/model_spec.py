"""The model being projected: a decoder-only transformer described in Megatron's argument names.

A model YAML lists the fields of :class:`ModelSpec` (``examples/projection/models/`` has real ones)::

    name: llama2-7b
    num_layers: 32
    hidden_size: 4096
    ffn_hidden_size: 11008
    num_attention_heads: 32
    seq_length: 4096
    vocab_size: 32000
    swiglu: true
    normalization: RMSNorm
    add_bias_linear: false
    position_embedding_type: rope
    untie_embeddings_and_output_weights: true

Mixture-of-experts models add ``num_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``,
``moe_shared_expert_intermediate_size`` and ``moe_layer_freq`` (which layers are MoE); multi-latent
attention (DeepSeek) sets ``multi_latent_attention`` and its ranks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from primuspipe.projection.spec_fields import InputError, check_fields, oversized, read_yaml, spec_from_mapping

LayerKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style model as megatron-core builds it (``GPTModel`` with the given layer options)."""

    num_layers: int
    """Transformer layers of the whole model."""
    hidden_size: int
    """Width of the residual stream (H)."""
    num_attention_heads: int
    """Query heads (a)."""
    seq_length: int
    """Tokens per sample (s)."""
    name: str = "model"
    """Shown in reports."""
    ffn_hidden_size: int | None = None
    """Dense MLP width (F); Megatron's default: 4H, or int(8H/3 / 64) * 64 with SwiGLU."""
    num_query_groups: int | None = None
    """Key/value heads (g) for grouped-query attention; None means one per query head."""
    kv_channels: int | None = None
    """Head dimension; None means H / a."""
    vocab_size: int | None = None
    """Tokenizer vocabulary; padded as Megatron does (to a multiple of make_vocab_size_divisible_by * TP)."""
    padded_vocab_size: int | None = None
    """The padded vocabulary itself (overrides vocab_size and the padding rule)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this (times TP)."""
    untie_embeddings_and_output_weights: bool = False
    """False: the output layer reuses the word embedding (a copy on the last stage when pp > 1)."""
    swiglu: bool = False
    """Gated SiLU MLP (three GEMMs); False: GELU MLP (two)."""
    squared_relu: bool = False
    """Squared-ReLU MLP, ``relu(x)^2``, not gated (Megatron's ``--squared-relu``; Nemotron-3 and Nemotron-4): two
    GEMMs as GELU's. What its activation costs depends on how the framework runs it (the training field
    ``squared_relu_fusion``)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """LayerNorm has a weight and a bias per channel; RMSNorm a weight."""
    add_bias_linear: bool = True
    """Biases on every linear layer (Megatron's default); Llama-style models turn them off."""
    add_qkv_bias: bool = False
    """Biases on the QKV projection only (Qwen2)."""
    qk_layernorm: bool = False
    """Norms on queries and keys per head (Qwen3), or on the MLA latents."""
    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "learned_absolute"
    """Learned positions add a table on the first stage; RoPE adds no parameters; ``yarn``: RoPE with YaRN's
    frequency scaling (GPT-OSS), see ``yarn_rotary_scaling_factor``."""
    yarn_rotary_scaling_factor: float | None = None
    """YaRN's context-extension factor (GPT-OSS: 32); with ``yarn_mscale`` / ``yarn_mscale_all_dim`` it gives the
    concentration factor megatron-core multiplies the rotary cos/sin by (:attr:`rope_concentration`)."""
    yarn_mscale: float | None = None
    """YaRN's ``mscale`` (megatron-core's ``yarn_mscale``); None with ``yarn_mscale_all_dim`` None: the default
    concentration ``0.1 ln(factor) + 1``."""
    yarn_mscale_all_dim: float | None = None
    """YaRN's ``mscale_all_dim`` (megatron-core's ``yarn_mscale_all_dim``)."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table; None means seq_length."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (Megatron's default is 0.1; current pre-training uses 0)."""
    hidden_dropout: float = 0.0
    """Dropout before each residual add."""
    num_experts: int | None = None
    """Routed experts per MoE layer; None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is sent to (k)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (megatron-core's ``group_limited_topk``): the experts split into this many equal
    groups of consecutive experts; each token picks ``moe_router_group_topk`` groups by the sum of each group's
    top ``moe_router_topk / moe_router_group_topk`` scores, then its ``k`` experts inside them (DeepSeek-V3: 8
    groups, 4 picked, so a token reaches at most 4 groups: 4 nodes, or 4 ranks at EP 8). None: no groups."""
    moe_router_group_topk: int | None = None
    """Groups each token picks under group-limited routing (with ``moe_router_num_groups``)."""
    moe_router_score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    """The router's score function (Megatron's default softmax; DeepSeek-V3 sigmoid). Only the group choice
    depends on it: groups are ranked by sums of scores."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (Megatron's ``moe_router_pre_softmax``): with softmax scoring,
    groups are then ranked by summed probabilities instead of summed logits."""
    moe_ffn_hidden_size: int | None = None
    """Width of one routed expert (F_e); None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total width of the shared expert(s) every token also goes through; None: no shared expert."""
    moe_layer_freq: int | tuple[int, ...] | str = 1
    """Which layers are MoE: N (every N-th, from layer 0), a list of 0/1 per layer, or Megatron's string
    form such as ``"([0]*1+[1]*26)"``."""
    window_size: tuple[int, ...] | None = None
    """Sliding-window attention, Megatron's ``window_size`` ``[left, right]``: each query attends to itself and
    the ``left`` keys before it; ``right`` must be 0 (causal, the form Transformer Engine's cuDNN attention
    runs). None: full causal attention in every layer."""
    window_attn_skip_freq: int | None = None
    """With ``window_size``: every N-th layer, counting from 1, keeps full attention (megatron-core's
    ``is_layer_window_attention``: layer_number % N != 0 is windowed); None: every layer is windowed."""
    activation_func_clamp_value: float | None = None
    """Clamp of a gated linear unit's inputs before the activation (GPT-OSS: 7.0; megatron-core's
    ``activation_func_clamp_value``): the gate half at most this, the linear half within plus or minus it.
    megatron-core clamps outside its fused expert activation, with two eager clamps and a concatenation
    (:meth:`~primuspipe.projection.compute.WorkModel._expert_clamp`); None: no clamp."""
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention instead of (grouped-query) self-attention."""
    q_lora_rank: int | None = None
    """MLA query compression rank; None: queries are projected directly."""
    kv_lora_rank: int = 512
    """MLA key/value compression rank."""
    qk_head_dim: int = 128
    """MLA per-head query/key width without the rotary part."""
    qk_pos_emb_head_dim: int = 64
    """MLA per-head rotary width."""
    v_head_dim: int = 128
    """MLA per-head value width."""
    source: str = "<built-in>"
    """Where the values came from; named in error messages."""

    def __post_init__(self) -> None:
        check_fields(self)
        self._check()

    # -- derived sizes --------------------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(8 * self.hidden_size / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def rotary(self) -> bool:
        """Rotary position embedding on queries and keys (plain RoPE or YaRN's)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def rope_concentration(self) -> float:
        """The factor megatron-core's attention multiplies the rotary cos and sin by
        (``_yarn_get_concentration_factor_from_config`` and ``_yarn_get_mscale`` in
        ``megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py``, lines 252-281 at the Megatron-LM
        commit 55ac708): with YaRN ``0.1 m ln(factor) + 1`` for a factor above 1, ``m`` 1, or the ratio of the
        ``yarn_mscale`` and ``yarn_mscale_all_dim`` ones where both are given; 1 otherwise (GPT-OSS: 1.347)."""
        factor = self.yarn_rotary_scaling_factor
        if self.position_embedding_type != "yarn" or factor is None or factor <= 1:
            return 1.0

        def mscale(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0

        if self.yarn_mscale is None or self.yarn_mscale_all_dim is None:
            return mscale(1.0)
        return mscale(self.yarn_mscale) / mscale(self.yarn_mscale_all_dim)

    @property
    def windowed_layers(self) -> int:
        """Layers whose attention is a sliding window (``window_size``, ``window_attn_skip_freq``)."""
        if self.window_size is None:
            return 0
        every = self.window_attn_skip_freq
        return self.num_layers if every is None else sum(n % every != 0 for n in range(1, self.num_layers + 1))

    def padded_vocab(self, tp: int) -> int:
        """Megatron's ``_vocab_size_with_padding``: up to a multiple of divisible_by * TP."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @cached_property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """``"dense"`` or ``"moe"`` for every layer, in model order."""
        if not self.is_moe:
            return ("dense",) * self.num_layers
        pattern = _moe_pattern(self.moe_layer_freq, self.num_layers, self.source)
        return tuple("moe" if p else "dense" for p in pattern)

    # -- validation -----------------------------------------------------------------------------------
    def _check(self) -> None:
        def fail(names: tuple[str, ...], problem: str, fix: str):
            raise InputError([(self.source, n, getattr(self, n)) for n in names], problem, fix)

        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by",
                     "ffn_hidden_size", "num_query_groups", "kv_channels", "vocab_size", "padded_vocab_size",
                     "num_experts", "moe_router_topk", "moe_router_num_groups", "moe_router_group_topk",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) == 0:
                fail((name,), "must be at least 1", "give a positive size (or leave it out for the default)")
        if large := oversized(self, MAX_SIZE, MAX_SIZES):
            fail((large[0],), f"is larger than {large[1]:,}, beyond any model this projects "
                 "(the layout and the arithmetic would not end or not be numbers)", "check the value")
        if self.vocab_size is None and self.padded_vocab_size is None:
            fail(("vocab_size",), "the vocabulary size is missing", "give vocab_size (or padded_vocab_size)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            fail(("hidden_size", "num_attention_heads"), "the hidden size does not split into heads",
                 "give kv_channels (the head dimension) or a head count that divides hidden_size")
        if self.num_attention_heads % self.query_groups:
            fail(("num_attention_heads", "num_query_groups"), "query heads do not split evenly over key/value groups",
                 "make num_query_groups a divisor of num_attention_heads")
        for name in ("attention_dropout", "hidden_dropout"):
            if getattr(self, name) >= 1:
                fail((name,), "a dropout probability must be below 1", "give a value in [0, 1)")
        if self.is_moe:
            if self.moe_router_topk > self.num_experts:
                fail(("moe_router_topk", "num_experts"), "each token cannot go to more experts than there are",
                     "make moe_router_topk at most num_experts")
            self.layer_kinds  # noqa: B018  (checks moe_layer_freq now, at load time)
            self._check_groups(fail)
        if self.window_size is not None and (len(self.window_size) != 2 or self.window_size[1] != 0):
            fail(("window_size",), "a sliding window is [left, 0]: the keys before each query, none after it",
                 "give [left, 0] (e.g. [128, 0]), or leave window_size out for full causal attention")
        if self.window_attn_skip_freq is not None and (self.window_size is None or self.window_attn_skip_freq < 1):
            fail(("window_attn_skip_freq", "window_size"), "says which layers keep full attention, so it needs a window "
                 "and N >= 1", "give window_size, and N >= 1 (every N-th layer keeps full attention)")
        yarn = [n for n in ("yarn_rotary_scaling_factor", "yarn_mscale", "yarn_mscale_all_dim") if getattr(self, n) is not None]
        if yarn and self.position_embedding_type != "yarn":
            fail((*yarn, "position_embedding_type"), "YaRN settings scale a YaRN rotary embedding, which this model "
                 "does not have", "set position_embedding_type: yarn, or leave the yarn_* fields out")
        if self.squared_relu and self.swiglu:
            fail(("squared_relu", "swiglu"), "an MLP has one activation: squared ReLU is not gated, SwiGLU is",
                 "set one of squared_relu and swiglu")
        clamp = self.activation_func_clamp_value
        if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
            fail(("activation_func_clamp_value",), "a clamp bounds the activation's inputs to [-value, value], so it "
                 "must be a positive number", "give a positive value (GPT-OSS: 7.0), or leave it out for no clamp")
        if (self.position_embedding_type == "learned_absolute" and self.max_position_embeddings is not None
                and self.max_position_embeddings < self.seq_length):
            fail(("max_position_embeddings", "seq_length", "position_embedding_type"), "a learned position table "
                 "has no entry for the later positions of the sequence (Megatron asserts max_position_embeddings >= "
                 "seq_length)", "raise max_position_embeddings to at least seq_length")
        if self.multi_latent_attention and self.position_embedding_type == "learned_absolute":
            fail(("multi_latent_attention", "position_embedding_type"), "MLA carries its own rotary embedding",
                 "set position_embedding_type: rope")


    def _check_groups(self, fail) -> None:
        """Megatron's conditions on group-limited routing (``group_limited_topk`` reshapes the scores into
        ``[tokens, groups, experts / groups]`` and takes ``k // group_topk`` of each group, then ``k`` experts
        of the picked groups)."""
        groups, picked, k = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk
        names = ("moe_router_num_groups", "moe_router_group_topk")
        if (groups is None) != (picked is None):
            fail(names, "group-limited routing needs both the group count and the groups each token picks",
                 "give both moe_router_num_groups and moe_router_group_topk, or neither")
        if groups is None:
            return
        if self.num_experts % groups:
            fail(("num_experts", "moe_router_num_groups"), "the experts do not split into equal groups",
                 "make moe_router_num_groups a divisor of num_experts")
        if picked > groups or picked > k:
            fail(names + ("moe_router_topk",), "a token cannot pick more groups than there are, nor more groups "
                 "than experts (each group is ranked by its top k / group_topk scores)",
                 "make moe_router_group_topk at most moe_router_num_groups and at most moe_router_topk")
        if picked * (self.num_experts // groups) < k:
            fail(names + ("moe_router_topk",), "the picked groups hold fewer experts than each token needs",
                 "pick more groups (moe_router_group_topk) or route to fewer experts")


MAX_SIZE = 2**31
"""Largest width, head count, vocabulary or sequence length a model may give (no trained model is near)."""
MAX_SIZES = {"num_layers": 100_000}
"""Tighter bounds: the projection keeps one entry per layer."""


def _moe_pattern(freq: int | tuple[int, ...] | str, num_layers: int, source: str) -> tuple[int, ...]:
    """Megatron's ``moe_layer_freq`` as one 0/1 per layer."""
    if isinstance(freq, int):
        if freq < 1:
            raise InputError([(source, "moe_layer_freq", freq)], "must be at least 1", "give N >= 1 (every N-th layer)")
        return tuple(int(i % freq == 0) for i in range(num_layers))
    pattern = _parse_pattern(freq, num_layers, source) if isinstance(freq, str) else freq
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise InputError([(source, "moe_layer_freq", freq), (source, "num_layers", num_layers)],
                         f"the list has {len(pattern)} entries of 0/1 for {num_layers} layers" if len(pattern) != num_layers
                         else "entries must be 0 (dense) or 1 (MoE)", "give one 0 or 1 per layer")
    return tuple(pattern)


_TERM = re.compile(r"\[([01](?:\s*,\s*[01])*)\]\s*\*\s*([0-9]{1,18})", re.ASCII)
"""One ``[bits]*count`` term; the count in ASCII digits, as Megatron's eval of the text reads it (``[1]*٧`` is a
SyntaxError there), of at most 18 (more was int()'s ValueError past 4,300)."""


def _parse_pattern(text: str, num_layers: int, source: str) -> tuple[int, ...]:
    """Megatron's string form, a sum of ``[bits]*count`` terms, e.g. ``([0]*3+[1]*58)``, read without eval.
    Each term's length is counted before it is expanded: ``[1]*10000000000`` would not fit in memory."""
    body = text.strip()
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    pattern: list[int] = []
    for term in body.split("+"):
        match = _TERM.fullmatch(term.strip())
        if not match:
            raise InputError([(source, "moe_layer_freq", text)], f"cannot read the term {term.strip()!r}",
                             "write it as a sum of [0/1 list]*count terms, e.g. ([0]*1+[1]*26), or as a list")
        bits = [int(b) for b in match.group(1).split(",")]
        entries = len(pattern) + len(bits) * int(match.group(2))
        if entries > num_layers:
            raise InputError([(source, "moe_layer_freq", text), (source, "num_layers", num_layers)],
                             f"the pattern has {entries:,} or more entries of 0/1 for {num_layers} layers",
                             "give one 0 or 1 per layer")
        pattern += bits * int(match.group(2))
    return tuple(pattern)


def load_model(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a model YAML file."""
    return spec_from_mapping(ModelSpec, read_yaml(path, "model"), str(path))
