"""A chunk's fixed cost apart from its layers' (``compute.fixed`` / ``compute.chunk``): the cut for another
vpp, its inverse, the YAML form and its refusals, and calibration recovering them from timelines whose
events time the layers (``TimedNode.layers`` / ``ends``), so that a file measured on one table predicts
a table of another vpp and microbatch count exactly where the even cut cannot."""

import random
import statistics
from dataclasses import replace

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.measure import measure_costs
from primuspipe.errors import ConfigError, TableFormatError
from primuspipe.io.timeline import Timeline
from primuspipe.ir.kinds import NodeKind
from primuspipe.simulator import CostModel, simulate

SHAPES = [(pp, vpp) for pp in (1, 2, 3, 4) for vpp in (1, 2, 3)]


def _file(pp: int, seed: int) -> dict:
    rng = random.Random(seed)
    value = {key: [round(rng.uniform(4, 9), 3) for _ in range(pp)] for key in ("f", "b", "w", "bw")}
    fixed = {key: [round(rng.uniform(0.5, 2), 3) for _ in range(pp)] for key in ("f", "b", "bw")}
    chunk = {"f": [round(x * rng.uniform(0.3, 1), 3) for x in fixed["f"]]}
    return {"time_unit": "ms", "compute": {**value, "fixed": fixed, "chunk": chunk}}


@pytest.mark.parametrize("pp,vpp", SHAPES)
def test_the_cut_keeps_1f1b_stages_and_charges_each_extra_chunk_its_fixed_cost(pp, vpp):
    data = _file(pp, seed=pp * 10 + vpp)
    comp = data["compute"]
    one = CostModel.from_dict(data, pp=pp, vpp=1)
    assert one.compute.forward == tuple(comp["f"]), "at vpp = 1 the file's values are the stages' times"
    cut = CostModel.from_dict(data, pp=pp, vpp=vpp)
    inner = comp["fixed"]["b"][1:-1]  # without compute.chunk: the middle stages' median, else the smaller end
    chunk = {"f": comp["chunk"]["f"], "b": [statistics.median(inner) if inner else min(comp["fixed"]["b"])] * pp}
    for key, times in (("f", cut.compute.forward), ("b", cut.compute.backward_input)):
        for k in range(pp):
            # a 1F1B stage's chunks together: its time plus vpp - 1 more chunk costs
            got = sum(times[k * vpp:(k + 1) * vpp])
            want = comp[key][k] + (vpp - 1) * min(chunk[key][k], comp["fixed"][key][k])
            assert got == pytest.approx(want, rel=1e-12), (key, k)
    assert cut.compute.backward_weight == tuple(comp["w"][s // vpp] / vpp for s in range(pp * vpp)), \
        "a kind without a fixed part keeps the even cut"
    if pp > 1:  # the embedding's and head's share stays on the first and last model stage
        first, last = cut.compute.forward[0], cut.compute.forward[-1]
        layers = [(comp["f"][k] - comp["fixed"]["f"][k]) / vpp for k in range(pp)]
        assert first == pytest.approx(layers[0] + comp["fixed"]["f"][0])
        assert last == pytest.approx(layers[-1] + comp["fixed"]["f"][-1])
    # the same model cut from its vpp = 1 form (zb-auto's path), and back
    assert _close(one.for_shape(pp, vpp), cut)
    assert _close(cut.for_shape(pp, 1), one)
    assert CostModel.from_dict(cut.to_dict(), pp=pp, vpp=vpp) == cut, "the YAML form round-trips"


def _close(a: CostModel, b: CostModel) -> bool:
    def flat(model: CostModel) -> list[float]:
        c = model.compute
        parts = [x for _, fixed, chunk in model.fixed for x in (*fixed, *chunk)]
        return [*c.forward, *c.backward_input, *c.backward_weight, *model.fused_backward, *parts]

    return [k for k, *_ in a.fixed] == [k for k, *_ in b.fixed] and flat(a) == pytest.approx(flat(b), rel=1e-9)


@pytest.mark.parametrize("compute,names", [
    ({"f": [1, 2], "fixed": {"f": [0.5, 3]}}, "compute.fixed.f[1] = 3 is more than"),
    ({"f": 1, "fixed": {"f": 0.5}, "chunk": {"f": 0.7}}, "compute.chunk.f[0] = 0.7 is more than"),
    ({"f": 1, "chunk": {"f": 0.2}}, "compute.chunk.f is given but compute.fixed.f is not"),
    ({"f": 1, "fixed": {"bw": 0.2}}, "compute.fixed.bw is given but compute.bw is not"),
    ({"f": 1, "fixed": {"f": [0.2, ".nan"]}}, "compute.fixed.f[1]"),
    ({"f": 1, "fixed": {"f": [0.2, 0.1, 0.3]}}, "compute.fixed.f has 3 values"),
    ({"f": 1, "fixed": {"x": 0.2}}, "compute.fixed has unknown key"),
    ({"f": 1, "fixed": 0.2}, "compute.fixed must be a mapping"),
    ({"f": 1, "fixed": {"f": -0.1}}, "compute.fixed.f"),
])
def test_bad_fixed_parts_are_refused_in_one_line(compute, names):
    data = {"compute": {"b": 1, "w": 1, **compute}}
    with pytest.raises(ConfigError) as info:
        CostModel.from_dict(data, pp=2, vpp=2)
    assert names in str(info.value) and "\n" not in str(info.value)


# -- calibration: timelines of a "true" model whose nodes are chunk + layers (+ embedding / head) ----------

LAYERS = {NodeKind.F: 4.0, NodeKind.B: 4.4, NodeKind.W: 3.0}  # per 1F1B stage's layers
CHUNK = {NodeKind.F: 1.5, NodeKind.B: 1.0, NodeKind.W: 0.4}  # every chunk, every node
EMBEDDING, HEAD = 0.3, {NodeKind.F: 2.0, NodeKind.B: 1.2, NodeKind.W: 0.6}


def _truth(pp: int, vpp: int) -> tuple[CostModel, dict]:
    """Per model stage times and, per (kind, stage), the part outside the layers and the embedding."""
    n = pp * vpp
    times, outside = {}, {}
    for kind in LAYERS:
        for s in range(n):
            extra = (EMBEDDING if s == 0 and kind is NodeKind.F else 0.0) + (HEAD[kind] if s == n - 1 else 0.0)
            times[(kind, s)] = LAYERS[kind] / vpp + CHUNK[kind] + extra
            outside[(kind, s)] = (times[(kind, s)] - LAYERS[kind] / vpp, EMBEDDING if s == 0 and kind is NodeKind.F else 0.0)
    per = {kind: [times[(kind, s)] for s in range(n)] for kind in LAYERS}
    return CostModel.per_stage(n, per[NodeKind.F], per[NodeKind.B], per[NodeKind.W]), outside


def _timed_layers(timeline: Timeline, outside: dict) -> Timeline:
    """The timeline with every compute event's time in the layers and the embedding, as a dump has it."""
    placement = build_schedule(timeline.algorithm, timeline.pp, timeline.microbatches).placement
    ranks = []
    for rt in timeline.ranks:
        events = []
        for e in rt.events:
            if e.node.kind.is_compute:
                fixed, ends = outside[(e.node.kind, placement.stage(rt.rank, e.node.chunk))]
                e = replace(e, layers=(e.end - e.start - fixed, None), ends=(ends, None) if ends else None)
            events.append(e)
        ranks.append(replace(rt, events=tuple(events)))
    return replace(timeline, ranks=tuple(ranks))


@pytest.mark.parametrize("pp,target,m", [(2, "interleaved-1f1b", 6), (2, "zbv", 4), (3, "v-half", 9),
                                         (4, "interleaved-1f1b", 16), (4, "zbv", 8)])
def test_a_file_from_zb_h1_predicts_vpp2_tables_at_other_shapes_exactly(pp, target, m):
    truth1, outside1 = _truth(pp, 1)
    timeline = _timed_layers(simulate(build_schedule("zb-h1", pp, 8), truth1).timeline(), outside1)
    measured = measure_costs([timeline])
    assert measured.fixed and measured.chunk
    cost = measured.cost_dict()
    assert cost["compute"]["chunk"]["f"] == pytest.approx([CHUNK[NodeKind.F]] * pp)

    table = build_schedule(target, pp, m)
    truth2, _ = _truth(pp, table.vpp)
    want = simulate(table, truth2).step_time
    got = simulate(table, CostModel.from_dict(cost, pp=pp, vpp=table.vpp)).step_time
    assert got == pytest.approx(want, rel=1e-9)
    even = {**cost, "compute": {k: v for k, v in cost["compute"].items() if k not in ("fixed", "chunk")}}
    even_step = simulate(table, CostModel.from_dict(even, pp=pp, vpp=table.vpp)).step_time
    assert even_step < want * 0.97, "the even cut leaves out a chunk cost per extra chunk"


def test_timeline_layers_round_trip_and_bad_values_are_refused(tmp_path):
    truth, outside = _truth(2, 1)
    timeline = _timed_layers(simulate(build_schedule("zb-h1", 2, 4), truth).timeline(), outside)
    path = tmp_path / "t.json"
    timeline.save(path)
    assert Timeline.load(path) == timeline
    data = timeline.to_dict()
    event = data["ranks"][0]["events"][0]
    for bad, says in (([event["end"] - event["start"] + 1, None], "is longer than the node itself"),
                      ([0.1], "must be [wall, cpu]"), ([-1, None], "layers[0]")):
        event["layers"] = bad
        with pytest.raises(TableFormatError, match=r"events\[0\]\.layers"):
            Timeline.from_dict(data)
        try:
            Timeline.from_dict(data)
        except TableFormatError as exc:
            assert says in str(exc) and "\n" not in str(exc)


def test_a_file_calibrated_at_vpp2_is_the_same_per_1f1b_stage():
    """From a vpp = 2 run the file is written per 1F1B stage: the chunks' times and fixed parts together,
    less the extra chunk's own cost a 1F1B stage does not pay -- the vpp = 1 model, and cut back, the run's."""
    truth2, outside2 = _truth(2, 2)
    timeline = _timed_layers(simulate(build_schedule("zbv", 2, 6), truth2).timeline(), outside2)
    cost = measure_costs([timeline]).cost_dict()
    for vpp in (1, 2):
        truth, _ = _truth(2, vpp)
        model = CostModel.from_dict(cost, pp=2, vpp=vpp)
        for kind in LAYERS:
            assert model.compute.of(kind) == pytest.approx(truth.compute.of(kind), rel=1e-9), (vpp, kind)
