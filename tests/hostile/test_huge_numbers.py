"""Huge but finite numbers: each input is finite, but what they add up to need not be. No output holds
infinity, NaN, a bubble rate outside [0, 1] or an MFU above 1: such a result is refused, naming the
figure, and ``--json`` is always JSON (never ``Infinity``/``NaN``)."""

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import accepted, refused, run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
HUGE = ["1e308", "1.7e308", "9e307", "1e300,1e308,1,1", "1e308,1e308,1e308,1e308", "1e20", "1e-300", "1,1,1,1e-12"]


def _impossible(text: str) -> bool:
    """Whether ``text`` shows an infinite or undefined number."""
    return re.search(r"(?<![\w.])-?(inf|nan|infinity)(?![\w])", text, re.IGNORECASE) is not None


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["--f", "--b", "--w", "--bw", "--p2p"]), st.sampled_from(HUGE),
       st.sampled_from(["1f1b", "zb-h1", "zbv", "zb-auto", "all"]), st.booleans())
def test_huge_or_spread_times(flag, value, algorithm, as_json):
    """Times too large to add up, or so far apart that a sum loses one (which hung the V planners), are
    refused before any table is built, naming the flag."""
    if flag == "--p2p" and "," in value:  # one latency: the list's most extreme
        value = max(value.split(","), key=lambda v: abs(math.log10(float(v))))
    argv = ["-q", "simulate", "-a", algorithm, "--pp", "4", "-m", "8", flag, value, *(["--json"] if as_json else [])]
    outcome = refused(run_cli(argv), flag, case=" ".join(argv), before_work=True)
    assert not _impossible(outcome.out)


@pytest.mark.parametrize("section", [{"compute": {"f": 1e308, "b": 1e308, "w": 1e308}},
                                     {"compute": {"f": 1, "b": 1, "w": 1}, "p2p": {"message_bytes": 1e308,
                                                                                    "intra_node": {"bandwidth": 1e-300}}},
                                     {"compute": {"f": 1e-320, "b": 1e308, "w": 1e308}}])
def test_huge_cost_files(tmp_path, section):
    cost = tmp_path / "cost.yaml"
    cost.write_text(yaml.safe_dump(section))
    outcome = refused(run_cli(["simulate", "-a", "1f1b", "--pp", "4", "-m", "8", "--cost", cost, "--json"]), "cost.yaml",
                      case=f"simulate cost {section}", before_work=True)
    assert not _impossible(outcome.out + outcome.err)


def test_huge_dump_times(tmp_path):
    """A timeline whose finite times sum to infinity: vis refuses to print its bubble rate."""
    from hostile_support import make_dump
    from primuspipe.io.timeline import dump_path

    dump = make_dump(tmp_path / "d", iterations=(0,))
    for rank in range(4):
        path = dump_path(dump, 0, rank)
        data = json.loads(path.read_text())
        for e in data["ranks"][0]["events"]:
            e["start"], e["end"] = e["start"] * 1e307, e["end"] * 1e307
        path.write_text(json.dumps(data))
    for argv in (["vis", dump, "--json"], ["vis", dump]):
        outcome = run_cli(argv)
        assert not _impossible(outcome.out), outcome.out
        if outcome.code == 0:
            accepted(outcome, case=" ".join(map(str, argv)))
        else:
            refused(outcome, case="vis huge dump times " + " ".join(map(str, argv[2:])))


MODEL = EXAMPLES / "models" / "llama2-7b.yaml"
HARDWARE = EXAMPLES / "hardware" / "h100.yaml"


@pytest.mark.parametrize("field, value", [("num_layers", 10**9), ("num_layers", 10**6), ("hidden_size", 10**30),
                                          ("hidden_size", 2**40), ("seq_length", 10**20), ("vocab_size", 10**18),
                                          ("ffn_hidden_size", 10**15), ("kv_channels", 2**40)])
def test_projection_sizes(tmp_path, field, value):
    data = yaml.safe_load(MODEL.read_text())
    data[field] = value
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    refused(run_cli(["project", "--model", path, "--hardware", HARDWARE, "-a", "1f1b"]), field,
            case=f"project {field}={value}")


def test_projection_edge_sizes_still_project(tmp_path):
    data = yaml.safe_load(MODEL.read_text())
    data.update(num_layers=96, seq_length=131072)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    outcome = accepted(run_cli(["project", "--model", path, "--hardware", HARDWARE, "-a", "1f1b", "--pp", "8", "--json"]),
                       case="project 96 layers, 128k sequence")
    for row in json.loads(outcome.out)["results"]:
        assert 0 <= row["mfu"] <= 1 and 0 <= row["bubble_rate"] <= 1


@pytest.mark.parametrize("scale", [1e-3, 1e-6])
def test_measured_costs_of_another_model(tmp_path, scale):
    """A cost file far faster than the hardware can run this model (another, tiny model's run) would give
    an MFU above 1: refused, naming --measured-costs."""
    from hostile_support import make_dump

    dump = make_dump(tmp_path / "d", iterations=(0, 1))
    cost = tmp_path / "measured.yaml"
    assert run_cli(["calibrate", dump, "-o", cost]).code == 0
    text = cost.read_text()
    data = yaml.safe_load(text)
    for key in ("f", "b", "w"):
        value = data["compute"][key]
        data["compute"][key] = [v * scale for v in value] if isinstance(value, list) else value * scale
    cost.write_text(yaml.safe_dump(data))
    outcome = run_cli(["project", "--model", MODEL, "--hardware", HARDWARE, "-a", "1f1b", "--measured-costs", cost])
    if outcome.code == 0:
        accepted(outcome, case=f"project --measured-costs x{scale}")
        assert "%" in outcome.out
        return
    refused(outcome, case=f"project --measured-costs x{scale} (MFU > 1)")


@pytest.mark.parametrize("pp", ["2", "8"])
def test_measured_costs_of_another_pipeline(tmp_path, pp):
    """A cost file measured at pp=4 used for another pp: refused naming the file."""
    from hostile_support import make_dump

    cost = tmp_path / "measured.yaml"
    assert run_cli(["calibrate", make_dump(tmp_path / "d"), "-o", cost]).code == 0
    refused(run_cli(["project", "--model", MODEL, "--hardware", HARDWARE, "-a", "1f1b", "--measured-costs", cost,
                     "--pp", pp]), "--measured-costs", "measured.yaml", case=f"project --measured-costs of pp=4 at pp={pp}")
