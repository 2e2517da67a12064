"""Train a tiny megatron-core GPT with a primuspipe schedule, on CPU (gloo) or GPU (nccl).

    torchrun --nproc-per-node 4 examples/train_gpt.py --pp 4 --microbatches 8 --pp-algorithm 1f1b
    torchrun --nproc-per-node 2 examples/train_gpt.py --pp 2 --vpp 2 --microbatches 4 \
        --pp-algorithm interleaved-1f1b --compare-native --dump-dir /tmp/pp_data
    torchrun --nproc-per-node 2 examples/train_gpt.py --pp 2 --microbatches 4 --config primuspipe.yaml
    torchrun --nproc-per-node 2 examples/train_gpt.py --pp 2 --microbatches 4 --pp-algorithm zbv --compare-native

The schedule comes from ``--config`` (YAML, see docs/megatron.md), the environment, or the flags
(flags win). The last line printed (rank 0) is one JSON object: ``algorithm``, ``loss`` (last
iteration's mean per-token loss), ``step_time_s`` (median forward-backward time); with
``--compare-native`` the same model, weights and data also go through Megatron's own schedule in this
run, adding ``native_loss``, ``native_step_time_s`` and ``max_abs_grad_diff`` (over all parameters of
all ranks, first iteration).

Zero-bubble algorithms (``zb-h1``, ``zb-h2``, ``zbv``, ``v-half``, ``v-min``, ``dualpipe-v``, ``zb-auto``)
split the backward into B and W nodes. V-shape ones (``zbv``, ``v-half``, ``v-min``, ``dualpipe-v``)
need two chunks per rank in the V placement: ``--vpp`` defaults to the algorithm's, and the model is
built with ``placement="v"``; ``--compare-native`` then runs Megatron's own schedule for the same
layout (interleaved 1F1B for vpp 2, on interleaved-built chunks with the same global weights).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size (= number of processes)")
    p.add_argument("--vpp", type=int, default=None, help="model chunks per rank (default: the algorithm's, else 1)")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--pp-algorithm", default=None, help="primuspipe algorithm (default: config, else auto)")
    p.add_argument("--config", default=None, help="primuspipe YAML config (else $PRIMUSPIPE_CONFIG)")
    p.add_argument("--model", default="tiny-gpt", choices=["tiny-gpt", "tiny-moe"])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--dump-dir", default=None, help="turn on dump_pp_data and write timelines here")
    p.add_argument("--compare-native", action="store_true", help="also run Megatron's own schedule and compare")
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args(argv)


def init_distributed(args) -> torch.device:
    """``env://`` init (torchrun), Megatron's parallel state and RNG; CPU mode without a GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.pp:
        raise SystemExit(f"run with --nproc-per-node {args.pp} (got WORLD_SIZE={world}); data parallelism is not used here")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

        torch.set_num_threads(1)
        enable_cpu_mode()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        return torch.device("cuda", torch.cuda.current_device())
    from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed

    cpu_rng_seed(0)
    return torch.device("cpu")


def train(schedule, spec_for, args, device):
    """``iterations`` steps (DDP, finalize grads, SGD) from fresh weights; returns
    (per-iteration losses on the last stage, step times, first iteration's grads)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from primuspipe.testing.megatron import compare

    _, chunks, model = compare.build(spec_for(0), args.pp, args.vpp, device)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=args.lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
                        params_dtype=torch.float32), model)
    losses, times, first_grads = [], [], None
    for it in range(args.iterations):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out, seconds = compare.call_schedule(schedule, spec_for(it), model, device)
        times.append(seconds)
        if first_grads is None:
            first_grads = {name: g.cpu() for name, g in compare.param_grads(chunks, ddp=True).items()}
        optimizer.step()
        if out:
            total = torch.stack([d["lm loss"] for d in out]).sum(0)
            losses.append((total[0] / total[1]).item())
    return losses, times, first_grads


def gather_grads(grads: dict) -> dict:
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, grads)
    return {k: v for part in everything for k, v in part.items()}


def from_loss_rank(value):
    """``value`` of the rank holding the last stage (the last rank; rank 0 in the V placement)."""
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, value)
    return next((v for v in everything if v not in (None, [])), value)


def resolve_layout(args, algorithm: str | None) -> str:
    """Fill ``args.vpp`` from the algorithm when not given; return the chunk placement it needs."""
    from primuspipe.algorithms import get_algorithm

    info = get_algorithm(algorithm) if algorithm not in (None, "auto") else None
    if args.vpp is None:
        args.vpp = (info.vpp or info.default_vpp) if info is not None else 1
    return "v" if info is not None and info.placement == "v" else "interleaved"


def main(argv=None) -> None:
    args = parse_args(argv)
    from primuspipe.backends.megatron import load_config

    file_config = load_config(args.config)
    placement = resolve_layout(args, args.pp_algorithm or file_config.pp_algorithm)
    device = init_distributed(args)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from primuspipe.testing.megatron import compare, tiny_models
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

    overrides = {"patch_primus_pipeline": True}
    if args.pp_algorithm:
        overrides["pp_algorithm"] = args.pp_algorithm
    if args.dump_dir:
        overrides.update(dump_pp_data=True, dump_dir=args.dump_dir)
    config = replace(file_config, **overrides)
    ours = PrimusForwardBackward(config)
    model_cfg = tiny_models.get_tiny_model(args.model)

    def spec_for(iteration, placement=placement):
        return compare.StepSpec(model_cfg, args.microbatches, seed=iteration, ddp=True, placement=placement)

    losses, times, grads = train(ours, spec_for, args, device)
    result = {"algorithm": config.algorithm_for(args.vpp), "pp": args.pp, "vpp": args.vpp,
              "microbatches": args.microbatches, "model": args.model, "device": device.type,
              "loss": from_loss_rank(losses[-1] if losses else None),
              "losses": from_loss_rank(losses), "step_time_s": statistics.median(times)}
    if args.compare_native:
        native_spec = functools.partial(spec_for, placement="interleaved")
        native_losses, native_times, native_grads = train(get_forward_backward_func(), native_spec, args, device)
        result.update(native_loss=from_loss_rank(native_losses[-1] if native_losses else None),
                      native_step_time_s=statistics.median(native_times),
                      max_abs_grad_diff=compare.max_abs_diff(gather_grads(grads), gather_grads(native_grads)))
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
