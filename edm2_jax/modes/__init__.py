"""Command-line modes of `python -m edm2_jax.main`: each module defines the absl flags
of its modes beside a `run_*()` that reads them and calls the library.

    common.py    --config, --workdir; the errors a user can act on; flag parsing
    train.py     --mode=train
    generate.py  --mode=generate (and the sampler's flags eval shares)
    evaluate.py  --mode=eval, --mode=ref
    phema.py     --mode=phema, --mode=phema_sweep
    release.py   --mode=convert, --mode=export (and their orchestration: a release
                 training state into a run, a network into a release pickle)

May import every library layer below it (training, ema, evaluation, sampling, release,
run, ...), never `edm2_jax.main` or `edm2_jax.process`: what the process knows (its
devices) is passed in by the entry point.
"""
