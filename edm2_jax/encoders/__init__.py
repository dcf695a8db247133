"""Encoders: the pretrained networks the paper borrows, ported from PyTorch, and the
reader of their weight files.

    vae.py            Stability's SD VAE (`sd-vae-ft-mse`) in Flax and the release's
                      latent conventions: the space of the ImageNet-512 models (Sec. 5)
    torch_weights.py  PyTorch weight files (`.safetensors`, `torch.save` and TorchScript
                      archives) read as NumPy without running them; also used by the
                      feature networks of `edm2_jax.evaluation` (Inception-v3, DINOv2)

The user's weight files are read, never downloaded. Nothing here is the paper's math
(`edm2_jax.model`) or asks which machine it runs on.

The data sources, the sampler, the metrics and the training loop import it.
"""
