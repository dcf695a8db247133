"""Sampling: the samplers (`solvers.py`: the EDM sampler with Heun steps and churn, and
beside it Heun's step and the reference sampler as Algorithms 1-2 write it; the few-step
sampler of a distilled student, `consistency.py`), images from seeds (`sampler.py`;
per-seed randomness, `seeds.py`), classifier-free guidance, autoguidance and the guidance
interval (`guidance.py`), the release's named presets (`presets.py`), and the images of a
seed range from a network (`seed_images.py`; reading the network is `nets.py`'s, the body
of `--mode=generate` `modes/generate.py`'s).
"""
