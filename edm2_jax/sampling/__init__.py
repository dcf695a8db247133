"""Sampling: the EDM sampler (Heun steps, churn; `sampler.py`), classifier-free guidance,
autoguidance and the guidance interval (`guidance.py`), the release's named presets
(`presets.py`), and the generation of images for a seed range from a network
(`generate.py`; reading the network is `nets.py`'s, the body of `--mode=generate`
`modes/generate.py`'s).

May import `paths`, `model`, `backends`, `data`, `run` and `release`; never the metrics,
the EMA, the configs, the training loop or anything above them.
"""
