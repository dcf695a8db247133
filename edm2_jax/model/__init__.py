"""The model: the paper's math, read next to the paper.

Role: the magnitude-preserving layers (`mp.py`, Appendix B, one banner per equation),
the EDM2 U-Net with EDM preconditioning (`networks.py`, Figure 21), the released
presets (`presets.py`), the training loss (`loss.py`, Sec. 2) and the Stable Diffusion
VAE that maps images to latents (`vae.py`, with the reader of its weights). Pure
functions and parameter-holding `linen` modules: no training logic, and no question of
which machine runs them; hardware kernels come in as `mp.Kernels` (`edm2_jax.backends`).

May import: the standard library, jax, flax, numpy and `edm2_jax.paths`; nothing else
of edm2_jax.
"""
