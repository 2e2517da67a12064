"""MLPerf Training rows against the launch configs their notes name.

NVIDIA's MLPerf implementations (and the submitters that reuse them) name each launch config after its layout:
``config_<system>_<nodes>x<gpus a node>x<MINIBS>xtp<T>pp<P>cp<C>[suffixes].sh``, with the global batch MINIBS times
the data-parallel size. A row whose notes cite such a config must carry that layout, and the config must not be an
``_fp4`` one (NVFP4 is not modelled): a typo in a row, or a row written from the wrong config, fails here.
"""
import re

from published_rows import shipped_runs

CONFIG = re.compile(r"config_(?:DGX)?[A-Za-z0-9]+_(\d+)x(\d+)x(\d+)xtp(\d+)pp(\d+)cp(\d+)(\w*)\.sh")


def _cited_configs():
    """(row, the first launch config its notes name) for every MLPerf row whose notes name one."""
    for run in shipped_runs():
        if run.id.startswith("mlperf") and (match := CONFIG.search(run.notes or "")):
            yield run, match


def test_mlperf_rows_carry_the_layout_their_launch_config_names():
    checked = []
    for run, match in _cited_configs():
        nodes, per_node, minibs, tp, pp, cp = map(int, match.groups()[:6])
        t = run.training
        layout = (t.get("tensor_model_parallel_size", 1), t.get("pipeline_model_parallel_size", 1),
                  t.get("context_parallel_size", 1))
        assert (nodes * per_node, layout) == (run.gpus, (tp, pp, cp)), (run.id, match.group(0))
        assert t["global_batch_size"] == minibs * run.gpus // (tp * pp * cp), (run.id, match.group(0))
        assert "fp4" not in match.group(7), (run.id, match.group(0))
        checked.append(run.id)
    assert {"mlperf60-nvidia-gb200-llama3.1-8b-fp8-1024-tp4cp4", "mlperf60-nvidia-gb300-llama3.1-8b-fp8-512-tp2cp4",
            "mlperf51-uf-b200-llama3.1-405b-fp8-256", "mlperf50-coreweave-gb200-llama3.1-405b-fp8-2496"} <= set(checked)
