"""Round twelve: how a Megatron run cuts its layers into pipeline stages, generated over every way to say it -- the
layer count, pp, the launcher's GPUs, ``--num-virtual-stages-per-pipeline-rank``, ``--num-layers-per-virtual-
pipeline-stage``, ``--pipeline-model-parallel-layout`` (pp and 2 * pp stages, and a count pp does not divide), each
vpp flag beside the layout, and the ``--account-for-*-in-pipeline-split`` slots -- each judged against Megatron's own
rules (:func:`_megatron_refuses`, from ``validate_args`` and megatron-core's ``get_num_layers_to_build`` and
``TransformerConfig``): refused in one line naming a flag, or projected at the vpp Megatron runs. Then a layout beside
the other split settings from a training file, and every algorithm given a layout it cannot run.

Defects this family found: a layout beside a vpp flag won silently; a layout of 2 * pp stages (vpp 2, as Megatron
reads it) was refused as "the layout has 4 stages, pp * vpp = 2"; 9 layers at pp 2 were projected split 5/4 and 8
layers at pp 2 with 3 virtual stages a rank 2/2/1/1/1/1, runs Megatron asserts against; a layout beside first/last
stage counts or the embedding/loss slots (megatron-core refuses both) projected the layout and ignored the rest; and
a projection that refused every candidate (``-a 1f1b`` on a layout of 2 * pp stages) printed 'not projected' lines
(``--json``: an empty ranking) and exit 1 with no error line."""

import json
from pathlib import Path

import pytest
import yaml

from hostile_support import accepted, projected_or_named, refused, run_cli
from primuspipe.algorithms.registry import list_algorithms
from primuspipe.projection.layout import parse_layout

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
HARDWARE = EXAMPLES / "hardware" / "h100.yaml"
SPLITS = ["", "stages 0", "stages 2", "stages 3", "per-stage 0", "per-stage 1", "per-stage 2", "layout 1", "layout 2",
          "layout 3/2", "layout 2 + stages 2", "layout 1 + per-stage 1"]
"""How the arguments give vpp: nothing, ``--num-virtual-stages-per-pipeline-rank N``,
``--num-layers-per-virtual-pipeline-stage K`` (0 of either too: ``--num-layers-per-virtual-pipeline-stage 0`` was
ignored), a layout of ``k * pp`` stages (``3/2``: 3 * pp / 2, rounded up, a
count pp does not divide where pp > 1), or a layout beside a vpp flag."""
SLOTS = {"": 0, "--account-for-embedding-in-pipeline-split": 1,
         "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split": 2}


def _layout(layers: int, stages: int) -> str:
    """``stages`` stages holding the layers evenly (the first ones one more), the embedding first, the loss last."""
    base, extra = divmod(layers, stages)
    parts = ["t" * (base + (s < extra)) for s in range(stages)]
    parts[0] = "E" + parts[0]
    parts[-1] += "L"
    return "|".join(parts)


def _stages(split: str, pp: int) -> int:
    k = split.split()[1]
    return -(-3 * pp // 2) if k == "3/2" else int(k) * pp


def _megatron_refuses(layers: int, pp: int, split: str, slots: int) -> tuple[bool, int]:
    """(Whether Megatron refuses the run, the vpp it runs): ``validate_args`` takes one vpp source, a layout's stages
    a multiple of pp, layers per virtual stage dividing each pp stage's layers, an interleaved schedule only with a
    pipeline; ``get_num_layers_to_build`` asserts the layers (with the slots) divide over pp and over vpp;
    ``TransformerConfig`` refuses a layout beside the slots."""
    if "+" in split:
        return True, 0
    if split.startswith("layout"):
        stages = _stages(split, pp)
        vpp = stages // pp
        return bool(slots or stages % pp or (vpp > 1 and pp == 1)), vpp
    if split.endswith(" 0"):  # no chunk, or chunks of no layer (Megatron divides by it)
        return True, 0
    total = layers + slots
    if total % pp:
        return True, 0
    vpp = 1
    if split.startswith("per-stage"):
        per_stage = int(split.split()[1])
        if (total // pp) % per_stage:
            return True, 0
        vpp = total // pp // per_stage
    elif split.startswith("stages"):
        vpp = int(split.split()[1])
    return bool(vpp > 1 and (pp == 1 or (total // pp) % vpp)), vpp


def _arguments(layers: int, pp: int, split: str, slots: str) -> str:
    flags = []
    for part in split.split(" + ") if split else []:
        kind, value = part.split()
        if kind == "layout":
            flags.append(f"--pipeline-model-parallel-layout '{_layout(layers, _stages(part, pp))}'")
        else:
            flags.append({"stages": "--num-virtual-stages-per-pipeline-rank",
                          "per-stage": "--num-layers-per-virtual-pipeline-stage"}[kind] + f" {value}")
    return (f"torchrun --nnodes 1 --nproc-per-node {2 * pp} pretrain_gpt.py --num-layers {layers} --hidden-size 256 "
            "--num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 --vocab-size 1000 "
            f"--micro-batch-size 1 --global-batch-size 16 --bf16 --pipeline-model-parallel-size {pp} "
            + " ".join([*flags, slots]))


CASES = [(layers, pp, split, slots) for layers in (8, 9, 12) for pp in (1, 2, 3, 4) for split in SPLITS
         for slots in SLOTS if not (slots and split.startswith("layout") and "+" not in split and pp > 2)]


@pytest.mark.parametrize("layers, pp, split, slots", CASES,
                         ids=[f"{n}-pp{p}-{s or 'even'}-{SLOTS[a]}slots" for n, p, s, a in CASES])
def test_megatron_split_rules(tmp_path, layers, pp, split, slots):
    path = tmp_path / "args.sh"
    path.write_text(_arguments(layers, pp, split, slots))
    no, vpp = _megatron_refuses(layers, pp, split, SLOTS[slots])
    algorithm = "interleaved-1f1b" if vpp > 1 else "1f1b"
    outcome = run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", algorithm, "--json"])
    case = f"megatron-config {layers} layers pp {pp} {split or 'even'} {slots}".strip()
    if no:
        refused(outcome, "args.sh", "pipeline", case=case)
        return
    accepted(outcome, case=case)
    assert {row["vpp"] for row in json.loads(outcome.out)["results"]} == {vpp}, case


BESIDE_A_LAYOUT = {"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2,
                   "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}


@pytest.mark.parametrize("field", sorted(BESIDE_A_LAYOUT))
def test_layout_beside_other_split_settings(tmp_path, field):
    """A training file's layout beside another split setting: megatron-core's TransformerConfig refuses it; the
    projection took the layout and left the other setting unread."""
    model = yaml.safe_load((EXAMPLES / "models" / "llama2-7b.yaml").read_text())
    training = {**yaml.safe_load((EXAMPLES / "training" / "default.yaml").read_text()),
                "pipeline_model_parallel_size": 2,
                "pipeline_model_parallel_layout": _layout(model["num_layers"], 2), field: BESIDE_A_LAYOUT[field]}
    (tmp_path / "training.yaml").write_text(yaml.safe_dump(training))
    outcome = run_cli(["project", "--model", EXAMPLES / "models" / "llama2-7b.yaml", "--training",
                       tmp_path / "training.yaml", "--hardware", HARDWARE, "-a", "1f1b", "--json"])
    refused(outcome, "pipeline_model_parallel_layout", field, case=f"training layout beside {field}")


ALGORITHMS = sorted(info.name for info in list_algorithms() if info.name != "zb-auto")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_every_algorithm_given_a_layout(tmp_path, algorithm, chunks):
    """A layout of ``chunks * pp`` stages under each algorithm: projected where the algorithm runs that many chunks a
    rank, else one line naming the layout -- never only 'not projected' lines and exit 1."""
    model = yaml.safe_load((EXAMPLES / "models" / "llama2-7b.yaml").read_text())
    training = {**yaml.safe_load((EXAMPLES / "training" / "default.yaml").read_text()),
                "pipeline_model_parallel_size": 4,
                "virtual_pipeline_model_parallel_size": chunks,
                "pipeline_model_parallel_layout": _layout(model["num_layers"], 4 * chunks)}
    (tmp_path / "training.yaml").write_text(yaml.safe_dump(training))
    outcome = run_cli(["project", "--model", EXAMPLES / "models" / "llama2-7b.yaml", "--training",
                       tmp_path / "training.yaml", "--hardware", HARDWARE, "-a", algorithm, "--json"])
    projected_or_named(outcome, f"project {algorithm} on a layout of {chunks} chunks a rank",
                       "pipeline_model_parallel_layout")


PRIMUS = {"layout of 2 * pp stages": ({"pipeline_model_parallel_layout": _layout(8, 4)}, 2),
          "layout beside the vpp": ({"pipeline_model_parallel_layout": _layout(8, 4),
                                     "num_virtual_stages_per_pipeline_rank": 2}, None),
          "9 layers over pp 2": ({"num_layers": 9}, None),
          "4 virtual stages of 8 layers over pp 2": ({"num_virtual_stages_per_pipeline_rank": 4}, 4),
          "3 virtual stages of 8 layers over pp 2": ({"num_virtual_stages_per_pipeline_rank": 3}, None)}
"""A Primus YAML's overrides over 8 layers at pp 2 -> the vpp Megatron runs (None: it refuses them)."""


@pytest.mark.parametrize("label", sorted(PRIMUS))
def test_primus_yaml_split_rules(tmp_path, label):
    """The same rules read from a Primus YAML's module overrides (YAML values, not argument texts)."""
    changes, vpp = PRIMUS[label]
    overrides = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256,
                 "max_position_embeddings": 256, "vocab_size": 1000, "micro_batch_size": 1, "global_batch_size": 16,
                 "bf16": True, "pipeline_model_parallel_size": 2, **changes}
    path = tmp_path / "primus.yaml"
    path.write_text(yaml.safe_dump({"modules": {"pre_trainer": {"framework": "megatron", "overrides": overrides}}}))
    outcome = run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "--target-nodes", "1",
                       "-a", "interleaved-1f1b" if vpp and vpp > 1 else "1f1b", "--json"])
    if vpp is None:
        refused(outcome, "primus.yaml", "pipeline", case=f"primus {label}")
        return
    accepted(outcome, case=f"primus {label}")
    assert {row["vpp"] for row in json.loads(outcome.out)["results"]} == {vpp}, label


LETTERS = {"Et*4|t*4L": 0, "Et*4|t*4mL": 1, "Et*4|t*4mmL": 2, "Et*4|t*4mL ": 0, "Et*4|t*4L ": 1, "Et*4m|t*4L": 1,
           "Et*4|mt*4L": 1, "Et*4|t*3mtL": 1, "Et*4|t*4m|L": 1, "EEt*4|t*4L": 0, "tEt*3|t*4L": 0, "Et*4|t*4LL": 0,
           "Et*4|t*4Lm": 1, "Et*4|Lt*4": 0, "t*4|Et*4L": 0, "Et*4|t*4": 0, "t*4|t*4L": 0, "Et*4|t*4mLm": 2}
"""Layouts of 8 layers over pp 2 (or 3 stages) -> mtp_num_layers given beside it (0: none)."""


def _layout_refused(layout: str, mtp: int) -> bool:
    """megatron-core's ``validate_layer_layout``: the embedding first and the loss last, once each; as many ``m`` as
    mtp_num_layers, none before a transformer layer; and the projection's own rule, every ``m`` in the last stage."""
    stages = parse_layout(layout.strip())
    flat = "".join(stages)
    return not (flat[:1] == "E" and flat[-1:] == "L" and flat.count("E") == flat.count("L") == 1
                and flat.count("m") == mtp and "t" not in flat[flat.find("m"):] * bool(mtp)
                and stages[-1].count("m") == mtp and len(stages) == 2)


@pytest.mark.parametrize("layout", sorted(LETTERS))
def test_layout_letters(tmp_path, layout):
    """Round twelve: ``m`` without ``--mtp-num-layers`` was priced as no MTP (and the count without ``m`` as MTP), a
    second ``E`` or ``L`` and an ``L`` before the last letter projected; each is now refused naming the layout."""
    mtp = LETTERS[layout]
    path = tmp_path / "args.sh"
    path.write_text(_arguments(8, 2, "", "") + f" --pipeline-model-parallel-layout '{layout}'"
                    + (f" --mtp-num-layers {mtp}" if mtp else ""))
    outcome = run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b", "--json"])
    case = f"megatron-config layout {layout!r} with {mtp} MTP layers"
    if _layout_refused(layout, mtp):
        refused(outcome, "args.sh", "layout", case=case)
    else:
        accepted(outcome, case=case)
