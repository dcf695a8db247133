"""Former name of `edm2_jax.rundir` (the owner of a training run's directory), kept so
that existing imports (`benchmarks/chaos.py`, `benchmarks/phema_memory.py`) keep working.
New code imports `edm2_jax.rundir`."""
from edm2_jax.rundir import (CheckpointSaveError, StatsLogger, TrainCheckpoints,  # noqa: F401
                             list_snapshots, restore_numpy, restore_snapshot)
