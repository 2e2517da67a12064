"""A Megatron-LM GPT pretraining script (the shape of Megatron-LM's ``pretrain_gpt.py``) run through
``megatron.training.pretrain`` on CPU/gloo, with or without primuspipe -- for the end-to-end test of
``pretrain()`` against Megatron's own schedule.

Launch with torchrun and Megatron-LM's own flags, e.g.::

    PRIMUSPIPE_PATCH=1 PRIMUSPIPE_PP_ALGORITHM=zbv torchrun --nproc-per-node 4 \\
        -m primuspipe.testing.megatron.pretrain_gpt_cpu --record out.json \\
        --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 ... (Megatron-LM flags;
        the full list for CPU is in tests/megatron/test_pretrain_cpu.py)

What is the user's (as in ``pretrain_gpt.py``): ``model_provider`` (a local-spec ``GPTModel``),
``forward_step`` / ``loss_func`` (Megatron-LM's: loss sum, token count, ``{"lm loss": ...}``), the
dataset provider (Megatron's ``MockGPTDataset`` through ``BlendedMegatronDatasetBuilder``, ``--mock-data``)
and the one line a primuspipe user adds, :func:`primuspipe.backends.megatron.install`. Two differences
from ``pretrain_gpt.py``, both so that runs of different layouts are comparable: ``model_provider`` (and,
with ``--model-config``, a pre-wrap hook of the ``GPTModelConfig``) fills every parameter from its *global* name (:func:`tiny_models.fill_parameters`; Megatron
draws initial weights from a per-pipeline-rank seed, so a V placement would start from other weights),
and ``--record FILE`` writes what ``pretrain`` logs each iteration (the reduced loss dict, the gradient
norm, the learning rate, skipped iterations) on every rank, bit-exact (float hex), as JSON.

Not product code: CPU mode (:mod:`primuspipe.testing.megatron.pretrain_cpu`) patches megatron's CUDA
calls for this process only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial

import torch


def _own_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--record", help="write each rank's logged iterations here (JSON, one list per rank)")
    parser.add_argument("--model-config", action="store_true",
                        help="give pretrain a GPTModelConfig (built from the flags by Megatron's gpt_config_from_args) "
                             "instead of model_provider: Megatron's model builder builds the chunks")
    return parser.parse_known_args(argv)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's GPT model provider (local spec), with layout-independent initial weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from primuspipe.testing.megatron.tiny_models import fill_parameters

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    fill_parameters(model, args.seed)
    return model


def _get_batch(data_iterator, vp_stage):
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: the loss sum, the token count, and the report ``train_step`` reduces."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = _get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's mock GPT datasets (``--mock-data``), built where a stage consumes data."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                              blend_per_split=None, split=args.split, tokenizer=build_tokenizer(args),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=args.create_attention_mask_in_dataloader,
                              path_to_cache=args.data_cache_path,
                              mid_level_dataset_surplus=args.mid_level_dataset_surplus)

    def built_here() -> bool:
        return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, built_here, config).build()


def _record_training_log(path: str) -> Callable[[], None]:
    """Wrap ``megatron.training.training.training_log`` (what ``pretrain`` calls once per iteration) to
    keep its inputs; write them, every rank's, to ``path`` when ``pretrain`` returns."""
    from megatron.training import training

    log, entries = training.training_log, []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs):
        entries.append({
            "iteration": iteration,
            "loss": {k: [float(x).hex() for x in torch.as_tensor(v).reshape(-1).tolist()] for k, v in loss_dict.items()},
            "grad_norm": None if grad_norm is None else float(grad_norm).hex(),
            "learning_rate": None if learning_rate is None else float(learning_rate).hex(),
            "loss_scale": None if loss_scale is None else float(loss_scale).hex(),
            "skipped": int(skipped_iter),
        })
        return log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                   skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs)

    training.training_log = training_log

    def write() -> None:
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, entries)
        if torch.distributed.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(gathered, f, indent=1)

    return write


def main(argv: list[str] | None = None) -> None:
    own, megatron_argv = _own_args(sys.argv[1:] if argv is None else argv)
    from primuspipe.testing.megatron.pretrain_cpu import enable_pretrain_cpu_mode

    enable_pretrain_cpu_mode()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from primuspipe.backends.megatron import install

    install()  # the one line a primuspipe user adds; PRIMUSPIPE_PATCH unset -> Megatron's own schedule
    write = _record_training_log(own.record) if own.record else None
    sys.argv = sys.argv[:1] + megatron_argv
    args = parse_and_validate_args()
    if own.model_config:
        from megatron.training.argument_utils import gpt_config_from_args

        from primuspipe.testing.megatron.tiny_models import fill_parameters

        def fill(chunks):
            for chunk in chunks:
                fill_parameters(chunk, args.seed)
            return chunks

        model_config = gpt_config_from_args(args)
        model_config.pre_wrap_hooks.append(fill)
        cfg = pretrain_cfg_container_from_args(args, model_cfg=model_config)
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    else:
        cfg = pretrain_cfg_container_from_args(args)
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
    if write is not None:
        write()
    _close_process_group()


def _close_process_group() -> None:
    """Tear the process group down before the interpreter does: Megatron's ``pretrain`` returns with it alive.
    Once in a full suite two ranks aborted at the same moment with "terminate called without an active exception"
    (SIGABRT: a C++ thread destroyed while still joinable, as a gloo group's threads can be when the group is left
    to interpreter teardown); the three reruns passed, so this is the likely, not a proven, cause."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
