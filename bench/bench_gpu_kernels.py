"""The projection's kernel model against the kernels themselves, timed on the local CUDA GPU.

    PYTHONPATH=. python bench/bench_gpu_kernels.py [--hardware examples/projection/hardware/h100.yaml]
                                                   [--output bench/results/gpu_kernels.json] [--markdown FILE]

``primuspipe project`` prices every GEMM by its shape, attention at a kernel efficiency and element-wise work as
HBM traffic, from published figures (the hardware file says which). This bench times the same kernels on the GPU
it runs on and sets each beside the model's time for it as an isolated kernel (``sustained_fraction`` 1: what a
whole run loses beyond its kernels is that fitted figure's, checked against published runs instead):

* BF16 GEMMs at the forward, input-gradient and weight-gradient shapes of published dense layouts (Llama 3 8B at
  TP 1, 70B at TP 4 with CP 2, 405B at TP 8; 8,192-token sequences), laid out as ``torch.nn.functional.linear``
  and its autograd run them (``x W^T``, ``dY W``, ``dY^T x``);
* the same shapes in FP8 (``torch._scaled_mm``, E4M3 with per-tensor scales: the TN layout Hopper's FP8 tensor
  cores take);
* MoE experts' grouped GEMMs (Qwen3-30B-A3B, GPT-OSS 120B and DeepSeek-V3 expert shapes): as Transformer
  Engine's ``GroupedLinear`` runs them, one GEMM per expert round-robin on four streams (the model's
  ``multi_stream``; replayed from a CUDA graph, since a Python loop would time its own launches), and as one grouped kernel (``torch._grouped_mm``, the model's ``fused``) where torch has it;
* causal attention forward and backward (``scaled_dot_product_attention``, the cuDNN and flash backends) at
  head dims 128 and 64 over sequence lengths 1k-16k, 16k tokens a call;
* element-wise traffic: a residual add (reads two tensors, writes one) against HBM bandwidth times the file's
  ``memory_bandwidth_fraction``.

Each time is the median of ``--repeats`` timed runs (CUDA events) of ``--inner`` back-to-back kernels after
warm-up. Without CUDA it stops with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from write_results import RESULTS, markdown_table  # noqa: E402

from primuspipe.projection.compute import Work  # noqa: E402
from primuspipe.projection.gemm import Gemm, gemm_seconds  # noqa: E402
from primuspipe.projection.hardware_spec import load_hardware  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DENSE_LAYOUTS = {
    # name: (tokens per GEMM, hidden, ffn, heads, kv heads, TP): the GEMM rows are the rank's tokens (s / CP * MBS)
    "Llama 3 8B TP1": (8192, 4096, 14336, 32, 8, 1),
    "Llama 3 70B TP4 CP2": (4096, 8192, 28672, 64, 8, 4),
    "Llama 3 405B TP8": (8192, 16384, 53248, 128, 8, 8),
}
EXPERTS = {
    # name: (local experts, hidden, expert ffn): fc1 is SwiGLU's two halves in one weight
    "Qwen3-30B-A3B EP8": (16, 2048, 768),
    "GPT-OSS 120B EP8": (16, 2880, 2880),
    "DeepSeek-V3 EP64": (4, 7168, 2048),
}
TOKENS_PER_EXPERT = (256, 1024, 4096)
ATTENTION = [(32, 128, 8192), (16, 128, 1024), (16, 128, 2048), (16, 128, 4096), (16, 128, 16384),
             (32, 64, 4096), (32, 64, 8192)]  # (heads, head dim, sequence length)
ATTENTION_TOKENS = 16384
"""Tokens per attention call (batch = this / length, at least 1): the FlashAttention-3 benchmark behind the
hardware files' ``attention_length_rates`` runs batch x sequence = 16k, so shorter sequences get a larger batch."""


def timed(torch, fn, repeats: int, inner: int) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` CUDA-event spans of ``inner`` calls, after warm-up."""
    for _ in range(3):
        fn()
    spans = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(spans)


def graphed(torch, fn):
    """``fn`` captured in a CUDA graph, its replay returned: the device time of a multi-stream loop without the
    Python launches between its kernels (Transformer Engine issues them from C++, far faster than a Python loop)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def dense_gemms(torch, hardware, repeats: int, inner: int) -> list[dict]:
    rows = []
    dev, bf16 = "cuda", torch.bfloat16
    for layout, (tokens, hidden, ffn, heads, kv, tp) in DENSE_LAYOUTS.items():
        head_dim = hidden // heads
        linears = {"qkv": ((hidden + 2 * kv * head_dim) // tp, hidden), "proj": (hidden, hidden // tp),
                   "fc1": (2 * ffn // tp, hidden), "fc2": (hidden, ffn // tp)}
        for name, (out, inp) in linears.items():
            x = torch.randn(tokens, inp, device=dev, dtype=bf16)
            w = torch.randn(out, inp, device=dev, dtype=bf16)
            dy = torch.randn(tokens, out, device=dev, dtype=bf16)
            forward = Gemm(tokens, out, inp)
            for pass_name, gemm, fn in (("forward", forward, lambda: x @ w.t()),
                                        ("dgrad", forward.dgrad(), lambda: dy @ w),
                                        ("wgrad", forward.wgrad(), lambda: dy.t() @ x)):
                rows.append(_row("gemm bf16", f"{layout} {name} {pass_name}", gemm,
                                 timed(torch, fn, repeats, inner), gemm_seconds(gemm, hardware, "bf16")))
            if hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9):
                for pass_name, gemm in (("forward", forward), ("dgrad", forward.dgrad()), ("wgrad", forward.wgrad())):
                    a = torch.randn(int(gemm.m), int(gemm.k), device=dev).to(torch.float8_e4m3fn)
                    b = torch.randn(int(gemm.n), int(gemm.k), device=dev).to(torch.float8_e4m3fn).t()
                    one = torch.ones((), device=dev)
                    fp8 = replace(gemm, fp8=True)
                    seconds = timed(torch, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=bf16),
                                    repeats, inner)
                    rows.append(_row("gemm fp8", f"{layout} {name} {pass_name}", fp8, seconds,
                                     gemm_seconds(fp8, hardware, "bf16")))
            del x, w, dy
    return rows


def grouped_gemms(torch, hardware, repeats: int, inner: int) -> list[dict]:
    rows = []
    dev, bf16 = "cuda", torch.bfloat16
    streams = [torch.cuda.Stream() for _ in range(4)]
    for name, (experts, hidden, ffn) in EXPERTS.items():
        for part, (out, inp) in {"fc1": (2 * ffn, hidden), "fc2": (hidden, ffn)}.items():
            for per_expert in TOKENS_PER_EXPERT:
                xs = [torch.randn(per_expert, inp, device=dev, dtype=bf16) for _ in range(experts)]
                ws = [torch.randn(out, inp, device=dev, dtype=bf16) for _ in range(experts)]

                def multi_stream():
                    main = torch.cuda.current_stream()
                    for s in streams:
                        s.wait_stream(main)
                    for i, (x, w) in enumerate(zip(xs, ws)):
                        with torch.cuda.stream(streams[i % 4]):
                            x @ w.t()
                    for s in streams:
                        main.wait_stream(s)

                gemm = Gemm(per_expert, out, inp, groups=experts, kernel="multi_stream")
                label = f"{name} {part} {experts} x {per_expert} tokens"
                rows.append(_row("grouped bf16 4-stream", label, gemm,
                                 timed(torch, graphed(torch, multi_stream), repeats, inner),
                                 gemm_seconds(gemm, hardware, "bf16")))
                if hasattr(torch, "_grouped_mm"):
                    a = torch.cat(xs)
                    b = torch.stack(ws).transpose(-2, -1)
                    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * per_expert
                    fused = replace(gemm, kernel="fused")
                    try:
                        seconds = timed(torch, lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=bf16), repeats,
                                        inner)
                    except RuntimeError as error:  # not built for this GPU / torch
                        rows.append({"kind": "grouped bf16 fused", "case": label, "error": str(error)[:200]})
                    else:
                        rows.append(_row("grouped bf16 fused", label, fused, seconds,
                                         gemm_seconds(fused, hardware, "bf16")))
    return rows


def attention(torch, hardware, repeats: int, inner: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for heads, dim, length in ATTENTION:
            batch = max(1, ATTENTION_TOKENS // length)
            q, k, v = (torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16)
            label = f"{backend.name.lower()} {batch} x {heads} heads x {dim} x {length}"
            try:
                with sdpa_kernel([backend]):
                    forward = timed(torch, lambda: sdpa(q, k, v, is_causal=True), repeats, inner)
                    both = timed(torch, lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad),
                                 repeats, inner)
            except RuntimeError as error:  # the backend refuses this shape or GPU
                rows.append({"kind": "attention", "case": label, "error": str(error)[:200]})
                continue
            flops = 4 * batch * heads * length * length * dim / 2  # QK^T and PV, causal half
            model_forward = Work(attention_flops=flops).attention_seconds(hardware, "bf16", length, dim)
            model_backward = Work(attention_flops=2.5 * flops).attention_seconds(hardware, "bf16", length, dim, backward=True)
            rows.append(_row("attention forward", label, None, forward, model_forward, flops))
            rows.append(_row("attention backward", label, None, both - forward, model_backward, 2.5 * flops))
    return rows


def elementwise(torch, hardware, repeats: int, inner: int) -> list[dict]:
    rows = []
    for tokens, hidden in ((8192, 4096), (8192, 8192), (16384, 16384)):
        a, b = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        moved = 3 * a.numel() * a.element_size()
        model = Work(memory_bytes=moved).seconds(hardware, "bf16")
        rows.append(_row("residual add", f"{tokens} x {hidden} bf16", None, timed(torch, lambda: a + b, repeats, inner),
                         model, None, moved))
    return rows


def _row(kind: str, case: str, gemm: Gemm | None, measured: float, modelled: float, flops: float | None = None,
         moved: float | None = None) -> dict:
    flops = gemm.flops if gemm is not None else flops
    row = {"kind": kind, "case": case, "measured_s": measured, "modelled_s": modelled,
           "modelled_over_measured": modelled / measured}
    if gemm is not None:
        row["shape"] = {"m": gemm.m, "n": gemm.n, "k": gemm.k, "groups": gemm.groups}
    if flops:
        row["measured_tflops"] = flops / measured / 1e12
    if moved:
        row["measured_bytes_per_s"] = moved / measured
    return row


def summary(rows: list[dict]) -> dict:
    """Per kind: how many, and the geometric mean, spread and worst of modelled / measured."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        logs = [math.log(r["modelled_over_measured"]) for r in rows if r["kind"] == kind and "measured_s" in r]
        if logs:
            out[kind] = {"cases": len(logs), "geomean_modelled_over_measured": math.exp(statistics.fmean(logs)),
                         "rms_log_error": math.sqrt(statistics.fmean(x * x for x in logs)),
                         "worst_modelled_over_measured": math.exp(max(logs, key=abs))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", type=Path, default=ROOT / "examples/projection/hardware/h100.yaml")
    parser.add_argument("--output", type=Path, default=RESULTS / "gpu_kernels.json")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_gpu_kernels.py: no CUDA device here; it times kernels on a GPU (run it on one)")
    hardware = replace(load_hardware(args.hardware), sustained_fraction=1.0)  # isolated kernels
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, errors = [], {}
    for part in (dense_gemms, grouped_gemms, attention, elementwise):
        try:
            rows += part(torch, hardware, args.repeats, args.inner)
        except Exception as error:  # one part's failure must not lose the others' figures on a lent GPU
            errors[part.__name__] = traceback.format_exc()[-2000:]
            print(f"{part.__name__} failed: {error}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        print(f"{part.__name__}: {len(rows)} cases so far", file=sys.stderr, flush=True)
    payload = {"machine": platform.platform(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "hardware_file": str(args.hardware.relative_to(ROOT)),
               "summary": summary(rows), "errors": errors, "cases": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=1))
    table = markdown_table(["kind", "case", "measured ms", "modelled ms", "modelled / measured"],
                           [[r["kind"], r["case"], f"{r['measured_s'] * 1e3:.3f}", f"{r['modelled_s'] * 1e3:.3f}",
                             f"{r['modelled_over_measured']:.2f}"] for r in rows if "measured_s" in r])
    text = table + "\n" + "\n".join(f"{k}: {v['cases']} cases, modelled/measured geomean "
                                    f"{v['geomean_modelled_over_measured']:.3f}, rms log error {v['rms_log_error']:.3f},"
                                    f" worst {v['worst_modelled_over_measured']:.2f}"
                                    for k, v in payload["summary"].items()) + "\n"
    if args.markdown:
        args.markdown.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
