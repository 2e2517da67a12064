"""The projection's measured side, the one part that needs torch and megatron-core: real megatron-core
modules built from the specs (``megatron_model``) and the layer benchmark that times them (``layers``).
The projected-vs-measured check of a CPU pipeline run lives with the test harness
(:mod:`primuspipe.testing.megatron.projection_fidelity`)."""
