"""dataset_tool convert / encode: the release's layout, transforms, latents, errors."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest

from edm2_jax.data import dataset_tool as DT
from edm2_jax.data.image_folder import ImageFolder
from edm2_jax.data.latents import LatentFolder
from edm2_jax.encoders import vae as V
from edm2_jax.sampling.solvers import Heun

TINY = V.VAEConfig(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save_tiny_vae(path, config=TINY, seed=0) -> str:
    """A random-weight AutoencoderKL of `config` saved as diffusers' safetensors (torch
    names and layouts), with a config.json for the norm groups."""
    safetensors = pytest.importorskip("safetensors.numpy")
    params = V.AutoencoderKL(config).init(jax.random.PRNGKey(seed),
                                          jnp.zeros((1, 2, 2, 3)))["params"]
    rng = np.random.default_rng(seed)
    sd = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = "/".join(k.key for k in kp)
        a = np.asarray(leaf, np.float32)
        a = a + 0.1 * rng.standard_normal(a.shape).astype(np.float32)  # non-trivial norms/biases
        if key.endswith("kernel"):
            a = a.transpose(3, 2, 0, 1) if a.ndim == 4 else a.T
        sd[V._torch_name(key)] = np.ascontiguousarray(a)
    os.makedirs(path, exist_ok=True)
    safetensors.save_file(sd, os.path.join(path, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"block_out_channels": list(config.block_out_channels),
                   "norm_num_groups": config.norm_num_groups}, f)
    return str(path)


def _img(seed, h=8, w=8):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _source_folder(root, sizes=(8, 8)) -> dict:
    """cats/a.png, cats/b.png, dogs/c.png (+ a .txt to ignore); returns {rel: img}."""
    imgs = {"cats/a.png": _img(1, *sizes), "cats/b.png": _img(2, *sizes),
            "dogs/c.png": _img(3, *sizes)}
    for rel, a in imgs.items():
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        PIL.Image.fromarray(a).save(os.path.join(root, rel))
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("not an image")
    return imgs


def _release_spec_zip(path, imgs_labels) -> None:
    """A data set built by hand to the release's spec: stored zip, uncompressed PNGs at
    00000/img%08d.png, dataset.json {"labels": [[name, label], ...]}."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        labels = []
        for i, (img, label) in enumerate(imgs_labels):
            name = f"00000/img{i:08d}.png"
            b = io.BytesIO()
            PIL.Image.fromarray(img).save(b, format="png", compress_level=0)
            z.writestr(name, b.getvalue())
            labels.append([name, label])
        z.writestr("dataset.json", json.dumps({"labels": labels}))


def test_convert_folder_with_subfolder_labels_matches_the_release_layout(tmp_path):
    imgs = _source_folder(tmp_path / "src")
    n = DT.convert(str(tmp_path / "src"), str(tmp_path / "out.zip"), quiet=True)
    assert n == 3
    with zipfile.ZipFile(tmp_path / "out.zip") as z:
        assert sorted(z.namelist()) == ["00000/img00000000.png", "00000/img00000001.png",
                                        "00000/img00000002.png", "dataset.json"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        meta = json.loads(z.read("dataset.json"))
    assert meta == {"labels": [["00000/img00000000.png", 0], ["00000/img00000001.png", 0],
                               ["00000/img00000002.png", 1]]}
    # our reader, and a file built by hand to the release's spec, agree
    _release_spec_zip(tmp_path / "spec.zip", [(imgs["cats/a.png"], 0), (imgs["cats/b.png"], 0),
                                              (imgs["dogs/c.png"], 1)])
    ours, spec = ImageFolder(str(tmp_path / "out.zip")), ImageFolder(str(tmp_path / "spec.zip"))
    assert ours.fnames == spec.fnames and ours.label_dim == spec.label_dim == 2
    for i in range(3):
        (a, la), (b, lb) = ours[i], spec[i]
        np.testing.assert_array_equal(a, b)
        assert la == lb
    np.testing.assert_array_equal(ours[2][0].reshape(8, 8, 3), imgs["dogs/c.png"])
    # and the other way: the hand-built release file converts to the same (zip source,
    # its dataset.json labels), into a folder
    DT.convert(str(tmp_path / "spec.zip"), str(tmp_path / "again"), quiet=True)
    again = ImageFolder(str(tmp_path / "again"))
    assert [again[i][1] for i in range(3)] == [0, 0, 1]
    np.testing.assert_array_equal(again[1][0], spec[1][0])


def test_unlabelled_is_null_and_resolution_resizes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        PIL.Image.fromarray(_img(i, 10, 10)).save(src / f"{i}.png")
    DT.convert(str(src), str(tmp_path / "o.zip"), resolution="8x8", quiet=True)
    with zipfile.ZipFile(tmp_path / "o.zip") as z:
        assert json.loads(z.read("dataset.json")) == {"labels": None}
    f = ImageFolder(str(tmp_path / "o.zip"), use_labels=False)
    assert f.resolution == 8 and len(f) == 2
    want = np.array(PIL.Image.fromarray(_img(0, 10, 10)).resize((8, 8), PIL.Image.LANCZOS))
    np.testing.assert_array_equal(f[0][0].reshape(8, 8, 3), want)


def test_center_crop_dhariwal_against_the_formula():
    """A 40x18 (WxH) image to 8: halve (18 >= 16) with a box filter to 20x9, bicubic to
    round(20 * 8/9) x 8 = 18x8, then the central 8 columns: 5..12."""
    img = np.random.default_rng(0).integers(0, 256, (18, 40, 3), dtype=np.uint8)
    half = PIL.Image.fromarray(img).resize((20, 9), PIL.Image.Resampling.BOX)
    small = np.array(half.resize((18, 8), PIL.Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(DT.center_crop_dhariwal(img, 8), small[:, 5:13])
    out = DT.make_transform("center-crop-dhariwal", (8, 8))(img)
    assert out.shape == (8, 8, 3)
    with pytest.raises(DT.DatasetToolError, match="square --resolution"):
        DT.make_transform("center-crop-dhariwal", (8, 4))
    with pytest.raises(DT.DatasetToolError, match="needs --resolution"):
        DT.make_transform("center-crop-wide", None)
    wide = DT.make_transform("center-crop-wide", (8, 4))(img)
    assert wide.shape == (8, 8, 3) and not wide[:2].any() and not wide[6:].any()


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(DT.DatasetToolError, match="does not exist"):
        DT.convert(str(tmp_path / "nope"), str(tmp_path / "o.zip"), quiet=True)
    with pytest.raises(DT.DatasetToolError, match="--resolution=12y5"):
        DT.convert(str(tmp_path), str(tmp_path / "o.zip"), resolution="12y5", quiet=True)
    src = tmp_path / "src"
    src.mkdir()
    PIL.Image.fromarray(_img(0, 12, 12)).save(src / "a.png")
    (src / "b.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(DT.DatasetToolError, match=r"cannot read image .*b\.png"):
        DT.convert(str(src), str(tmp_path / "o.zip"), resolution="8x8", quiet=True)
    (src / "b.png").unlink()
    with pytest.raises(DT.DatasetToolError, match="power of two"):
        DT.convert(str(src), str(tmp_path / "o2.zip"), quiet=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(DT.DatasetToolError, match="not empty"):
        DT.convert(str(src), str(full), resolution="8x8", quiet=True)
    r = subprocess.run([sys.executable, "-m", "edm2_jax.data.dataset_tool", "convert",
                        f"--source={tmp_path / 'nope'}", f"--dest={tmp_path / 'o.zip'}"],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 1 and r.stderr.startswith("error: --source=") and "Traceback" not in r.stderr


def test_an_existing_zip_is_refused_and_kept_as_it_was(tmp_path):
    """`convert --dest=existing.zip` is refused like a folder that is not empty: one
    `error:` line naming the file and the fix, the zip byte-identical (its 3 images are
    not replaced by the new source's 1)."""
    _source_folder(tmp_path / "three")
    DT.convert(str(tmp_path / "three"), str(tmp_path / "data.zip"), quiet=True)
    before = (tmp_path / "data.zip").read_bytes()
    one = tmp_path / "one"
    one.mkdir()
    PIL.Image.fromarray(_img(9)).save(one / "a.png")
    with pytest.raises(DT.DatasetToolError, match="exists"):
        DT.convert(str(one), str(tmp_path / "data.zip"), quiet=True)
    r = subprocess.run([sys.executable, "-m", "edm2_jax.data.dataset_tool", "convert",
                        f"--source={one}", f"--dest={tmp_path / 'data.zip'}"],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --dest={tmp_path / 'data.zip'} exists") and \
        "delete" in lines[0], lines[0]
    assert (tmp_path / "data.zip").read_bytes() == before
    assert len(ImageFolder(str(tmp_path / "data.zip"))) == 3
    assert not list(tmp_path.glob("*.unfinished"))


def test_fashion_mnist_source(tmp_path):
    from edm2_jax.data.fashion_mnist import DEFAULT_PATH
    assert os.path.isdir(DEFAULT_PATH), (
        f"{DEFAULT_PATH} missing: apt-get install dataset-fashion-mnist")
    DT.convert("fashion_mnist", str(tmp_path / "fm.zip"), resolution="16x16", max_images=5,
               quiet=True)
    f = ImageFolder(str(tmp_path / "fm.zip"))
    assert len(f) == 5 and f.resolution == 16 and f[0][0].shape[-1] == 3


# Slow (~20 s on 2 cores): the SD VAE encoder compiled and run through the command line.
@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("batch", [2, 8])
def test_encode_writes_release_latents_equal_to_vae_encode(tmp_path, batch):
    """3 labelled 16x16 images -> 3 .npy [8, 8, 8] (the tiny VAE downsamples 2x) that
    LatentFolder reads, equal to vae.encode_pixels of the same pixels; batch 2 (a padded
    last batch) and 8 (one padded batch) give the same values."""
    vae_dir = _save_tiny_vae(tmp_path / "vae")
    _source_folder(tmp_path / "src", sizes=(16, 16))
    DT.convert(str(tmp_path / "src"), str(tmp_path / "img.zip"), quiet=True)
    n = DT.encode(str(tmp_path / "img.zip"), str(tmp_path / "lat.zip"), vae_dir, batch=batch,
                  quiet=True)
    assert n == 3
    with zipfile.ZipFile(tmp_path / "lat.zip") as z:
        names = sorted(z.namelist())
        assert names == ["00000/img-mean-std-00000000.npy", "00000/img-mean-std-00000001.npy",
                         "00000/img-mean-std-00000002.npy", "dataset.json"]
        arr = np.load(io.BytesIO(z.read(names[1])))
        assert json.loads(z.read("dataset.json"))["labels"][2] == [names[2], 1]
    assert arr.shape == (8, 8, 8) and arr.dtype == np.float32
    lat = LatentFolder(str(tmp_path / "lat.zip"))
    assert len(lat) == 3 and lat.label_dim == 2 and [lat[i][1] for i in range(3)] == [0, 0, 1]
    imgs = ImageFolder(str(tmp_path / "img.zip"))
    pixels = np.stack([imgs[i][0].reshape(16, 16, 3) for i in range(3)])
    want = V.load_vae(vae_dir).encode_pixels(pixels)
    got = np.stack([lat[i][0] for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(arr.transpose(1, 2, 0), want[1], rtol=1e-5, atol=1e-6)
    assert np.all(got[..., 4:] > 0)  # std


@pytest.mark.slow
@pytest.mark.ci
def test_encode_unlabelled_and_bad_inputs(tmp_path):
    vae_dir = _save_tiny_vae(tmp_path / "vae")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        PIL.Image.fromarray(_img(i, 16, 16)).save(src / f"{i}.png")
    DT.encode(str(src), str(tmp_path / "lat"), vae_dir, batch=4, quiet=True)
    assert json.loads((tmp_path / "lat" / "dataset.json").read_text()) == {"labels": None}
    assert LatentFolder(str(tmp_path / "lat"), use_labels=False).resolution == 8
    with pytest.raises(FileNotFoundError, match="--vae"):
        DT.encode(str(src), str(tmp_path / "x.zip"), str(tmp_path / "novae"), quiet=True)
    assert not (tmp_path / "x.zip").exists()
    odd = tmp_path / "odd"
    odd.mkdir()
    PIL.Image.fromarray(_img(0, 15, 15)).save(odd / "a.png")
    with pytest.raises(DT.DatasetToolError, match="multiples of 2"):
        DT.encode(str(odd), str(tmp_path / "y.zip"), vae_dir, quiet=True)


# ------------------------------------------------------- decoding before measuring (eval)

def _fake_features(seen):
    """A cheap feature extractor standing in for Inception: per-channel means of uint8
    RGB images; records the shapes and dtypes it was given."""
    def fn(params, images):
        images = np.asarray(images)
        seen.append((images.shape, images.dtype))
        return images.reshape(len(images), -1, images.shape[-1]).mean(1)
    return fn


def _latent_setup(tmp_path, n=8):
    from tests.test_vae import NET, _save_net
    vae_dir = _save_tiny_vae(tmp_path / "vae")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        PIL.Image.fromarray(_img(10 + i, 16, 16)).save(src / f"{i}.png")
    DT.encode(str(src), str(tmp_path / "lat.zip"), vae_dir, batch=n, quiet=True)
    data = dict(source="folder", path=str(tmp_path / "lat.zip"), encoder="sd-vae",
                use_labels=False)
    return vae_dir, _save_net(tmp_path / "net", NET), data


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_eval_decodes_a_latent_net_and_latent_reference_data(tmp_path, monkeypatch,
                                                             standin_inception_weights):
    """--mode=eval of a latent net (8x8x4) with --vae: generated latents and the latent
    reference data both reach the metric as uint8 RGB 16x16 (the tiny VAE's 2x), and the
    metric is finite; without --vae it fails naming --vae before any metric is set up."""
    from edm2_jax.evaluation import commands, images, metrics
    vae_dir, net, data = _latent_setup(tmp_path)
    seen = []
    calls = []
    monkeypatch.setattr(metrics, "feature_extractor",
                        lambda m, d=None: calls.append(m) or (None, _fake_features(seen)))
    with pytest.raises(ValueError, match=r"latent network.*pass --vae=PATH"):
        commands.main_eval(images_dir=None, net_path=net, num_images=8, metrics="fid",
                           ref=None, data_config=data)
    assert calls == []
    res = commands.main_eval(images_dir=None, net_path=net, num_images=8, metrics="fid",
                             ref=None, data_config=data, vae_path=vae_dir, sampler=Heun(2),
                             batch_size=4)
    assert np.isfinite(res["fid8"]) and res["fid8"] >= 0
    assert seen and all(s[1:] == (16, 16, 3) and d == np.uint8 for s, d in seen)
    # the reference side: the VAE's decodes of the stored means
    src = images.DecodedSource(LatentFolder(data["path"], use_labels=False),
                               V.load_vae(vae_dir), chunk=3)
    raw = LatentFolder(data["path"], use_labels=False)[4][0][None]
    want = V.load_vae(vae_dir).decode(V.encode_latents(raw, np.zeros((1, 8, 8, 4), np.float32)))
    np.testing.assert_array_equal(src[4][0], want[0])
    assert len(src) == 8 and src[4][1] == -1


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_training_eval_and_sweep_need_the_vae_for_latent_runs(tmp_path):
    import ml_collections
    from edm2_jax.training.snapshot_outputs import TrainingEval
    from edm2_jax.ema import sweep as sigma_sweep
    from tests.test_vae import NET
    vae_dir = _save_tiny_vae(tmp_path / "vae")
    c = ml_collections.ConfigDict(dict(eval=dict(metrics="fid", vae=""),
                                       data=dict(encoder="sd-vae")))
    with pytest.raises(ValueError, match=r"config.eval.vae=PATH"):
        TrainingEval.vae_of(c)
    c.eval.vae = vae_dir
    assert TrainingEval.vae_of(c).config == TINY
    c.data.encoder = "none"
    with pytest.raises(ValueError, match="drop --config.eval.vae"):
        TrainingEval.vae_of(c)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"network": NET, "data": {"encoder": "sd-vae"}}))
    with pytest.raises(ValueError, match="pass --vae=PATH"):
        sigma_sweep.main_sweep(str(run), [0.05], metrics="fid", num_images=4, ref="x.pkl")


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_training_eval_decodes_a_latent_run(tmp_path, monkeypatch, standin_inception_weights):
    """Evaluation during training (config.eval.*) of a latent run: samples and reference
    latents decoded by config.eval.vae, a finite metric under eval/."""
    from edm2_jax import configs
    from edm2_jax.evaluation import metrics
    from edm2_jax import nets, objectives
    from edm2_jax.training.snapshot_outputs import TrainingEval
    vae_dir, net_path, data = _latent_setup(tmp_path)
    seen = []
    monkeypatch.setattr(metrics, "feature_extractor",
                        lambda m, d=None: (None, _fake_features(seen)))
    c = configs.base_config()
    c.data.update(data)
    c.eval.update(dict(metrics="fid", num_images=4, num_steps=2, batch_size=4, vae=vae_dir))
    ev = TrainingEval(c, objectives.from_config(c), log=False)
    net, variables, _ = nets.load_net(net_path)
    out = ev(net, variables)
    assert np.isfinite(out["eval/fid4"])
    assert seen and all(s[1:] == (16, 16, 3) and d == np.uint8 for s, d in seen)


def test_tfds_source(tmp_path, monkeypatch):
    """tfds:NAME:SPLIT reads `tfds.data_source` (a fake module here) at the images' own
    sizes, grey repeated to RGB, then --transform; without the package, one error naming
    the pip command."""
    import types
    imgs = [np.random.default_rng(i).integers(0, 256, (12 + i, 10, 1), dtype=np.uint8)
            for i in range(3)]
    asked = {}

    def data_source(name, **kw):
        asked.update(kw, name=name)
        return [{"image": im, "label": i % 2} for i, im in enumerate(imgs)]
    monkeypatch.setitem(sys.modules, "tensorflow_datasets",
                        types.SimpleNamespace(data_source=data_source))
    DT.convert("tfds:mnist:test", str(tmp_path / "t.zip"), resolution="8x8",
               transform="center-crop-dhariwal", quiet=True, tfds_dir="/data/tfds")
    assert asked == dict(name="mnist", split="test", data_dir="/data/tfds", download=False)
    f = ImageFolder(str(tmp_path / "t.zip"))
    assert len(f) == 3 and [f[i][1] for i in range(3)] == [0, 1, 0]
    want = DT.center_crop_dhariwal(np.repeat(imgs[2], 3, axis=-1), 8)
    np.testing.assert_array_equal(f[2][0].reshape(8, 8, 3), want)
    with pytest.raises(DT.DatasetToolError, match="tfds:NAME:SPLIT"):
        DT.convert("tfds:", str(tmp_path / "u.zip"), quiet=True)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    with pytest.raises(DT.DatasetToolError, match="pip install tensorflow-datasets"):
        DT.convert("tfds:mnist", str(tmp_path / "v.zip"), quiet=True)


def test_latent_data_without_vae_and_ref_of_latents_are_refused(tmp_path):
    from edm2_jax.evaluation import commands
    vae_dir = _save_tiny_vae(tmp_path / "vae")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        PIL.Image.fromarray(_img(i, 16, 16)).save(src / f"{i}.png")
    DT.encode(str(src), str(tmp_path / "lat.zip"), vae_dir, quiet=True)
    data = dict(source="folder", path=str(tmp_path / "lat.zip"), encoder="sd-vae",
                use_labels=False)
    with pytest.raises(ValueError, match="pass --vae=PATH to decode"):
        commands.main_eval(images_dir=None, net_path=None, num_images=2, metrics="fid",
                           ref=None, data_config=data, data_split_images="train")
    with pytest.raises(ValueError, match="give --images=the PNG data set"):
        commands.main_ref(dest=str(tmp_path / "r.pkl"), images_dir=None, data_config=data,
                          split="train", metrics="fid", batch_size=2)
    with pytest.raises(ValueError, match="drop --vae"):
        commands.main_eval(images_dir=str(src), net_path=None, num_images=2, metrics="fid",
                           ref=None, data_config=None, vae_path=vae_dir)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_decode_writes_the_vae_decodes_as_pngs(tmp_path):
    """decode --mean: each PNG is vae.decode of the stored mean (scaled), labels kept;
    a draw (--seed) differs from the mean and is reproducible."""
    vae_dir = _save_tiny_vae(tmp_path / "vae")
    _source_folder(tmp_path / "src", sizes=(16, 16))
    DT.encode(str(tmp_path / "src"), str(tmp_path / "lat.zip"), vae_dir, batch=2, quiet=True)
    n = DT.decode(str(tmp_path / "lat.zip"), str(tmp_path / "dec.zip"), vae_dir, batch=2,
                  mean=True, quiet=True)
    assert n == 3
    dec = ImageFolder(str(tmp_path / "dec.zip"))
    assert dec.fnames[0] == "00000/img00000000.png" and [dec[i][1] for i in range(3)] == [0, 0, 1]
    raw = np.stack([LatentFolder(str(tmp_path / "lat.zip"))[i][0] for i in range(3)])
    vae = V.load_vae(vae_dir)
    want = vae.decode(V.encode_latents(raw, np.zeros((3, 8, 8, 4), np.float32)))
    got = np.stack([dec[i][0].reshape(16, 16, 3) for i in range(3)])
    assert np.abs(got.astype(int) - want).max() <= 1
    DT.decode(str(tmp_path / "lat.zip"), str(tmp_path / "d1"), vae_dir, seed=3, quiet=True)
    DT.decode(str(tmp_path / "lat.zip"), str(tmp_path / "d2"), vae_dir, seed=3, quiet=True)
    a, b = ImageFolder(str(tmp_path / "d1"))[1][0], ImageFolder(str(tmp_path / "d2"))[1][0]
    np.testing.assert_array_equal(a, b)
    assert (a.reshape(16, 16, 3) != got[1]).any()


def _tool(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edm2_jax.data.dataset_tool", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a refused run (exit 1, no traceback); the progress bar may
    stand beside it."""
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def _grey16(seed, n=8) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(
        0, 65536, (n, n), dtype=np.uint16))


@pytest.mark.parametrize("first_8_bit", [False, True])
@pytest.mark.parametrize("dest", ["out.zip", "out", "out.npy"])
def test_images_of_more_than_8_bits_are_refused_as_training_refuses_them(tmp_path, dest,
                                                                         first_8_bit):
    """A folder of 16-bit grey PNGs ('I;16') given to `convert` was written with its
    pixels clipped to 255 (exit 0); it is refused in one `error:` line naming the file, its
    mode and the fix, as training's reader refuses the folder, and no destination is left
    (also when an 8-bit image came first and was written under the temporary name)."""
    src = tmp_path / "png16"
    src.mkdir()
    if first_8_bit:
        PIL.Image.fromarray(_img(0)).save(src / "a.png")
    for i in range(2):
        _grey16(i).save(src / f"b{i}.png")
    with PIL.Image.open(src / "b0.png") as im:
        assert im.mode == "I;16"
    if not first_8_bit:
        with pytest.raises(ValueError, match=r"b0\.png has PIL mode 'I;16'"):
            ImageFolder(str(src), use_labels=False)  # training's reader
    out = tmp_path / dest
    line = _one_error_line(_tool("convert", f"--source={src}", f"--dest={out}"))
    assert "b0.png" in line and "'I;16'" in line and "8-bit" in line, line
    assert not out.exists() and not list(tmp_path.glob("out*")), list(tmp_path.iterdir())


def test_float_images_are_refused_and_other_8_bit_modes_still_convert(tmp_path):
    """A float ('F') TIFF is refused like 16-bit images; an 8-bit mode training does not
    read ('LA', grey with alpha) is still converted, to its grey repeated as RGB."""
    src = tmp_path / "f"
    src.mkdir()
    PIL.Image.fromarray(np.full((8, 8), 1000.5, np.float32), "F").save(src / "x.tif")
    with pytest.raises(DT.DatasetToolError, match=r"x\.tif has PIL mode 'F'"):
        DT.convert(str(src), str(tmp_path / "f.zip"), quiet=True)
    assert not list(tmp_path.glob("f.zip*"))
    la = tmp_path / "la"
    la.mkdir()
    grey = _img(4)[..., 0]
    PIL.Image.fromarray(np.stack([grey, np.full_like(grey, 7)], -1), "LA").save(la / "a.png")
    DT.convert(str(la), str(tmp_path / "la.zip"), quiet=True)
    img, _ = ImageFolder(str(tmp_path / "la.zip"), use_labels=False)[0]
    np.testing.assert_array_equal(img, np.repeat(grey[..., None], 3, axis=-1))


@pytest.mark.parametrize("command,name", [
    ("convert", "Z" * 300 + ".zip"), ("convert", "Z" * 300), ("convert", "Z" * 300 + ".npy"),
    ("convert", "Z" * 248 + ".zip"),  # 252 bytes: its temporary name, 263, is too long
    ("encode", "Z" * 300 + ".zip"), ("decode", "Z" * 300)])
def test_a_dest_name_longer_than_the_file_system_allows_is_one_line_before_any_work(
        tmp_path, command, name):
    """`--dest` with a name longer than the file system allows (where writing the first
    image would raise `OSError: [Errno 36] File name too long`) is one `error:` line naming
    the length and the limit before any work (the VAE, missing here, is not read), for
    convert, encode and decode, and nothing is left behind."""
    _source_folder(tmp_path / "src")
    vae = [f"--vae={tmp_path / 'no_vae'}"] if command != "convert" else []
    line = _one_error_line(_tool(command, f"--source={tmp_path / 'src'}",
                                 f"--dest={tmp_path / name}", *vae))
    assert "--dest=" in line and "bytes long, more than the 255" in line and \
        "no_vae" not in line, line
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("dest", ["out.zip", "out.npy"])
def test_an_os_error_while_writing_is_one_line_naming_the_path(tmp_path, dest):
    """A `--dest` below a file (its folder cannot be made: an OSError when the first image
    is written, a traceback before) is one `error:` line naming the path, nothing left."""
    _source_folder(tmp_path / "src")
    (tmp_path / "file").write_text("x")
    line = _one_error_line(_tool("convert", f"--source={tmp_path / 'src'}",
                                 f"--dest={tmp_path / 'file' / dest}", "--resolution=8x8"))
    assert str(tmp_path / "file") in line, line
    assert sorted(os.listdir(tmp_path)) == ["file", "src"] and \
        (tmp_path / "file").read_text() == "x"
