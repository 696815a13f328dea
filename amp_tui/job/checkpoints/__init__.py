"""A run's checkpoints: saving, restoring mid-run, resuming, and the layout of a sharded model's."""
