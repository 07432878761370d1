"""A phase: its schedule, generation, the rollouts on disk, the checks, and the batches."""
