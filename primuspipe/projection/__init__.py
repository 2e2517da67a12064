"""Projection: step time, memory and MFU of a model on a cluster, for every pipeline schedule, without a GPU.

Modules, in the order data flows (docs/projection.md has every formula and its source):

* ``model_spec``, ``training_spec``, ``hardware_spec`` -- the three inputs (YAML in Megatron's names),
  ``megatron_args`` -- the same from a Megatron argument list or Primus-style YAML, ``spec_fields`` --
  reading them with one-line errors;
* ``layout`` -- layers per stage; ``parameters`` and ``static_memory`` -- per-rank weights, gradients,
  optimizer state; ``activations`` -- what autograd keeps per layer and component;
* ``compute`` -- FLOPs and bytes per pass (a package, one module per concern), their times, calibration
  factors; ``comm`` -- collectives and the pipeline link; ``measured`` -- calibration from a real run's cost
  file; ``benchmark`` (torch, megatron-core) -- calibration from real layers timed on this host;
* ``stage_costs`` -- per-stage costs for the simulator; ``projection`` -- simulate, rank, search;
  ``report`` -- the table and the JSON; ``framework`` -- the one import point of the rest of primuspipe.
"""
