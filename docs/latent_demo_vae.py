"""Write a random-weight SD-layout VAE (a quarter of its widths) for docs/latent_demo.md:
    python docs/latent_demo_vae.py /tmp/ld/vae
"""
# A random-weight VAE of the SD layout at a quarter of its widths (8x downsampling),
# saved as diffusers' safetensors (+ config.json for the norm groups).
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from safetensors.numpy import save_file
from edm2_jax.encoders import vae as V
cfg = V.VAEConfig(block_out_channels=(32, 64, 128, 128), layers_per_block=2, norm_num_groups=32)
params = V.AutoencoderKL(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)))["params"]
sd = {}
for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = "/".join(k.key for k in kp)
    a = np.asarray(leaf, np.float32)
    if key.endswith("kernel"):
        a = a.transpose(3, 2, 0, 1) if a.ndim == 4 else a.T
    sd[V._torch_name(key)] = np.ascontiguousarray(a)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
save_file(sd, os.path.join(out, "diffusion_pytorch_model.safetensors"))
json.dump({"block_out_channels": list(cfg.block_out_channels), "norm_num_groups": 32},
          open(os.path.join(out, "config.json"), "w"))
