"""A run's ``attention_kernel`` (training) selects a published per-kernel rate table of the hardware file
(``attention_kernels``): the H100's ``cudnn-2024`` and ``flash2`` reproduce the FlashAttention-3 paper's bars,
``flash1`` FlashAttention-2's release chart's FlashAttention 1 / 2 ratio, a run that names one is timed at them, and a
name the file does not list is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest

from primuspipe.projection.compute import Calibration, Work, WorkModel, part_times
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.published import EXAMPLES
from primuspipe.projection.spec_fields import InputError, spec_from_mapping
from primuspipe.projection.training_spec import TrainingSpec

H100 = EXAMPLES / "hardware" / "h100.yaml"
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
# FlashAttention-3 paper (arXiv 2407.08608), H100 SXM5, BF16, head dim 128, TFLOP/s: Figure 5's causal forward, and
# the causal backward the file derives from Figure 6's unmasked one (times the forward's causal / unmasked ratio).
PAPER = {"cudnn-2024": {"forward": (315, 410, 484, 518, 529, 539),
                        "backward": tuple(b * c / n for b, c, n in zip((305, 408, 465, 499, 518, 516),
                                                                       (315, 410, 484, 518, 529, 539),
                                                                       (497, 574, 617, 609, 600, 595)))},
         "flash2": {"forward": (191, 260, 298, 319, 333, 335),
                    "backward": tuple(b * c / n for b, c, n in zip((214, 260, 291, 310, 318, 322),
                                                                   (191, 260, 298, 319, 333, 335),
                                                                   (309, 350, 362, 368, 370, 370)))}}


def _isolated(kernel: str | None):
    """The H100 with ``kernel``'s rates, as an isolated kernel (sustained fraction 1, as the paper times it)."""
    return dataclasses.replace(load_hardware(H100), sustained_fraction=1.0).with_attention_kernel(kernel, "test")


@pytest.mark.parametrize("kernel", sorted(PAPER))
@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_a_named_kernel_runs_at_the_papers_rates(kernel, pass_name):
    h100 = _isolated(kernel)
    for length, tflops in zip(LENGTHS, PAPER[kernel][pass_name]):
        flops = 1e12
        seconds = Work(attention_flops=flops).attention_seconds(h100, "bf16", length, 128, pass_name == "backward")
        assert flops / seconds / 1e12 == pytest.approx(tflops, rel=0.004), length  # the file's three decimals


# FlashAttention-2's release chart (flash-attention assets/flash2_h100_fwd_bwd_benchmark.png, panel (d): causal, head
# dim 128, H100 SXM5), forward + backward TFLOP/s of FlashAttention 1 and FlashAttention-2.
FA2_CHART = {"flash1": (98, 109, 108, 126, 135, 137), "flash2": (163, 221, 265, 294, 308, 328)}


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_flash1_runs_at_flash2s_rates_times_the_release_charts_ratio(pass_name):
    flash1, flash2 = _isolated("flash1"), _isolated("flash2")
    for length, old, new in zip(LENGTHS, FA2_CHART["flash1"], FA2_CHART["flash2"]):
        seconds = [Work(attention_flops=1e12).attention_seconds(h, "bf16", length, 128, pass_name == "backward")
                   for h in (flash1, flash2)]
        assert seconds[1] / seconds[0] == pytest.approx(old / new, rel=0.006), length  # the file's three decimals


def test_the_rates_come_from_the_hardware_file():
    h100 = load_hardware(H100)
    named = h100.with_attention_kernel("cudnn-2024", "test")
    table = h100.attention_kernels["cudnn-2024"]
    assert (named.attention_efficiency, named.attention_length_rates, named.attention_backward_length_rates) == (
        table.efficiency, table.length_rates, table.backward_length_rates)
    # what the kernel does not replace stays the file's
    assert (named.attention_head_dim_rates, named.attention_dropout_rate) == (h100.attention_head_dim_rates,
                                                                              h100.attention_dropout_rate)
    assert h100.with_attention_kernel(None, "test") is h100


def test_a_run_naming_cudnn_2024_is_slower_at_long_sequences_by_the_rates_ratio():
    """Llama 2 7B at 32K with CP 2: each ring step's kernels see 16,384 queries, where the 2024 cuDNN ran 539 / 601.9
    of today's forward and 467.4 / 510.7 of its backward (the 2024 backward from Figure 6 as above)."""
    h100 = load_hardware(H100)
    model = dataclasses.replace(load_model(EXAMPLES / "models" / "llama2-7b.yaml"), seq_length=32768)
    base = TrainingSpec(micro_batch_size=1, context_parallel_size=2, global_batch_size=64)
    today = part_times(WorkModel(model, base), h100, Calibration())["dense"]
    named = part_times(WorkModel(model, dataclasses.replace(base, attention_kernel="cudnn-2024")), h100,
                       Calibration())["dense"]
    forward, backward = PAPER["cudnn-2024"]["forward"][-1], PAPER["cudnn-2024"]["backward"][-1]
    assert named.attention[0] / today.attention[0] == pytest.approx(601.9 / forward, rel=0.005)
    assert named.attention[1] / today.attention[1] == pytest.approx(510.7 / backward, rel=0.005)
    assert named.gemm == today.gemm
    assert named.forward - today.forward == pytest.approx(named.attention[0] - today.attention[0])


def test_an_unknown_kernel_is_refused_naming_the_choices():
    model = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
    work = WorkModel(model, TrainingSpec(attention_kernel="flash3", source="train.yaml"))
    with pytest.raises(InputError,
                       match=r"train.yaml: attention_kernel='flash3'.*name one of cudnn-2024, flash1, flash2"):
        part_times(work, load_hardware(H100), Calibration())


def test_a_kernel_on_a_hardware_file_without_tables_is_refused():
    work = WorkModel(load_model(EXAMPLES / "models" / "llama2-7b.yaml"), TrainingSpec(attention_kernel="flash2"))
    with pytest.raises(InputError, match=r"mi300x.yaml: attention_kernels=\[\].*no rates for this attention kernel"):
        part_times(work, load_hardware(EXAMPLES / "hardware" / "mi300x.yaml"), Calibration())


@pytest.mark.parametrize("entry, problem", [
    ({"efficiency": 0.5, "length_rates": [[8192, 1.0]]}, "field 'backward_length_rates' missing"),
    ({"efficiency": 0.5, "length_rates": [], "backward_length_rates": [], "peak": 1}, "unknown field 'peak'"),
    ({"efficiency": 0.5, "length_rates": [[8192, 2.0]], "backward_length_rates": []},
     r"attention_kernels.k.length_rates=.*relative rate in \[0.001, 1.5\]"),
    ({"efficiency": 1.5, "length_rates": [], "backward_length_rates": []}, r"attention_kernels.k.efficiency=1.5"),
    ({"efficiency": "fast", "length_rates": [], "backward_length_rates": []}, "efficiency: not a number"),
])
def test_a_malformed_kernel_table_is_refused(entry, problem):
    from primuspipe.projection.hardware_spec import HardwareSpec
    data = {"peak_bf16_tflops": 989.4, "hbm_bytes": 8e10, "hbm_bandwidth_bytes_per_s": 3.35e12,
            "intra_node_bandwidth_bytes_per_s": 4.5e11, "inter_node_bandwidth_bytes_per_s": 5e10,
            "attention_kernels": {"k": entry}}
    with pytest.raises(InputError, match=problem):
        spec_from_mapping(HardwareSpec, data, "hw.yaml")
