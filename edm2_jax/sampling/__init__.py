"""Sampling: the EDM sampler (Heun steps, churn; `sampler.py`), classifier-free guidance,
autoguidance and the guidance interval (`guidance.py`), the release's named presets
(`presets.py`), and the generation of images for a seed range from any
network this project knows (`generate.py`, the body of `--mode=generate`).

May import `paths`, `model`, `backends`, `data`, `run` and `release`; never the metrics,
the EMA, the configs, the training loop or anything above them.
"""
