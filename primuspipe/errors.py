"""The project's exceptions.

Every user mistake (a bad table, an impossible shape, a wrong config, a stuck peer) raises a subclass of
:class:`PrimusPipeError`, so callers can catch the product's own failures apart from bugs. ``assert`` is
kept for internal invariants only.
"""


class PrimusPipeError(Exception):
    """Base class of every error primuspipe raises on purpose."""


class ScheduleShapeError(PrimusPipeError):
    """An algorithm cannot build a schedule of the requested shape (pp, vpp, microbatches)."""


class UnknownAlgorithmError(PrimusPipeError):
    """No algorithm is registered under the requested name."""


class DuplicateAlgorithmError(PrimusPipeError):
    """Two algorithms were registered under one name."""


class AlgorithmOutputError(PrimusPipeError):
    """An algorithm (a plug-in's, typically) returned something other than a compute-only table of the
    requested shape whose nodes name existing chunks and microbatches."""


class TableFormatError(PrimusPipeError):
    """A node text, JSON or CSV document does not describe a schedule table."""


class ValidationError(PrimusPipeError):
    """A schedule table breaks one of the validator's rules.

    ``rule`` names the broken rule (e.g. ``"completeness"``, ``"deadlock"``) and ``nodes`` lists
    ``(rank, index)`` positions of the offending nodes, so tools can mark them.
    """

    def __init__(self, rule: str, message: str, nodes: tuple[tuple[int, int], ...] = ()):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.nodes = tuple(nodes)


class ConfigError(PrimusPipeError):
    """A configuration value (YAML, environment, Megatron flag) is missing, malformed or incompatible."""


class OutputFileError(PrimusPipeError):
    """A result file cannot be written where it was asked for: a directory or a file in the way, a folder
    that does not exist or cannot be written, a full disk."""


class SimulationError(PrimusPipeError):
    """The simulator cannot run a table with the given cost model."""


class WeightGradError(PrimusPipeError):
    """A ``W`` ran without its ``B`` (or twice), a ``B`` ran twice, or a ``B``'s weight gradients were left
    unapplied at the end of a step (both backends split weight gradients, so both raise it)."""


class PipelineHangError(PrimusPipeError):
    """A send or receive did not complete within the watchdog timeout."""


class TableMismatchError(PrimusPipeError):
    """The ranks of one pipeline hold different schedule tables (running them would hang or corrupt)."""
