"""Exponential moving averages of the network weights (EDM2 paper Sec. 3).

    power.py           the power-function EMA (Sec. 3.1, Eq. 123, 127) and the traditional EMA,
                       updated in the train state; sigma_rel <-> gamma; `ema_key`
    posthoc.py         the post-hoc EMA API in one namespace (Sec. 3.2, App. C.3,
                       Algorithm 3), over:
    solver.py            the Algorithm-3 solve and its profile error (NumPy, no I/O)
    inputs.py            which snapshots a directory holds, and their network
    streaming.py         snapshot EMAs read tensor by tensor in bounded memory
    reconstruction.py    `reconstruct`, `--mode=phema`
    outputs.py           the outputs' names and their complete-or-absent writing
    sweep.py             the sigma_rel sweep (a metric per EMA length), `--mode=phema_sweep`

This `__init__` imports nothing, so that `import edm2_jax.ema.power`
does not load the post-hoc modules (`sweep` imports `evaluation`): import the module
you need.
"""
