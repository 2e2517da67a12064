"""The simulator: times a schedule table under a cost model, offline and deterministically.

The cost model itself lives in :mod:`primuspipe.ir.cost_model`, so cost-aware algorithms and the
search read the very model the simulator times them with; it is re-exported here as the simulator's
input.

>>> from primuspipe.algorithms.build import build_schedule
>>> table = build_schedule("1f1b", pp=4, microbatches=8)
>>> result = simulate(table, CostModel.per_stage(4, f=1, b=2, w=0))
>>> round(result.bubble_rate, 4), result.peak_activations
(0.2727, [4.0, 3.0, 2.0, 1.0])
"""

from primuspipe.ir.cost_model import CostModel, Link, MemoryCost, P2PCost, read_cost_file, split_stages
from primuspipe.simulator.engine import simulate
from primuspipe.simulator.result import RankResult, SimulationResult
from primuspipe.simulator.trace import chrome_trace, write_chrome_trace

__all__ = ["CostModel", "Link", "MemoryCost", "P2PCost", "RankResult", "SimulationResult", "chrome_trace",
           "read_cost_file", "simulate", "split_stages", "write_chrome_trace"]
