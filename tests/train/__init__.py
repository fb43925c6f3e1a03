"""toolkit.train: the training loop end to end, a run's lifecycle, the --nproc launcher under faults, GPU training."""
