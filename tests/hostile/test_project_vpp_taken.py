"""Round fourteen: ``project --vpp N`` beside ``-a`` names, generated over every registered algorithm that runs a vpp
of its own (``primuspipe list``: 1f1b 1, the V-shapes 2, ...) and vpp 1 to 3. The algorithm's own vpp projects
(sound); any other is refused in one line naming ``--vpp`` and the algorithm -- it was dropped without a word, and
the rows said vpp 2 where the user asked 3 (``simulate -a zbv --vpp 3`` was already refused). Beside an algorithm
that takes any vpp, the flag is that algorithm's (sound) -- unless it is one the algorithm is never projected at
(``interleaved-1f1b --vpp 1`` projected vpp 2 without a word: its registered ``default_vpp`` is 2), which is refused
the same way, generated over every such algorithm."""

from pathlib import Path

import pytest

from hostile_support import accepted, refused, run_cli
from primuspipe.algorithms import list_algorithms

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
BASE = ["project", "--model", EXAMPLES / "models" / "llama2-7b.yaml", "--hardware", EXAMPLES / "hardware" / "h100.yaml",
        "--json", "-q"]
FIXED = [(info.name, info.vpp) for info in list_algorithms() if info.vpp is not None and info.name != "zb-auto"]
TAKER = next(info.name for info in list_algorithms() if info.vpp is None and info.name != "zb-auto")
ANY = [(info.name, info.default_vpp) for info in list_algorithms() if info.vpp is None and info.placement != "any"]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.setenv("PRIMUSPIPE_PROJECT_WORKERS", "1")


@pytest.mark.parametrize("algorithm, own", FIXED, ids=[name for name, _ in FIXED])
@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_a_vpp_beside_an_algorithm_of_its_own_vpp(algorithm, own, vpp):
    outcome = run_cli([*BASE, "-a", algorithm, "--vpp", vpp])
    case = f"project -a {algorithm} --vpp {vpp}"
    if vpp == own:
        accepted(outcome, case=case)
    else:
        refused(outcome, "--vpp", algorithm, case=case)


def test_a_vpp_beside_one_that_takes_any():
    fixed = FIXED[0][0]
    accepted(run_cli([*BASE, "-a", fixed, "-a", TAKER, "--vpp", 3]), case=f"project -a {fixed} -a {TAKER} --vpp 3")


@pytest.mark.parametrize("algorithm, default", ANY, ids=[name for name, _ in ANY])
@pytest.mark.parametrize("vpp", [1, 3])
def test_a_vpp_beside_an_algorithm_that_takes_any(algorithm, default, vpp):
    """An algorithm registered with a default vpp above 1 is projected at that default when asked for 1 (the
    training YAML's 1 means "not set"); asked for on the command line, 1 is refused, any vpp above it taken."""
    outcome = run_cli([*BASE, "-a", algorithm, "--vpp", vpp])
    case = f"project -a {algorithm} --vpp {vpp}"
    if vpp == 1 and default > 1:
        refused(outcome, "--vpp", algorithm, case=case)
    else:
        accepted(outcome, case=case)
