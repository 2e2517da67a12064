"""Train a megatron-core GPT with a primuspipe schedule, on CPU (gloo) or GPU (nccl), with Megatron's own
model and parallelism flags.

    torchrun --nproc-per-node 4 examples/train_gpt.py --pp 4 --microbatches 8 --pp-algorithm 1f1b
    torchrun --nproc-per-node 3 examples/train_gpt.py --pp 3 --num-layers 7 --microbatches 6 --compare-native
    torchrun --nproc-per-node 4 examples/train_gpt.py --pp 2 --microbatches 4 --pp-algorithm zbv \\
        --tensor-model-parallel-size 2 --sequence-parallel --num-experts 4 --expert-model-parallel-size 2 \\
        --moe-token-dispatcher-type alltoall --recompute-granularity full --recompute-method uniform \\
        --recompute-num-layers 1 --compare-native
    torchrun --nproc-per-node 2 examples/train_gpt.py --pp 2 --microbatches 4 --config primuspipe.yaml

The schedule comes from ``--config`` (YAML, see docs/megatron.md), the environment, or the flags (flags
win). The model's chunks are built for the placement and vpp of the table the algorithm returns (V-shape
algorithms: two chunks per rank in the V). The world size is ``pp * tensor-parallel * data-parallel``;
data parallelism fills the rest.

Model and parallelism flags keep Megatron-LM's names and meanings: embeddings are tied unless
``--untie-embeddings-and-output-weights``; gradient-accumulation fusion is on unless
``--no-gradient-accumulation-fusion``. When ``--num-layers`` does not split evenly over the pipeline
stages and neither ``--decoder-first-pipeline-num-layers`` nor ``--decoder-last-pipeline-num-layers``
is given, the first and last stage get their own count (Megatron's uneven split), and the run says so.

The last line printed (rank 0) is one JSON object: ``algorithm``, ``loss`` (last iteration's mean
per-token loss), ``step_time_s`` (median forward-backward time); with ``--compare-native`` the same
model, weights and data also go through Megatron's own schedule for the same pp and vpp in this run
(interleaved-built chunks for V tables), adding ``native_loss``, ``native_step_time_s``,
``max_abs_grad_diff`` (over all parameters of all ranks, first iteration) and ``reference``: where
Megatron's own schedule refuses the shape (e.g. pp=4, vpp=2, 6 microbatches), the reference is a pp=1
run of the same model on the same ranks instead, and ``reference`` says why.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from primuspipe.cli.options import count_type, number_type
from primuspipe.cli.parser import Parser
from primuspipe.runtime import nccl_emulation


POSITIVE, COUNT_OR_ZERO, NON_NEGATIVE = count_type(1), count_type(0), number_type(minimum=0)
"""The flags' types: sizes and counts are integers >= 1 (--iterations 0 had no median step time to print), the
two whose 0 means "off" >= 0, and --lr / --moe-aux-loss-coeff finite numbers >= 0 (--lr nan trained to NaN)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=POSITIVE, required=True,
                   help="pipeline-parallel size")
    p.add_argument("--vpp", "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size", dest="vpp",
                   type=POSITIVE, default=None,
                   help="model chunks per rank (default: the algorithm's)")
    p.add_argument("--microbatches", type=POSITIVE, required=True, help="microbatches per step and data-parallel rank")
    p.add_argument("--pp-algorithm", "--algorithm", "-a", dest="pp_algorithm", default=None,
                   help="primuspipe algorithm (default: config, else auto); --algorithm as examples/train_torch.py")
    p.add_argument("--config", default=None, help="primuspipe YAML config (else $PRIMUSPIPE_CONFIG)")
    p.add_argument("--iterations", type=POSITIVE, default=3)
    p.add_argument("--dump-dir", default=None, help="turn on dump_pp_data and write timelines here")
    p.add_argument("--compare-native", action="store_true", help="also run Megatron's own schedule and compare")
    p.add_argument("--auto-replan", action="store_true",
                   help="measure the first steps (auto_replan_warmup + auto_replan_steps, default 2 + 3) and switch to "
                        "the algorithm of the same layout the simulator ranks first (docs/replanning.md); needs more "
                        "--iterations than that")
    p.add_argument("--manual-gc", action="store_true",
                   help="Megatron-LM's: turn Python's automatic garbage collector off and collect between steps "
                        "(--manual-gc-interval), so a collection (100+ ms of CPU here) never lands inside a step")
    p.add_argument("--manual-gc-interval", type=COUNT_OR_ZERO, default=0,
                   help="with --manual-gc: collect after every N-th step (0: never between steps)")
    p.add_argument("--lr", type=NON_NEGATIVE, default=0.05)
    opt = p.add_argument_group("optimizer, data-parallel gradients and checkpoints (Megatron-LM's flags)")
    opt.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                     help="Megatron's optimizer (sgd without momentum, or adam); no gradient clipping")
    opt.add_argument("--use-distributed-optimizer", action="store_true",
                     help="shard the optimizer state and reduce-scatter gradients over data-parallel ranks (adam)")
    opt.add_argument("--overlap-grad-reduce", action="store_true",
                     help="start each gradient bucket's reduction during the backward (a chunk's buckets after "
                          "its last backward, or last W with B/W tables)")
    opt.add_argument("--overlap-param-gather", action="store_true",
                     help="all-gather updated parameters during the next step's forwards (needs "
                          "--use-distributed-optimizer and --overlap-grad-reduce, as in Megatron-LM)")
    opt.add_argument("--save", metavar="DIR", default=None,
                     help="after the last iteration save model and optimizer (Megatron distributed checkpoint)")
    opt.add_argument("--load", metavar="DIR", default=None,
                     help="start from a checkpoint --save wrote, under any schedule; iterations continue from "
                          "the saved one up to --iterations")
    m = p.add_argument_group("model (Megatron-LM's flags)")
    m.add_argument("--num-layers", type=POSITIVE, default=8)
    m.add_argument("--hidden-size", type=POSITIVE, default=16)
    m.add_argument("--ffn-hidden-size", type=POSITIVE, default=None, help="default: 2 * hidden size")
    m.add_argument("--num-attention-heads", type=POSITIVE, default=2)
    m.add_argument("--seq-length", type=POSITIVE, default=8)
    m.add_argument("--micro-batch-size", type=POSITIVE, default=2)
    m.add_argument("--vocab-size", type=POSITIVE, default=64)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--disable-bias-linear", action="store_true",
                   help="no bias in linear layers (always so for MoE: megatron-core 0.19's local experts take none)")
    m.add_argument("--decoder-first-pipeline-num-layers", type=POSITIVE, default=None)
    m.add_argument("--decoder-last-pipeline-num-layers", type=POSITIVE, default=None)
    m.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer when splitting layers over stages (the first stage "
                        "builds one fewer)")
    m.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the loss as a layer when splitting layers over stages (the last stage builds "
                        "one fewer)")
    m.add_argument("--mtp-num-layers", type=COUNT_OR_ZERO, default=None,
                   help="multi-token-prediction layers, built with the last stage")
    m.add_argument("--bf16", action="store_true",
                   help="bfloat16 parameters (Megatron's Float16Module) and pipeline transfers, fp32 gradient "
                        "reduction (CPU and GPU)")
    m.add_argument("--calculate-per-token-loss", action="store_true")
    m.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false")
    par = p.add_argument_group("parallelism (Megatron-LM's flags)")
    par.add_argument("--tensor-model-parallel-size", type=POSITIVE, default=1)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--expert-model-parallel-size", type=POSITIVE, default=1)
    par.add_argument("--expert-tensor-parallel-size", type=POSITIVE, default=1,
                     help="tensor parallelism inside each expert (carved out of the data-parallel ranks)")
    moe = p.add_argument_group("mixture of experts (Megatron-LM's flags)")
    moe.add_argument("--num-experts", type=POSITIVE, default=None)
    moe.add_argument("--moe-router-topk", type=POSITIVE, default=2)
    moe.add_argument("--moe-shared-expert-intermediate-size", type=POSITIVE, default=None)
    moe.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    moe.add_argument("--moe-aux-loss-coeff", type=NON_NEGATIVE, default=0.0,
                     help="> 0 turns on the load-balancing aux loss")
    rec = p.add_argument_group("activation recompute (Megatron-LM's flags)")
    rec.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    rec.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    rec.add_argument("--recompute-num-layers", type=POSITIVE, default=None)
    rec.add_argument("--recompute-modules", nargs="*", default=None)
    args = p.parse_args(argv)
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        p.error("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (Megatron-LM)")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        p.error("--use-distributed-optimizer needs --optimizer adam (megatron-core's distributed optimizer "
                "checkpoints Adam's state only)")
    if problem := combination_problem(args):
        p.error(problem)
    return args


def combination_problem(args: argparse.Namespace) -> str | None:
    """What Megatron-LM's ``validate_args`` (megatron/training/arguments.py) refuses of these flags together, and
    what would fail only inside the run (on every rank, after the process groups: a ZeroDivisionError building
    attention, torch.topk's "selected index k out of range" at the first routed token); None when they agree.
    The rest of megatron-core's rules are its ``TransformerConfig``'s, tried before any process group
    (:func:`prepare`)."""
    if args.hidden_size % args.num_attention_heads:  # validate_args: assert hidden_size % num_attention_heads == 0
        return (f"--hidden-size {args.hidden_size} does not split into --num-attention-heads "
                f"{args.num_attention_heads} heads (Megatron-LM's validate_args: each head gets hidden-size / heads "
                "channels); give a hidden size that is a multiple of the head count")
    if args.expert_model_parallel_size > 1 and args.num_experts is None:  # "num_experts must be non None to use ..."
        return (f"--expert-model-parallel-size {args.expert_model_parallel_size} spreads experts, and there are none "
                "(Megatron-LM's validate_args); add --num-experts, or drop it")
    if args.num_experts is not None and args.num_experts % args.expert_model_parallel_size:
        return (f"--num-experts {args.num_experts} does not split over --expert-model-parallel-size "
                f"{args.expert_model_parallel_size} (Megatron-LM's validate_args: \"Number of experts should be a "
                "multiple of expert model parallel_size\"); give a multiple")
    if args.num_experts is not None and args.moe_router_topk > args.num_experts:
        return (f"--moe-router-topk {args.moe_router_topk} routes each token to more experts than --num-experts "
                f"{args.num_experts}; give at most {args.num_experts}")
    if args.num_experts is not None and args.moe_router_topk == 1:  # TransformerConfig asks for a flag not here
        return ("--moe-router-topk 1 needs the router's softmax before the top-k (megatron-core's TransformerConfig: "
                "--moe-router-pre-softmax), which this example does not set; give --moe-router-topk 2 or more")
    if args.load is not None and args.optimizer != "adam":  # megatron-core's SGD has no init_state_fn to load into
        return ("--load restores the optimizer's state, which megatron-core loads for --optimizer adam only (its SGD "
                "was a TypeError on every rank); give --optimizer adam, as the run that saved it")
    if args.recompute_granularity == "selective" and args.recompute_method is not None:
        return ("--recompute-method is for --recompute-granularity full (Megatron-LM's validate_args: \"recompute "
                "method is not yet supported for selective recomputing granularity\"); drop one of them")
    return None


def world_problem(args: argparse.Namespace, world: int) -> str | None:
    """Whether ``world`` ranks hold the pipeline's grids: pp x tensor-parallel (data parallelism fills the rest) and
    megatron-core's expert grid, pp x expert-parallel x expert-tensor-parallel (parallel_state's "world_size is not
    divisible by expert_tensor_model_pipeline_parallel size", raised on every rank after the process group)."""
    for what, size in (("pp*tensor-parallel", args.pp * args.tensor_model_parallel_size),
                       ("pp*expert-parallel*expert-tensor-parallel",
                        args.pp * args.expert_model_parallel_size * args.expert_tensor_parallel_size)):
        if world % size:
            return f"WORLD_SIZE={world} is not a multiple of {what}={size}"
    return None


def uneven_split(num_layers: int, pp: int) -> tuple[int, int]:
    """``(first, last)`` stage layer counts that let the middle stages split the rest evenly, the first
    and last as close to an even share as possible."""
    if pp == 2:
        return num_layers - num_layers // 2, num_layers // 2
    fits = [x for x in range(1, num_layers) if num_layers - 2 * x >= pp - 2 and (num_layers - 2 * x) % (pp - 2) == 0]
    if not fits:
        raise SystemExit(f"{num_layers} layers cannot be split over {pp} pipeline stages; give "
                         "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
    ends = min(fits, key=lambda x: abs(x - num_layers / pp))
    return ends, ends


def model_and_overrides(args, table, say) -> tuple:
    """The tiny-model shape and the Megatron ``TransformerConfig`` fields the flags ask for (chunks for
    ``table``'s placement and vpp)."""
    from primuspipe.testing.megatron import tiny_models

    moe = args.num_experts is not None
    model = tiny_models.TinyModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 2 * args.hidden_size, vocab_size=args.vocab_size,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, add_bias_linear=not (args.disable_bias_linear or moe),
        tie_embeddings=not args.untie_embeddings_and_output_weights)
    overrides = {"sequence_parallel": args.sequence_parallel,
                 "gradient_accumulation_fusion": args.gradient_accumulation_fusion,
                 "calculate_per_token_loss": args.calculate_per_token_loss}
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    accounted = args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
    overrides.update(account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
                     account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
    if args.mtp_num_layers:
        overrides["mtp_num_layers"] = args.mtp_num_layers
    if args.expert_tensor_parallel_size != 1:
        overrides["expert_tensor_parallel_size"] = args.expert_tensor_parallel_size
    if args.bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    v = table.placement.name == "v"
    stages = args.pp * table.vpp
    if first is None and last is None and not accounted and args.num_layers % stages:
        if table.vpp > 1 and not v:
            raise SystemExit(f"{args.num_layers} layers do not split evenly over pp*vpp={stages} stages; give "
                             "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        first, last = uneven_split(args.num_layers, stages)  # the V: stages of the 2p-stage pipeline it folds
        say(f"{args.num_layers} layers do not split evenly over {stages} pipeline stages: using "
            f"--decoder-first-pipeline-num-layers {first} --decoder-last-pipeline-num-layers {last}")
    if first is not None:
        overrides["num_layers_in_first_pipeline_stage"] = first
    if last is not None:
        overrides["num_layers_in_last_pipeline_stage"] = last
    if moe:
        overrides.update(moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                         moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                         moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                         moe_router_load_balancing_type="aux_loss" if args.moe_aux_loss_coeff > 0 else "none")
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return model, overrides


def init_distributed(args, vpp: int) -> torch.device:
    """``env://`` init (torchrun) with a timeout; CPU mode without a GPU."""
    cuda = torch.cuda.is_available()
    if cuda:
        # more ranks than devices share them round-robin (NCCL then needs a distinct NCCL_HOSTID per rank, as
        # bench/nccl_one_gpu.py gives them; without it NCCL refuses the duplicate GPU with a clear error)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

        torch.set_num_threads(1)
        enable_cpu_mode()
    dist.init_process_group("nccl" if cuda else nccl_emulation.cpu_backend(), timeout=timedelta(minutes=5))
    set_parallel_state(args, args.pp, vpp)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def set_parallel_state(args, pp: int, vpp: int) -> None:
    """Megatron's parallel state and model-parallel RNG for a pipeline of ``pp`` stages."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
    else:
        from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed

        cpu_rng_seed(0)


def train(schedule, spec_for, args, pp: int, vpp: int, device, save: bool = True):
    """Steps up to ``--iterations`` (DDP, finalize grads, the optimizer), from fresh weights or ``--load``'s
    checkpoint, then ``--save``; returns (per-iteration mean per-token losses on the loss rank, step times,
    first iteration's grads by shard, first iteration); ``save=False`` leaves ``--save`` out (a
    reference run)."""
    from primuspipe.testing.megatron import compare

    result = compare.train(schedule, spec_for, pp, vpp, args.iterations, device,
                           load=args.load, save=args.save if save else None,
                           manual_gc_interval=args.manual_gc_interval if args.manual_gc else None, grads_kept=1)
    losses = []
    for out in result.losses:
        if out:
            total = torch.stack([d["lm loss"] for d in out]).sum(0)
            losses.append((total[0] / total[1]).item())
    first_grads = {name: None if g is None else g.cpu() for name, g in result.grads[0].items()} if result.grads else {}
    return losses, result.step_times, first_grads, result.start


def gather_grads(grads: dict) -> dict:
    """Every rank's gradients by shard name (data-parallel replicas hold the same values)."""
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, grads)
    return {k: v for part in everything for k, v in part.items()}


def from_loss_rank(value):
    """``value`` of a rank holding the last pipeline stage (the others report nothing)."""
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, value)
    return next((v for v in everything if v not in (None, [])), value)


def refused_everywhere(error: Exception | None) -> str | None:
    """Megatron's own schedule checks the shape before any transfer, on every rank alike; agree anyway."""
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, None if error is None else f"{type(error).__name__}: {error}")
    return next((e for e in everything if e is not None), None)


def replan_result(ours, table, times: list[float]) -> dict:
    """The JSON line's re-planning figures (global rank 0 holds the decision; every rank the same table)."""
    summary = ours.replanner.summary(table) if ours.replanner is not None else None
    if summary is None:
        return {"replanned_to": None, "replan": "no decision"}
    if "failure" in summary:
        return {"replanned_to": None, "replan": f"no decision: {summary['failure']}"}
    after = times[summary["first_verified_step"]:]  # a switched-to table's first step warms it up
    out = {"replanned_to": summary["replanned_to"], "predicted_step_time_s": summary["predicted_step_time_s"],
           "step_time_before_s": statistics.median(times[:summary["decided_at_step"]]),
           "step_time_s": statistics.median(after) if after else None}
    if "measured_step_time_after_s" in summary:
        out.update(measured_span_s=summary["measured_step_time_after_s"], prediction_error=summary["prediction_error"])
    return out


def prepare(args: argparse.Namespace, world: int) -> tuple:
    """Everything a run settles before its process groups, on ``world`` ranks: the grids, the checkpoint folders,
    the primuspipe config, the schedule and its table, the model and Megatron's config overrides -- and
    megatron-core's ``TransformerConfig`` tried once, so what it refuses (sequence parallelism without tensor
    parallelism, full recompute without a method, heads that do not split over tensor-parallel ranks, ...) is one
    line before any rank joins a group, not after.
    Returns ``(config, schedule, table, model, overrides, say)``."""
    from primuspipe import strict
    from primuspipe.backends.megatron import PrimusForwardBackward, load_config
    from primuspipe.errors import ConfigError
    from primuspipe.testing.megatron import compare, tiny_models

    if problem := world_problem(args, world):
        raise SystemExit(problem)
    if args.load is not None and not os.path.isfile(os.path.join(args.load, "metadata.json")):  # was a traceback
        raise ConfigError(f"--load {strict.shown_path(args.load)} holds no checkpoint (no metadata.json, which "
                          "Megatron's distributed checkpointing and --save write); give the folder --save wrote")
    if args.save is not None:  # a file in the way was a FileExistsError traceback after the training
        strict.writable_folder(args.save, f"--save {args.save}")
    overrides = {"patch_primus_pipeline": True}
    if args.pp_algorithm:
        overrides["pp_algorithm"] = args.pp_algorithm
    if args.dump_dir:
        overrides.update(dump_pp_data=True, dump_dir=args.dump_dir)
    if args.auto_replan:
        overrides["auto_replan"] = True
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
        logging.getLogger("primuspipe.replan").setLevel(logging.INFO if os.environ.get("RANK", "0") == "0"
                                                        else logging.WARNING)
    config = replace(load_config(args.config), **overrides)
    if config.auto_replan and args.iterations <= config.auto_replan_warmup + config.auto_replan_steps:
        raise SystemExit(f"--auto-replan decides after {config.auto_replan_warmup + config.auto_replan_steps} "
                         f"iterations (auto_replan_warmup + auto_replan_steps); give --iterations above that")
    ours = PrimusForwardBackward(config)
    table = ours.table_for(args.pp, args.vpp, args.microbatches)
    rank0 = os.environ.get("RANK", "0") == "0"

    def say(line: str) -> None:
        if rank0:
            print(f"train_gpt: {line}", file=sys.stderr, flush=True)

    model, overrides = model_and_overrides(args, table, say)
    if not torch.cuda.is_available():  # megatron-core imports triton unless CPU mode stubs it
        from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    trial = dict(overrides)
    if model.num_moe_experts:  # as compare.build_chunks settles it from the parallel state
        trial.setdefault("expert_tensor_parallel_size", args.expert_tensor_parallel_size)
    tiny_models.transformer_config(model, args.pp, table.vpp, tp=args.tensor_model_parallel_size,
                                   ep=args.expert_model_parallel_size if model.num_moe_experts else 1,
                                   placement=compare.placement_of(table), **trial)
    return config, ours, table, model, overrides, say


def main(argv=None) -> None:
    args = parse_args(argv)
    from primuspipe.errors import ConfigError
    from primuspipe.testing.megatron import compare

    config, ours, table, model, overrides, say = prepare(args, int(os.environ.get("WORLD_SIZE", "1")))
    device = init_distributed(args, table.vpp)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    placement = compare.placement_of(table)
    ddp_overrides = {"use_distributed_optimizer": args.use_distributed_optimizer,
                     "overlap_grad_reduce": args.overlap_grad_reduce,
                     "overlap_param_gather": args.overlap_param_gather,
                     "grad_reduce_in_fp32": args.bf16}

    def spec_for(iteration, placement=placement, overrides=overrides):
        return compare.StepSpec(model, args.microbatches, seed=iteration, ddp=True, placement=placement,
                                config_overrides=overrides, optimizer=args.optimizer, lr=args.lr,
                                ddp_overrides=ddp_overrides)

    losses, times, grads, start = train(ours, spec_for, args, args.pp, table.vpp, device)
    result = {"algorithm": table.algorithm, "pp": args.pp, "vpp": table.vpp, "placement": placement,
              "microbatches": args.microbatches, "device": device.type, "first_iteration": start,
              "loss": from_loss_rank(losses[-1] if losses else None),
              "losses": from_loss_rank(losses), "step_time_s": statistics.median(times)}
    if config.auto_replan:
        result.update(replan_result(ours, table, times))
    if args.compare_native:
        native, error = get_forward_backward_func(args.pp, table.vpp if table.vpp > 1 else None), None
        try:
            native_run = train(native, lambda it: spec_for(it, placement="interleaved"), args, args.pp, table.vpp, device,
                               save=False)
        except (AssertionError, RuntimeError, ValueError, ConfigError) as exc:
            error = exc
        if (why := refused_everywhere(error)) is not None:
            reference = f"pp=1 (Megatron's own schedule refuses pp={args.pp}, vpp={table.vpp}: {why})"
            say(f"comparing with a pp=1 run instead: {why}")
            set_parallel_state(args, 1, 1)
            flat = {k: v for k, v in overrides.items() if not k.startswith("num_layers_in_")}
            native_run = train(get_forward_backward_func(), lambda it: spec_for(it, "interleaved", flat), args, 1, 1,
                               device, save=False)
        else:
            reference = f"Megatron's own schedule, pp={args.pp}, vpp={table.vpp}"
        native_losses, native_times, native_grads, _ = native_run
        result.update(native_loss=from_loss_rank(native_losses[-1] if native_losses else None),
                      native_step_time_s=statistics.median(native_times), reference=reference,
                      max_abs_grad_diff=compare.max_abs_diff(gather_grads(grads), gather_grads(native_grads)))
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result), flush=True)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    from primuspipe.errors import PrimusPipeError

    try:
        main()
    except PrimusPipeError as exc:  # a refused setting: its one line, no traceback
        raise SystemExit(f"train_gpt: {exc}") from None
