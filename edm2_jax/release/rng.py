"""The authors' release's per-seed random draws, in NumPy (no torch at run time).

The release's `generate_images.py` gives every seed its own `torch.Generator` (CPU,
seeded with `seed mod 2^32`) and draws from it, in this order: the initial noise
`randn([C, H, W])` (NCHW), then, for a conditional net, the class `randint(label_dim)`,
then one `randn([C, H, W])` for each sampler step that adds churn noise. Reproducing
those draws lets a converted release network give the release's image for a seed.

What torch's CPU generator does (PyTorch 2.x, `aten/src/ATen/core/DistributionsHelper.h`,
`aten/src/ATen/native/cpu/DistributionTemplates.h`; checked against torch in
tests/test_release_interop.py):

  * the bits: the 32-bit Mersenne Twister mt19937 initialised by `init_genrand(seed)`,
    which is NumPy's legacy `RandomState(seed)`; `randint(0, 2^32, dtype=uint32)` hands
    out its raw 32-bit outputs one by one;
  * a float32 uniform in [0, 1) is `(bits & (2^24 - 1)) / 2^24`, one output each;
  * `randn` of n >= 16 float32 values fills n uniforms, then turns each block of 16
    `u[0..15]` into normals by the Box-Muller transform, `r = sqrt(-2 ln(1 - u[j]))`,
    `theta = 2 pi u[j + 8]`, `z[j] = r cos(theta)`, `z[j + 8] = r sin(theta)` (j < 8);
    when 16 does not divide n, 16 more uniforms are drawn and make the last 16 values
    again (so n + 16 outputs are used);
  * `randint(k)` of one int64 value below 2^32 is `bits mod k`, one output.

torch computes the Box-Muller transform in float32 (vectorised log/sin/cos with AVX2);
here it is float64 rounded to float32, so the values agree to a few float32 ulps of the
radius (measured max 1.4e-6 on 16,384 values), not bit for bit. Fewer than 16 values
take another path in torch (float64 pairs); `randn` refuses them.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

_U24 = 2.0 ** -24


class TorchCPUGenerator:
    """One seed's stream as torch's CPU `torch.Generator().manual_seed(seed % 2**32)`
    draws it (see the module docstring). Methods draw in call order, like torch."""

    def __init__(self, seed: int):
        self._mt = np.random.RandomState(int(seed) % (1 << 32))

    def _bits(self, n: int) -> np.ndarray:
        return self._mt.randint(0, 1 << 32, size=n, dtype=np.uint32)

    def _uniform(self, n: int) -> np.ndarray:
        return (self._bits(n) & 0xFFFFFF).astype(np.float64) * _U24

    def randn(self, shape: Sequence[int]) -> np.ndarray:
        """`torch.randn(shape, generator=g)`: float32 standard normals of `shape`.
        Raises ValueError for fewer than 16 values."""
        n = math.prod(shape)
        if n < 16:
            raise ValueError(f"randn of {n} values: torch draws fewer than 16 normals another "
                             f"way, which is not reproduced here")
        u = self._uniform(n)
        z = np.empty(n, np.float64)
        full = n // 16 * 16
        z[:full] = _box_muller_16(u[:full].reshape(-1, 16)).reshape(-1)
        if full != n:
            z[n - 16:] = _box_muller_16(self._uniform(16).reshape(1, 16)).reshape(-1)
        return z.astype(np.float32).reshape(tuple(shape))

    def randint(self, high: int) -> int:
        """`torch.randint(high, size=[], generator=g)` for `0 < high < 2^32`."""
        if not 0 < high < 1 << 32:
            raise ValueError(f"randint high must be in (0, 2^32), got {high}")
        return int(self._bits(1)[0] % high)


def _box_muller_16(u: np.ndarray) -> np.ndarray:
    """Blocks `[m, 16]` of float32-valued uniforms -> normals: the first 8 of a block give
    the radii, the last 8 the angles (cos into the first half, sin into the second)."""
    u = u.astype(np.float32).astype(np.float64)
    r = np.sqrt(-2.0 * np.log(1.0 - u[:, :8]))
    theta = 2.0 * np.pi * u[:, 8:]
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)], axis=1)


def release_draws(seeds: Sequence[int], shape_hwc: Sequence[int], label_dim: int,
                  churn_steps: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """What the release draws for each seed, in its order, as NHWC arrays:

    Returns `(noise [B, H, W, C] float32, labels [B] int64 or None (label_dim 0),
    churn [churn_steps, B, H, W, C] float32 or None)`: the initial noise, the class,
    and the churn noise of the sampler steps that add noise, in step order.
    """
    h, w, c = (int(x) for x in shape_hwc)
    noise, labels, churn = [], [], []
    for seed in seeds:
        g = TorchCPUGenerator(int(seed))
        noise.append(g.randn((c, h, w)).transpose(1, 2, 0))
        if label_dim > 0:
            labels.append(g.randint(label_dim))
        churn.append([g.randn((c, h, w)).transpose(1, 2, 0) for _ in range(churn_steps)])
    return (np.stack(noise),
            np.asarray(labels, np.int64) if label_dim > 0 else None,
            np.stack(churn, axis=1) if churn_steps else None)
