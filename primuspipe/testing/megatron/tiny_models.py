"""Tiny megatron-core GPT models whose weights do not depend on the pipeline layout.

Public API
----------
``TinyModelConfig``            sizes of the model and of one microbatch (frozen dataclass).
``TINY_MODELS``                ``{"tiny-gpt": TinyModelConfig(...), "tiny-moe": TinyModelConfig(...)}``.
``transformer_config(model, pp, vpp, tp=1, ep=1) -> TransformerConfig``
    CPU-safe Megatron config (float32, no dropout, no fusions, ``use_cpu_initialization``).
``build_model_chunks(model, config, seed=0, placement="interleaved") -> list[GPTModel]``
    This rank's ``vpp`` chunks (``vp_stage`` 0..vpp-1) under the current ``parallel_state``; every
    parameter is filled from ``seed``, its *global* name and its tensor-parallel rank, so models of
    different pipeline layouts are identical. ``placement="v"`` builds the V-shape chunks (chunk 1 of
    rank r = stage 2p-1-r; see ``v_placement``).
``global_param_name(chunk, local_name) -> str``
    ``decoder.layers.<local>.…`` → ``decoder.layers.<global>.…`` (global = ``layer_number - 1``) and
    ``….experts.local_experts.<local>.…`` → ``….experts.local_experts.<global expert>.…``.
``synthetic_batches(model, num_microbatches, seed=0) -> Iterator[dict[str, Tensor]]``
    Deterministic microbatches (tokens, labels, loss_mask, position_ids, attention_mask); give each
    chunk its own iterator, every stage draws the same sequence.
``forward_step(data_iterator, model) -> (output, loss_func)``
    A ``forward_step_func`` for Megatron schedules; ``loss_func(output)`` returns
    ``(loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})`` as ``pretrain_gpt`` does
    in megatron-core 0.19, so ``schedules.forward_step`` divides by tokens and microbatches.

Why
---
Comparing a pipelined run with a pp=1 run only proves something if both start from the same
weights. Megatron's own init draws from a per-rank RNG stream, so weights would change with the
layout; instead each parameter is regenerated from ``crc32(global name)``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional

import torch

from primuspipe.errors import ConfigError


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a tiny GPT; defaults are small enough for a 2-core CI machine."""

    num_layers: int = 8
    """Transformer layers in the whole model; must divide by ``pp * vpp`` unless the first and/or last
    stage get their own count (``num_layers_in_first/last_pipeline_stage``)."""
    hidden_size: int = 16
    num_attention_heads: int = 2
    ffn_hidden_size: int = 32
    vocab_size: int = 64
    seq_length: int = 8
    micro_batch_size: int = 2
    num_moe_experts: Optional[int] = None
    """``None`` for a dense MLP; otherwise the number of local-spec (sequential) experts."""
    moe_router_topk: int = 2
    add_bias_linear: bool = True
    """Expert MLPs need False: with a bias, megatron-core 0.19's expert MLP adds it in place to a
    custom-Function view output, which autograd forbids. Selective recompute of ``mlp`` needs False
    too: megatron-core 0.19 checkpoints the MLP's returned bias parameter, whose recompute then recurses
    without end."""
    tie_embeddings: bool = False
    """``share_embeddings_and_output_weights`` (Megatron's default is tied)."""


TINY_MODELS: dict[str, TinyModelConfig] = {
    "tiny-gpt": TinyModelConfig(),
    "tiny-moe": TinyModelConfig(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False),
}


def get_tiny_model(name: str) -> TinyModelConfig:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}") from None


def transformer_config(model: TinyModelConfig, pp: int, vpp: int = 1, tp: int = 1, ep: int = 1,
                       placement: str = "interleaved", **overrides):
    """Megatron ``TransformerConfig`` that runs on CPU; ``overrides`` go straight to Megatron.

    Dropout is 0 and fusions are off so pp=1 and pp=P runs take the same arithmetic path.
    ``batch_p2p_comm`` defaults to False: megatron's batched p2p swaps tensors on gloo when both
    pipeline neighbours are one rank (pp=2, vpp=2); see docs/design.md §3.

    ``placement="v"``: Megatron checks the layer split of the ``2p``-stage pipeline the V folds (the V's
    first and last stage take ``num_layers_in_first/last_pipeline_stage``), not of an interleaved one, whose
    rules (the first/last count and each middle rank's layers divisible by vpp) do not apply to the V.
    """
    from megatron.core.transformer import TransformerConfig

    split = {"num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
             "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"}
    if placement == "v":
        if vpp != 2:
            raise ConfigError(f"the V placement has two chunks per rank, got vpp={vpp}")
        config = transformer_config(model, 2 * pp, 1, tp, ep, **overrides)
        config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size = pp, 2
        return config
    if model.num_layers % (pp * vpp) and not split & overrides.keys():
        raise ConfigError(f"num_layers={model.num_layers} does not split into pp*vpp={pp * vpp} stages; give the first "
                          "and/or last stage its own count (num_layers_in_first/last_pipeline_stage)")
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        add_bias_linear=model.add_bias_linear,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        batch_p2p_comm=False,
    )
    if model.num_moe_experts is not None:
        fields.update(
            num_moe_experts=model.num_moe_experts,
            moe_router_topk=model.moe_router_topk,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_permute_fusion=False,
        )
    fields.update(overrides)
    try:
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"Megatron rejects this TransformerConfig: {exc}") from exc


def global_param_name(chunk: torch.nn.Module, local_name: str) -> str:
    """Name a parameter as it is called in the pp=1, ep=1 model."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        layer = chunk.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
        if parts[4:6] == ["experts", "local_experts"]:
            experts = layer.mlp.experts
            parts[6] = str(experts.ep_group.rank() * experts.num_local_experts + int(parts[6]))
    return ".".join(parts)


def _fill_(param: torch.Tensor, name: str, seed: int) -> None:
    from megatron.core import parallel_state

    if getattr(param, "tensor_model_parallel", False) and not getattr(param, "allreduce", True):
        name += f"@expert-tp{parallel_state.get_expert_tensor_parallel_rank()}"
    elif getattr(param, "tensor_model_parallel", False):
        name += f"@tp{parallel_state.get_tensor_model_parallel_rank()}"  # each shard its own values
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1_000_003 * seed)
    noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
    with torch.no_grad():
        if name.endswith("layernorm.weight") or name.endswith("layer_norm_weight"):
            param.copy_(1.0 + 0.1 * noise)  # near-identity norms keep activations O(1)
        else:
            param.copy_(0.1 * noise)


PLACEMENTS = ("interleaved", "v")
_TIED_EMBEDDING = "embedding.word_embeddings.weight"


def build_model_chunks(model: TinyModelConfig, config, seed: int = 0,
                       placement: str = "interleaved") -> list[torch.nn.Module]:
    """Build this rank's chunks (one per ``vp_stage``) with layout-independent weights.

    Tied embeddings (``model.tie_embeddings``) follow Megatron: the output layer's copy on the last stage
    starts as the word embedding. ``placement="v"`` (two chunks per rank) builds chunk 1 as stage
    ``2p-1-r`` with :mod:`~primuspipe.backends.megatron.v_placement`.
    """
    from megatron.core import parallel_state

    from primuspipe.backends.megatron.v_placement import v_model_provider

    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown placement {placement!r}; known: {PLACEMENTS}")
    vpp = config.virtual_pipeline_model_parallel_size or 1
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if placement == "v" and vpp != 2:
        raise ConfigError(f"the V placement has two chunks per rank; the config has vpp={vpp}")
    provider = model_provider(model, config)
    if placement == "v":
        provider = v_model_provider(provider, pp, parallel_state.get_pipeline_model_parallel_rank())
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunk = provider(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                         vp_stage=stage)
        fill_parameters(chunk, seed)
        chunks.append(chunk)
    return chunks


def model_provider(model: TinyModelConfig, config):
    """A Megatron-LM ``model_provider`` (the keyword signature ``megatron.training``'s ``get_model``
    calls) building ``model`` as a local-spec ``GPTModel`` with ``config``; a Megatron-LM script's
    provider, as unaware of primuspipe as one."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    def provide(pre_process=True, post_process=True, vp_stage=None, config_=None, pg_collection=None, **_):
        spec = get_gpt_layer_local_spec(num_experts=model.num_moe_experts, moe_grouped_gemm=False)
        mtp = (get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
               if config.mtp_num_layers else None)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=model.vocab_size,
                        max_sequence_length=model.seq_length, pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=model.tie_embeddings,
                        position_embedding_type="learned_absolute", vp_stage=vp_stage, mtp_block_spec=mtp)

    return provide


def fill_parameters(chunk: torch.nn.Module, seed: int) -> None:
    """Give every parameter of ``chunk`` its layout-independent value (``_fill_`` by global name); the
    output layer's tied copy gets the word embedding's values, as Megatron's tying gives it."""
    for name, param in chunk.named_parameters():
        _fill_(param, _TIED_EMBEDDING if getattr(param, "shared_embedding", False) else global_param_name(chunk, name),
               seed)


def synthetic_batches(
    model: TinyModelConfig, num_microbatches: int, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``num_microbatches`` deterministic microbatches, the same on every rank.

    The causal mask is explicit (``True`` = masked) because GPTModel's default one is built on CUDA.
    Every third label position is masked out so token-count normalisation is exercised.
    """
    s, b = model.seq_length, model.micro_batch_size
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    for i in range(num_microbatches):
        gen = torch.Generator().manual_seed(7919 * seed + i)
        tokens = torch.randint(model.vocab_size, (b, s + 1), generator=gen)
        loss_mask = torch.ones(b, s)
        loss_mask[:, (i % 3)::3] = 0.0
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": positions,
            "attention_mask": mask,
        }


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """``forward_step_func`` for Megatron schedules (every stage consumes one batch per call)."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(_loss_func, batch["loss_mask"])
