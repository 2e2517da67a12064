"""A model and a training configuration from what Megatron users already have: an argument list
(``--num-layers 32 --hidden-size 4096 ... --bf16``, as in a launch script) or a Primus-style YAML of
Megatron arguments (keys with underscores, at the top or under ``modules.<name>.overrides``).

Every argument is modelled, set aside as unable to change time or memory (learning rate, data paths,
logging, ...), or refused -- arguments that would change time or memory in a way the projection does not
model, and names Megatron does not define (with the closest one it does): see
:mod:`~primuspipe.projection.megatron_flags`. What the projection uses takes Megatron's own defaults when
absent (pp 1, fp32 unless ``--bf16``/``--fp16``, dropout 0.1, biases on, no distributed optimizer), so
the projection describes the run the arguments describe. The GPU count comes from the launcher in front
of the script (``torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py ...``); without one the caller
must give it (``--target-nodes``). A Primus module's ``model:`` file (and its ``bases:``) is read first,
its ``overrides`` on top.

>>> model, training = from_arguments("--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
...     "--seq-length 32 --max-position-embeddings 32 --vocab-size 100 --micro-batch-size 2 --bf16", "args")
>>> model.num_layers, training.precision, training.pipeline_model_parallel_size, model.hidden_dropout
(4, 'bf16', 1, 0.1)
"""

from __future__ import annotations

import functools
import logging
import re
import shlex
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.framework import ConfigError, strict
from primuspipe.projection.layout import parse_layout
from primuspipe.projection.megatron_flag_names import MEGATRON_FLAGS
from primuspipe.projection.megatron_flags import (ALIASES, PRIMUS_DESTS, PRIMUS_FLAGS, REFUSAL_REASONS, RESOLVED, closest,
                                                  megatron_default, no_effect, primus_default)
from primuspipe.projection.spec_fields import spec_from_mapping
from primuspipe.projection.training_spec import TrainingSpec

logger = logging.getLogger("primuspipe.projection")

MEGATRON_DEFAULTS = {
    "model": {"attention_dropout": 0.1, "hidden_dropout": 0.1},
    "training": {"pipeline_model_parallel_size": 1, "precision": "fp32", "use_distributed_optimizer": False,
                 "overlap_grad_reduce": False, "attention_backend": "flash", "moe_expert_gemm": "sequential"},
}
"""Where Megatron's defaults differ from the projection's own (which describe a current pre-training run)."""

RENAMED = {"num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size"}

_IGNORED_MODEL_FIELDS = {"name", "source"}
_PRIMUS_MODULE_KEYS = {"framework", "config", "model", "overrides"}


def _fields(cls) -> set[str]:
    return {f.name for f in fields(cls)} - _IGNORED_MODEL_FIELDS


@dataclass(frozen=True)
class MegatronConfig:
    """What a Megatron configuration says: the model, the training, and the GPU count if it names one."""

    model: ModelSpec
    training: TrainingSpec
    world_size: int | None
    """GPUs of the run (from the launcher's --nnodes x --nproc-per-node); None: the file does not say,
    so data parallelism must come from ``--target-nodes``."""
    no_effect: tuple[str, ...] = ()
    """Arguments read and set aside because they cannot change time or memory (docs/projection.md)."""


def split_arguments(arguments: Mapping[str, Any], source: str, world_size: int | None = None) -> MegatronConfig:
    """Sort Megatron arguments (underscore names) into a model and a training spec. Every argument is
    modelled, set aside as having no effect on time or memory, or refused (:mod:`megatron_flags`)."""
    values: dict[str, dict[str, Any]] = {"model": dict(MEGATRON_DEFAULTS["model"]),
                                         "training": dict(MEGATRON_DEFAULTS["training"])}
    targets = {"model": _fields(ModelSpec), "training": _fields(TrainingSpec)}
    set_aside, refused = [], []
    arguments = _settle_aliases(arguments, source)
    for name, value in arguments.items():
        if not isinstance(name, str):  # YAML reads `1:`, `true:` and `null:` as a number, a boolean, None
            raise ConfigError(f"{source}: the key {strict.show(name)} is no argument name; Megatron arguments are "
                              "names (num_layers: 32); quote it or remove it")
        name = RENAMED.get(name, name)
        spec = next((s for s, known in targets.items() if name in known), None)
        if name in ALIASES:
            if ALIASES[name][2] is not None and value is not None and not isinstance(value, bool):
                raise ConfigError(f"{source}: {name}={strict.show(value)}: {_flag(name)} is a switch, on or off; write "
                                  "true or false (a text such as 'no' would switch it on, as any non-empty text does)")
            field = ALIASES[name][1]  # a projection-only field given by name (moe_expert_gemm) wins over its alias
            if value is not False and value is not None and (field not in arguments or field in MEGATRON_FLAGS):
                spec, field, setting = ALIASES[name]
                values[spec][field] = value if setting is None else setting
        elif name in RESOLVED:
            continue  # resolved below, once the fields they depend on are known
        elif spec is not None:
            if value is not None:
                values[spec][name] = _field_value(name, value)
        elif no_effect(name) or primus_default(name, value) or megatron_default(name, value):
            set_aside.append(name)
        elif name in REFUSAL_REASONS:
            refused.append(f"{_flag(name)} {REFUSAL_REASONS[name]}")
        elif name in MEGATRON_FLAGS or name in PRIMUS_FLAGS:
            refused.append(f"{_flag(name)} changes time or memory in a way the projection does not model "
                           "(remove it to project the run without it)")
        else:
            guess = closest(name, MEGATRON_FLAGS | PRIMUS_FLAGS | targets["model"] | targets["training"])
            refused.append(f"{_flag(name)} is not a Megatron argument"
                           + (f" (did you mean {_flag(guess)}?)" if guess else ""))
    if refused:
        raise ConfigError(f"{source}: " + "; ".join(refused))
    if values["training"].get("recompute_granularity") == "op":
        raise ConfigError(f"{source}: --recompute-granularity op is torchtitan's op-level checkpointing, which Megatron "
                          "does not run (its choices are full and selective); give it in a training file instead")
    if arguments.get("bf16") and arguments.get("fp16"):
        raise ConfigError(f"{source}: --bf16 and --fp16 both set the precision (Megatron refuses both); keep one")
    if (optimizer := arguments.get("optimizer", "adam")) != "adam":
        raise ConfigError(f"{source}: --optimizer {optimizer}: only Adam's state is modelled (16 bytes a parameter); "
                          "project with --optimizer adam or remove it")
    _resolve_virtual_stages(arguments, values, source)
    _resolve_transformer_impl(arguments, values, source)
    if not _resolve_megatron_fsdp_grads(arguments, values, source):
        set_aside.append("megatron_fsdp_main_grads_dtype")
    training = values["training"]
    if training.get("attention_backend") == "local":  # these decide the local spec's attention kernels
        set_aside = [name for name in set_aside if name not in LOCAL_SOFTMAX_FLAGS]
    training.setdefault("global_batch_size", training.get("micro_batch_size", 1))  # Megatron: MBS * DP
    if not arguments.get("group_query_attention"):
        values["model"].pop("num_query_groups", None)
    if set_aside:
        logger.info("%s: no effect on time or memory, set aside: %s", source, ", ".join(sorted(set_aside)))
    _vocabulary_from_tokenizer(arguments, values["model"], source)
    values["model"].setdefault("name", Path(source).stem)
    if world_size is not None:
        per_replica = 1
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            per_replica *= strict.count(training.get(name, 1), f"{source}: {name}", minimum=1, text=True)
        if world_size % per_replica:
            raise ConfigError(f"{source}: {world_size} GPUs (launcher) do not hold whole TP x PP x CP = {per_replica} "
                              "replicas; fix the launcher's --nnodes / --nproc-per-node or the parallel sizes")
        training["data_parallel_size"] = world_size // per_replica
    return MegatronConfig(spec_from_mapping(ModelSpec, values["model"], source),
                          spec_from_mapping(TrainingSpec, values["training"], source), world_size, tuple(set_aside))


def _vocabulary_from_tokenizer(arguments: Mapping[str, Any], model: Mapping[str, Any], source: str) -> None:
    """Megatron takes the vocabulary's size from the tokenizer's files (``--tokenizer-type``, ``--tokenizer-model``,
    ``--vocab-file``), which the projection does not read; without ``--vocab-size`` the refusal names the tokenizer."""
    if model.get("vocab_size") is not None or model.get("padded_vocab_size") is not None:
        return
    tokenizer = " ".join(f"{_flag(name)} {arguments[name]}" for name in ("tokenizer_type", "tokenizer_model", "vocab_file")
                         if isinstance(arguments.get(name), str))
    if tokenizer:
        raise ConfigError(f"{source}: no --vocab-size: Megatron reads it from the tokenizer ({tokenizer}), whose files "
                          "the projection does not read; add --vocab-size N (vocab_size: N in a YAML), the tokenizer's size")


LEGACY_OVERRIDES = frozenset({"recompute_activations", "use_rotary_position_embeddings"})
"""Legacy switches Megatron's ``validate_args`` applies after parsing, over the field's own flag whatever their order
(megatron/training/arguments.py: ``if args.recompute_activations: args.recompute_granularity = 'selective'``; "Legacy
RoPE arguments": ``if args.use_rotary_position_embeddings: args.position_embedding_type = 'rope'``)."""


def _field_value(name: str, value: Any) -> Any:
    """What a spec field takes from its argument's value (``--attention-backend auto`` is flash attention here)."""
    return "flash" if (name, value) == ("attention_backend", "auto") else value


def _settle_aliases(arguments: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A switch alias (``--recompute-activations``) given beside its field's own Megatron flag set to another value
    (``--recompute-granularity full``): the field as Megatron ends up with it. The value was whichever of the two came
    last in the list; Megatron's legacy switches (:data:`LEGACY_OVERRIDES`) win in any order, and so do the CUDA-graph
    switches over ``--cuda-graph-impl none`` (Megatron asserts the flag is left at that default beside them); the others
    (which Megatron asserts against, or reads in an order not modelled) are refused naming both."""
    settled = dict(arguments)
    for name, (_, field, setting) in ALIASES.items():
        if setting is None or arguments.get(name) in (None, False) or field not in MEGATRON_FLAGS:
            continue
        given = arguments.get(field)
        if given is None or _field_value(field, given) == setting:
            continue
        if name not in LEGACY_OVERRIDES and (field, given) != ("cuda_graph_impl", "none"):  # Megatron asserts "none"
            raise ConfigError(f"{source}: {_flag(name)} sets {field} to {setting} but {_flag(field)} {given} sets it "
                              "too; keep one")
        settled[field] = setting
    return settled


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


LOCAL_SOFTMAX_FLAGS = frozenset({"masked_softmax_fusion", "no_masked_softmax_fusion", "attention_softmax_in_fp32",
                                 "apply_query_key_layer_scaling"})
"""Flags without effect on Transformer Engine's attention that decide the local spec's (:func:`_resolve_transformer_impl`)."""


def _resolve_transformer_impl(arguments: Mapping[str, Any], values: dict[str, dict[str, Any]], source: str) -> None:
    """``--transformer-impl local`` builds the layers from megatron-core's local spec
    (``get_gpt_layer_local_spec``): attention is megatron-core's own ``DotProductAttention``, scores, masked
    softmax and the probabilities' product as separate kernels over the whole square (whatever
    ``--attention-backend`` says; the local spec does not read it), so the projection prices and keeps it as the
    ``local`` backend. Megatron refuses FP8 without Transformer Engine, and so does the projection.

    Two of Megatron-LM's flags then decide that attention's kernels (``megatron/training/arguments.py``): the
    softmax runs in fp32 only with ``--attention-softmax-in-fp32`` or ``--apply-query-key-layer-scaling`` (which
    sets it; both off by default), and ``--no-masked-softmax-fusion`` keeps the softmax unfused; by default
    ``FusedScaleMaskSoftmax`` takes a fused CUDA kernel where the shapes allow it, which the projection does not
    price, so that case is refused."""
    impl = arguments.get("transformer_impl") or "transformer_engine"
    if impl == "transformer_engine":
        return
    if impl != "local":
        raise ConfigError(f"{source}: --transformer-impl {impl}: only transformer_engine (Megatron's default) and "
                          "local build training layers; use one of them")
    training = values["training"]
    if training.get("precision") == "fp8" or training.get("fp8_format"):
        raise ConfigError(f"{source}: --transformer-impl local with FP8: Megatron trains FP8 only with Transformer "
                          "Engine; drop --fp8-format or use --transformer-impl transformer_engine")
    if not arguments.get("no_masked_softmax_fusion") and arguments.get("masked_softmax_fusion", True) is not False:
        raise ConfigError(f"{source}: --transformer-impl local with Megatron's fused masked softmax (the default): "
                          "its kernel is not priced; add --no-masked-softmax-fusion, or use transformer_engine")
    training["attention_backend"] = "local"
    training["attention_softmax_in_fp32"] = bool(arguments.get("attention_softmax_in_fp32")
                                                 or arguments.get("apply_query_key_layer_scaling"))


MEGATRON_FSDP_GRAD_DTYPES = ("auto", "fp32", "bf16", "fp16")
"""``--megatron-fsdp-main-grads-dtype``'s choices (``megatron/training/arguments.py``); ``auto`` is its default."""


def _resolve_megatron_fsdp_grads(arguments: Mapping[str, Any], values: dict[str, dict[str, Any]], source: str) -> bool:
    """Megatron-FSDP's main gradients as megatron-core 0.19.2 keeps and reduces them: ``--megatron-fsdp-main-grads-dtype``
    (default ``auto``, None in ``DistributedDataParallelConfig.megatron_fsdp_main_grads_dtype``) leaves them in the
    model's dtype (``megatron_fsdp/param_and_grad_buffer.py``, ``_resolve_group_grad_dtype``: ``grad.dtype ==
    param.dtype``, bf16 for FP8 weights), and they are reduced in it (``--megatron-fsdp-grad-comm-dtype`` ``auto``: the
    main gradients' dtype); Megatron's fp32 accumulation (``grad_reduce_in_fp32``, ``--grad-reduce-in-bf16``) is the
    DDP buffer's and does not reach Megatron-FSDP. So a bf16 or fp16 model keeps and reduces 2-byte main gradients
    (``grad_reduce_in_bf16``) unless fp32 is asked for; the master weights stay fp32
    (``megatron_fsdp_main_params_dtype`` defaults to ``torch.float32``, the projection's). False: the flag was given
    without ``--use-megatron-fsdp``, where nothing reads it (set aside)."""
    given = arguments.get("megatron_fsdp_main_grads_dtype")
    training = values["training"]
    if given is not None and given not in MEGATRON_FSDP_GRAD_DTYPES:
        raise ConfigError(f"{source}: --megatron-fsdp-main-grads-dtype {given}: Megatron's choices are "
                          f"{', '.join(MEGATRON_FSDP_GRAD_DTYPES)}")
    if not training.get("use_megatron_fsdp"):
        return given is None
    dtype = training.get("precision", "fp32") if given in (None, "auto") else given
    if dtype != "fp32" and training.get("precision", "fp32") == "fp32":
        raise ConfigError(f"{source}: --megatron-fsdp-main-grads-dtype {given} under an fp32 model: 16-bit main "
                          "gradients of fp32 weights are not modelled; give fp32 (or auto), or add --bf16")
    training["grad_reduce_in_bf16"] = dtype != "fp32"
    return True


def _resolve_virtual_stages(arguments: Mapping[str, Any], values: dict[str, dict[str, Any]], source: str) -> None:
    """vpp and the layer split as Megatron's ``validate_args`` takes them (megatron/training/arguments.py, "Uneven
    virtual pipeline parallelism"): at most one of ``--num-layers-per-virtual-pipeline-stage``,
    ``--num-virtual-stages-per-pipeline-rank`` and ``--pipeline-model-parallel-layout`` (the layout's stages, a
    multiple of pp, give vpp); layers per virtual stage only where the stages hold equal shares; then
    :func:`_check_even_split`. Each was projected otherwise: a layout beside a vpp flag won silently, a layout of
    pp * 2 stages was refused as not pp stages, and layers that do not divide over the stages were split unevenly."""
    per_stage = arguments.get("num_layers_per_virtual_pipeline_stage")
    stages = arguments.get("num_virtual_stages_per_pipeline_rank")
    layout = arguments.get("pipeline_model_parallel_layout")
    given = [f"{_flag(name)} {strict.show(value)}" for name, value in (
        ("num_layers_per_virtual_pipeline_stage", per_stage), ("num_virtual_stages_per_pipeline_rank", stages),
        ("pipeline_model_parallel_layout", layout)) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"{source}: {' and '.join(given)} each set the virtual pipeline size (Megatron refuses more "
                          "than one); keep one")
    training = values["training"]
    if stages is not None:
        training["virtual_pipeline_model_parallel_size"] = stages
    if isinstance(layout, str) and layout:
        _resolve_layout(layout, training, source)
    if per_stage is not None:
        layers = strict.count(values["model"].get("num_layers"), f"{source}: num_layers", minimum=1, text=True)
        pp = strict.count(training["pipeline_model_parallel_size"], f"{source}: pipeline_model_parallel_size",
                          minimum=1, text=True)
        per_stage = strict.count(per_stage, f"{source}: num_layers_per_virtual_pipeline_stage", minimum=1, text=True)
        if any(training.get(name) is not None for name in ("decoder_first_pipeline_num_layers",
                                                           "decoder_last_pipeline_num_layers")):
            raise ConfigError(f"{source}: --num-layers-per-virtual-pipeline-stage {per_stage} with uneven first/last "
                              "pipeline stages (Megatron asserts against it: the stages hold unequal shares); give "
                              "--num-virtual-stages-per-pipeline-rank instead")
        total = layers + _slots(training)
        if total % pp or (total // pp) % per_stage:
            raise ConfigError(f"{source}: --num-layers-per-virtual-pipeline-stage {per_stage} does not divide the "
                              f"{total / pp:g} layers of each of the {pp} pipeline stages ({layers} layers"
                              f"{' and the embedding/loss slots' if total != layers else ''}; Megatron asserts it "
                              "does); give a divisor of the layers per stage")
        training["virtual_pipeline_model_parallel_size"] = total // (pp * per_stage)
    _check_even_split(values, source)


def _slots(training: Mapping[str, Any]) -> int:
    """Layer places the embedding and the loss take in Megatron's split (``--account-for-*-in-pipeline-split``)."""
    return sum(training.get(name) is True for name in ("account_for_embedding_in_pipeline_split",
                                                       "account_for_loss_in_pipeline_split"))


def _resolve_layout(layout: str, training: dict[str, Any], source: str) -> None:
    """vpp from ``--pipeline-model-parallel-layout``'s stages over pp, as ``validate_args`` sets it (it asserts the
    stages are a multiple of pp); the layout's own checks are :class:`~primuspipe.projection.layout.StageLayout`'s."""
    pp = training.get("pipeline_model_parallel_size")
    if not _whole(pp):
        return  # the spec refuses it, naming the field
    try:
        count = len(parse_layout(layout))
    except ValueError as exc:
        raise ConfigError(f"{source}: pipeline_model_parallel_layout={strict.show(layout)}: {exc}; write one stage "
                          "per pp * vpp, with every transformer layer once") from None
    if count % pp:
        raise ConfigError(f"{source}: --pipeline-model-parallel-layout has {count} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {pp} (Megatron asserts it is: the stages are pp * vpp); "
                          "write pp stages, or pp * vpp for vpp model chunks per rank")
    training["virtual_pipeline_model_parallel_size"] = count // pp


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_even_split(values: dict[str, dict[str, Any]], source: str) -> None:
    """Megatron's split where no layout and no first/last stage counts are given: the layers (and the embedding /
    loss slots) divide over the pp ranks and each rank's over its vpp chunks (megatron-core's
    ``get_num_layers_to_build``, megatron/core/transformer/transformer_block.py, asserts both; ``validate_args``
    asserts the first), and a vpp needs a pipeline. Values of the wrong type are left to the spec, which names them."""
    training = values["training"]
    layers, pp = values["model"].get("num_layers"), training.get("pipeline_model_parallel_size")
    vpp = training.get("virtual_pipeline_model_parallel_size", 1)
    if not (_whole(layers) and _whole(pp) and _whole(vpp)):
        return
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{source}: {vpp} virtual pipeline stages per rank without a pipeline "
                          "(--pipeline-model-parallel-size 1; Megatron asserts the interleaved schedule has pp > 1); "
                          "raise pp or drop the virtual pipeline flag")
    if training.get("pipeline_model_parallel_layout") or any(training.get(name) is not None for name in (
            "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")):
        return  # the layout and the first/last stage counts are checked by StageLayout
    total = layers + _slots(training)
    if total % pp or (total // pp) % vpp:
        slots = " (with the embedding/loss slots)" if total != layers else ""
        raise ConfigError(f"{source}: --num-layers {layers}: {total} layers{slots} do not split evenly over "
                          f"--pipeline-model-parallel-size {pp}{f' x {vpp} virtual stages' if vpp > 1 else ''} "
                          "(Megatron asserts they do); give a layer count divisible by pp * vpp, uneven first/last "
                          "stages (--decoder-first-pipeline-num-layers) or a --pipeline-model-parallel-layout")


_LAUNCHER_GPUS = {"nproc_per_node": "per_node", "nproc-per-node": "per_node", "nnodes": "nodes"}


def parse_argument_list(text: str, source: str = "the argument list") -> tuple[dict[str, Any], int | None]:
    """``--name value`` / ``--flag`` tokens (shell quoting and line continuations allowed) to a mapping
    (a flag maps to True; values stay text, read by :func:`_as_argparse_reads`, but for Primus's
    underscored overrides, which Primus reads as YAML scalars), and the world size when a launcher before the
    training script (``torchrun --nnodes N --nproc-per-node G pretrain_gpt.py ...``) names it."""
    try:
        tokens = shlex.split(text.replace("\r\n", "\n").replace("\\\n", " "), comments=True)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"{source}: cannot split the argument list as a shell would: {exc}; close the quote "
                          "or escape it") from None
    script = next((i for i, token in enumerate(tokens) if token.endswith(".py")), None)
    launcher, tokens = (tokens[:script], tokens[script + 1:]) if script is not None else ([], tokens)
    arguments = _options(tokens, source=source)
    if not arguments:
        raise ConfigError(f"{source}: holds no Megatron arguments (--name value) and no YAML mapping of them; is it "
                          "the right file? Give a launch script's argument list or a Primus-style YAML")
    return arguments, _world_size(_options(launcher, raw=True), source)


def _world_size(launcher: Mapping[str, Any], source: str) -> int | None:
    """GPUs of the run from the launcher's ``--nproc-per-node`` x ``--nnodes``; None where it names none or a
    shell variable / elastic range (``$GPUS``, ``1:4``): the file does not say. A count below 1 is refused by the
    launcher's flag (it was a data-parallel size of 0 or below, named as a field the user never wrote)."""
    sizes = {_LAUNCHER_GPUS[k]: (k, v) for k, v in launcher.items() if k in _LAUNCHER_GPUS}
    if "per_node" not in sizes:
        return None
    world = 1
    for flag, value in (sizes["per_node"], sizes.get("nodes", ("nnodes", "1"))):
        if not isinstance(value, str) or not strict.NUMBER_TEXT.fullmatch(value.strip()):
            return None  # a shell variable ($GPUS_PER_NODE), an elastic range: the file does not say
        world *= strict.count(value, f"{source}: the launcher's --{flag}", minimum=1, maximum=MAX_GPUS, text=True)
    return world


MAX_GPUS = 10**7
"""Most GPUs a launcher line may name (beyond any cluster; a larger count is a typo)."""

_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d"
_OPTION_MISSPELT = re.compile(rf"([{_DASHES}][{_DASHES}-]*|-)(?!-)\S*[^\W\d]\S*")
"""A token argparse would read as an option (a hyphen, not a negative number) but that is none of Megatron's
(those start with two ASCII hyphens), or one a word processor wrote with a typographic dash (``\u2014num-layers``)."""


def _misspelt(token: str) -> bool:
    return bool(_OPTION_MISSPELT.fullmatch(token)) and not strict.NUMBER_TEXT.fullmatch(token)


def _misspelt_option(token: str, after: str | None, source: str) -> ConfigError:
    where = f" (after {after})" if after else ""
    odd = next((ch for ch in token if ch in _DASHES), None)
    why = f"it is written with {odd!r} (U+{ord(odd):04X}), not two ASCII hyphens" if odd else \
        "Megatron's options start with two hyphens and its argparse takes a hyphen word for an option, not a value"
    return ConfigError(f"{source}: {token!r}{where} is no Megatron argument: {why}; write it as --name "
                       "(retype the dashes)")


def _options(tokens: list[str], raw: bool = False, source: str = "the argument list") -> dict[str, Any]:
    """``--name value...`` tokens to a mapping. Outside the launcher (``raw``), a token argparse would take for an
    option that is none (``-pipeline-model-parallel-size``, a typographic dash) is refused naming it: it was read
    as a value of the flag before it, so the refusal named that flag, or a switch took it silently."""
    if not raw and (bad := next((i for i, token in enumerate(tokens) if _misspelt(token)), None)) is not None:
        raise _misspelt_option(tokens[bad], next((t.partition("=")[0] for t in reversed(tokens[:bad])
                                                  if t.startswith("--")), None), source)
    arguments: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            continue  # the launcher and script names before the arguments
        name, given, inline = token[2:].partition("=")
        values = [inline] if given else []  # --num-layers= gives the empty text, as argparse reads it
        while not given and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        if not raw and "_" in name:  # Primus's override style (--num_layers 8): its values are YAML scalars
            values = [_yaml_value(v, f"{source}: --{name}") for v in values]
        key = name if raw else name.replace("-", "_")
        arguments[key] = True if not values else values[0] if len(values) == 1 else values
    return arguments


TUPLE_TYPED = frozenset({"window_size"})
"""Arguments Megatron parses with its ``tuple_type`` (one text, comma-separated: ``--window-size 127,0``)."""

_RESOLVED_TYPES = {"num_layers_per_virtual_pipeline_stage": int, "num_virtual_stages_per_pipeline_rank": int,
                   "optimizer": str, "transformer_impl": str, "group_query_attention": bool}
"""The types of the arguments the reader resolves itself (:data:`~primuspipe.projection.megatron_flags.RESOLVED`)."""


@functools.cache
def _spec_types() -> dict[str, Any]:
    return {name: hint for cls in (TrainingSpec, ModelSpec) for name, hint in typing.get_type_hints(cls).items()
            if name not in _IGNORED_MODEL_FIELDS}


def _field_type(name: str) -> Any:
    """The type of the spec field argument ``name`` sets (None: it sets none, so its text is not read); ``bool``
    for Megatron's ``store_true`` flags, aliases with a fixed setting included."""
    if name in _RESOLVED_TYPES:
        return _RESOLVED_TYPES[name]
    if name in ALIASES:
        spec, field, setting = ALIASES[name]
        if setting is not None:
            return bool
        name = field
    return _spec_types().get(RENAMED.get(name, name))


def _as_argparse_reads(arguments: Mapping[str, Any], source: str) -> dict[str, Any]:
    """An argument list's value texts (``--num-layers 32``: Megatron's own spelling, which its ``argparse``
    parses; Primus's ``--num_layers 32`` overrides are read as YAML, as Primus reads them) read as Megatron's
    ``argparse`` reads them: by the argument's type, ``int``
    (``0x20`` and ``1e3`` are refused, not 32 and 1000), ``float`` (finite, as every primuspipe number),
    ``store_true`` flags taking no value (``--bf16 no`` is refused, not fp32), text as text (``null`` is the
    word, not a missing value). Reading them as YAML scalars -- what a YAML file's values are -- gave another
    run than the one the list launches. Arguments the projection does not read keep their text."""
    typed: dict[str, Any] = {}
    for name, value in arguments.items():
        hint = _field_type(name)
        if not isinstance(value, (str, list)) or hint is None:  # a switch, a Primus override's YAML value, unread
            typed[name] = value
            continue
        flag = f"{source}: {_flag(name)}"
        if hint is bool:
            if name in MEGATRON_FLAGS or name in ALIASES:
                raise ConfigError(f"{flag} is a switch and takes no value (Megatron's argparse refuses "
                                  f"{_flag(name)} {' '.join(value) if isinstance(value, list) else value}); "
                                  "write the flag alone to set it, leave it out to unset it")
            typed[name] = strict.flag(value, flag)
            continue
        if name in TUPLE_TYPED and isinstance(value, str):
            value = value.strip("()").split(",")  # Megatron's tuple_type: "127,0" or "(127,0)"
        if _is_list(hint) and not isinstance(value, list):
            value = [value]  # nargs='*' / '+': one value is a list of one
        typed[name] = [_as_type(hint, v, flag) for v in value] if isinstance(value, list) else _as_type(hint, value, flag)
    return typed


def _alternatives(hint: Any) -> list[Any]:
    """The types a spec field's annotation allows, None aside (``int | None`` -> ``[int]``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [k for k in typing.get_args(hint) if k is not type(None)]
    return [hint]


def _is_list(hint: Any) -> bool:
    """Whether ``hint`` is a list field's (``tuple[X, ...]``, or it or None) and nothing else."""
    kinds = _alternatives(hint)
    return len(kinds) == 1 and typing.get_origin(kinds[0]) is tuple


def _as_type(hint: Any, text: str, flag: str) -> Any:
    """One value text as ``hint`` (a spec field's annotation; of a list field, its entries') reads it (a Primus
    override's value is YAML's already)."""
    if not isinstance(text, str):
        return text
    kinds = [typing.get_args(k)[0] if typing.get_origin(k) is tuple else k for k in _alternatives(hint)]
    if int in kinds and (len(kinds) == 1 or strict.NUMBER_TEXT.fullmatch(text.strip())):
        return strict.count(text, flag, text=True)
    if float in kinds:
        return strict.number(text, flag)
    return text


def from_arguments(text: str, source: str) -> tuple[ModelSpec, TrainingSpec]:
    """A model and a training spec from a Megatron argument list."""
    config = read_arguments(text, source)
    return config.model, config.training


def read_arguments(text: str, source: str) -> MegatronConfig:
    arguments, world = parse_argument_list(text, source)
    return split_arguments(_as_argparse_reads(arguments, source), source, world)


def load_megatron_config(path: str | Path) -> tuple[ModelSpec, TrainingSpec]:
    """From a file: a YAML mapping of Megatron arguments (Primus style), else an argument list."""
    config = read_megatron_config(path)
    return config.model, config.training


_ARGUMENT = re.compile(r"(^|\s)--[A-Za-z]")
_YAML_KEY = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*:", re.MULTILINE)
"""A token of an argument list (``--num-layers``) and a YAML mapping's key line (``num_layers:``): a file with keys
and no arguments that the strict loader refuses is refused for its YAML, not read as an argument list."""


def read_megatron_config(path: str | Path) -> MegatronConfig:
    """:func:`load_megatron_config` with the world size the file names (if any) and what it set aside."""
    text = strict.read_text(path, "Megatron configuration")
    try:
        data = strict.load_yaml(text, f"the Megatron configuration {path}")
    except ConfigError:
        if _YAML_KEY.search(text) and not _ARGUMENT.search(text):  # a YAML mapping, not an argument list: its own
            raise  # fault (an alias, a key twice, an octal 010) is the one to name
        data = None  # a launch script is rarely valid YAML
    if isinstance(data, list):  # its dashes would be read as values ("--num-layers must be an integer, got '-'")
        raise ConfigError(f"{path}: holds a YAML list; give a mapping of Megatron arguments (num_layers: 32) or a "
                          "launch script's argument list")
    if not isinstance(data, Mapping):
        return read_arguments(text, str(path))
    modules = data.get("modules")
    if not isinstance(modules, Mapping):
        return split_arguments(_primus_dests(_primus_values(data, str(path))), str(path))
    arguments: dict[str, Any] = dict(PRIMUS_MODULE_DEFAULTS)
    naming = [name for name, module in modules.items() if isinstance(module, Mapping) and module.get("model") is not None]
    if len(naming) > 1:  # one run trains one model: which file the projection read would be an accident of order
        named = ", ".join(f"{n} (model: {modules[n]['model']})" for n in naming)
        raise ConfigError(f"{path}: modules {named} each "
                          "name a model; one configuration projects one model: keep the model: of one module")
    for name, module in modules.items():
        if module is None:
            continue  # an empty module
        if not isinstance(module, Mapping):  # was skipped: its overrides silently not applied
            raise ConfigError(f"{path}: modules.{name} must be a mapping of {', '.join(sorted(_PRIMUS_MODULE_KEYS))}, "
                              f"got {strict.show(module)}")
        if unknown := set(module) - _PRIMUS_MODULE_KEYS:
            raise ConfigError(f"{path}: modules.{name}: unknown keys {sorted(unknown)}; a Primus module has "
                              f"{', '.join(sorted(_PRIMUS_MODULE_KEYS))}")
        if module.get("model") is not None:  # e.g. ${PRIMUS_MODEL:llama3.1_8B}.yaml
            reference = _primus_values({"model": module["model"]}, str(path))["model"]
            arguments.update(_primus_model(Path(path), str(reference)))
        overrides = module.get("overrides")
        if overrides is not None and not isinstance(overrides, Mapping):  # was skipped, the run projected without them
            raise ConfigError(f"{path}: modules.{name}.overrides must be a mapping of Megatron arguments "
                              f"(num_layers: 32), got {strict.show(overrides)}")
        arguments.update(overrides or {})
    return split_arguments(_primus_dests(_primus_values(arguments, str(path))), str(path))


def _primus_dests(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A Primus YAML's argparse destinations as the flags the reader knows (:data:`PRIMUS_DESTS`). Megatron's layers
    fuse the bias into the activation by the model's own activation's switch (``bias_activation_fusion``:
    ``bias_swiglu_fusion`` with ``swiglu``, else ``bias_gelu_fusion``): that one false is ``--no-bias-...-fusion``; on
    (the default), or the other activation's, it is set aside."""
    read: dict[str, Any] = {}
    own = "bias_swiglu_fusion" if arguments.get("swiglu") is True else "bias_gelu_fusion"
    for name, value in arguments.items():
        if name == own and value is False:
            read[f"no_{name}"] = True
        else:
            read[PRIMUS_DESTS.get(name, name)] = value
    return read


PRIMUS_MODULE_DEFAULTS = {"moe_router_force_load_balancing_type": "even", "bf16": True, "use_distributed_optimizer": True,
                          "micro_batch_size": 2, "global_batch_size": 16, "seq_length": 1024}
"""Primus module defaults that differ from megatron-core's and change a step: forced balance is Primus's round-robin
(``primus/configs/modules/megatron/primus_megatron_module.yaml``; before that flag, the only forced balance its
router had); bf16 and the micro batch (``trainer_base.yaml``: ``bf16: true``, ``micro_batch_size: 2``), the
distributed optimizer, the global batch and the sequence (``pre_trainer.yaml``, the module ``config:`` of Primus's
pre-training experiments: ``use_distributed_optimizer: true``, ``global_batch_size: 16``, ``seq_length: 1024``;
AMD-AGI/Primus fd1eeab). Read as Megatron's defaults, a Primus experiment that leaves ``bf16`` to its module was
projected in fp32. A module's ``overrides`` and ``model:`` file still win."""

_PRIMUS_VARIABLE = re.compile(r"\$\{\w+:([^}]*)\}")


def _yaml_value(text: str, source: str) -> Any:
    """One value written as YAML inside another text (an override's argument, a ``${VAR:default}``), read by the
    strict loader as a file's values are: an unclosed ``[``, an alias, ``!!python/...``, an octal ``010`` are
    refused naming ``source``, not a traceback or another number."""
    return strict.load_yaml(text, f"{source} {strict.show(text)}")


def _primus_values(arguments: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Primus writes ``${VAR:default}`` for values a launch may override: the default is the value (read as
    YAML when it is the whole value, so numbers stay numbers; put in place within a longer string)."""
    resolved = {}
    for name, value in arguments.items():
        if isinstance(value, str) and (match := _PRIMUS_VARIABLE.fullmatch(value.strip())):
            value = _yaml_value(match.group(1), f"{source}: {name}") if match.group(1) else None
        elif isinstance(value, str):
            value = _PRIMUS_VARIABLE.sub(lambda m: m.group(1), value)
        resolved[name] = value
    return resolved


def _primus_model(config: Path, reference: str, chain: tuple[Path, ...] = (),
                  read: dict[Path, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Megatron arguments of a Primus model file a module names (``model: llama3.1_8B.yaml``), its
    ``bases:`` first: looked up beside the configuration, in ``models/`` or ``models/megatron/`` there, and
    in ``configs/models/megatron/`` of the enclosing directories (Primus's layout). Each file is read once
    (``read``; a file named as a base many times over many levels was read exponentially often, a hang), and
    one that bases on itself through ``chain`` is refused, naming the loop."""
    read = {} if read is None else read
    path = _find_model_file(config, reference)
    if path in chain:
        loop = " -> ".join(p.name for p in (*chain[chain.index(path):], path))
        raise ConfigError(f"{config}: model files base on each other in a loop ({loop}); remove one of the bases")
    if len(chain) > 8:
        raise ConfigError(f"{config}: model files base on each other more than 8 deep at {reference}; flatten them")
    if path in read:
        return read[path]
    data = strict.load_yaml(strict.read_text(path, "Primus model file"), f"the Primus model file {path}")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a Primus model file must hold a mapping of Megatron arguments")
    values: dict[str, Any] = {}
    bases = []
    for key in ("bases", "extends"):  # Primus's loader names them extends (primus/core/config/yaml_loader.py)
        named = data.get(key) or []
        named = [named] if isinstance(named, str) else named
        if not isinstance(named, list) or not all(isinstance(base, str) for base in named):
            raise ConfigError(f"{path}: {key} must be a model file name or a list of them, "
                              f"got {strict.show(data[key])}")
        bases += named
    for base in bases:
        values.update(_primus_model(path, str(base), (*chain, path), read))
    values.update({k: v for k, v in data.items() if k not in ("bases", "extends")})
    read[path] = values
    return values


def _find_model_file(config: Path, reference: str) -> Path:
    here = config.parent
    candidates = [here / reference, here / "models" / reference, here / "models" / "megatron" / reference]
    candidates += [d / sub / "configs" / "models" / "megatron" / reference for d in [here, *here.parents]
                   for sub in (".", "primus")]  # a Primus checkout: primus/configs/models/megatron beside examples/
    candidates += [d / "models" / "megatron" / reference for d in here.parents]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ConfigError(f"{config}: model {reference!r} not found (looked beside it, in models/, models/megatron/ "
                          "and [primus/]configs/models/megatron/ up the tree); give its path relative to the configuration")
    return found.resolve()
