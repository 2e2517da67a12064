"""The forward-backward function that replaces Megatron's: same keyword signature (megatron-core 0.19),
same return value, any primuspipe table.

A call builds (or takes from the cache) the configured algorithm's table for this shape -- tables are
immutable and cached per (algorithm, pp, vpp, microbatches, options) -- checks Megatron's config
against it, runs this rank's row through the backend-neutral
:class:`~primuspipe.runtime.driver.StepDriver` with the
:class:`~primuspipe.backends.megatron.binder.MegatronBinder`, then finishes the step as Megatron's
schedules do (embedding wgrad, ``finalize_model_grads_func`` with ``total_num_tokens`` when
``calculate_per_token_loss``). ``forward_only`` runs the table's forward-only view. With ``auto_replan`` the training calls run what the
:class:`~primuspipe.backends.replanning.InFlightReplanner` picks: the table, probed while measured, then
the algorithm of its layout the simulator ranks first (docs/replanning.md). Tables with a split
backward (``B``/``W``/``FB``) defer weight gradients from ``B`` to ``W``; the step ends with every
deferred gradient applied (else :class:`~primuspipe.errors.WeightGradError`).

Whatever the placement, the call keeps Megatron's contracts: loss dicts and the loss-token count end
on the last pipeline rank (:mod:`~primuspipe.backends.megatron.last_stage`), and the two copies of tied
embeddings get the same summed gradient (:func:`~primuspipe.backends.megatron.v_placement.tied_embedding_grads`
where both are on one rank, as in the V).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Iterator, List, Optional, Union

import contextlib
import logging
import weakref

import torch

from primuspipe import strict
from primuspipe.algorithms import get_algorithm
from primuspipe.algorithms.build import offload_options
from primuspipe.backends.megatron.binder import GradSync, MegatronBinder, StepArgs
from primuspipe.backends.megatron.compat import check_megatron_config
from primuspipe.backends.megatron.config import PrimusPipeConfig
from primuspipe.backends.megatron.last_stage import hand_to_last_rank
from primuspipe.backends.megatron.v_placement import tied_embedding_grads, v_float16_boundaries
from primuspipe.backends.replanning import InFlightReplanner
from primuspipe.errors import ConfigError, ScheduleShapeError
from primuspipe.ir.node import NodeKind
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.offload import offload_activations
from primuspipe.passes.split_probe import split_backward_probe
from primuspipe.passes.validation import validate
from primuspipe.runtime.activation_offload import ActivationOffload, SavedBytes
from primuspipe.runtime.driver import StepDriver, cached_schedule, last_backwards

_log = logging.getLogger(__name__)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _adjusted_shapes(adjusted: Any) -> list:
    """What ``adjust_tensor_shapes_fn`` returned -- ``(receive shapes, send shapes)`` -- as the one transfer shape
    primuspipe runs with, refused in one line unless it is one shape of positive integers, the same both ways
    (anything else was an unpacking error or a TypeError from the receive buffer)."""
    pair = adjusted if isinstance(adjusted, (tuple, list)) and len(adjusted) == 2 else (None, None)
    recv, send = (list(p) if isinstance(p, (tuple, list)) else p for p in pair)
    one = isinstance(recv, list) and len(recv) == 1 and recv == send
    if not (one and isinstance(recv[0], (tuple, list, torch.Size))
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in recv[0])):
        raise ConfigError("adjust_tensor_shapes_fn must return (receive shapes, send shapes) keeping one transfer "
                          f"tensor of one shape per hand-off with primuspipe; got {strict.show(adjusted)}")
    return recv


def _group_kind(collection: Any, name: str) -> str:
    """What ``collection`` holds as its ``name`` group, by type (a collection's own repr asks each group its size)."""
    return type(getattr(collection, name, None)).__name__


def _given_groups(p2p_communicator: Any, pg_collection: Any) -> Any:
    """The pipeline group of the ``p2p_communicator`` and ``pg_collection`` a caller passed, refused in one line
    unless the collection is megatron-core's ``ProcessGroupCollection`` with its ``tp`` and ``cp`` groups and the
    communicator has a ``pp_group`` (Megatron's own schedules: a TypeError or a bare assert; here they were an
    AttributeError from the first use)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not isinstance(pg_collection, ProcessGroupCollection) or not all(
            getattr(pg_collection, group, None) is not None for group in ("tp", "cp")):
        raise ConfigError(f"pg_collection must be megatron.core's ProcessGroupCollection with its tp and cp groups "
                          f"set, got a {type(pg_collection).__name__} of tp={_group_kind(pg_collection, 'tp')} "
                          f"cp={_group_kind(pg_collection, 'cp')}; pass one (ProcessGroupCollection."
                          "use_mpu_process_groups()) or leave p2p_communicator and pg_collection unset")
    pp_group = getattr(p2p_communicator, "pp_group", None)
    if not callable(getattr(pp_group, "size", None)) or not callable(getattr(pp_group, "rank", None)):
        raise ConfigError(f"p2p_communicator must be megatron.core's P2PCommunicator with its pp_group, got "
                          f"{strict.show(p2p_communicator)}; build it on the pipeline group or leave "
                          "p2p_communicator and pg_collection unset")
    return pp_group


class PrimusForwardBackward:
    """Callable with the keyword signature of Megatron's forward-backward functions."""

    def __init__(self, config: PrimusPipeConfig, count_saved_bytes: bool = False):
        self.config = config
        self.count_saved_bytes = count_saved_bytes
        """Count what autograd saves even without offload (:attr:`saved_bytes`): the figures to set
        ``offload_fraction`` and ``pp_max_mem`` from."""
        self.saved_bytes: SavedBytes | None = None
        """The last step's bytes held by autograd on this rank (now, peak, per chunk forward); set when the
        step offloaded or ``count_saved_bytes``."""
        self.driver = StepDriver(watchdog_timeout_s=config.watchdog_timeout_s,
                                 dump_dir=config.dump_dir if config.dump_pp_data else None)
        self._tables: dict[tuple, ScheduleTable] = {}
        """(pp, vpp, microbatches, Megatron's interleaved group) -> the table :meth:`table_for` built."""
        self._printed: set[ScheduleTable] = set()
        """Tables whose grid ``debug_scheduler_table`` has printed (once each)."""
        self._offloads: weakref.WeakKeyDictionary[torch.nn.Module, ActivationOffload] = weakref.WeakKeyDictionary()
        """First model chunk -> the activation offload over its rank's chunks."""
        self._reported: weakref.WeakSet[ActivationOffload] = weakref.WeakSet()
        self.replanner: InFlightReplanner | None = None
        """With ``auto_replan``: picks each training step's table (built at the first training call)."""

    def table_for(self, pp: int, vpp: int | None, num_microbatches: int, megatron_config: Any = None) -> ScheduleTable:
        """The table a call runs for this shape (``vpp=None``: the algorithm's own choice), built once per
        shape. Build the model chunks for its ``placement`` and ``vpp``."""
        group = getattr(megatron_config, "microbatch_group_size_per_vp_stage", None)
        key = (pp, vpp, num_microbatches, group)
        if (table := self._tables.get(key)) is None:
            table = self._tables[key] = self._build_table(pp, vpp, num_microbatches, group)
        return table

    def _build_table(self, pp: int, vpp: int | None, num_microbatches: int, group: int | None) -> ScheduleTable:
        """The configured algorithm's validated table, then the passes the config asks for: the split
        probe (``split_probe``) and the offload pass (``offload``; an algorithm that weighs the pass's copies
        itself, zb-auto, gets the limit instead, as in ``primuspipe simulate --offload``:
        :func:`~primuspipe.algorithms.build.offload_options`)."""
        algorithm = self.config.algorithm_for(vpp or 1)
        configured = algorithm in self.config.algorithms()
        options = self.config.schedule_options(pp, vpp or 1) if configured else {}
        runs = get_algorithm(algorithm).alias_of or algorithm  # Primus's 1f1b-interleaved is interleaved-1f1b
        followed = runs == "interleaved-1f1b" and "microbatch_group_size" not in options and group not in (None, pp)
        if followed:
            options["microbatch_group_size"] = group  # follow Megatron's setting; its default (pp) is ours
        plan = self.config.offload_plan(pp, vpp or 1) if configured else None
        offload_pass = plan is not None
        if plan is not None:  # as primuspipe simulate --offload: zb-auto weighs the pass's copies itself
            options, offload_pass = offload_options(algorithm, options)
            if not offload_pass:
                options.update(cost=plan[0], memory_limit=plan[1])
        try:
            table = cached_schedule(algorithm, pp, vpp, num_microbatches, tuple(sorted(options.items())))
        except ScheduleShapeError as exc:
            if not followed:
                raise
            raise ScheduleShapeError(f"Megatron's microbatch_group_size_per_vp_stage={group}, which {algorithm} "
                                     f"follows unless algorithm_options gives microbatch_group_size: {exc}") from None
        if self.config.split_probe:
            table = add_communication(split_backward_probe(table.compute_only(), min(self.config.split_probe,
                                                                                      num_microbatches)))
            validate(table)
        if offload_pass:
            cost, limit = self.config.offload_plan(pp, table.vpp)
            table = offload_activations(table, cost, memory_limit=limit)
        return table

    def _offload_for(self, models: list[torch.nn.Module], device: torch.device) -> ActivationOffload:
        """This rank's saved-tensor hooks over its chunks: built once per model (the op hooks stay
        registered), a fresh count per step."""
        offload = self._offloads.get(models[0])
        if offload is None:
            offload = self._offloads[models[0]] = ActivationOffload(models, device, self.config.offload_modules)
        offload.begin_step()
        return offload

    def _report_offload(self, offload: ActivationOffload, table: ScheduleTable, rank: int) -> None:
        """Log once what share of the activations OFFLOAD moved; warn when it is less than the share the
        offload pass planned with (``offload_fraction``): the memory limit is then not met."""
        if offload in self._reported or (share := offload.saved.moved_share()) is None:
            return
        self._reported.add(offload)
        plan = self.config.offload_plan(table.pp, table.vpp)
        planned = plan[0].memory.offload_fraction if plan else 1.0
        message = (f"primuspipe offload (rank {rank}): OFFLOAD moves {share:.1%} of what a chunk's forward saves "
                   f"(bytes per chunk forward: {offload.saved.per_forward}); the offload pass planned with "
                   f"{planned:.1%}")
        if share < planned - 0.01:
            _log.warning("%s: pp_max_mem is not met; set offload_fraction: %.2f, or offload more ops", message, share)
        else:
            _log.info(message)

    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator: Union[Iterator, List[Iterator]],
        model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: Optional[int] = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        adjust_tensor_shapes_fn: Optional[Callable] = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: Optional[bool] = False,
    ):
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
        from megatron.core.utils import get_model_config

        models = list(model) if isinstance(model, list) else [model]
        if not models or not all(isinstance(m, torch.nn.Module) for m in models):
            raise ConfigError(f"model must be a torch.nn.Module or a list of them (one per model chunk), got "
                              f"{strict.show(model) if not isinstance(model, list) else strict.show(models)}")
        for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                            ("decoder_seq_length", decoder_seq_length)):
            if value is not None or name != "decoder_seq_length":  # the transfer shape is made of them
                strict.count(value, name, minimum=1)
        iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
        if len(iterators) != len(models):
            raise ConfigError(f"got {len(models)} model chunk(s) but {len(iterators)} data iterator(s); pass one per chunk")
        config = get_model_config(models[0])
        if isinstance(pg_collection, MultiModuleProcessGroupCollection):
            raise ConfigError("multi-module pipelines (MultiModuleProcessGroupCollection) are not supported by primuspipe")
        if (p2p_communicator is None) != (pg_collection is None):
            raise ConfigError("provide both p2p_communicator and pg_collection, or neither (as Megatron requires)")
        if pg_collection is None:
            if not parallel_state.model_parallel_is_initialized():  # else an assert inside parallel_state
                raise ConfigError("Megatron's parallel state is not initialized; call torch.distributed."
                                  "init_process_group and megatron.core.parallel_state.initialize_model_parallel "
                                  "before the forward-backward function, or pass p2p_communicator and pg_collection")
            pg_collection = schedules._build_default_pg_collection()
            pp_group = parallel_state.get_pipeline_model_parallel_group()
        else:
            pp_group = _given_groups(p2p_communicator, pg_collection)
        pp, rank = pp_group.size(), pp_group.rank()

        full = self.table_for(pp, len(models), num_microbatches, config)
        plan = None
        if self.config.auto_replan and not forward_only:
            if self.replanner is None:
                self.replanner = InFlightReplanner(self.config.replan_settings(), pp_group, _device(),
                                                   self.driver.dump_dir)
            plan = self.replanner.plan(full)
            full = plan.table
        if self.config.debug_scheduler_table and rank == 0 and full not in self._printed:
            self._printed.add(full)
            print(f"primuspipe schedule table ({full.algorithm}, pp={pp} vpp={full.vpp} microbatches={num_microbatches}):\n"
                  f"{full.grid()}", flush=True)
        check_megatron_config(config, full, models, rank)
        if full.placement == Placement.vshape(pp) and full.vpp == 2:
            v_float16_boundaries(models, pp, rank)
        table = self.driver.view(full, forward_only)

        shapes = schedules.get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            config=config, tp_group=pg_collection.tp, cp_group=pg_collection.cp)
        if adjust_tensor_shapes_fn is not None:
            shapes = _adjusted_shapes(adjust_tensor_shapes_fn(shapes, shapes))
        (shape,) = shapes

        if getattr(config, "moe_paged_stash", False):
            schedules.paged_stash_reset(enabled=not forward_only, config=config)
        embedding_module = None
        loss_rank = table.placement.rank_of(table.num_stages - 1)  # holds the output layer and the loss
        last_rank = loss_rank == rank
        if config.finalize_model_grads_func is not None and not forward_only:
            embedding_module = schedules.clear_embedding_activation_buffer(config, models, last_rank)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

        args = StepArgs(forward_step_func, iterators, models, num_microbatches, config, pg_collection.cp.size(),
                        forward_only, collect_non_loss_data, first_val_step, interleaved=isinstance(model, list) and len(models) > 1)
        split = any(kind is NodeKind.B for node in table.ranks[rank] for kind, _, _ in node.parts())
        sync = GradSync(args, last_backwards(table, rank),
                        None if forward_only else config.grad_sync_func,
                        None if forward_only else config.param_sync_func, split_backward=split)
        device = _device()
        offloads = any(n.kind.on_host_stream for n in table.ranks[rank])
        offload = self._offload_for(models, device) if offloads or self.count_saved_bytes else None
        binder = MegatronBinder(args, num_stages=table.num_stages, transfer_shape=shape, device=device, sync=sync,
                                offload=offload)

        sync.begin()
        timeline = self.driver.execute(table, rank, binder, pp_group, device=device, forward_only=forward_only,
                                       record=plan is not None and plan.record,
                                       dump_meta=None if plan is None else plan.dump_meta)
        if plan is not None:
            self.replanner.after_step(self.table_for(pp, len(models), num_microbatches, config), timeline)
        binder.wgrad.check_empty()
        if offload is not None:
            self.saved_bytes = offload.saved
            if offloads:
                self._report_offload(offload, full, rank)
        sync.end()
        forward_data = hand_to_last_rank(binder.forward_data_store(), binder.total_num_tokens, src=loss_rank,
                                         rank=rank, group=pp_group, device=device)

        if config.finalize_model_grads_func is not None and not forward_only:
            schedules.finish_embedding_wgrad_compute(config, embedding_module, last_rank, pg_collection.tp)
            ends_on_one_rank = table.placement.rank_of(0) == loss_rank and pp > 1
            with tied_embedding_grads(models) if ends_on_one_rank else contextlib.nullcontext():
                config.finalize_model_grads_func(
                    models, binder.total_num_tokens if config.calculate_per_token_loss else None,
                    pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        if getattr(config, "fine_grained_activation_offloading", False):
            schedules.off_interface.reset()
        if config.timers is not None:
            config.timers("forward-backward").stop()
        if getattr(config, "cuda_graph_impl", None) == "local":
            schedules.create_cudagraphs()
        return forward_data
