"""The run around the engine: distributed set-up and agreement, run id and lease, lineage, preemption."""
