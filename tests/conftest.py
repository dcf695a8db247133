"""The test process runs under the XLA flags of the entry points (`edm2_jax/process.py`,
`add_default_xla_flags`), set here before any test starts JAX's backend, so that tests
time and compute what `python -m edm2_jax.main` does."""
from edm2_jax import process

process.add_default_xla_flags()
