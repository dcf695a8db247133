"""edm2-jax: EDM2 (Karras et al., "Analyzing and Improving the Training Dynamics of
Diffusion Models", CVPR 2024) in JAX/Flax."""
__version__ = "0.1.0"
