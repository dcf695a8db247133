"""DINOv2 ViT-L/14 for FD_DINOv2: the release's preprocessing (hand-evaluated and against
torch's `interpolate`), DINOv2's position-embedding resampling, parity with timm's DINOv2
ViT on random weights, the weights readers and their errors, and reference `.pkl` files in
the release's format.

Oracles: torch (`F.interpolate`, the calls the release and the official DINOv2 make) and
timm's `VisionTransformer` (tests skip without them). timm imports torchvision at import
time for layers a ViT never uses; where no torchvision build matches the installed torch
(the CPU torch of CI has no CPU torchvision on PyPI), `_import_timm` serves an inert
stand-in for torchvision to timm's import only (removed right after), so the ViT code
itself is the real timm.
"""
import importlib.abc
import importlib.machinery
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

from edm2_jax.evaluation import commands
from edm2_jax.evaluation import metrics as eval_metrics
from edm2_jax.evaluation import dinov2 as dv
from edm2_jax.evaluation import fid
from edm2_jax.evaluation.stats import FeatureStats
from tests.tolerances import EPS32, reorder_tol, scaled_err

# Hand-evaluated Keys cubic (a = -0.5) at the tap distances of an exact 2x shrink
# (filter stretched by 2): k(0.25), k(0.75), k(1.25), k(1.75), e.g.
# k(0.25) = 1.5 * 0.25^3 - 2.5 * 0.25^2 + 1 = 0.8671875.
K025, K075, K125, K175 = 0.8671875, 0.2265625, -0.0703125, -0.0234375
TINY = dv.ViTConfig(embed_dim=128, depth=2, num_heads=2, pos_grid=5)  # head width 64


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})


class _Inert(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _Inert("instance", (), {})


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _InertModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _import_timm():
    """timm, or a skip when torch or timm is absent (see the module docstring)."""
    pytest.importorskip("torch")
    try:
        import timm  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "torchvision" and "torchvision" not in str(e):
            pytest.skip(f"timm not installed ({e})")
    except (RuntimeError, OSError, ImportError):  # a torchvision built for another torch
        pass
    if "timm" not in sys.modules or not hasattr(sys.modules["timm"], "create_model"):
        for name in [n for n in sys.modules if n.split(".")[0] in ("torchvision", "timm")]:
            del sys.modules[name]
        finder = _InertFinder()
        sys.meta_path.insert(0, finder)
        try:
            import timm  # noqa: F401
        except ModuleNotFoundError as e:
            pytest.skip(f"timm not installed ({e})")
        finally:  # the stand-in serves timm's import only, never other tests
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
                del sys.modules[name]
    return sys.modules["timm"]


def _timm_vit(config: dv.ViTConfig, img_size: int):
    timm = _import_timm()
    return timm.create_model(
        "vit_large_patch14_dinov2", pretrained=False, img_size=img_size, num_classes=0,
        patch_size=config.patch_size, embed_dim=config.embed_dim, depth=config.depth,
        num_heads=config.num_heads).eval()


def _randomise(model, seed: int) -> None:
    """O(1) random weights everywhere (timm's init makes the layer scales 1e-5, which
    would hide the blocks from the comparison)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
                p.copy_(1 + 0.2 * r)
            elif name.endswith("gamma"):
                p.copy_(0.5 + 0.5 * r.abs())
            elif p.ndim >= 2 and "pos_embed" not in name and "cls_token" not in name:
                p.copy_(r / np.sqrt(p[0].numel()))
            else:
                p.copy_(0.3 * r)


def _official_pos_embed(pos_embed, grid: int, offset: float = 0.1):
    """The official DINOv2 resampling, by torch: bicubic with scale factor
    `(grid + offset) / M` (see `dv.interpolate_pos_embed`)."""
    import torch
    import torch.nn.functional as F
    m, d = int(round((pos_embed.shape[1] - 1) ** 0.5)), pos_embed.shape[2]
    patch = pos_embed[:, 1:].reshape(1, m, m, d).permute(0, 3, 1, 2)
    kw = {"scale_factor": ((grid + offset) / m,) * 2} if offset else {"size": (grid, grid)}
    patch = F.interpolate(patch, mode="bicubic", **kw)
    return torch.cat([pos_embed[:, :1], patch.permute(0, 2, 3, 1).reshape(1, -1, d)], 1)


def _release_preprocess(images_uint8, dtype):
    """The release's DINOv2Detector preprocessing (`resize_mode='torch'`), by torch."""
    import torch
    import torch.nn.functional as F
    x = torch.from_numpy(images_uint8).permute(0, 3, 1, 2).to(dtype)
    x = F.interpolate(x, size=(224, 224), mode="bicubic", antialias=True) / 255
    x = x - torch.tensor([0.485, 0.456, 0.406], dtype=dtype).reshape(1, -1, 1, 1)
    return x / torch.tensor([0.229, 0.224, 0.225], dtype=dtype).reshape(1, -1, 1, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny DINOv2 (timm, pos-embed grid 5) and its `torch.save`d state dict.
    Its tests skip without torch and timm (optional installs, README)."""
    torch = pytest.importorskip("torch")
    model = _timm_vit(TINY, img_size=TINY.pos_grid * TINY.patch_size)
    _randomise(model, seed=0)
    path = tmp_path_factory.mktemp("dinov2") / "tiny_pretrain.pth"
    torch.save(model.state_dict(), path)
    return model, path


# ---------------------------------------------------------------------------- preprocessing

def test_antialias_resize_weights_hand_evaluated_for_2x_shrink():
    """torch's bicubic antialias filter at an exact 2x shrink: an interior output pixel
    `i` (centre 2i + 1) weighs input pixels 2i-3 .. 2i+4 by k(d / 2) / 2, d their
    distance to the centre; the first output pixel loses the taps left of the image and is
    renormalised by their sum 1.8671875; at 224 -> 224 the matrix is the identity."""
    w = dv.antialias_bicubic_matrix(448, 224)
    interior = np.array([K175, K125, K075, K025, K025, K075, K125, K175]) / 2
    np.testing.assert_allclose(w[100, 197:205], interior, rtol=0, atol=1e-15)
    assert np.count_nonzero(w[100]) == 8
    first = np.array([K025, K025, K075, K125, K175])
    np.testing.assert_allclose(w[0, :5], first / first.sum(), rtol=0, atol=1e-15)
    assert first.sum() == 1.8671875 and np.count_nonzero(w[0]) == 5
    np.testing.assert_array_equal(dv.antialias_bicubic_matrix(224, 224), np.eye(224))


def test_preprocess_hand_example_impulse_and_grayscale():
    """One white pixel at (200, 201) of a black 448x448 image, resized to 224: pixel
    (100, 100) = 255 * (k(0.25)/2) * (k(0.25)/2), (100, 101) = 255 * (k(0.25)/2) *
    (k(0.75)/2); then / 255 and ImageNet mean/std. Float32 arithmetic on values <= 255
    with 8 x 8 taps: error <= a few eps32 of 255 / 255 / 0.225, bound 1e-5."""
    img = np.zeros((1, 448, 448, 3), np.uint8)
    img[0, 200, 201, 0] = 255
    x = np.asarray(dv.preprocess_uint8(img))
    assert x.shape == (1, 224, 224, 3) and x.dtype == np.float32
    want_00 = ((K025 / 2) * (K025 / 2) - 0.485) / 0.229
    want_01 = ((K025 / 2) * (K075 / 2) - 0.485) / 0.229
    assert abs(x[0, 100, 100, 0] - want_00) <= 1e-5
    assert abs(x[0, 100, 101, 0] - want_01) <= 1e-5
    np.testing.assert_allclose(x[..., 1], (0 - 0.456) / 0.224, rtol=0, atol=1e-6)
    gray = np.full((1, 30, 30, 1), 200, np.uint8)
    want = (200 / 255 - np.array(dv.IMAGENET_MEAN)) / dv.IMAGENET_STD
    np.testing.assert_allclose(np.asarray(dv.preprocess_uint8(gray)),  # constant stays so
                               np.broadcast_to(want, (1, 224, 224, 3)), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="uint8"):
        dv.preprocess_uint8(img.astype(np.float32))
    with pytest.raises(ValueError, match="NHWC"):
        dv.preprocess_uint8(img.transpose(0, 3, 1, 2))


@pytest.mark.parametrize("shape", [(2, 64, 64, 3), (1, 512, 512, 3), (1, 100, 150, 3)])
def test_preprocess_matches_release_formula_by_torch(shape):
    """`preprocess_uint8` equals the release's torch preprocessing (upsampling,
    shrinking, non-square). Oracle in float64: our float32 matrix products of <= 2 x 10
    taps per pixel differ by <= reorder_tol(20) of the output scale (measured ~1e-7). The
    release itself runs torch in float32, whose weights carry ~1e-5 absolute error at
    512 px (centres computed in float32); that difference is reported, not asserted."""
    torch = pytest.importorskip("torch")
    images = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    got = np.asarray(dv.preprocess_uint8(images))
    want = _release_preprocess(images, torch.float64).permute(0, 2, 3, 1).numpy()
    assert scaled_err(got, want) <= reorder_tol(20)


def test_pos_embed_resampling_matches_official_torch_call():
    """DINOv2's position-embedding resampling (37x37 -> 16x16 for 224 px input) equals
    torch's bicubic `interpolate` with scale factor 16.1 / 37 (and with size= when the
    offset is 0); the native grid is returned unchanged. Oracle in float64; ours sums
    16 taps in float32: bound reorder_tol(16) of the scale."""
    torch = pytest.importorskip("torch")
    pos = np.random.default_rng(2).normal(size=(1, 1 + 37 * 37, 8)).astype(np.float32)
    for offset in (0.1, 0.0):
        got = np.asarray(dv.interpolate_pos_embed(pos, (16, 16), offset))
        want = _official_pos_embed(torch.from_numpy(pos).double(), 16, offset).numpy()
        assert got.shape == (1, 257, 8)
        assert scaled_err(got, want) <= reorder_tol(16)
    assert dv.interpolate_pos_embed(pos, (37, 37)) is pos
    # The offset matters: with it, the resampled grid is not the size= one.
    assert scaled_err(dv.interpolate_pos_embed(pos, (16, 16), 0.1),
                      dv.interpolate_pos_embed(pos, (16, 16), 0.0)) > 1e-3


# ---------------------------------------------------------------------------- network

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_tiny_dinov2_features_match_timm(tiny):
    """Features of uint8 images through the whole path (file read without torch,
    preprocessing, pos-embed resampling, 2 blocks, final norm, class token) equal timm's
    DINOv2 ViT given the release's torch preprocessing and the official pos-embed
    resampling, random O(1) weights: <= 1e-4 of the feature scale (the acceptance bound;
    float32 through 2 blocks, measured 1.2e-6 with the float32 torch preprocessing)."""
    import torch
    model, path = tiny
    net = dv.load_dinov2(path, require_vitl14=False)
    assert net.config == TINY and net.feature_dim == 128
    images = np.random.default_rng(3).integers(0, 256, (3, 40, 40, 3), dtype=np.uint8)
    got = np.asarray(net.features_uint8(images))

    oracle = _timm_vit(TINY, img_size=224)
    sd = dict(model.state_dict())
    sd["pos_embed"] = _official_pos_embed(sd["pos_embed"], 16)
    oracle.load_state_dict(sd)
    with torch.no_grad():
        want = oracle(_release_preprocess(images, torch.float32)).numpy()
    assert got.shape == want.shape == (3, 128) and got.dtype == np.float32
    assert scaled_err(got, want) <= 1e-4
    assert scaled_err(got[:1], want[1:2]) > 0.1  # the images are told apart


@pytest.mark.slow
def test_vitl14_geometry_matches_timm():
    """The release's network, ViT-L/14 (24 blocks, width 1024, 16 heads, 37x37 pos
    grid), on random weights: config inferred from the state dict, features of two
    images within 1e-4 of timm's (float32 through 24 blocks)."""
    torch = pytest.importorskip("torch")
    model = _timm_vit(dv.VITL14, img_size=518)
    _randomise(model, seed=1)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    config = dv.config_from_state_dict(sd)
    assert config == dv.VITL14
    net = dv.DINOv2(config, dv.params_from_state_dict(sd, config))
    images = np.random.default_rng(4).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    got = np.asarray(net.features_uint8(images))
    oracle = _timm_vit(dv.VITL14, img_size=224)
    sd_t = dict(model.state_dict())
    sd_t["pos_embed"] = _official_pos_embed(sd_t["pos_embed"], 16)
    oracle.load_state_dict(sd_t)
    with torch.no_grad():
        want = oracle(_release_preprocess(images, torch.float32)).numpy()
    assert got.shape == (2, 1024)
    assert scaled_err(got, want) <= 1e-4


# ---------------------------------------------------------------------------- weights

def test_weights_readers_agree_with_torch(tiny, tmp_path):
    """The torch-free `.pth` reader returns exactly `torch.load`'s tensors; so do the
    `.safetensors` reader (timm's file layout) and, through torch, a legacy non-zip
    file."""
    import torch
    model, path = tiny
    want = {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}
    got = dv.read_state_dict(path)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    legacy = tmp_path / "legacy.pth"
    torch.save(model.state_dict(), legacy, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(legacy)
    np.testing.assert_array_equal(dv.read_state_dict(legacy)["pos_embed"], want["pos_embed"])
    chunked = tmp_path / "chunked.pth"  # DINOv2's training layout: blocks.<chunk>.<i>.*
    torch.save({k.replace("blocks.1.", "blocks.0.1."): v for k, v in model.state_dict().items()},
               chunked)
    np.testing.assert_array_equal(dv.read_state_dict(chunked)["blocks.1.ls1.gamma"],
                                  want["blocks.1.ls1.gamma"])
    safetensors = pytest.importorskip("safetensors.numpy")
    st = tmp_path / "model.safetensors"
    safetensors.save_file({k: np.ascontiguousarray(v) for k, v in want.items()}, str(st))
    np.testing.assert_array_equal(dv.read_state_dict(st)["blocks.1.mlp.fc2.weight"],
                                  want["blocks.1.mlp.fc2.weight"])


def test_bad_weights_give_errors_naming_the_fix(tiny, tmp_path, monkeypatch):
    import torch
    model, path = tiny
    monkeypatch.delenv(dv.WEIGHTS_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="--dinov2=PATH"):
        dv.load_dinov2(None)
    with pytest.raises(FileNotFoundError, match="dinov2_vitl14_pretrain.pth"):
        dv.load_dinov2(tmp_path / "absent.pth")
    with pytest.raises(ValueError, match="ViT-L/14"):
        dv.load_dinov2(path)  # a real DINOv2 file, but not the one FD_DINOv2 is defined with
    sd = dict(model.state_dict())
    del sd["blocks.1.ls2.gamma"]
    sd["blocks.0.mlp.fc1.bias"] = sd["blocks.0.mlp.fc1.bias"][:10]
    sd["head.weight"] = torch.zeros(3, 3)
    torch.save(sd, tmp_path / "broken.pth")
    with pytest.raises(ValueError, match=r"missing \(1\): blocks.1.ls2.gamma; wrong shape \(1\)"
                                         r": blocks.0.mlp.fc1.bias \(10,\); unexpected \(1\): "
                                         r"head.weight"):
        dv.load_dinov2(tmp_path / "broken.pth", require_vitl14=False)
    torch.save({"embeddings.cls_token": torch.zeros(1)}, tmp_path / "hf.pth")
    with pytest.raises(ValueError, match="transformers' layout"):
        dv.load_dinov2(tmp_path / "hf.pth", require_vitl14=False)
    evil = tmp_path / "evil.pth"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("archive/data.pkl", b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(ValueError, match="os.system"):
        dv.read_state_dict(evil)


# ---------------------------------------------------------------------------- statistics

def _fake_extractor(metric, dinov2=None):
    """A cheap stand-in feature extractor: 4 fixed linear features of the mean colour."""
    proj = np.random.default_rng(len(metric)).normal(size=(3, 4))

    def feature_fn(params, images):
        return np.asarray(images, np.float64).mean(axis=(1, 2))[:, :3] @ proj + params
    return (1.0 if metric == "fid" else 2.0), feature_fn


def test_ref_pkl_in_release_format_round_trip(tmp_path):
    """Statistics of two metrics written as the release's `.pkl` read back with a plain
    `pickle.load` as `{'num_images', 'fid': {'mu', 'sigma'}, 'fd_dinov2': {...}}` (what its
    `calculate_metrics.py` loads) and through `load_ref_stats` / `fid_from_stats`."""
    rng = np.random.default_rng(5)
    a, b = FeatureStats.from_features(rng.normal(size=(9, 4))), \
        FeatureStats.from_features(rng.normal(size=(9, 3)))
    path = tmp_path / "ref.pkl"
    fid.save_ref_stats(path, {"fid": a, "fd_dinov2": b})
    with open(path, "rb") as f:
        raw = pickle.load(f)
    assert raw["num_images"] == 9 and sorted(raw) == ["fd_dinov2", "fid", "num_images"]
    np.testing.assert_array_equal(raw["fd_dinov2"]["sigma"], b.cov())
    np.testing.assert_array_equal(fid.load_ref_stats(path, "fid")[0], a.mean())
    assert fid.fid_from_stats(b, path, "fd_dinov2") == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError, match="different image counts"):
        fid.save_ref_stats(path, {"fid": a, "fd_dinov2": FeatureStats.from_features(
            rng.normal(size=(5, 3)))})
    with pytest.raises(ValueError, match=r"\.pkl instead"):
        fid.save_ref_stats(tmp_path / "ref.npz", {"fid": a, "fd_dinov2": b})


def test_mode_ref_and_eval_wiring_for_fd_dinov2(tmp_path, monkeypatch):
    """`main_ref` reads a folder once and writes both metrics' statistics; `Metrics`
    measures `fd_dinov2{N}` against that file (0 for the same images); a reference file
    without the metric's entry and missing DINOv2 weights fail before any image is made."""
    import PIL.Image
    rng = np.random.default_rng(6)
    folder = tmp_path / "imgs"
    folder.mkdir()
    images = rng.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    for i, im in enumerate(images):
        PIL.Image.fromarray(im).save(folder / f"{i:02d}.png")
    monkeypatch.setattr(eval_metrics, "feature_extractor", _fake_extractor)
    ref = tmp_path / "ref.pkl"
    res = commands.main_ref(dest=str(ref), images_dir=str(folder), data_config=None,
                            split="test", metrics="fid,fd_dinov2", batch_size=4)
    assert res["num_images"] == 6
    params, fn = _fake_extractor("fd_dinov2")
    np.testing.assert_allclose(fid.load_ref_stats(ref, "fd_dinov2")[0],
                               fn(params, images).mean(0), rtol=1e-12)
    suite = eval_metrics.Metrics(["fd_dinov2", "fid"], 6, ref=str(ref))
    out = suite(images)
    assert out["fd_dinov26"] == pytest.approx(0, abs=1e-8) and "fid6" in out
    assert suite(images[::-1].copy() // 2)["fd_dinov26"] > 1
    fid.save_ref_stats(tmp_path / "fid_only.pkl", FeatureStats.from_features(
        rng.normal(size=(4, 4))))
    with pytest.raises(ValueError, match="no 'fd_dinov2' statistics"):
        eval_metrics.Metrics(["fd_dinov2"], 6, ref=str(tmp_path / "fid_only.pkl"))
    monkeypatch.undo()
    monkeypatch.delenv(dv.WEIGHTS_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="--dinov2=PATH"):
        commands.main_eval(images_dir=str(folder), net_path=None, num_images=6,
                           metrics="fd_dinov2", ref=str(ref), data_config=None)


def test_eval_during_training_needs_vitl14_weights_before_any_step(tiny, monkeypatch):
    """`eval.metrics=fd_dinov2` fails when the evaluator is set up (before training),
    naming `eval.dinov2`; a DINOv2 file of another size is refused there too."""
    from edm2_jax import configs, objectives
    from edm2_jax.training.snapshot_outputs import TrainingEval
    monkeypatch.delenv(dv.WEIGHTS_ENV, raising=False)
    cfg = configs.base_config()
    cfg.eval.metrics = "fd_dinov2"
    with pytest.raises(FileNotFoundError, match="eval.dinov2=PATH"):
        TrainingEval(cfg, objectives.from_config(cfg), log=False)
    cfg.eval.dinov2 = str(tiny[1])
    with pytest.raises(ValueError, match="ViT-L/14"):
        TrainingEval(cfg, objectives.from_config(cfg), log=False)
