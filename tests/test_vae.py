"""The SD VAE in Flax and the release's latent conventions: encode and decode
parity with diffusers' `AutoencoderKL` on random weights at two architectures, the weights
readers and their errors, the latent scale/bias against the formula by hand, the
release's latent datasets (zip and folder, `{"labels": null}`, wrong shapes) and their
per-step draw in the batch pipeline, and `--mode=generate` for latent networks.

Oracles: diffusers' PyTorch `AutoencoderKL` built from a config (never downloaded), with
the release's `StabilityVAEEncoder` formulas written out by hand around it
(`_release_encode_pixels`, `_release_decode`); tests needing them skip without torch or
diffusers.
"""
import io
import json
import os
import subprocess
import sys
import zipfile

import jax
import numpy as np
import PIL.Image
import pytest

from edm2_jax import data, nets
from edm2_jax.run import network_dir as checkpoint
from edm2_jax.encoders import vae as V
from edm2_jax.data.pipeline import latent_noise
from edm2_jax.model.networks import init_variables, precond_from_config
from edm2_jax.modes import generate as generate_mode
from edm2_jax.sampling.solvers import Heun
from tests.tolerances import scaled_err

# Two architectures: a small one (2 levels, 1 resnet per level, 8 groups, 2x) and the SD
# VAE's own (128/256/512/512, 2 resnets per level, 32 groups, 8x; `vae.SD_VAE`), on
# 16x16 and 64x64 pixels. QUARTER: the SD layout at a quarter of its widths, for the
# generate test.
ARCHS = {
    "small": (dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8), 16),
    "sd": (dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                norm_num_groups=32), 64),
}
QUARTER = dict(block_out_channels=(32, 64, 128, 128), layers_per_block=2, norm_num_groups=32)
# Raw latents are 8 channels; the release stores them CHW as float32 [8, 64, 64].
R = 4  # latent side of the test datasets


def _diffusers_vae(arch: dict, seed: int = 0):
    """diffusers' AutoencoderKL of `arch` with O(1) random weights everywhere (its init
    leaves the norms at 1/0 and biases at 0, which would hide them from the test)."""
    pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    import torch
    levels = len(arch["block_out_channels"])
    model = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, latent_channels=4, **arch).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            else:
                p.copy_(r / np.sqrt(p[0].numel()))
    return model


def _release_encode_pixels(model, images_uint8):
    """The release's encode_pixels: uint8 / 255 -> latent_dist -> cat(mean, std), NHWC."""
    import torch
    x = torch.from_numpy(images_uint8).permute(0, 3, 1, 2).to(torch.float32) / 255
    with torch.no_grad():
        d = model.encode(x)["latent_dist"]
    return torch.cat([d.mean, d.std], dim=1).permute(0, 2, 3, 1).numpy()


def _release_decode(model, latents, uint8: bool = True):
    """The release's decode: undo scale and bias, decoder, clamp [0, 1], * 255, uint8."""
    import torch
    x = torch.from_numpy(latents).permute(0, 3, 1, 2)
    x = x - torch.from_numpy(V.LATENT_BIAS).reshape(1, -1, 1, 1)
    x = x / torch.from_numpy(V.LATENT_SCALE).reshape(1, -1, 1, 1)
    with torch.no_grad():
        y = model.decode(x)["sample"]
    if uint8:
        y = y.clamp(0, 1).mul(255).to(torch.uint8)
    return y.permute(0, 2, 3, 1).numpy()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def saved(request, tmp_path_factory):
    """(arch name, diffusers model, its save_pretrained folder, input side)."""
    arch, side = ARCHS[request.param]
    model = _diffusers_vae(arch)
    folder = tmp_path_factory.mktemp(request.param) / "vae"
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder, side


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(diffusers model, its save_pretrained folder) of the small architecture."""
    model = _diffusers_vae(ARCHS["small"][0])
    folder = tmp_path_factory.mktemp("small") / "vae"
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


# ---------------------------------------------------------------------------- parity

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_encode_and_decode_match_diffusers(saved):
    """Through the whole path (diffusers folder read without torch, config from the
    shapes and config.json, params, jitted encode/decode), float32 on random O(1)
    weights: raw latents (mean, std) and the decoder's output within 1e-4 of the
    tensor's scale of the release's formulas around diffusers (the acceptance bound;
    measured encode / decode 9.2e-7 / 1.1e-6 small, 2.3e-6 / 5.2e-6 SD); the uint8
    decode differs by at most one level (truncation at a boundary) in under 1% of values
    (measured: none small, 0.008% SD)."""
    name, model, folder, side = saved
    vae = V.load_vae(folder if name == "small" else folder.parent)  # a pipeline's vae/
    assert vae.config == V.SD_VAE or name == "small"
    assert vae.config.block_out_channels == ARCHS[name][0]["block_out_channels"]
    assert vae.config.norm_num_groups == ARCHS[name][0]["norm_num_groups"]
    images = np.random.default_rng(0).integers(0, 256, (2, side, side, 3), dtype=np.uint8)
    raw = vae.encode_pixels(images)
    want = _release_encode_pixels(model, images)
    d = vae.config.downsampling
    assert raw.shape == want.shape == (2, side // d, side // d, 8) and raw.dtype == np.float32
    assert scaled_err(raw, want) <= 1e-4
    assert (raw[..., 4:] > 0).all()  # std

    x = V.encode_latents(raw, np.random.default_rng(1).standard_normal(
        raw.shape[:3] + (4,)).astype(np.float32))
    z = V.unscale_latents(x)
    got = np.asarray(V.AutoencoderKL(vae.config).apply({"params": vae.params}, z,
                                                        method="decode"))
    assert got.shape == (2, side, side, 3)
    assert scaled_err(got, _release_decode(model, x, uint8=False)) <= 1e-4
    pixels, want_u8 = vae.decode(x), _release_decode(model, x)
    assert pixels.dtype == np.uint8 and pixels.shape == want_u8.shape
    diff = np.abs(pixels.astype(int) - want_u8)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert len(np.unique(pixels)) > 50  # not clamped flat


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_decode_batches_give_the_same_images(small):
    """Decoding in chunks (the last one padded) gives each image as decoded alone."""
    _, folder = small
    side = ARCHS["small"][1]
    vae = V.load_vae(folder)
    x = np.random.default_rng(3).normal(size=(3, side // 2, side // 2, 4)).astype(np.float32)
    whole = V.SDVAE(vae.config, vae.params, batch_size=8).decode(x)
    chunked = V.SDVAE(vae.config, vae.params, batch_size=2).decode(x)
    np.testing.assert_array_equal(whole, chunked)
    with pytest.raises(ValueError, match=r"NHWC \[N, H, W, 4\]"):
        vae.decode(x.transpose(0, 3, 1, 2))
    with pytest.raises(ValueError, match="uint8"):
        vae.encode_pixels(np.zeros((1, side, side, 3), np.float32))
    with pytest.raises(ValueError, match="multiples of 2"):
        vae.encode_pixels(np.zeros((1, side + 1, side + 1, 3), np.uint8))


# ---------------------------------------------------------------------------- weights

def test_weights_from_safetensors_bin_and_folders(small, tmp_path):
    """The same params from: the diffusers folder, a pipeline's `vae/` subfolder, the
    `.safetensors` file alone, a `.bin` (torch.save) file, and a file with the 2022
    attention names (query/key/value/proj_attn); without config.json the groups default
    to 32 (no shape shows them)."""
    import torch
    model, folder = small
    ref = V.load_vae(folder)
    leaves = jax.tree.leaves(ref.params)

    def same(vae):
        assert vae.config == ref.config
        for a, b in zip(jax.tree.leaves(vae.params), leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    same(V.load_vae(folder.parent))                                   # pipeline root
    same(V.load_vae(folder / "diffusion_pytorch_model.safetensors"))  # file + config.json
    bin_dir = tmp_path / "bin"
    model.save_pretrained(bin_dir, safe_serialization=False)
    assert V.find_weights(bin_dir)[0].name == "diffusion_pytorch_model.bin"
    same(V.load_vae(bin_dir))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    old = {}
    for k, v in sd.items():
        for new, legacy in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"),
                            ("to_out.0", "proj_attn")):
            k = k.replace(f"attentions.0.{new}.", f"attentions.0.{legacy}.")
        old[k] = v
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    torch.save({k: torch.from_numpy(v) for k, v in old.items()},
               legacy_dir / "diffusion_pytorch_model.bin")
    (legacy_dir / "config.json").write_text((folder / "config.json").read_text())
    same(V.load_vae(legacy_dir))
    safetensors = pytest.importorskip("safetensors.numpy")
    bare = tmp_path / "bare.safetensors"
    safetensors.save_file(sd, str(bare))
    assert V.config_from_state_dict(V.read_state_dict(bare)).norm_num_groups == 32


def test_bad_vae_files_give_one_error_naming_the_file_and_fix(small, tmp_path, monkeypatch):
    model, folder = small
    safetensors = pytest.importorskip("safetensors.numpy")
    with pytest.raises(FileNotFoundError, match="--vae=.*does not exist"):
        V.load_vae(tmp_path / "absent.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no diffusion_pytorch_model.safetensors"):
        V.load_vae(tmp_path / "empty")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    del sd["decoder.up_blocks.1.resnets.0.conv2.bias"]
    sd["encoder.conv_out.bias"] = sd["encoder.conv_out.bias"][:3]
    sd["decoder.extra.weight"] = np.zeros(2, np.float32)
    bad = tmp_path / "bad" / "diffusion_pytorch_model.safetensors"
    bad.parent.mkdir()
    safetensors.save_file(sd, str(bad))
    (bad.parent / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=(
            rf"{bad} does not match an AutoencoderKL.*missing \(1\): "
            r"decoder.up_blocks.1.resnets.0.conv2.bias; wrong shape \(1\): "
            r"encoder.conv_out.bias \(3,\); unexpected \(1\): decoder.extra.weight")):
        V.load_vae(bad.parent)
    ldm = tmp_path / "ldm.safetensors"
    safetensors.save_file({"encoder.down.0.block.0.norm1.weight": np.ones(4, np.float32)},
                          str(ldm))
    with pytest.raises(ValueError, match="original LDM/CompVis layout.*diffusers format"):
        V.load_vae(ldm)
    other = tmp_path / "other.safetensors"
    safetensors.save_file({"pos_embed": np.ones(4, np.float32)}, str(other))
    with pytest.raises(ValueError, match="not an AutoencoderKL"):
        V.load_vae(other)
    wrong_cfg = tmp_path / "wrong_cfg"
    model.save_pretrained(wrong_cfg)
    cfg = json.loads((wrong_cfg / "config.json").read_text())
    (wrong_cfg / "config.json").write_text(json.dumps(dict(cfg, layers_per_block=2)))
    with pytest.raises(ValueError, match="config.json says layers_per_block=2, the weights "
                                         "say 1"):
        V.load_vae(wrong_cfg)
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    (tmp_path / "x.bin").write_bytes(b"\x80\x02")  # a legacy torch file cut after 2 bytes
    with pytest.raises(ValueError, match="x.bin is not a torch zip archive"):
        V.load_vae(tmp_path / "x.bin")
    (tmp_path / "y.bin").write_bytes(b"")  # no weights file at all
    with pytest.raises(ValueError, match="y.bin is not a torch zip archive"):
        V.load_vae(tmp_path / "y.bin")


# ---------------------------------------------------------------------------- conventions

def test_latent_scale_and_bias_by_hand():
    """scale_c = 0.5 / raw_std_c and bias_c = 0 - raw_mean_c * scale_c (release
    defaults), e.g. channel 0: 0.5 / 4.17 = 0.11990408 and -5.81 * 0.11990408 =
    -0.69664269; one draw is `(mean + noise * std) * scale + bias`, and `unscale`
    inverts the scale and bias (float32 round trip within a few ulp)."""
    assert V.LATENT_SCALE.dtype == V.LATENT_BIAS.dtype == np.float32
    np.testing.assert_allclose(V.LATENT_SCALE[0], 0.11990408, rtol=1e-7)
    np.testing.assert_allclose(V.LATENT_BIAS[0], -0.69664269, rtol=1e-7)
    raw_mean, raw_std = np.array([5.81, 3.25, 0.12, -2.15]), np.array([4.17, 4.62, 3.71, 3.28])
    np.testing.assert_allclose(V.LATENT_SCALE, 0.5 / raw_std, rtol=1e-7)
    np.testing.assert_allclose(V.LATENT_BIAS, -raw_mean * 0.5 / raw_std, rtol=1e-6)
    rng = np.random.default_rng(4)
    mean = rng.normal(size=(2, 3, 3, 4)) * 4 + raw_mean
    std = rng.uniform(0.01, 0.5, size=(2, 3, 3, 4))
    noise = rng.normal(size=(2, 3, 3, 4)).astype(np.float32)
    raw = np.concatenate([mean, std], -1).astype(np.float32)
    x = V.encode_latents(raw, noise)
    assert x.dtype == np.float32 and x.shape == (2, 3, 3, 4)
    want = (mean + noise * std - raw_mean) * (0.5 / raw_std)  # float64, by hand
    assert np.abs(x - want).max() <= 1e-5
    np.testing.assert_allclose(V.unscale_latents(x), mean + noise * std, rtol=0, atol=1e-5)
    # The raw mean itself maps to ~0 and one raw std to ~0.5 (the final mean and std).
    np.testing.assert_allclose(V.encode_latents(np.concatenate([raw_mean, 0 * raw_std])
                                                .astype(np.float32), np.zeros(4)), 0, atol=1e-6)


def test_encoder_names_and_what_a_net_is_in():
    assert V.encoder_of({"img_channels": 4}) == "sd-vae"
    assert V.encoder_of({"img_channels": 3}) == "none"
    assert V.encoder_of({"img_channels": 4}, {"encoder": "none"}) == "none"
    assert V.encoder_of({"img_channels": 3}, None, {"encoder": "sd-vae"}) == "sd-vae"
    with pytest.raises(ValueError, match=r"unknown encoder 'vq'.*\['none', 'sd-vae'\]"):
        V.encoder_of({"img_channels": 3}, {"encoder": "vq"})
    import runpy
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    img512 = runpy.run_path(os.path.join(root, "configs", "img512.py"))
    assert img512["get_config"]("xs").data.encoder == "sd-vae"


# ---------------------------------------------------------------------------- datasets

def _write_latent_set(root, arrays, labels, as_zip: bool) -> str:
    """The layout of the release's `dataset_tool.py encode`: `00000/img-mean-std-
    00000000.npy` (np.save of float32 [8, R, R]) and dataset.json, stored uncompressed."""
    names = [f"{i:08d}"[:5] + f"/img-mean-std-{i:08d}.npy" for i in range(len(arrays))]
    meta = {"labels": None if labels is None else [[n, int(c)] for n, c in zip(names, labels)]}
    files = {}
    for n, a in zip(names, arrays):
        buf = io.BytesIO()
        np.save(buf, a)
        files[n] = buf.getvalue()
    files["dataset.json"] = json.dumps(meta).encode()
    if as_zip:
        path = f"{root}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            for n, b in files.items():
                zf.writestr(n, b)
        return path
    for n, b in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, n)), exist_ok=True)
        with open(os.path.join(root, n), "wb") as f:
            f.write(b)
    return str(root)


def _arrays(n: int, seed: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.normal(size=(4, R, R)) * 4,
                            rng.uniform(0.05, 0.5, size=(4, R, R))]).astype(np.float32)
            for _ in range(n)]


@pytest.mark.parametrize("as_zip", [False, True], ids=["folder", "zip"])
def test_latent_dataset_reads_the_release_layout(tmp_path, as_zip):
    """Raw latents come back channels-last in sorted order with their labels; the source
    describes a 4-channel R x R net input (`data.encoder='sd-vae'`)."""
    arrays = _arrays(5)
    path = _write_latent_set(tmp_path / "lat", arrays, [3, 0, 2, 2, 1], as_zip)
    cfg = dict(source="folder", path=path, encoder="sd-vae", use_labels=True)
    s = data.make_source(cfg)
    assert isinstance(s, data.LatentFolder) and s.encoder == "sd-vae"
    assert (len(s), s.resolution, s.num_channels, s.label_dim) == (5, R, 4, 4)
    assert data.network_kwargs(s) == dict(img_resolution=R, img_channels=4, label_dim=4)
    lat, label = s[2]
    assert lat.dtype == np.float32 and lat.shape == (R, R, 8) and label == 2
    np.testing.assert_array_equal(lat, arrays[2].transpose(1, 2, 0))
    flipped = data.make_source(dict(cfg, xflip=True))  # mirrored copies follow
    assert flipped.encoder == "sd-vae"
    np.testing.assert_array_equal(flipped[7][0], lat[:, ::-1])


def test_unlabelled_latents_and_wrong_shapes(tmp_path):
    """`{"labels": null}` (what the release writes without labels) is an unlabelled set:
    use_labels=False reads it, use_labels=True says so. A wrong-shaped array fails at
    opening, naming the file and the expected shape; a [1, 8, R, R] array is accepted
    (leading unit axes dropped, as the release's reader)."""
    arrays = _arrays(3)
    arrays[1] = arrays[1][None]
    path = _write_latent_set(tmp_path / "nolab", arrays, None, as_zip=True)
    s = data.LatentFolder(path, use_labels=False)
    assert s.label_dim == 0 and s[1][1] == data.NO_LABEL
    np.testing.assert_array_equal(s[1][0], arrays[1][0].transpose(1, 2, 0))
    with pytest.raises(ValueError, match=r'says \{"labels": null\}.*use_labels=False'):
        data.LatentFolder(path, use_labels=True)
    bad = _arrays(3)
    bad[2] = bad[2][:4]
    path = _write_latent_set(tmp_path / "bad", bad, None, as_zip=False)
    with pytest.raises(ValueError, match=(
            r"latent .*00000/img-mean-std-00000002.npy is float32 \(4, 4, 4\), expected "
            r"float32 \(8, 4, 4\) \(CHW: mean and std")):
        data.LatentFolder(path, use_labels=False)
    hwc = [a.transpose(1, 2, 0).copy() for a in _arrays(2)]
    path = _write_latent_set(tmp_path / "hwc", hwc, None, as_zip=True)
    with pytest.raises(ValueError, match=r"is float32 \(4, 4, 8\), expected float32 \(8, R, R\)"):
        data.LatentFolder(path, use_labels=False)
    with pytest.raises(ValueError, match=r"are 4x4, but data.resolution=64"):
        data.LatentFolder(_write_latent_set(tmp_path / "ok", _arrays(2), None, True),
                          use_labels=False, resolution=64)


def test_wrong_encoder_for_the_data_names_the_fix(tmp_path):
    lat = _write_latent_set(tmp_path / "lat", _arrays(2), None, as_zip=False)
    with pytest.raises(ValueError, match="holds .npy latents.*data.encoder='sd-vae'"):
        data.make_source(dict(source="folder", path=lat, use_labels=False))
    img = tmp_path / "img"
    img.mkdir()
    PIL.Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(img / "a.png")
    with pytest.raises(ValueError, match="no .npy latents.*holds images.*dataset_tool.py encode"):
        data.make_source(dict(source="folder", path=str(img), encoder="sd-vae",
                              use_labels=False))
    with pytest.raises(ValueError, match="data.source='folder'"):
        data.make_source(dict(source="fashion_mnist", encoder="sd-vae"))
    with pytest.raises(ValueError, match="unknown encoder"):
        data.make_source(dict(source="folder", path=lat, encoder="latent"))


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_pipeline_draws_latents_per_image_per_step(tmp_path):
    """Each batch entry is `encode_latents(raw, N(0,1))` of the image at its stream
    position, with the position's own draw: the same image gets a new draw in the next
    epoch (only the noise term differs), a resumed or threaded stream gets the same
    batches, and the draws are standard normal."""
    arrays = _arrays(5)
    s = data.LatentFolder(_write_latent_set(tmp_path / "lat", arrays, [0, 1, 0, 1, 0], True))
    it = data.make_iterator(s, global_batch=5, seed=7, num_workers=0)
    epochs = [next(it), next(it)]
    for e, batch in enumerate(epochs):
        assert batch["image"].shape == (5, R, R, 4) and batch["image"].dtype == np.float32
        perm = data.epoch_permutation(7, e, 5)
        for j in range(5):
            raw = arrays[perm[j]].transpose(1, 2, 0)
            want = V.encode_latents(raw, latent_noise(7, 5 * e + j, (R, R, 4)))
            np.testing.assert_array_equal(batch["image"][j], want)
            assert batch["label"][j].argmax() == [0, 1, 0, 1, 0][perm[j]]
    first = {int(p): j for j, p in enumerate(data.epoch_permutation(7, 0, 5))}
    second = {int(p): j for j, p in enumerate(data.epoch_permutation(7, 1, 5))}
    a, b = epochs[0]["image"][first[3]], epochs[1]["image"][second[3]]
    std_scaled = arrays[3][4:].transpose(1, 2, 0) * V.LATENT_SCALE
    noise_a = (a - V.encode_latents(arrays[3].transpose(1, 2, 0), 0)) / std_scaled
    noise_b = (b - V.encode_latents(arrays[3].transpose(1, 2, 0), 0)) / std_scaled
    np.testing.assert_allclose(noise_a, latent_noise(7, first[3], (R, R, 4)), atol=1e-4)
    np.testing.assert_allclose(noise_b, latent_noise(7, 5 + second[3], (R, R, 4)), atol=1e-4)
    assert np.abs(noise_a - noise_b).max() > 0.5
    resumed = next(data.make_iterator(s, global_batch=5, seed=7, start_nimg=5, num_workers=2))
    np.testing.assert_array_equal(resumed["image"], epochs[1]["image"])
    draws = np.stack([latent_noise(7, k, (8, 8, 4)) for k in range(64)])
    assert abs(draws.mean()) < 0.02 and abs(draws.std() - 1) < 0.02


# ---------------------------------------------------------------------------- generate

NET = dict(img_resolution=8, img_channels=4, label_dim=0, model_channels=8, channel_mult=(1,),
           num_blocks=1, attn_resolutions=())


def _save_net(path, net_config, meta=None) -> str:
    """A network checkpoint of `net_config` with N(0, 1) weights and gains 0.7 (so that
    the network, not only c_skip, shapes the samples); shapes from `jax.eval_shape`, so
    nothing is compiled."""
    net = precond_from_config(net_config)
    shapes = jax.eval_shape(lambda: init_variables(net, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    v = jax.tree.map(lambda a: (rng.standard_normal(a.shape).astype(a.dtype) if a.ndim
                                else np.asarray(0.7, a.dtype)), shapes)
    return checkpoint.save_network(str(path), v, net_config, meta)


def test_generate_needs_vae_for_latent_nets_only(tmp_path):
    """A latent net (4 channels, or metadata / a run's data.encoder saying sd-vae)
    without --vae fails at once naming --vae; a pixel-space net given --vae fails naming
    the problem; a guide of the other space is refused; nothing is generated."""
    latent = _save_net(tmp_path / "latent", NET)
    rgb = _save_net(tmp_path / "rgb", dict(NET, img_channels=3))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"is a latent network.*pass --vae=PATH"):
        generate_mode.main_generate(latent, "0-1", str(out))
    with pytest.raises(ValueError, match=r"--vae=sd.safetensors given, but .* pixel-space "
                                         r"network.*drop --vae"):
        generate_mode.main_generate(rgb, "0-1", str(out), vae_path="sd.safetensors")
    with pytest.raises(ValueError, match="--guide=.* works in encoder 'none' space"):
        nets.check_vae(latent, "sd.safetensors", guide_path=rgb)
    assert not out.exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"network": dict(NET, img_channels=3),
                                                 "data": {"encoder": "sd-vae"}}))
    assert nets.net_encoder(str(run)) == nets.net_encoder(
        str(run / "snapshots" / "8")) == "sd-vae"
    assert nets.net_encoder(_save_net(tmp_path / "meta", NET, {"encoder": "none"})) == "none"


def test_generate_cli_refuses_vae_for_an_rgb_net(tmp_path):
    """`--vae` reaches the check through main.py's flags: one `error:` line, exit 1."""
    rgb = _save_net(tmp_path / "rgb", dict(NET, img_channels=3))
    r = subprocess.run([sys.executable, "-m", "edm2_jax.main", "--mode=generate", f"--net={rgb}",
                        "--vae=sd-vae-ft-mse", f"--outdir={tmp_path / 'out'}"],
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "error: --vae=sd-vae-ft-mse given" in r.stderr and "drop --vae" in r.stderr


# Slow (~10-15 s on 2 cores): a latent network sampled and decoded through the command line.
@pytest.mark.slow
@pytest.mark.ci
def test_generate_decodes_latent_net_samples_to_rgb_pngs(tmp_path):
    """A latent net with `--vae` (SD layout, 8x) writes RGB PNGs 8x the net's side,
    each the VAE's decode of the sampler's latents for its seed (up to one level where
    another batch size moved a value across a truncation boundary)."""
    model = _diffusers_vae(QUARTER)
    model.save_pretrained(tmp_path / "vae")
    latent = _save_net(tmp_path / "latent", NET)
    generate_mode.main_generate(latent, "5-7", str(tmp_path / "out"), vae_path=str(tmp_path / "vae"),
                           sampler=Heun(2), batch_size=2, grid=str(tmp_path / "grid.png"))
    assert sorted(os.listdir(tmp_path / "out")) == ["000005.png", "000006.png", "000007.png"]
    img = np.asarray(PIL.Image.open(tmp_path / "out" / "000006.png"))
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    from edm2_jax.sampling.sampler import sample_images
    net, v, _ = nets.load_net(latent)
    x = np.asarray(sample_images(net, v, np.array([6], np.uint32), sampler=Heun(2), raw=True))
    assert x.shape == (1, 8, 8, 4)
    diff = np.abs(img.astype(int) - V.load_vae(tmp_path / "vae").decode(x)[0])
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01 and img.std() > 5
    assert PIL.Image.open(tmp_path / "grid.png").size == (128, 128)


def test_latent_sample_grid_is_a_channel_mosaic(tmp_path):
    """A latent run's training grid (no VAE at hand) shows each latent's 4 channels as
    a 2x2 grey-scale mosaic: channel 0 top left, 1 top right, 2 bottom left, 3 bottom
    right; training no longer stops at its first snapshot."""
    from edm2_jax.sampling.sampler import save_image_grid
    x = np.zeros((2, 3, 3, 4), np.uint8) + np.array([0, 100, 200, 255], np.uint8)
    save_image_grid(x, str(tmp_path / "g.png"), 1, 2)
    g = np.asarray(PIL.Image.open(tmp_path / "g.png"))
    assert g.shape == (6, 12)
    assert (g[0, 0], g[0, 3], g[3, 0], g[3, 3], g[5, 11]) == (0, 100, 200, 255, 255)
