"""edm2-jax: EDM2 (Karras et al., "Analyzing and Improving the Training Dynamics of
Diffusion Models", CVPR 2024) in JAX/Flax.

Subpackages by role, lowest layer first (each says what it may import): `model`,
`backends`, `data`, `run`, `release`, `sampling`, `objectives`, `nets.py` (reading a
network: its weights, config, encoder and sampler), `evaluation`, `ema`, `configs`,
`training`, `analysis`, `modes`; the entry point `python -m edm2_jax.main` and
`process.py`, which sets up the process (XLA flags, host allocator, CPU devices).
Importing the package changes nothing in the process.
"""
__version__ = "0.1.0"
