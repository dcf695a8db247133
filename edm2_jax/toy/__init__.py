"""The 2D toy: the paper's ideas on a two-class mixture of thin branches in the plane,
where the exact density and ideal denoiser are known and a run takes minutes on a CPU
(docs/toy_2d.md, colabs/toy_2d.ipynb).

    data.py          the mixture: exact noisy density, ideal denoiser (`tree_mixture`)
    denoiser.py      `ToyDenoiser`, an MP MLP in EDM preconditioning, and its training
    autoguidance.py  CFG against autoguidance and the guidance interval (autoguidance
                     paper Fig. 1): sampling, the metrics, `run`
    plot.py          the figure of `autoguidance.run`
    distill.py       the denoiser distilled into 1-8 step students (multistep consistency)
    dmd.py           few-step generators distilled by distribution matching
    scm.py           a 1 and 2-step student by continuous-time consistency (sCD, sCT)

    python -m edm2_jax.toy.autoguidance --out=toy_out
    python -m edm2_jax.toy.distill --out=toy_distill_out
    python -m edm2_jax.toy.scm --out=toy_scm_out

This `__init__` imports nothing: import the module you need.
"""
