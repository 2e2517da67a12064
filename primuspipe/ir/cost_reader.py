"""The cost file's YAML mapping read into a cost model: every field checked, and every error naming the file.

The file's form and its section readers are :mod:`~primuspipe.ir.cost_file`'s; what the model does with its
fields is :mod:`~primuspipe.ir.cost_model`'s. This is the step between them: the sections put together for one
pipeline shape (per-stage values cut for ``pp`` x ``vpp``, ``compute.fixed`` and ``compute.w_warm`` spread over
the chunks), apart from the model so that the model reads as what a node costs, not how a file is parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from primuspipe import strict
from primuspipe.errors import ConfigError, ScheduleShapeError
from primuspipe.ir.cost_file import (COMPUTE_FIELDS, SECTIONS, cold_start_section, cost_keys, counts_taken,
                                     host_section, late_section, link_section, memory_section, split_fixed,
                                     split_stages, stage_totals, warm_stages, window_section)
from primuspipe.ir.cost_parts import TIME_UNITS, P2PCost
from primuspipe.ir.costs import Values, per_stage_values
from primuspipe.ir.limits import check_shape

if TYPE_CHECKING:
    from primuspipe.ir.cost_model import CostModel


def _check_file_shape(compute: Mapping[str, Any], pp: int, vpp: int, source: str) -> None:
    """F, B and W lists of one length that fits neither this pp nor pp x vpp were written for another
    pipeline (a run calibrated at pp 4, simulated at --pp 8): said once, with the shape to use, rather than
    as one field's count."""
    lists = [v for k in ("f", "b", "w")
             if isinstance(v := compute[k], Sequence) and not isinstance(v, (str, bytes, bytearray))]
    if len(lists) == 3 and len({len(v) for v in lists}) == 1 and len(lists[0]) not in (pp, pp * vpp):
        raise ConfigError(f"{source}: F, B and W have {len(lists[0])} values each, one per stage of another pipeline "
                          f"than pp={pp}: give {counts_taken(pp, vpp)}; a calibrated file's first line names the "
                          f"shape it was measured at, simulate that one")


def read_model(build: Callable[..., CostModel], data: Mapping[str, Any], *, pp: int, vpp: int,
               source: str) -> CostModel:
    """The model ``build`` (:meth:`CostModel.per_stage <primuspipe.ir.cost_model.CostModel.per_stage>`) makes of
    the YAML mapping ``data`` for a pipeline of ``pp`` ranks x ``vpp`` chunks, each field read by its section's
    reader; a value of the wrong type or range anywhere, the model's own checks included, is refused naming
    ``source``. The shape is checked first: the model keeps one value per stage (``--vpp 999999999999999999``
    built them for ever)."""
    try:
        check_shape(pp, vpp, 1)
    except ScheduleShapeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    top = strict.keys(data, source, SECTIONS)
    comp = strict.keys(top.get("compute"), f"{source}: compute", {*cost_keys(), *COMPUTE_FIELDS},
                       required={"f", "b", "w"})
    _check_file_shape(comp, pp, vpp, source)
    p2p = strict.keys(top.get("p2p", {}), f"{source}: p2p",
                      {"message_bytes", "ranks_per_node", "intra_node", "inter_node"})
    links = {k: strict.keys(p2p.get(k, {}), f"{source}: p2p.{k}", {"latency", "bandwidth"})
             for k in ("intra_node", "inter_node")}

    fixed_given = strict.keys(comp.get("fixed", {}), f"{source}: compute.fixed", cost_keys())
    chunk_given = strict.keys(comp.get("chunk", {}), f"{source}: compute.chunk", cost_keys())
    for part, given, needs in (("fixed", fixed_given, comp), ("chunk", chunk_given, fixed_given)):
        if unknown := sorted(set(given) - set(needs)):
            raise ConfigError(f"{source}: compute.{part}.{unknown[0]} is given but compute."
                              f"{'fixed.' if part == 'chunk' else ''}{unknown[0]} is not; give both or neither")
    fixed: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {}

    def stages(name: str, value: Values) -> tuple[float, ...]:
        key = name.lower()
        if key in fixed_given:
            times, *fixed[key] = split_fixed(f"{source}: compute.{key}", value, fixed_given[key], pp, vpp,
                                             f"{source}: compute.fixed.{key}", chunk_given.get(key),
                                             f"{source}: compute.chunk.{key}")
            return times
        return split_stages(f"{source}: {name}", value, pp, vpp)

    def number(section: Mapping[str, Any], key: str, name: str, default: float, **bounds: float) -> float:
        return strict.number(section.get(key, default), f"{source}: {name}", **bounds)

    def warm(w: tuple[float, ...]) -> tuple[float, ...] | None:
        """``compute.w_warm`` per model stage (:mod:`~primuspipe.ir.cost_file`): as given per model
        stage, else each chunk's W less its share of its 1F1B stage's saving."""
        if (value := comp.get("w_warm")) is None:
            return None
        name, n = f"{source}: compute.w_warm", pp * vpp

        def per_model_stage(v: Any) -> bool:
            return vpp > 1 and isinstance(v, Sequence) and not isinstance(v, (str, bytes, bytearray)) and len(v) == n

        if per_model_stage(value):
            return per_stage_values(name, value, n, "stages")
        hot = per_stage_values(name, value, pp, "1F1B stages")
        if per_model_stage(comp["w"]):
            totals = stage_totals(per_stage_values(f"{source}: compute.w", comp["w"], n, "stages"), pp)
        else:
            totals = per_stage_values(f"{source}: compute.w", comp["w"], pp, "1F1B stages")
        return warm_stages(w, [t - h for t, h in zip(totals, hot)])

    try:
        memory = memory_section(top.get("memory", {}), pp, vpp, source)
        other = {key: stages(key.upper(), comp[key]) for key in sorted(set(comp) - COMPUTE_FIELDS)}
        w = stages("W", comp["w"])
        return build(
            pp * vpp, stages("F", comp["f"]), stages("B", comp["b"]), w, other=other, w_warm=warm(w),
            bw=None if comp.get("bw") is None else stages("BW", comp["bw"]),
            fb_overlap=number(comp, "fb_overlap", "compute.fb_overlap", 0.0, minimum=0, maximum=1),
            probe_window=window_section(comp.get("probe_window", 0.0), pp, f"{source}: compute.probe_window"),
            late_w=late_section(comp.get("late_w"), f"{source}: compute.late_w"),
            p2p=P2PCost(number(p2p, "message_bytes", "p2p.message_bytes", 0.0, minimum=0),
                        ranks_per_node=strict.count(p2p.get("ranks_per_node", 8), f"{source}: p2p.ranks_per_node",
                                                    minimum=1),
                        **{k: link_section(v, f"{source}: p2p.{k}") for k, v in links.items()}),
            memory=memory, time_unit=strict.text(top.get("time_unit", "ms"), f"{source}: time_unit",
                                                 choices=TIME_UNITS),
            host=host_section(top.get("host", {}), pp), cold_start=cold_start_section(comp.get("cold_start"), pp, vpp),
            host_link=link_section(strict.keys(top.get("host_link", {}), f"{source}: host_link",
                                        {"latency", "bandwidth"}), f"{source}: host_link"),
            fixed=tuple((key, *parts) for key, parts in sorted(fixed.items())), source=source,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value in the cost model: {exc}") from exc
