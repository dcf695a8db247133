"""TPU slices as Cloud TPU names them (`v5p-64`, `v5e-16`, `v4-32`, `v6e-8`): their chips,
their topology as libtpu names it (`v5p:2x4x4`) and the hosts it spans.

The number in a name counts TensorCores for v4 and v5p (two per chip: `v5p-64` is 32
chips) and chips for v5e and v6e (`v5e-16` is 16 chips). Chip figures are Google's
published ones per chip: HBM in GiB and the dense bfloat16 peak in TFLOP/s.

Pure Python: nothing here imports JAX or libtpu (`plan.py` compiles for a slice).
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation.

    Attributes:
      generation: 'v4', 'v5e', 'v5p' or 'v6e' (libtpu's topology prefix too).
      hbm_gib: HBM per chip, GiB.
      peak_tflops: dense bfloat16 peak per chip, TFLOP/s (1e12 flop/s).
      cores_per_count: what one unit of the name's number is, in chips' TensorCores:
        2 where the name counts TensorCores (v4, v5p), 1 where it counts chips.
      dims: 3 for a 3D torus (v4, v5p), 2 for a 2D one (v5e, v6e).
      single_host_chips: the largest slice one host serves (a larger one has 4 chips per
        host).
    """

    generation: str
    hbm_gib: float
    peak_tflops: float
    cores_per_count: int
    dims: int
    single_host_chips: int


CHIPS = {
    "v4": Chip("v4", hbm_gib=32.0, peak_tflops=275.0, cores_per_count=2, dims=3,
               single_host_chips=4),
    "v5e": Chip("v5e", hbm_gib=16.0, peak_tflops=197.0, cores_per_count=1, dims=2,
                single_host_chips=8),
    "v5p": Chip("v5p", hbm_gib=95.0, peak_tflops=459.0, cores_per_count=2, dims=3,
                single_host_chips=4),
    "v6e": Chip("v6e", hbm_gib=32.0, peak_tflops=918.0, cores_per_count=1, dims=2,
                single_host_chips=8),
}
ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e"}
EXAMPLES = "v5p-64, v5e-16, v4-32, v6e-8"


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: `name` as given ('v5p-64'), its `chip`, `chips` count, torus
    `shape` (chips per axis) and `host_shape` (chips per host per axis)."""

    name: str
    chip: Chip
    chips: int
    shape: tuple[int, ...]
    host_shape: tuple[int, ...]

    @property
    def topology(self) -> str:
        """libtpu's topology name, e.g. 'v5p:2x4x4'."""
        return f"{self.chip.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def hosts(self) -> int:
        """Hosts (one JAX process each) the slice spans."""
        per_host = 1
        for n in self.host_shape:
            per_host *= n
        return self.chips // per_host


def torus_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The torus of `chips` chips (a power of two) as Cloud TPU lays it out: 2D slices
    1x1, 2x2, 2x4, 4x4, 4x8, ...; 3D slices 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
    (each step doubles the last of the smallest axes)."""
    shape = [1] * dims if dims == 2 else [2, 2, 1]
    size = 1 if dims == 2 else 4
    while size < chips:
        smallest = min(shape)
        last = max(i for i, n in enumerate(shape) if n == smallest)
        shape[last] *= 2
        size *= 2
    return tuple(shape)


def parse_slice(name: str) -> Slice:
    """The `Slice` of a Cloud TPU accelerator name: 'v5p-64', 'v5e-16' (or
    'v5litepod-16'), 'v4-32', 'v6e-8'. Raises ValueError naming the accepted forms for
    an unknown generation or a count that is no slice of it."""
    m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", str(name).lower())
    generation = ALIASES.get(m.group(1), m.group(1)) if m else None
    if generation not in CHIPS:
        raise ValueError(f"--tpu={name}: not a TPU slice name; give a generation "
                         f"({', '.join(CHIPS)}) and its count, e.g. {EXAMPLES}")
    chip = CHIPS[generation]
    count = int(m.group(2))
    chips, rest = divmod(count, chip.cores_per_count)
    smallest = 4 if chip.dims == 3 else 1
    if rest or chips < smallest or chips & (chips - 1):
        counted = "TensorCores, 2 per chip" if chip.cores_per_count == 2 else "chips"
        raise ValueError(f"--tpu={name}: {generation} slices count {counted}, a power of two "
                         f"of at least {smallest * chip.cores_per_count}, e.g. "
                         f"{generation}-{8 * chip.cores_per_count}")
    shape = torus_shape(chips, chip.dims)
    if chips <= chip.single_host_chips:
        host_shape = shape
    else:
        host_shape = (2, 2) if chip.dims == 2 else (2, 2, 1)
    return Slice(f"{generation}-{count}", chip, chips, shape, host_shape)
