"""The projection's measured side, the one part that needs torch and megatron-core: real megatron-core
modules built from the specs (``megatron_model``), the layer benchmark that times them (``layers``), and
the projected-vs-measured check of a CPU pipeline run (``fidelity``)."""
