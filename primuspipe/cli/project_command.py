"""``project``: which schedule and layout to run for a model on a cluster, how fast, and whether it fits."""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from pathlib import Path

from primuspipe.algorithms import get_algorithm, list_algorithms
from primuspipe.cli import sane
from primuspipe.cli.options import count_type, number_type, report_console
from primuspipe.errors import PrimusPipeError
from primuspipe.projection.compute import Calibration
from primuspipe.projection.framework import ConfigError
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.measured import calibration_from_cost_file
from primuspipe.projection.megatron_args import read_megatron_config
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.projection import RISK_MARGIN, Projector, Refusal, algorithm_vpp, project, scale_to_nodes
from primuspipe.projection.report import print_report, report_dict
from primuspipe.projection.training_spec import load_training

_DESCRIPTION = f"""\
Project training of a model on a cluster without a GPU: for every pipeline algorithm (and, with --search,
every pp / vpp / micro-batch size / recompute the GPU count allows) the step time, bubble rate, per-rank
peak memory with its breakdown, tokens/s per GPU, MFU and whether it fits, ranked by throughput.

Inputs (YAML; examples in examples/projection/):
  --model     the model in Megatron's argument names: num_layers, hidden_size, ffn_hidden_size,
              num_attention_heads, num_query_groups, kv_channels, seq_length, vocab_size, swiglu,
              normalization, untie_embeddings_and_output_weights, MoE (num_experts, moe_router_topk,
              moe_ffn_hidden_size, moe_shared_expert_intermediate_size, moe_layer_freq), MLA, ...
  --training  batch sizes, parallelism (TP, PP, VPP, EP, CP, DP), sequence parallel, recompute, distributed
              optimizer, precision and FP8 (fp8_format, fp8_recipe), communication overlap (tp_comm_overlap,
              overlap_grad_reduce, overlap_param_gather, overlap_moe_expert_parallel_comm), uneven or explicit
              stage layouts, MTP, kernels (attention backend, fusions);
              without it: MBS 1, GBS 128, PP 4, the rest 1, no recompute, distributed optimizer, bf16, flash
  --hardware  one accelerator (peak dense bf16 TFLOP/s, achievable fraction, HBM bytes and bandwidth) and its
              links (GPUs per node, intra/inter-node bandwidth and latency)
  --megatron-config  instead of --model/--training: a Megatron argument list (--num-layers 32 ...; a
              torchrun/launcher in front of the script gives the GPU count, else give --target-nodes) or a
              Primus-style YAML of Megatron arguments (its modules' model: files and overrides). Megatron's
              defaults apply to what it leaves out; arguments that change time or memory in ways the
              projection does not model, and names Megatron does not define, are refused (docs/projection.md)

Times are analytical unless calibrated: GEMMs by shape (the accelerator's measured best GEMM rate, tiles,
waves, a roofline), attention at its kernel efficiency, element-wise traffic at HBM bandwidth, collectives on
the links, with what TP/CP/EP/DP overlap hides taken off. --benchmark-layers times real megatron-core layers on
this host's device; --measured-costs scales them to a real run's timings (a 'primuspipe calibrate' file of a
run of this model and training configuration). Memory is simulated: what each rank holds in flight under the
algorithm's table (including what B keeps for a deferred W), plus weights, gradients and optimizer state.

Verdicts: OOM when a rank's peak (with the hardware's runtime reserve: context, communicator buffers,
workspaces) exceeds HBM; AT-RISK within --risk-margin of it (default {RISK_MARGIN:.0%}: allocator fragmentation
is not modelled); FITS otherwise. MFU is given both ways: causal attention counted once (mfu) and the full
attention square as NVIDIA and AMD report Model TFLOP/s (mfu_full_attention)."""

_EPILOG = """\
examples:
  primuspipe project --model examples/projection/models/llama2-7b.yaml --hardware examples/projection/hardware/mi300x.yaml
  primuspipe project --model examples/projection/models/llama3-70b.yaml --hardware examples/projection/hardware/h100.yaml \\
      --training examples/projection/training/llama3-70b.yaml --target-nodes 16
  primuspipe project --model examples/projection/models/mixtral-8x7b.yaml --hardware examples/projection/hardware/mi355x.yaml \\
      --training examples/projection/training/mixtral-8x7b.yaml --search --json
  primuspipe project --megatron-config my_run_args.txt --hardware examples/projection/hardware/h200.yaml --pp 8

environment:
  PRIMUSPIPE_PROJECT_WORKERS=N  processes that project the candidates side by side (default: one per core;
                                1: all in this process); the rows are the same either way"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("project", help="project step time, memory and MFU of a model on a cluster for every schedule",
                       description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    inputs = p.add_argument_group("inputs")
    inputs.add_argument("--model", type=Path, metavar="FILE", help="model YAML (see above)")
    inputs.add_argument("--training", type=Path, metavar="FILE", help="training YAML (default: the built-in setup)")
    inputs.add_argument("--megatron-config", type=Path, metavar="FILE",
                        help="a Megatron argument list or Primus-style YAML, instead of --model and --training")
    inputs.add_argument("--hardware", type=Path, metavar="FILE", required=True, help="hardware YAML (see above)")
    shape = p.add_argument_group("overrides of the training configuration")
    shape.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=count_type(), metavar="N",
                       help="pipeline-parallel size (default: the training YAML's, else 4)")
    shape.add_argument("--vpp", "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
                       dest="vpp", type=count_type(), metavar="N",
                       help="chunks per rank for algorithms that take any vpp (default: the training YAML's)")
    shape.add_argument("--micro-batch-size", type=count_type(), metavar="N",
                       help="samples per microbatch (default: the training YAML's, else 1)")
    shape.add_argument("--target-nodes", type=count_type(), metavar="N",
                       help="run on N nodes: data parallelism becomes what they hold (N * GPUs per node / (TP*PP*CP))")
    what = p.add_argument_group("what to project")
    what.add_argument("--algorithm", "-a", action="append", metavar="NAME",
                      help="only this algorithm (repeatable; default: every registered one; --search skips zb-auto "
                           "unless named, its own search being slow)")
    what.add_argument("--search", action="store_true",
                      help="also vary pp, vpp, micro-batch size and recompute (none / selective core_attn / full "
                           "uniform 1) over what the GPU count allows")
    calibration = p.add_argument_group("calibration (default: analytical times)")
    how = calibration.add_mutually_exclusive_group()
    how.add_argument("--benchmark-layers", action="store_true",
                     help="time real megatron-core layers (F, dgrad, wgrad) on this host's device and scale the "
                          "analytical times by what they measure (needs torch and megatron-core)")
    how.add_argument("--measured-costs", type=Path, metavar="FILE",
                     help="a 'primuspipe calibrate' cost file of a run of this model under this training configuration")
    calibration.add_argument("--benchmark-ranks", type=count_type(), metavar="N",
                             help="CPU only: the run puts N single-threaded ranks on this host; beyond its core count they "
                                  "time-share cores and the benchmark's times scale by N / cores (default 1)")
    out = p.add_argument_group("output")
    out.add_argument("--risk-margin", type=number_type(minimum=0), default=RISK_MARGIN, metavar="FRACTION",
                     help=f"share of HBM a FITS configuration must leave free (default {RISK_MARGIN})")
    out.add_argument("--top", type=count_type(), default=20, metavar="N", help="rows of the table (default 20)")
    out.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.set_defaults(handler=cmd_project)


def _check_vpp_taken(args: argparse.Namespace) -> None:
    """``--vpp`` beside ``-a`` names none of which is projected at that vpp was dropped without a word -- the rows
    said vpp 2 where the user asked 3 (zbv runs 2; ``simulate -a zbv --vpp 3`` is refused), or where the user asked
    1 (interleaved-1f1b is projected at 2 chunks or more, :func:`algorithm_vpp`). With one that runs the asked vpp
    it is used there; zb-auto tries its placements itself, and ``--search`` varies vpp itself."""
    if args.vpp is None or not args.algorithm or args.search:
        return
    runs = {name: algorithm_vpp(name, args.vpp) for name in args.algorithm if get_algorithm(name).placement != "any"}
    if len(runs) == len(args.algorithm) and args.vpp not in runs.values():
        takers = ", ".join(info.name for info in list_algorithms()
                           if info.placement != "any" and algorithm_vpp(info.name, args.vpp) == args.vpp)
        raise ConfigError(f"--vpp {args.vpp} is taken by no algorithm projected "
                          f"({', '.join(f'{name} runs vpp {vpp}' for name, vpp in runs.items())}); drop --vpp, or "
                          f"name an algorithm projected at vpp {args.vpp} ({takers})")


def cmd_project(args: argparse.Namespace) -> int:
    if args.benchmark_ranks is not None and not args.benchmark_layers:
        raise ConfigError("--benchmark-ranks says how many ranks share the host --benchmark-layers times layers on; "
                          "add --benchmark-layers, or drop --benchmark-ranks")
    _check_vpp_taken(args)
    model, training = _inputs(args)
    hardware = load_hardware(args.hardware)
    if not 0 <= args.risk_margin < 1:
        raise ConfigError(f"--risk-margin must be in [0, 1), got {args.risk_margin}")
    overrides = {name: value for name, value in (("pipeline_model_parallel_size", args.pp),
                                                 ("virtual_pipeline_model_parallel_size", args.vpp),
                                                 ("micro_batch_size", args.micro_batch_size)) if value is not None}
    training = dataclasses.replace(training, **overrides, source=f"{training.source} with command-line overrides"
                                   if overrides else training.source)
    if args.target_nodes is not None:
        training = scale_to_nodes(training, hardware, args.target_nodes)
    calibration = Calibration()
    if args.benchmark_layers:
        from primuspipe.projection.benchmark.layers import benchmark_calibration  # torch and megatron: only when asked

        calibration = benchmark_calibration(model, training, hardware, host_ranks=args.benchmark_ranks or 1)
    elif args.measured_costs is not None:
        try:
            calibration = calibration_from_cost_file(args.measured_costs, model, training, hardware)
        except PrimusPipeError as exc:
            message = str(exc)
            raise ConfigError(f"--measured-costs: {message}" if str(args.measured_costs) in message else
                              f"--measured-costs {args.measured_costs}: {message}") from None
    projector = Projector(model, hardware, calibration, args.risk_margin)
    results, refusals = project(projector, training, algorithms=args.algorithm, search=args.search)
    cause = (f"--measured-costs {args.measured_costs} does not describe this model and training configuration "
             "(its times are faster than the hardware can be); calibrate a run of this model"
             if args.measured_costs is not None else "the model's sizes or the hardware's figures are implausible")
    implausible = [r.error for r in refusals if "MFU" in r.error]
    if not results and implausible and args.measured_costs is not None:
        raise ConfigError(f"{cause}: {implausible[0]}")
    if not results:
        raise ConfigError(_nothing_projected(refusals))
    for result in results:
        sane.check(result.row(), f"the projection of {result.algorithm}", cause)
    if args.json:
        print(sane.json_text(report_dict(projector, training, results, refusals)))
    else:
        print_report(report_console(), projector, training, results, refusals, top=args.top)
    return 0


def _nothing_projected(refusals: list[Refusal]) -> str:
    """One line for a projection that refused every candidate, naming the commonest reason and what it refused: the
    report was a list of 'not projected' lines (--json: an empty ranking) and exit 1, with no error that says why."""
    assert refusals, "project() answers every candidate with a result or a refusal"
    reasons = Counter(r.error for r in refusals)
    reason, count = reasons.most_common(1)[0]
    named = list(dict.fromkeys(f"{r.algorithm} (pp {r.pp}, vpp {r.vpp})" for r in refusals if r.error == reason))
    shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    others = len(refusals) - count
    return (f"every candidate was refused ({shown}): {reason}"
            + (f" (and {others} more for {len(reasons) - 1} other reason(s))" if others else ""))


def _inputs(args: argparse.Namespace):
    if args.megatron_config is not None:
        if args.model is not None or args.training is not None:
            raise ConfigError("give either --megatron-config or --model [--training], not both")
        config = read_megatron_config(args.megatron_config)
        if config.world_size is None and args.target_nodes is None:
            raise ConfigError(f"{args.megatron_config}: the arguments do not say how many GPUs run (no launcher with "
                              "--nnodes / --nproc-per-node in front of the script), so data parallelism is unknown; "
                              "give --target-nodes N")
        return config.model, config.training
    if args.model is None:
        raise ConfigError("give the model: --model FILE (or --megatron-config FILE)")
    return load_model(args.model), load_training(args.training)
