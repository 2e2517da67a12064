"""primuspipe: pluggable pipeline-parallel schedules for large-model training."""
