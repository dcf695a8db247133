"""The planner of `--mode=plan`: a run's training step and sampler compiled for a TPU
slice on a machine without one (`plan.py`), the slices by Cloud TPU's names
(`tpu_slices.py`), and the train state's size per device and the `mesh.fsdp` that fits
it, before any compile (`fit.py`); docs/scaling.md.
"""
