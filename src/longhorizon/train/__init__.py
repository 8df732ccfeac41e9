"""Training infrastructure: checkpoints, metrics, progress and timing."""
