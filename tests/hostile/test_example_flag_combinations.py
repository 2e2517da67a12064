"""Round thirteen: ``examples/train_gpt.py``'s Megatron-LM flags in combinations Megatron refuses, judged against an
oracle of Megatron's rules (:func:`_megatron_refuses`: megatron/training/arguments.py's ``validate_args``,
megatron-core's ``TransformerConfig`` and parallel state) -- the model's head split, tensor and sequence parallelism,
experts over expert-parallel ranks and the router's top-k, recompute granularity and method, the world's grids.
Each refused combination is one line before any process group (``parse_args``, or :func:`prepare`, which tries
megatron-core's config once); each other one is prepared (sound). Nothing here starts a process group.

Defects this family found: ``--num-attention-heads 3`` at hidden size 16 trained a model Megatron-LM refuses (3 heads
of 5 channels), and 32 heads a ZeroDivisionError traceback on every rank; ``--moe-router-topk 5 --num-experts 4``
torch.topk's "selected index k out of range" traceback at the first step (and top-1, which megatron-core refuses
without a pre-softmax flag the example lacks, was refused naming that flag); ``--expert-model-parallel-size 2``
without experts, or experts it does not divide, parallel state's RuntimeError traceback on every rank;
``--recompute-granularity selective --recompute-method uniform`` ran though Megatron-LM refuses it; and what
megatron-core's ``TransformerConfig`` refuses (sequence parallelism without tensor parallelism, full recompute
without a method, heads over tensor-parallel ranks) was refused only after every rank had joined its groups.
``--load`` under ``--optimizer sgd`` (megatron-core's SGD has no state loader), of a folder without a checkpoint or of
a file was a TypeError on every rank, ``--save`` to a file a FileExistsError after the whole training."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
from pathlib import Path

import pytest

from hostile_support import Outcome, accepted, refused
from primuspipe.errors import PrimusPipeError

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_gpt.py"
BASE = {"--pp": 2, "--microbatches": 4, "--num-layers": 4, "--hidden-size": 16, "--num-attention-heads": 2}
GROUPS = {
    "heads": {"--hidden-size": [16, 12], "--num-attention-heads": [2, 3, 32], "--tensor-model-parallel-size": [1, 2],
              "--sequence-parallel": [False, True]},
    "experts": {"--num-experts": [None, 3, 4], "--expert-model-parallel-size": [1, 2], "--moe-router-topk": [1, 2, 5]},
    "recompute": {"--recompute-granularity": [None, "full", "selective"], "--recompute-method": [None, "uniform"],
                  "--recompute-num-layers": [None, 1]},
}
"""Flags that constrain each other, each group swept over every combination of its values (the rest at BASE)."""


def _megatron_refuses(flags: dict) -> str | None:
    """The flag Megatron's refusal names, or None where Megatron runs the combination."""
    hidden, heads = flags["--hidden-size"], flags["--num-attention-heads"]
    tp, sp = flags.get("--tensor-model-parallel-size", 1), flags.get("--sequence-parallel", False)
    experts, ep = flags.get("--num-experts"), flags.get("--expert-model-parallel-size", 1)
    topk, granularity = flags.get("--moe-router-topk", 2), flags.get("--recompute-granularity")
    method, recomputed = flags.get("--recompute-method"), flags.get("--recompute-num-layers")
    rules = [
        (hidden % heads, "--hidden-size"),  # validate_args: hidden_size % num_attention_heads == 0
        (heads % tp, "tensor_model_parallel_size"),  # TransformerConfig
        (sp and tp == 1, "sequence parallelism"),  # TransformerConfig (Megatron-LM's own arguments drop it instead)
        (ep > 1 and experts is None, "--expert-model-parallel-size"),  # validate_args
        (experts is not None and experts % ep, "--num-experts"),  # validate_args
        (experts is not None and topk > experts, "--moe-router-topk"),  # torch.topk at the first routed token
        (experts is not None and topk == 1, "--moe-router-topk"),  # TransformerConfig: top-1 needs pre-softmax
        (granularity == "selective" and method is not None, "--recompute-method"),  # validate_args
        (granularity == "full" and method is None, "recompute_method"),  # TransformerConfig
        (granularity == "full" and recomputed is None, "recompute_num_layers"),  # TransformerConfig
        (granularity == "selective" and recomputed is not None, "recompute_num_layers"),  # TransformerConfig
    ]
    return next((name for broken, name in rules if broken), None)


def _cases():
    for group, values in GROUPS.items():
        for combination in itertools.product(*values.values()):
            yield group, {**BASE, **dict(zip(values, combination))}


def _argv(flags: dict) -> list[str]:
    argv = []
    for flag, value in flags.items():
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, str(value)]
    return argv


@pytest.fixture(scope="module")
def example():
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    spec = importlib.util.spec_from_file_location("example_train_gpt_combinations", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prepared(example, argv: list[str], world: int) -> Outcome:
    """``parse_args`` then ``prepare`` on ``world`` ranks, classified: argparse's one usage error, a
    PrimusPipeError's line or a SystemExit's text is clear; anything else escaping is a traceback."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            example.prepare(example.parse_args(argv), world)
        except SystemExit as exc:
            lines = [line for line in err.getvalue().splitlines() if ": error: " in line]
            message = lines[0] if exc.code == 2 and len(lines) == 1 else exc.code if isinstance(exc.code, str) else ""
            return Outcome("clear" if message else "garbled", 1, message)
        except PrimusPipeError as exc:
            return Outcome("clear", 1, str(exc))
        except Exception as exc:  # noqa: BLE001 - the sweep's traceback class
            return Outcome("traceback", None, f"{type(exc).__name__}: {exc}")
    return Outcome("silent", 0, "")


CASES = list(_cases())


@pytest.mark.parametrize("group, flags", CASES, ids=[" ".join(_argv(f)[len(_argv(BASE)):]) or g for g, f in CASES])
def test_flag_combination(example, group, flags):
    argv = _argv(flags)
    case = f"train_gpt.py {' '.join(argv[len(_argv(BASE)):])}"
    outcome = _prepared(example, argv, world=8)
    if (name := _megatron_refuses(flags)) is None:
        accepted(outcome, case=case)
    else:
        refused(outcome, name, case=case)


@pytest.mark.parametrize("world", [2, 4, 6, 8, 12])
@pytest.mark.parametrize("grid", [{"--tensor-model-parallel-size": 2}, {"--num-experts": 4,
                                                                        "--expert-model-parallel-size": 2},
                                  {"--num-experts": 4, "--expert-model-parallel-size": 4}])
def test_world_holds_the_grids(example, world, grid):
    """WORLD_SIZE against pp x tensor-parallel and megatron-core's expert grid (pp x EP x ETP): the expert grid was
    parallel state's RuntimeError on every rank after the process group."""
    argv = _argv({**BASE, **grid})
    size = BASE["--pp"] * grid.get("--tensor-model-parallel-size", 1) * grid.get("--expert-model-parallel-size", 1)
    case = f"train_gpt.py WORLD_SIZE={world} {' '.join(argv[len(_argv(BASE)):])}"
    outcome = _prepared(example, argv, world)
    if world % size:
        refused(outcome, "WORLD_SIZE", case=case)
    else:
        accepted(outcome, case=case)


CHECKPOINTS = [
    (["--load", "CKPT"], None), (["--save", "NEW"], None), (["--save", "EMPTY"], None), (["--save", "CKPT"], None),
    (["--load", "CKPT", "--optimizer", "sgd"], "--optimizer adam"), (["--load", "EMPTY"], "--load"),
    (["--load", "MISSING"], "--load"), (["--load", "FILE"], "--load"), (["--save", "FILE"], "--save"),
    (["--save", "FILE/sub"], "--save"),
]
"""--load and --save folders (CKPT holds a checkpoint's metadata.json, EMPTY nothing, FILE is a file), beside
``--optimizer adam`` unless the case names another optimizer."""


@pytest.mark.parametrize("flags, name", CHECKPOINTS, ids=[" ".join(f) for f, _ in CHECKPOINTS])
def test_checkpoint_folders(example, tmp_path, flags, name):
    (tmp_path / "CKPT").mkdir()
    (tmp_path / "CKPT" / "metadata.json").write_text("{}")
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "FILE").write_text("a file")
    argv = _argv(BASE) + (["--optimizer", "adam"] if "--optimizer" not in flags else [])
    argv += [str(tmp_path / f) if f.isupper() or "/" in f else f for f in flags]
    case = f"train_gpt.py {' '.join(flags)}"
    outcome = _prepared(example, argv, world=2)
    if name is None:
        accepted(outcome, case=case)
    else:
        refused(outcome, name, case=case)


TORCH_CASES = [
    (["--schedule", "T"], None), (["--microbatches", "4"], None), (["--microbatches", "4", "-a", "zbv"], None),
    (["--microbatches", "4", "--vpp", "2", "-a", "interleaved-1f1b", "--layers", "4"], None),
    ([], "--microbatches"), (["-a", "zbv"], "--microbatches"), (["--vpp", "2"], "--microbatches"),
    (["--schedule", "T", "--microbatches", "4"], "--microbatches"), (["--schedule", "T", "-a", "zbv"], "--algorithm"),
    (["--schedule", "T", "--pp-algorithm", "1f1b"], "--algorithm"), (["--schedule", "T", "--vpp", "2"], "--vpp"),
    (["--schedule", "T4"], "--schedule"), (["--schedule", "MISSING"], "MISSING"),
    (["--microbatches", "4", "--vpp", "2", "-a", "interleaved-1f1b", "--layers", "3"], "--layers"),
    (["--microbatches", "4", "-a", "zbv", "--layers", "3"], "--layers"),
    (["--microbatches", "4", "WORLD=3"], "--nproc-per-node"), (["--schedule", "T", "WORLD=1"], "--nproc-per-node"),
]
"""``examples/train_torch.py``'s table source and what the table needs (``T`` a pp=2 table file, ``T4`` a pp=4 one;
a world of 2 unless ``WORLD=``): --schedule, or --microbatches with --algorithm and --vpp. A flag beside --schedule
was ignored (the table file fixes the shape and the algorithm: --microbatches 64 ran the file's 4); a run with
neither, a table of another pp, fewer --layers than stages and a world of another size were refused on every rank
after its process group."""


@pytest.fixture(scope="module")
def train_torch():
    spec = importlib.util.spec_from_file_location("example_train_torch_source", EXAMPLE.with_name("train_torch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, name", TORCH_CASES, ids=[" ".join(a) or "none" for a, _ in TORCH_CASES])
def test_train_torch_table(train_torch, tmp_path, argv, name):
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.io.formats import save_table

    save_table(build_schedule("1f1b", 2, 4), tmp_path / "T.json")
    save_table(build_schedule("1f1b", 4, 4), tmp_path / "T4.json")
    world = next((int(a[6:]) for a in argv if a.startswith("WORLD=")), 2)
    files = {"T": tmp_path / "T.json", "T4": tmp_path / "T4.json", "MISSING": tmp_path / "MISSING.json"}
    argv = ["--pp", "2", *[str(files.get(a, a)) for a in argv if not a.startswith("WORLD=")]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train_torch.plan(train_torch.parse_args(argv), world)
            outcome = Outcome("silent", 0, "")
        except SystemExit as exc:
            lines = [line for line in err.getvalue().splitlines() if ": error: " in line]
            outcome = Outcome("clear" if exc.code == 2 and len(lines) == 1 else "garbled", exc.code,
                              lines[0] if lines else err.getvalue())
        except PrimusPipeError as exc:
            outcome = Outcome("clear", 1, str(exc))
    case = f"train_torch.py {' '.join(argv[2:]).replace(str(tmp_path) + '/', '')} on {world} ranks"
    if name is None:
        accepted(outcome, case=case)
    else:
        refused(outcome, name, case=case)
