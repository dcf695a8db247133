"""Post-hoc EMA: any power-function EMA, after training, from saved snapshots
(paper Sec. 3.2 and App. C.3, Algorithm 3; docs/recipe.md §5). This module gathers the
public API of the post-hoc modules of `edm2_jax.ema` in one namespace
(`posthoc.reconstruct`, `posthoc.solve_weights`, ...); it defines nothing itself.

Training saves snapshots of a few power-function EMAs (`sigma_rel` 0.05 and 0.10 every
8Mi in the paper); any other EMA length is the least-squares combination of the
snapshots' profiles, applied to their weights. As in the authors' release (the math in
`training/phema.py`, the I/O in `reconstruct_phema.py`), the math is apart from the I/O:

    solver.py          profile inner products, the Algorithm-3 solve, its profile
                       error (float64 NumPy, no I/O)
    inputs.py          which snapshots a directory holds (a training run, or imported
                       release snapshots) and the network they belong to; the release's
                       file naming
    streaming.py       reading snapshot EMAs tensor by tensor in bounded memory
                       (TensorStore, Orbax as the fallback)
    reconstruction.py  `reconstruct`: solve, stream the snapshots into accumulators,
                       write network checkpoints; `--mode=phema`
    sweep.py           `sweep`: the sigma_rel sweep with its CSV and plot;
                       `--mode=phema_sweep`

Command line (dispatched by main.py):
`python -m edm2_jax.main --mode=phema --workdir=RUN --sigma_rel=0.05,0.075,0.10
[--at_kimg=...] [--outdir=...] [--per_tensor='emb=0.10']`; RUN may also be a release
run directory (`network-snapshot-<kimg>-<sigma_rel>.pkl`) or downloaded raw snapshots.

No module is named after a function it exports, so that `posthoc.reconstruct` and
`posthoc.sweep` are always the functions.
"""
from edm2_jax.ema.inputs import (RELEASE_NAME_RE, SnapshotFile, find_snapshots,
                                   import_release_snapshots, input_network,
                                   parse_release_name, release_kimg_to_nimg)
from edm2_jax.ema.outputs import output_name
from edm2_jax.ema.reconstruction import (PROFILE_ERROR_WARN, main_phema, parse_per_tensor,
                                        reconstruct)
from edm2_jax.ema.solver import profile_error, profile_inner_products, solve_weights
from edm2_jax.ema.sweep import main_sweep, run_data_config, sweep

__all__ = ["RELEASE_NAME_RE", "PROFILE_ERROR_WARN", "SnapshotFile", "find_snapshots",
           "import_release_snapshots", "input_network", "main_phema", "main_sweep",
           "output_name", "parse_per_tensor", "parse_release_name", "profile_error",
           "release_kimg_to_nimg",
           "profile_inner_products", "reconstruct", "run_data_config", "solve_weights",
           "sweep"]
