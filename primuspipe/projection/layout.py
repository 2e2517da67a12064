"""Which transformer layers each pipeline stage holds, and which rank holds each stage.

The model is cut into ``S = pp * vpp`` stages in model order; the algorithm's placement (interleaved
or V) maps stages to ranks. Stage 0 also holds the embedding, stage ``S - 1`` the final norm, output
layer and loss -- on the last rank with the interleaved placement, on rank 0 with the V placement.

Layers are split as the Primus projection does when no explicit split is given: evenly, with the
remainder going to the first stages (61 layers over 4 stages: 16, 15, 15, 15). With
``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers`` the split is Megatron's:
the first (last) pipeline rank holds that many layers over all its chunks, the other ranks share the
rest evenly, and each rank's layers split evenly over its chunks.

>>> layer_counts(61, pp=4, vpp=1)
(16, 15, 15, 15)
>>> layer_counts(24, pp=4, vpp=2, first=2, last=6, placement=Placement.interleaved(4, 2))
(1, 4, 4, 3, 1, 4, 4, 3)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from primuspipe.projection.framework import Placement
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec


def layer_counts(num_layers: int, pp: int, vpp: int, *, first: int | None = None, last: int | None = None,
                 placement: Placement | None = None, embedding_slot: bool = False, loss_slot: bool = False
                 ) -> tuple[int, ...]:
    """Layers of each stage, in stage order (``placement`` is needed only with ``first``/``last``).

    ``embedding_slot`` / ``loss_slot`` are Megatron's ``account_for_embedding/loss_in_pipeline_split``: the
    embedding (the output layer and loss) takes one layer's place on the first (last) stage.

    >>> counts = layer_counts(126, pp=8, vpp=8, embedding_slot=True, loss_slot=True)
    >>> counts[:2], counts[-1]
    ((1, 2), 1)
    """
    stages = pp * vpp
    if first is None and last is None:
        base, extra = divmod(num_layers + embedding_slot + loss_slot, stages)
        counts = [base + (s < extra) for s in range(stages)]
        counts[0] -= embedding_slot
        counts[-1] -= loss_slot
        return tuple(counts)
    assert placement is not None, "uneven first/last stages are per rank: give the placement"
    per_rank = _uneven_rank_counts(num_layers, pp, first, last)
    counts = []
    for stage in range(stages):
        rank = placement.rank_of(stage)
        if per_rank[rank] % vpp:
            raise ValueError(f"pipeline rank {rank} holds {per_rank[rank]} layers, which do not split evenly over "
                             f"its {vpp} model chunks")
        counts.append(per_rank[rank] // vpp)
    return tuple(counts)


def _uneven_rank_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Megatron's per-rank split with explicit first/last rank counts."""
    fixed = {0: first} if first is not None else {}
    if last is not None:
        fixed[pp - 1] = last
    rest, others = num_layers - sum(fixed.values()), pp - len(fixed)
    if rest < 0 or (others and rest % others) or (not others and rest):
        raise ValueError(f"after the first/last ranks' layers, {rest} layers remain for {others} middle ranks; "
                         "they must split evenly")
    return [fixed.get(r, rest // others if others else 0) for r in range(pp)]


_REPEAT = re.compile(r"\(([^()]+)\)\*([0-9]{1,18})|([EtmL])\*([0-9]{1,18})", re.ASCII)
MAX_LAYOUT_LENGTH = 1_000_000
"""Most characters a layout may expand to: far past any model's layers and stages, while ``t*99999999999`` or
nested repeats (``((t)*9)*9...``) would otherwise be expanded to gigabytes before a count is compared."""


def parse_layout(text: str) -> list[str]:
    """Megatron's ``--pipeline-model-parallel-layout``: stages in model order separated by ``|``, each a run
    of ``E`` (embedding), ``t`` (transformer layer), ``m`` (multi-token prediction), ``L`` (loss), with
    ``(...)*N`` (a group of at least one character, as megatron-core's) and ``X*N`` repeats (``N`` in ASCII
    digits); spaces and commas are cosmetic (megatron-core's ``PipelineParallelLayerLayout.from_str`` drops
    commas too). A layout that would expand past :data:`MAX_LAYOUT_LENGTH` characters is refused before it is
    expanded.

    >>> parse_layout("Et|(tt|)*2mL")
    ['Et', 'tt', 'tt', 'mL']
    >>> parse_layout("E, t|t*2, L")
    ['Et', 'ttL']
    """
    expanded, previous = text.replace(" ", "").replace(",", ""), None
    while previous != expanded:
        previous, length = expanded, len(expanded)

        def repeat(match: re.Match) -> str:
            nonlocal length
            unit, times = (match[1], match[2]) if match[2] is not None else (match[3], match[4])
            length += len(unit) * int(times) - len(match[0])
            if length > MAX_LAYOUT_LENGTH:
                raise ValueError(f"the layout expands to more than {MAX_LAYOUT_LENGTH:,} stage and layer letters, "
                                 "more than any model has")
            return unit * int(times)

        expanded = _REPEAT.sub(repeat, expanded)
    stages = expanded.split("|")
    if any(set(stage) - set("EtmL") for stage in stages):
        raise ValueError(f"cannot read the layout {text!r}: stages hold only E, t, m and L")
    return stages


def _layout_counts(text: str, num_layers: int, stages: int, mtp_layers: int | None) -> tuple[int, ...]:
    """Transformer layers of each stage of a layout, checked as megatron-core's ``PipelineParallelLayerLayout.
    validate_layer_layout`` checks it (the embedding first and the loss last, once each; as many ``m`` as
    ``mtp_num_layers``, after every transformer layer) and placing MTP where the projection prices it, in the last
    stage (``m`` without ``mtp_num_layers`` was priced as no MTP, ``mtp_num_layers`` without ``m`` as MTP)."""
    parts = parse_layout(text)
    if len(parts) != stages:
        raise ValueError(f"the layout has {len(parts)} stages, pp * vpp = {stages}")
    counts = tuple(p.count("t") for p in parts)
    if sum(counts) != num_layers:
        raise ValueError(f"the layout places {sum(counts)} transformer layers, the model has {num_layers}")
    flat = "".join(parts)
    if not (parts[0].startswith("E") and parts[-1].endswith("L") and flat.count("E") == flat.count("L") == 1):
        raise ValueError("the embedding (E) must open the first stage and the loss (L) close the last, once each")
    if (mtp := flat.count("m")) != (mtp_layers or 0):
        raise ValueError(f"the layout places {mtp} MTP layer(s) (m), mtp_num_layers is {mtp_layers or 0} (Megatron "
                         "requires they match)")
    if mtp and (parts[-1].count("m") != mtp or "t" in flat[flat.find("m"):]):
        raise ValueError("the MTP layers (m) must follow every transformer layer, in the last stage (where the "
                         "projection places them, beside the loss)")
    return counts


@dataclass(frozen=True)
class StageLayout:
    """Layers per stage and the placement of stages on ranks for one (algorithm, pp, vpp)."""

    counts: tuple[int, ...]
    """Layers of each stage, in stage (model) order."""
    placement: Placement

    @classmethod
    def build(cls, num_layers: int, training: TrainingSpec, placement: Placement) -> StageLayout:
        first, last = training.decoder_first_pipeline_num_layers, training.decoder_last_pipeline_num_layers
        if training.pipeline_model_parallel_layout:
            try:
                counts = _layout_counts(training.pipeline_model_parallel_layout, num_layers,
                                        placement.pp * placement.vpp, training.mtp_num_layers)
                return cls(counts, placement)
            except ValueError as exc:
                raise InputError([(training.source, "pipeline_model_parallel_layout",
                                   training.pipeline_model_parallel_layout)], str(exc),
                                 "write one stage per pp * vpp, with every transformer layer once") from None
        try:
            counts = layer_counts(num_layers, placement.pp, placement.vpp, first=first, last=last, placement=placement,
                                  embedding_slot=training.account_for_embedding_in_pipeline_split,
                                  loss_slot=training.account_for_loss_in_pipeline_split)
        except ValueError as exc:
            raise InputError([(training.source, "decoder_first_pipeline_num_layers", first),
                              (training.source, "decoder_last_pipeline_num_layers", last)], str(exc),
                             "choose first/last counts that leave the middle ranks equal shares divisible by vpp") from None
        holds_more = {0: training.account_for_embedding_in_pipeline_split,
                      len(counts) - 1: training.account_for_loss_in_pipeline_split}
        if any(n < 0 or (n == 0 and not holds_more.get(s)) for s, n in enumerate(counts)):
            raise InputError([(training.source, "pipeline_model_parallel_size", placement.pp)],
                             f"stage {counts.index(min(counts))} gets no transformer layer (split {list(counts)})",
                             "lower pp * vpp or change the first/last stage layer counts")
        return cls(counts, placement)

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    @cached_property
    def stage_layers(self) -> tuple[range, ...]:
        """Global layer indices of each stage."""
        starts = [sum(self.counts[:s]) for s in range(self.num_stages)]
        return tuple(range(start, start + n) for start, n in zip(starts, self.counts))

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        return self.placement.stages[rank]

    @property
    def embedding_rank(self) -> int:
        return self.placement.rank_of(0)

    @property
    def head_rank(self) -> int:
        return self.placement.rank_of(self.num_stages - 1)
