"""In-flight re-planning on TorchPipeline, real gloo ranks: the run measures its first steps, switches at a
step boundary to the algorithm the simulator ranks first, every rank runs the same table, and every step
(warm-up, probed, switched) gives exactly the losses and gradients of a pipeline running that step's
reference table -- the configured one before the switch (the probe changes no gradient), the chosen one
after. No timing is asserted (timing targets live in bench/bench_auto_replan.py).

Which algorithm ranks first depends on the measured costs (on a loaded two-core host the ranks
time-slice, and a schedule's bubble hardly matters); a run that names the algorithms to choose among,
without the one it starts with, always switches -- to the simulator's first among them."""

import copy
import dataclasses
import json

import pytest
import torch

from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.torch import TorchPipeline, split_sequential
from primuspipe.calibration.replan import ReplanSettings
from primuspipe.errors import ConfigError
from primuspipe.runtime.driver import table_digest
from primuspipe.testing.gloo import run_gloo

WIDTH = 256
STEPS = 5
SETTINGS = ReplanSettings(enabled=True, warmup_steps=1, measure_steps=2, verify_steps=1, threshold=0.02)
SPLIT = ("zb-h1", "zb-h2")  # zb-auto may find that 1F1B's own order is best: then nothing switches


def _model(stages: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                 for _ in range(stages)])


def _replanned_run(algorithm: str, pp: int, microbatches: int, dump_dir: str | None, settings: ReplanSettings):
    """Per rank: the algorithm each step ran, the digest of the table after the decision, the summary,
    and per step whether losses and gradients equalled those of the reference table's pipeline."""

    def work(rank, world):
        table = build_schedule(algorithm, pp, microbatches)
        stages = split_sequential(_model(table.num_stages), table.num_stages)
        mine = {s: stages[s] for s in table.placement.stages[rank]}
        shadow = {s: copy.deepcopy(m) for s, m in mine.items()}
        loss = torch.nn.MSELoss()
        pipe = TorchPipeline(table, mine, loss_fn=loss, auto_replan=settings, dump_dir=dump_dir)
        ran, same = [], []
        for step in range(STEPS):
            reference_table = pipe.running_table if pipe.replan_summary else table  # probe: same gradients
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16 * microbatches, WIDTH, generator=gen), torch.randn(16 * microbatches, WIDTH, generator=gen)
            for s, module in mine.items():
                shadow[s].load_state_dict(module.state_dict())
            reference = TorchPipeline(reference_table, shadow, loss_fn=loss, auto_replan=False)
            ran.append(pipe.running_table.algorithm)
            losses = pipe.step(x, target=y)
            ref_losses = reference.step(x, target=y)
            equal = losses is None or all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
            for s, module in mine.items():
                for p, q in zip(module.parameters(), shadow[s].parameters()):
                    equal &= torch.equal(p.grad, q.grad)
                    q.grad = None
            same.append(equal)
            with torch.no_grad():  # an SGD step, so every step starts from other weights
                for module in mine.values():
                    for p in module.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
        return ran, table_digest(pipe.running_table), pipe.replan_summary, same

    return run_gloo(work, pp, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_a_1f1b_run_switches_to_the_simulators_first_choice_with_its_reference_gradients(tmp_path, pp):
    settings = dataclasses.replace(SETTINGS, algorithms=SPLIT)
    results = _replanned_run("1f1b", pp=pp, microbatches=2 * pp, dump_dir=str(tmp_path), settings=settings)
    ran, digests, summaries, same = zip(*results)
    assert len(set(digests)) == 1, f"ranks hold different tables after re-planning: {digests}"
    summary = summaries[0]
    assert all(s["replanned_to"] == summary["replanned_to"] for s in summaries)
    best = summary["ranking"][0]["algorithm"]
    assert summary["switch"] and summary["replanned_to"] == summary["chosen"] == best != "1f1b", summary
    assert best in SPLIT
    decided = SETTINGS.warmup_steps + SETTINGS.measure_steps
    assert summary["decided_at_step"] == decided and summary["first_verified_step"] == decided + 1
    for per_rank in ran:  # the switch happens at the step boundary after the measured steps, on every rank
        assert per_rank == ["1f1b"] * decided + [best] * (STEPS - decided), per_rank
    assert all(all(rank) for rank in same), f"losses/gradients differ from the reference table's: {same}"
    written = json.loads((tmp_path / "replan.json").read_text())
    assert written[0]["replanned_to"] == best and len(written[0]["verified_steps"]) == SETTINGS.verify_steps
    assert {c["algorithm"] for c in summary["ranking"]} == set(SPLIT)


@pytest.mark.slow
def test_a_1f1b_run_takes_the_simulators_first_choice_on_every_rank():
    """pp = 2, m = 4 from 1F1B among every algorithm of its layout, threshold 0: the run switches exactly
    when something ranks above 1F1B (the measured split decides between a fused and a split backward), and
    every step equals the reference of the table it ran."""
    results = _replanned_run("1f1b", pp=2, microbatches=4, dump_dir=None,
                             settings=dataclasses.replace(SETTINGS, threshold=0.0))
    ran, digests, summaries, same = zip(*results)
    assert len(set(digests)) == 1
    summary = summaries[0]
    ranking = summary["ranking"]
    assert summary["chosen"] == ranking[0]["algorithm"]
    assert {c["algorithm"] for c in ranking} >= {"1f1b", "gpipe", "zb-auto", *SPLIT}
    # zb-auto may rank first with 1F1B's own order (its search found nothing better): nothing to switch to
    assert summary["switch"] == (ranking[0]["algorithm"] not in ("1f1b", "zb-auto")) or \
        ranking[0]["algorithm"] == "zb-auto", summary
    assert all(r[-1] == (summary["chosen"] if summary["switch"] else "1f1b") for r in ran)
    assert all(all(rank) for rank in same), f"losses/gradients differ from the reference table's: {same}"


def test_auto_replan_refusals():
    with pytest.raises(ConfigError, match="auto_replan must be True, False or a ReplanSettings"):
        from primuspipe.calibration.replan import check_settings_kind

        check_settings_kind("yes")
    with pytest.raises(ConfigError, match="threshold"):
        ReplanSettings(enabled=True, threshold=float("nan"))
    with pytest.raises(ConfigError, match="PRIMUSPIPE_AUTO_REPLAN_STEPS"):
        ReplanSettings.from_env({"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_STEPS": "two"})
    assert ReplanSettings.from_env({"PRIMUSPIPE_AUTO_REPLAN": "on"}).enabled
    settings = ReplanSettings.from_env({"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS": "zb-h1, zbv"})
    assert settings.algorithms == ("zb-h1", "zbv")
    with pytest.raises(ConfigError, match=r"\['zbv'\] do not share the running 1f1b table's layout"):
        settings.check_layout(build_schedule("1f1b", 2, 4))
    assert ReplanSettings.from_env({"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_VERIFY": "7"}).verify_steps == 7
    with pytest.raises(ConfigError, match="PRIMUSPIPE_AUTO_REPLAN_VERIFY"):
        ReplanSettings.from_env({"PRIMUSPIPE_AUTO_REPLAN": "1", "PRIMUSPIPE_AUTO_REPLAN_VERIFY": "-2"})


def test_a_run_whose_decision_fails_keeps_its_table_and_records_why(tmp_path):
    """Calibration can refuse the measured steps: the run keeps its table, stops probing, and its summary
    and replan.json say why -- no decision made of NaN predictions."""
    def work(rank, world):
        import primuspipe.backends.replanning as replanning

        def refuse(*args, **kwargs):
            raise ConfigError("the measured steps do not calibrate (test)")

        replanning.decide = refuse  # this rank's process only
        table = build_schedule("1f1b", 2, 4)
        stages = split_sequential(_model(table.num_stages), table.num_stages)
        mine = {s: stages[s] for s in table.placement.stages[rank]}
        pipe = TorchPipeline(table, mine, loss_fn=torch.nn.MSELoss(), auto_replan=SETTINGS, dump_dir=str(tmp_path))
        for _ in range(STEPS):
            pipe.step(torch.randn(64, WIDTH), target=torch.randn(64, WIDTH))
            for module in mine.values():
                module.zero_grad()
        return pipe.running_table.algorithm, pipe.replan_summary

    for algorithm, summary in run_gloo(work, 2, timeout_s=300):
        assert algorithm == "1f1b"
        assert summary["replanned_to"] is None and "do not calibrate" in summary["failure"]
    (record,) = json.loads((tmp_path / "replan.json").read_text())
    assert "do not calibrate" in record["failure"]
