"""The layer benchmark: real megatron-core layers timed on the local device, turned into a calibration.

Every part the model has -- a dense and/or an MoE transformer layer, the embedding, the head (final
norm, output layer, vocab-parallel cross entropy) -- is built once at the shape one rank of the target
configuration computes (heads, groups, MLP width and vocabulary divided by TP, experts by EP, sequence
by CP) and timed pass by pass: F is the forward; B the backward with the weight-gradient GEMMs of
megatron-core's linear layers deferred (primuspipe's weight-gradient store, as split-backward schedules
run it); W those deferred GEMMs. Each figure is the median over ``iterations`` after ``warmup`` runs.

The calibration factor of a (part, pass) is the measured time over the analytical time of the same
benchmark shape on the given hardware spec; projected times are then analytical times of any
configuration times the factors, so a benchmark at the target's own shape reproduces its measured
times exactly, and one at another shape carries its measured efficiency over.

On a CPU host the timing runs in one single-threaded process; a run that puts more single-threaded
ranks on the host than it has cores time-shares them, each rank getting ``cores / ranks`` of a core
while all are busy, so the times are scaled by ``ranks / cores`` then (``host_ranks``; steady state
exactly, a pipeline's fill and drain, when fewer ranks are busy, pessimistically). On a GPU it runs in
this process, on the current device, and takes each pass's kernels' device time (CUDA events), not the host's
time issuing them, which the projection's host model prices on its own. The local spec's attention is always the unfused
``DotProductAttention``; multi-latent attention cannot be built by it (megatron-core 0.19).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from primuspipe.projection.benchmark.megatron_model import (
    DTYPES, build_layer, causal_mask, rotary_embedding, transformer_config)
from primuspipe.projection.compute import PARTS, PASSES, Calibration, WorkModel
from primuspipe.projection.framework import ConfigError
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

logger = logging.getLogger("primuspipe.projection")

Timings = dict[tuple[str, str], float]
"""``(part, pass) -> seconds``."""


def benchmark_shape(model: ModelSpec, training: TrainingSpec) -> tuple[ModelSpec, TrainingSpec]:
    """The single-device model and configuration whose layers compute what one rank of ``training`` does."""
    if model.multi_latent_attention:
        raise ConfigError(f"{model.source}: multi_latent_attention: the layer benchmark builds megatron-core's local "
                          "layers, which cannot run multi-latent attention; project without --benchmark-layers")
    t = training
    shard = dict(num_attention_heads=model.num_attention_heads // t.tp, num_query_groups=model.query_groups // t.tp,
                 kv_channels=model.head_dim, ffn_hidden_size=model.ffn // t.tp, seq_length=model.seq_length // t.cp,
                 padded_vocab_size=model.padded_vocab(t.tp) // t.tp, max_position_embeddings=model.seq_length // t.cp)
    if model.is_moe:
        local = model.num_experts // t.ep
        shared = model.moe_shared_expert_intermediate_size
        shard.update(num_experts=local, moe_router_topk=min(model.moe_router_topk, local),
                     moe_ffn_hidden_size=model.expert_ffn // t.etp,
                     moe_shared_expert_intermediate_size=shared // t.tp if shared else None)
    one = dataclasses.replace(t, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              virtual_pipeline_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1,
                              expert_model_parallel_size=1, expert_tensor_parallel_size=None, sequence_parallel=False,
                              recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                              op_recompute_compiled=False, decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                              global_batch_size=t.micro_batch_size, attention_backend="local",
                              defer_embedding_wgrad_compute=False)
    return dataclasses.replace(model, **shard), one


class _Part(NamedTuple):
    """A part to time: its forward from an input ``make_input`` builds (untimed), and its parameters."""

    forward: Callable[[torch.Tensor | None], torch.Tensor]
    make_input: Callable[[], torch.Tensor | None]
    parameters: list[torch.nn.Parameter]


def _host_seconds(run: Callable[[], None]) -> float:
    """Wall seconds of ``run`` (on CPU the work is done when the call returns)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class _DeviceSeconds:
    """Device seconds of the kernels a call issues on the current CUDA stream, the host's time issuing them left out.

    A wall clock between synchronisations counts the host's launches too: a small part (the embedding, a head
    over a small vocabulary) measured 7-60x the model's time for it that way on a lent H100, twice as much on
    one machine as on another, and the projection then charged those launches once more through its host
    model (``projection/host.py``). Here a sleep kernel is
    queued first, holding the device until the host has issued every kernel of the call, and two CUDA events on
    the stream bracket those kernels alone, as in a run's steady state, where earlier kernels hide the launches.
    The lead starts at 5 ms and becomes twice the host's issuing time whenever that exceeds half of it, so the
    warm-up iterations settle it before the timed ones."""

    def __init__(self) -> None:
        probe = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        self.seconds_per_cycle = start.elapsed_time(end) / 1e3 / probe
        self.lead_s = 0.005

    def __call__(self, run: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(self.lead_s / self.seconds_per_cycle))
        start.record()
        issuing = _host_seconds(run)
        end.record()
        end.synchronize()
        if issuing > self.lead_s / 2:
            self.lead_s = 2 * issuing
        return start.elapsed_time(end) / 1e3


def _time_passes(part: _Part, iterations: int, warmup: int, device: torch.device) -> tuple[float, float, float]:
    """Median (F, B, W) seconds of ``part`` (its forward returns a tensor to back-propagate from): on a GPU its
    kernels' device time (:class:`_DeviceSeconds`), on CPU wall time.

    Each iteration runs F, B and W of one input in turn, as a pipeline's steady state does: timing all
    forwards first would keep every graph alive and time the allocator's growth instead (on CPU, a third
    more per forward)."""
    from primuspipe.backends.megatron.wgrad_store import WeightGradStore

    timed = _DeviceSeconds() if device.type == "cuda" else _host_seconds
    store = WeightGradStore()
    samples: list[tuple[float, float, float]] = []
    for i in range(warmup + iterations):
        x = part.make_input()
        out = None

        def forward() -> None:
            nonlocal out
            out = part.forward(x)

        def backward() -> None:
            with store.collecting(0, i):
                torch.autograd.backward(out, torch.ones_like(out))

        spans = (timed(forward), timed(backward), timed(lambda: store.flush(0, i)))
        for p in part.parameters:
            p.grad = None
        if i >= warmup:
            samples.append(spans)
    return tuple(statistics.median(s[k] for s in samples) for k in range(3))


def _build_parts(model: ModelSpec, training: TrainingSpec, device: torch.device) -> dict[str, _Part]:
    """Every part of the model at the benchmark shape, on ``device``."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    dtype, config = DTYPES[training.precision], transformer_config(model, training)
    b, s, h = training.micro_batch_size, model.seq_length, model.hidden_size
    mask = causal_mask(s).to(device)
    rope = rotary_embedding(model, training)
    rope = None if rope is None else rope.to(device)

    def hidden() -> torch.Tensor:
        return torch.randn(s, b, h, dtype=dtype, device=device, requires_grad=True)

    parts = {}
    for kind in sorted(set(model.layer_kinds)):
        layer = build_layer(model, training, kind, config).to(device)
        parts[kind] = _Part(lambda x, layer=layer: layer(x, attention_mask=mask, rotary_pos_emb=rope)[0], hidden,
                            list(layer.parameters()))
    vocab = model.padded_vocab(1)
    embedding = LanguageModelEmbedding(config, vocab, model.max_position_embeddings or s,
                                       "rope" if model.rotary else model.position_embedding_type).to(device=device, dtype=dtype)
    tokens = torch.randint(vocab, (b, s), device=device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    parts["embedding"] = _Part(lambda _: embedding(tokens, positions), lambda: None, list(embedding.parameters()))
    norm = WrappedTorchNorm(config=config, hidden_size=h).to(device=device, dtype=dtype)
    output = tensor_parallel.ColumnParallelLinear(h, vocab, config=config, init_method=config.init_method, bias=False,
                                                  gather_output=False).to(device=device, dtype=dtype)
    labels = tokens.transpose(0, 1).contiguous()
    parts["head"] = _Part(lambda x: tensor_parallel.vocab_parallel_cross_entropy(output(norm(x))[0], labels), hidden,
                          [*norm.parameters(), *output.parameters()])
    return parts


def time_parts(model: ModelSpec, training: TrainingSpec, *, iterations: int, warmup: int,
               device: torch.device) -> Timings:
    """Seconds of every pass of every part, at the given (single-device) shape, in an initialised
    megatron ``parallel_state``."""
    timings = {}
    parts = _build_parts(model, training, device)
    for k, (name, part) in enumerate(parts.items(), 1):
        logger.info("benchmark-layers: timing part %d of %d, %s (%d warm-up and %d timed iterations of every pass, "
                    "on %s)", k, len(parts), name, warmup, iterations, device)
        timings.update(zip(((name, p) for p in PASSES), _time_passes(part, iterations, warmup, device)))
    return timings


def measure(model: ModelSpec, training: TrainingSpec, *, iterations: int = 5, warmup: int = 2,
            host_ranks: int = 1) -> Timings:
    """Time the benchmark shape of (model, training) on this host's device (see the module docstring);
    on CPU, for a run that puts ``host_ranks`` single-threaded ranks on this host."""
    bench_model, bench_training = benchmark_shape(model, training)
    if torch.cuda.is_available():
        return _on_one_rank("nccl", lambda: time_parts(bench_model, bench_training, iterations=iterations, warmup=warmup,
                                                       device=torch.device("cuda", torch.cuda.current_device())))
    fork = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=fork) as child:
        timings = child.submit(_time_on_cpu, bench_model, bench_training, iterations, warmup).result()
    sharing = max(1.0, host_ranks / len(os.sched_getaffinity(0)))
    return {key: seconds * sharing for key, seconds in timings.items()}


def _time_on_cpu(model: ModelSpec, training: TrainingSpec, iterations: int, warmup: int) -> Timings:
    """In a child process, so the caller's threads and Megatron state stay untouched: one single-threaded
    rank of Megatron's CPU mode, as each rank of a CPU pipeline run is."""
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    torch.set_num_threads(1)
    return _on_one_rank("gloo", lambda: time_parts(model, training, iterations=iterations, warmup=warmup,
                                                   device=torch.device("cpu")))


def _on_one_rank(backend: str, run: Callable[[], Timings]) -> Timings:
    """``run`` under a one-rank process group and Megatron's parallel state (set up here unless the caller has)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        if backend == "nccl":
            model_parallel_cuda_manual_seed(0)
        else:
            from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed

            cpu_rng_seed(0)
    try:
        return run()
    finally:
        if owned:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def benchmark_calibration(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, *, iterations: int = 5,
                          warmup: int = 2, host_ranks: int = 1) -> Calibration:
    """Calibration factors (measured / analytical, per part and pass) from timing the local device."""
    measured = measure(model, training, iterations=iterations, warmup=warmup, host_ranks=host_ranks)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {host_ranks} rank(s) per host"
    return calibration_from_timings(model, training, hardware, measured, source=f"layer benchmark ({device})")


def calibration_from_timings(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, measured: Timings,
                             *, source: str) -> Calibration:
    """Factors from benchmark timings of (model, training)'s benchmark shape: measured over the analytical
    time of the same shape on ``hardware``, per part and pass (1 where the analytical time is zero)."""
    bench_model, bench_training = benchmark_shape(model, training)
    work = WorkModel(bench_model, bench_training)
    # the analytical time as part_times prices it (a named attention kernel's rates), so factor x it is the measured
    hardware = hardware.with_attention_kernel(training.attention_kernel, training.source)
    factors = {}
    for part in PARTS:
        if (part, "forward") not in measured:
            continue
        for name, analytical in zip(PASSES, work.part(part).passes()):
            seconds = analytical.seconds(hardware, bench_training.precision, backward=name != "forward")
            factors[(part, name)] = measured[(part, name)] / seconds if seconds > 0 else 1.0
    return Calibration(factors, source=source)
