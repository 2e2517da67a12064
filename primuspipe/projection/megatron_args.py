"""A model and a training configuration from what Megatron users already have: an argument list
(``--num-layers 32 --hidden-size 4096 ... --bf16``, as in a launch script) or a Primus-style YAML of
Megatron arguments (keys with underscores, at the top or under ``modules.<name>.overrides``).

Arguments the projection does not use (learning rate, data paths, ...) are skipped; those it uses take
Megatron's own defaults when absent (pp 1, fp32 unless ``--bf16``/``--fp16``, dropout 0.1, biases on,
no distributed optimizer), so the projection describes the run the arguments describe.

>>> model, training = from_arguments("--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
...     "--seq-length 32 --max-position-embeddings 32 --vocab-size 100 --micro-batch-size 2 --bf16", "args")
>>> model.num_layers, training.precision, training.pipeline_model_parallel_size, model.hidden_dropout
(4, 'bf16', 1, 0.1)
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.framework import ConfigError, strict
from primuspipe.projection.spec_fields import spec_from_mapping
from primuspipe.projection.training_spec import TrainingSpec

logger = logging.getLogger("primuspipe.projection")

MEGATRON_DEFAULTS = {
    "model": {"attention_dropout": 0.1, "hidden_dropout": 0.1},
    "training": {"pipeline_model_parallel_size": 1, "precision": "fp32", "use_distributed_optimizer": False,
                 "overlap_grad_reduce": False, "attention_backend": "flash"},
}
"""Where Megatron's defaults differ from the projection's own (which describe a current pre-training run)."""

FLAGS = {
    # flag: (spec, field, value it sets)
    "disable_bias_linear": ("model", "add_bias_linear", False),
    "no_rope_fusion": ("training", "apply_rope_fusion", False),
    "no_bias_swiglu_fusion": ("training", "bias_activation_fusion", False),
    "no_bias_gelu_fusion": ("training", "bias_activation_fusion", False),
    "bf16": ("training", "precision", "bf16"),
    "fp16": ("training", "precision", "fp16"),
}
"""Megatron switches whose name is not the field they set."""

RENAMED = {"num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size"}

_IGNORED_MODEL_FIELDS = {"name", "source"}


def _fields(cls) -> set[str]:
    return {f.name for f in fields(cls)} - _IGNORED_MODEL_FIELDS


def split_arguments(arguments: Mapping[str, Any], source: str) -> tuple[ModelSpec, TrainingSpec]:
    """Sort Megatron arguments (underscore names) into a model and a training spec."""
    values: dict[str, dict[str, Any]] = {"model": dict(MEGATRON_DEFAULTS["model"]),
                                         "training": dict(MEGATRON_DEFAULTS["training"])}
    targets = {"model": _fields(ModelSpec), "training": _fields(TrainingSpec)}
    unused = []
    for name, value in arguments.items():
        name = RENAMED.get(name, name)
        if name in FLAGS:
            if value is not False:
                spec, field, setting = FLAGS[name]
                values[spec][field] = setting
            continue
        if name == "num_layers_per_virtual_pipeline_stage":
            continue  # resolved below, once num_layers and pp are known
        spec = next((s for s, known in targets.items() if name in known), None)
        if spec is None:
            unused.append(name)
        elif value is not None:
            values[spec][name] = "flash" if (name, value) == ("attention_backend", "auto") else value
    if per_stage := arguments.get("num_layers_per_virtual_pipeline_stage"):
        layers = strict.count(values["model"]["num_layers"], f"{source}: num_layers", minimum=1, text=True)
        pp = strict.count(values["training"]["pipeline_model_parallel_size"], f"{source}: pipeline_model_parallel_size",
                          minimum=1, text=True)
        per_stage = strict.count(per_stage, f"{source}: num_layers_per_virtual_pipeline_stage", minimum=1, text=True)
        values["training"]["virtual_pipeline_model_parallel_size"] = layers // (pp * per_stage)
    training = values["training"]
    training.setdefault("global_batch_size", training.get("micro_batch_size", 1))  # Megatron: MBS * DP
    if not arguments.get("group_query_attention"):
        values["model"].pop("num_query_groups", None)
    if unused:
        logger.debug("%s: not used by the projection: %s", source, ", ".join(sorted(unused)))
    values["model"].setdefault("name", Path(source).stem)
    return (spec_from_mapping(ModelSpec, values["model"], source),
            spec_from_mapping(TrainingSpec, values["training"], source))


def parse_argument_list(text: str) -> dict[str, Any]:
    """``--name value`` / ``--flag`` tokens (shell quoting and line continuations allowed) to a mapping;
    a flag maps to True; values are read as YAML scalars."""
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    arguments: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            continue  # the launcher and script names before the arguments
        name, _, inline = token[2:].partition("=")
        values = [inline] if inline else []
        while not inline and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        parsed = [yaml.safe_load(v) for v in values]
        arguments[name.replace("-", "_")] = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
    return arguments


def from_arguments(text: str, source: str) -> tuple[ModelSpec, TrainingSpec]:
    """A model and a training spec from a Megatron argument list."""
    return split_arguments(parse_argument_list(text), source)


def load_megatron_config(path: str | Path) -> tuple[ModelSpec, TrainingSpec]:
    """From a file: a YAML mapping of Megatron arguments (Primus style), else an argument list."""
    text = strict.read_text(path, "Megatron configuration")
    try:
        data = strict.load_yaml(text, f"the Megatron configuration {path}")
    except ConfigError:
        data = None  # a launch script is rarely valid YAML (and YAML with aliases is refused, not expanded)
    if not isinstance(data, Mapping):
        return from_arguments(text, str(path))
    for module in (data.get("modules") or {}).values():
        if isinstance(module, Mapping) and isinstance(module.get("overrides"), Mapping):
            data = {**data, **module["overrides"]}
    return split_arguments({k: v for k, v in data.items() if k != "modules"}, str(path))
