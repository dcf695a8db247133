"""Exponential moving averages of the network weights (EDM2 paper Sec. 3).

Training tracks a few power-function EMAs and saves them as snapshots; post-hoc EMA
(Sec. 3.2, App. C.3, Algorithm 3) gives any other EMA length after training as the
least-squares combination of the snapshots' profiles, applied to their weights. As in
the authors' release (the math in `training/phema.py`, the I/O in
`reconstruct_phema.py`), the math is apart from the I/O:

    power.py           the power-function EMA (Sec. 3.1, Eq. 123, 127) and the traditional EMA,
                       updated in the train state; sigma_rel <-> gamma; `ema_key`
    solver.py          profile inner products, the Algorithm-3 solve and its profile error
                       (float64 NumPy, no I/O)
    inputs.py          which snapshots a directory holds (a training run, or imported release
                       snapshots) and their network; the release's file naming
    streaming.py       snapshot EMAs read tensor by tensor in bounded memory
    reconstruction.py  `reconstruct`, `--mode=phema`
    outputs.py         the outputs' names and their complete-or-absent writing
    sweep.py           the sigma_rel sweep (a metric per EMA length), `--mode=phema_sweep`

Command line (`modes/phema.py`): `python -m edm2_jax.main --mode=phema --workdir=RUN
--sigma_rel=0.05,0.075,0.10 [--at_kimg=...] [--outdir=...] [--per_tensor='emb=0.10']`;
RUN may also be a release run directory (`network-snapshot-<kimg>-<sigma_rel>.pkl`) or
downloaded raw snapshots.

Training imports `ema.power`. This `__init__` imports nothing, so that
`import edm2_jax.ema.power` does not load the post-hoc modules (`sweep` imports
`evaluation`): import the module you need.
"""
