"""``simulate`` refusals that depend on the cost file, not on the algorithm: a ``host.background`` that leaves
no core free for a node's ranks was refused inside each algorithm's row -- with ``--json``, exit 1 with no
``error:`` line and without the file's name. Now one ``error:`` line naming the file and the field, with or
without ``--json``, before any table is built; files that leave a core free still simulate."""

import json

import pytest
import yaml

from hostile_support import accepted, refused, run_cli

CORES = 2


def _simulate(tmp_path, host, pp, per_node, as_json, algorithm="all"):
    cost = tmp_path / "cost.yaml"
    cost.write_text(yaml.safe_dump({"compute": {"f": 1.0, "b": 1.0, "w": 1.0}, "host": host,
                                    "p2p": {"ranks_per_node": per_node}}))
    return run_cli(["simulate", "-a", algorithm, "--pp", pp, "-m", 2 * pp, "--cost", cost]
                   + (["--json"] if as_json else []))


@pytest.mark.parametrize("background", [0.25, 0.5, 0.6, 1.0, 2.0, 1e300])
@pytest.mark.parametrize("pp, per_node", [(2, 8), (4, 8), (4, 2), (8, 1), (8, 4)])
@pytest.mark.parametrize("as_json", [False, True])
def test_background_that_leaves_no_core(tmp_path, background, pp, per_node, as_json):
    ranks = min(pp, per_node)
    outcome = _simulate(tmp_path, {"cores": CORES, "background": background}, pp, per_node, as_json, "1f1b")
    case = f"simulate host.background {background} x {ranks} ranks on {CORES} cores json={as_json}"
    if background * ranks >= CORES:
        refused(outcome, "cost.yaml", "host.background", case=case, before_work=True)
    else:
        accepted(outcome, case=case)


@pytest.mark.parametrize("message_cpu", [0.5, 1.0, 10.0])
@pytest.mark.parametrize("as_json", [False, True])
def test_messages_that_take_every_core(tmp_path, message_cpu, as_json):
    """``host.message_cpu`` takes cores per message, so it depends on each table: refused per algorithm, and when
    none is left, in one line naming the file."""
    outcome = _simulate(tmp_path, {"cores": CORES, "background": 0.4, "message_cpu": message_cpu}, 4, 8, as_json)
    case = f"simulate host.message_cpu {message_cpu} json={as_json}"
    if outcome.code == 0:  # some algorithm kept a core: the others' rows name the file
        accepted(outcome, case=case)
        if as_json:
            errors = [r["error"] for r in json.loads(outcome.out)["results"] if "error" in r]
            assert all("cost.yaml" in e for e in errors if "host." in e), errors
        return
    refused(outcome, "cost.yaml", "host.message_cpu", case=case)
