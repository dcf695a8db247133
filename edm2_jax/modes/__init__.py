"""Command-line modes of `python -m edm2_jax.main` (the table of modes is `main.MODES`):
each module defines the absl flags of its modes beside a `run_*()` that reads them and
calls the library; `common.py` holds `--config`, `--workdir`, `--plugins`, the errors a
user can act on and flag parsing.
"""
