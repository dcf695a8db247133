"""The model: the paper's math, read next to the paper.

Role: the magnitude-preserving layers (`mp.py`, Appendix B, one banner per equation),
the EDM2 U-Net with EDM preconditioning (`networks.py`, Figure 21), the released
presets (`presets.py`) and the training loss (`loss.py`, Sec. 2). Pure functions and
parameter-holding `linen` modules: no training logic, and no question of which machine
runs them; hardware kernels come in as `mp.Kernels` (`edm2_jax.backends`). The SD VAE
of the latent models is `edm2_jax.encoders`'; the precision policy's audit of a traced
program `edm2_jax.analysis.precision`.
"""
