"""The authors' release (NVlabs/edm2) as a run-time oracle for the interoperability tests.

The release is not part of this repository (CC BY-NC-SA; nothing of it is copied here).
Tests that compare with it import it from a checkout named by `EDM2_RELEASE` (default
`/work/edm2_release`): without torch they skip; without the checkout they fail, naming
the variable (a missing oracle must not pass silently).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

RELEASE_DIR = Path(os.environ.get("EDM2_RELEASE", "/work/edm2_release"))


def release():
    """`(torch, modules)` with the release's modules `networks_edm2`, `phema`,
    `reconstruct_phema`, `dnnlib` importable; skips without torch."""
    torch = pytest.importorskip("torch", reason="the release oracle needs torch (.ci/run installs it)")
    if not (RELEASE_DIR / "training" / "networks_edm2.py").is_file():
        pytest.fail(f"the authors' release is not at {RELEASE_DIR}: clone "
                    f"https://github.com/NVlabs/edm2 there or set EDM2_RELEASE", pytrace=False)
    if str(RELEASE_DIR) not in sys.path:
        sys.path.insert(0, str(RELEASE_DIR))
    import dnnlib
    import reconstruct_phema
    from training import networks_edm2, phema
    return torch, dict(networks_edm2=networks_edm2, phema=phema,
                       reconstruct_phema=reconstruct_phema, dnnlib=dnnlib)


# A release Precond small enough for tests: 8x8, two levels, attention at 4x4 (one head).
TINY_NET = dict(img_resolution=8, img_channels=2, label_dim=3, model_channels=32,
                channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4], logvar_channels=8)


def tiny_release_net(seed: int = 0):
    """A release `Precond(**TINY_NET)` whose every parameter (gains included) is
    standard normal, drawn from `torch.Generator().manual_seed(seed)`; its MPFourier
    buffers are those of `torch.manual_seed(0)`, the same for every `seed` (as in the
    snapshots of one run)."""
    torch, m = release()
    torch.manual_seed(0)
    net = m["networks_edm2"].Precond(**TINY_NET)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net.eval().requires_grad_(False)


def forget_release() -> None:
    """Drop the release's modules and path entry again (other tests check that reading a
    release pickle needs none of the authors' modules, `tests/test_convert.py`)."""
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        if path.startswith(str(RELEASE_DIR) + os.sep) or name.startswith("_imported_module_"):
            del sys.modules[name]
    while str(RELEASE_DIR) in sys.path:
        sys.path.remove(str(RELEASE_DIR))


@pytest.fixture(scope="module", autouse=False)
def release_modules_forgotten():
    """Module fixture: `forget_release()` after the module's tests."""
    yield
    forget_release()
