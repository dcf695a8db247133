"""Named presets (`sampling/presets.py`, `--preset=NAME --models=DIR`): the table against
facts taken by hand from the release's `generate_images.py` comments and README and from
the guidance-interval authors' `generate_zip.py`; every preset resolved from a folder of
stand-in pickles written under the release's file names (tiny networks, pickled as the
release pickles them: `tests/test_convert.write_release_pickle`), each pickle converted
once, a killed conversion redone, the one-line errors, `--list_presets`, the command
line's settings, and `--mode=generate --preset` end to end.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import PIL.Image
import pytest

from edm2_jax import nets
from edm2_jax.modes import generate as generate_mode
from edm2_jax.release import convert as C
from edm2_jax.run import network_dir
from edm2_jax.sampling import presets
from edm2_jax.sampling.sampler import sample_images
from edm2_jax.sampling.solvers import Heun
from tests.test_cli_errors import assert_one_error, run_cli
from tests.test_convert import write_release_pickle
from tests.test_eval_options import dispatch

ROOT = Path(__file__).resolve().parents[1]
URL = "https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/"

# From the release's generate_images.py comments (preset -> net, guide, guidance, figure).
FROM_THE_RELEASE = {
    "edm2-img512-xs-dino": ("edm2-img512-xs-2147483-0.200.pkl", None, 1.0, "fd_dinov2", 103.39),
    "edm2-img64-xl-fid": ("edm2-img64-xl-0671088-0.040.pkl", None, 1.0, "fid", 1.33),
    "edm2-img512-s-guid-dino": ("edm2-img512-s-2147483-0.085.pkl",
                                "edm2-img512-xs-uncond-2147483-0.085.pkl", 1.9, "fd_dinov2", 52.32),
    "edm2-img512-xxl-guid-fid": ("edm2-img512-xxl-0939524-0.015.pkl",
                                 "edm2-img512-xs-uncond-2147483-0.015.pkl", 1.2, "fid", 1.81),
    "edm2-img512-xxl-autog-fid": ("edm2-img512-xxl-0939524-0.075.pkl",
                                  "edm2-img512-m-0268435-0.155.pkl", 2.05, "fid", 1.25),
    "edm2-img512-s-uncond-autog-fid": ("edm2-img512-s-uncond-2147483-0.070.pkl",
                                       "edm2-img512-xs-uncond-0134217-0.110.pkl", 2.85, "fid", 3.86),
    "edm2-img64-s-autog-dino": ("edm2-img64-s-1073741-0.105.pkl",
                                "edm2-img64-xs-0134217-0.175.pkl", 2.2, "fd_dinov2", 31.85),
    # README: "--preset=edm2-img512-xxl-guid-dino is equivalent to --net=... --gnet=... --guidance=1.7"
    "edm2-img512-xxl-guid-dino": ("edm2-img512-xxl-0939524-0.015.pkl",
                                  "edm2-img512-xs-uncond-2147483-0.015.pkl", 1.7, "fd_dinov2", 33.09),
}
FILE_NAME = re.compile(r"edm2-(img512|img64)-(xs|s|m|l|xl|xxl)(-uncond)?-(\d{7})-(0\.\d{3})\.pkl")


def test_table_holds_the_releases_presets():
    release = {n: p for n, p in presets.PRESETS.items() if p.guidance_interval is None}
    assert len(release) == 36 and len(presets.PRESETS) == 38
    for name, (net, guide, w, metric, figure) in FROM_THE_RELEASE.items():
        p = presets.PRESETS[name]
        assert (p.net, p.guide, p.guidance, p.metric, p.reported) == (net, guide, w, metric, figure)
    for name, p in release.items():
        data, size = name.split("-")[1:3]
        assert name.endswith("-fid") == (p.metric == "fid") and p.metric in ("fid", "fd_dinov2")
        assert (p.data, p.latent, p.ref) == (data, data == "img512", f"{data}.pkl")
        net = FILE_NAME.fullmatch(p.net)
        assert net and net.group(1) == data and net.group(2) == size, p.net
        assert bool(net.group(3)) == ("-uncond-" in name), name
        if p.guide is None:
            assert p.guidance == 1.0 and "-guid-" not in name and "-autog-" not in name
            continue
        guide = FILE_NAME.fullmatch(p.guide)
        assert guide and guide.group(1) == data and p.guidance > 1, p.guide
        if "-guid-" in name:  # CFG: the unconditional XS net of the same EMA length
            assert (guide.group(2), guide.group(3), guide.group(5)) == ("xs", "-uncond", net.group(5))
        else:                 # autoguidance: a smaller net, trained for fewer images
            assert "-autog-" in name and int(guide.group(4)) < int(net.group(4))
            assert bool(guide.group(3)) == bool(net.group(3))


def _edm_t(i, n=32, sigma_min=0.002, sigma_max=80.0, rho=7.0):
    """EDM (Karras et al. 2022) Eq. 5, in float64."""
    return (sigma_max ** (1 / rho) + i / (n - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


@pytest.mark.parametrize("kind, w, steps, figure", [("fid", 2.0, range(17, 23), 1.40),
                                                    ("dino", 2.9, range(13, 20), None)])
def test_interval_presets_guide_the_authors_steps(kind, w, steps, figure):
    """generate_zip.py of kynkaat/guidance-interval guides steps i (inclusive) [17, 22]
    (FID, G = 2.0) and [13, 19] (FD_DINOv2, G = 2.9) of the default 32-step schedule,
    with the EDM2-XXL net and the XS unconditional guide; the paper: FID 1.40."""
    p = presets.PRESETS[f"edm2-img512-xxl-guid-interval-{kind}"]
    lo, hi = p.guidance_interval
    assert [i for i in range(32) if lo < _edm_t(i) <= hi] == list(steps)
    cfg = presets.PRESETS[f"edm2-img512-xxl-guid-{kind}"]
    assert (p.net, p.guide, p.guidance, p.reported) == (cfg.net, cfg.guide, w, figure)
    assert "edm2-img512-xxl-guid-" + kind in p.note and p.latent
    assert not [n for n in presets.PRESETS if "interval" in n and "-xxl-" not in n]


# --- a folder of stand-in pickles ----------------------------------------------------------

def _state_dict(img_channels: int, label_dim: int, seed: int) -> dict:
    """A tiny EDM2 Precond (widths 32: the stand-in pickle records model_channels=32),
    random weights, as the release's state dict."""
    cfg = dict(img_resolution=8, img_channels=img_channels, label_dim=label_dim,
               model_channels=32, channel_mult=[1], num_blocks=1, attn_resolutions=[],
               logvar_channels=16)
    rng = np.random.default_rng(seed)
    variables: dict = {}
    for path, shape in sorted(C.expected_variable_shapes(cfg).items()):
        node = variables
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = rng.standard_normal(shape).astype(np.float32)
    return C.variables_to_state_dict(variables)


def write_models(folder: Path, files) -> None:
    """Each file as a stand-in pickle: 4 channels for img512 (latents), 3 for img64,
    unconditional for '-uncond-'; distinct weights per (data, conditioning, size)."""
    folder.mkdir(parents=True, exist_ok=True)
    written: dict = {}
    for f in sorted(files):
        data, size, uncond = FILE_NAME.fullmatch(f).group(1, 2, 3)
        kind = (data, bool(uncond), size == "xs")
        if kind not in written:
            sd = _state_dict(4 if data == "img512" else 3, 0 if uncond else 10,
                             zlib.crc32(repr(kind).encode()))
            write_release_pickle(folder / f, sd, label_dim=0 if uncond else 10)
            written[kind] = folder / f
        else:
            shutil.copyfile(written[kind], folder / f)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    write_models(folder, {f for p in presets.PRESETS.values() for f in p.files})
    return folder


@pytest.fixture
def count_conversions(monkeypatch):
    done: list[str] = []

    def counted(src, dest, *a, **kw):
        done.append(os.path.basename(src))
        return C.convert(src, dest, *a, **kw)
    monkeypatch.setattr(presets, "convert", counted)
    return done


def _mtimes(folder: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_every_preset_resolves_converting_each_pickle_once(models, count_conversions):
    files = {f for p in presets.PRESETS.values() for f in p.files}
    for name, p in presets.PRESETS.items():
        r = presets.resolve(name, str(models))
        assert (r.name, r.guidance, r.guidance_interval) == (name, p.guidance, p.guidance_interval)
        for path, f in ((r.net_path, p.net), (r.guide_path, p.guide)):
            if f is None:
                assert path is None
                continue
            assert path == str(models / (f[:-len(".pkl")] + ".edm2jax"))
            cfg, meta = network_dir.read_network_json(path)
            assert meta["source"] == str(models / f)
            assert nets.net_encoder(path) == ("sd-vae" if p.latent else "none")
            assert cfg["label_dim"] == (0 if "-uncond-" in f else 10)
    assert sorted(count_conversions) == sorted(files)       # each pickle once, shared ones too
    before = _mtimes(models)
    for name in presets.PRESETS:                            # again: every cache reused
        presets.resolve(name, str(models))
    assert sorted(count_conversions) == sorted(files) and _mtimes(models) == before
    assert not [p for p in models.iterdir() if p.name.startswith(".")]


def test_a_killed_conversion_is_redone(tmp_path, monkeypatch):
    name = "edm2-img64-s-autog-fid"
    p = presets.PRESETS[name]
    write_models(tmp_path, p.files)
    net_cache = Path(presets.cache_path(str(tmp_path / p.net)))
    guide_cache = Path(presets.cache_path(str(tmp_path / p.guide)))

    # Killed inside `convert`: neither cache exists afterwards, nothing partial stays.
    def killed(src, dest, *a, **kw):
        C.convert(src, dest)
        os.remove(os.path.join(dest, network_dir.NETWORK_JSON))
        raise KeyboardInterrupt
    monkeypatch.setattr(presets, "convert", killed)
    with pytest.raises(KeyboardInterrupt):
        presets.resolve(name, str(tmp_path))
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(p.files)

    # SIGKILLed (no clean-up): a partial directory of a dead process of this host, and a
    # checkpoint without network.json at the cache path (variables only). The partial
    # directory of a live process (the parent of this one) is left alone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    partial = tmp_path / f".{guide_cache.name}.partial-{socket.gethostname()}-{dead.pid}"
    live = tmp_path / f".{guide_cache.name}.partial-{socket.gethostname()}-{os.getppid()}"
    C.convert(str(tmp_path / p.guide), str(partial))
    live.mkdir()
    C.convert(str(tmp_path / p.net), str(net_cache))
    os.remove(net_cache / network_dir.NETWORK_JSON)
    done = []

    def counted(src, dest):
        done.append(os.path.basename(src))
        return C.convert(src, dest)
    monkeypatch.setattr(presets, "convert", counted)
    r = presets.resolve(name, str(tmp_path))
    assert sorted(done) == sorted(p.files) and not partial.exists() and live.exists()
    for path in (r.net_path, r.guide_path):
        cfg, variables, _ = network_dir.load_network(path)   # complete, checksums verified
        assert cfg["img_channels"] == 3
    assert (r.net_path, r.guide_path) == (str(net_cache), str(guide_cache))


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_missing_pickle_is_one_error_line_naming_it(tmp_path):
    p = presets.PRESETS["edm2-img64-s-autog-fid"]
    write_models(tmp_path, [p.net])
    r = run_cli("--mode=generate", f"--preset={p.name}", f"--models={tmp_path}",
                f"--grid={tmp_path / 'g.png'}")
    line = assert_one_error(r, p.guide, f"--models={tmp_path}", URL + p.guide)
    assert p.net not in line.split("download")[1]             # only the missing file to fetch
    assert sorted(x.name for x in tmp_path.iterdir()) == [p.net]   # nothing converted
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        presets.resolve(p.name, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"did you mean edm2-img64-s-fid.*--list_presets"):
        presets.get("edm2-img64-s-fdi")


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_list_presets_prints_every_preset():
    r = subprocess.run([sys.executable, "-m", "edm2_jax.main", "--list_presets"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "importing JAX" not in r.stdout  # the table alone, no training start line
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.startswith("edm2-")}
    assert set(rows) >= set(presets.PRESETS)
    assert rows["edm2-img512-xxl-autog-fid"][1:4] == ["edm2-img512-xxl-0939524-0.075.pkl",
                                                      "edm2-img512-m-0268435-0.155.pkl", "2.05"]
    assert rows["edm2-img512-xxl-guid-interval-fid"][4:] == ["(0.28,", "1.61]", "fid", "1.40"]


def test_command_line_fills_networks_guidance_and_interval(models, tmp_path, monkeypatch):
    name = "edm2-img512-xxl-guid-interval-dino"
    r = presets.resolve(name, str(models))
    common = [f"--preset={name}", f"--models={models}", "--vae=VAE"]
    gen = dispatch(["--mode=generate", *common, f"--grid={tmp_path / 'g.png'}"], monkeypatch)
    assert (gen["net_path"], gen["guide_path"], gen["guidance"]) == (r.net_path, r.guide_path, 2.9)
    assert gen["guidance_interval"] == (0.60, 5.0) and gen["vae_path"] == "VAE"
    (models / "img512.pkl").write_bytes(b"")                  # the release's reference statistics
    ev = dispatch(["--mode=eval", *common, f"--outdir={tmp_path / 'o'}"], monkeypatch)
    assert (ev["preset"], ev["metrics"], ev["ref"]) == (name, "fd_dinov2", str(models / "img512.pkl"))
    assert (ev["net_path"], ev["guide_path"], ev["guidance"]) == (r.net_path, r.guide_path, 2.9)
    assert ev["guidance_interval"] == (0.60, 5.0) and ev["outdir"] == str(tmp_path / "o")
    ev = dispatch(["--mode=eval", "--net=N", "--guide=G", "--guidance=2", "--metrics=cls",
                   "--guidance_interval=0.5,inf"], monkeypatch)
    assert ev["guidance_interval"] == (0.5, float("inf")) and ev["preset"] is None
    ev = dispatch(["--mode=eval", "--net=N", "--metrics=cls"], monkeypatch)
    assert ev["guidance_interval"] is None and ev["outdir"] is None

    for argv, words in (
            ([*common, "--guidance=2"], "drop --guidance"),
            ([*common, "--guidance_interval=0.1,1"], "drop --guidance_interval"),
            ([f"--preset={name}", f"--models={models}"], "pass --vae=PATH"),
            (["--preset=edm2-img64-s-fid", f"--models={models}", "--vae=V"], "drop --vae"),
            (["--net=N", f"--models={models}"], "read only with --preset"),
            (["--preset=edm2-img64-s-fid"], "needs --models=DIR"),
            (["--net=N", "--guide=G", "--guidance_interval=0,1"], "--guidance=W (W != 1)")):
        with pytest.raises(ValueError, match=re.escape(words)):
            dispatch(["--mode=generate", "--grid=g.png", *argv], monkeypatch)
    with pytest.raises(FileNotFoundError, match=r"img64\.pkl.*dataset-refs/img64\.pkl"):
        dispatch(["--mode=eval", "--preset=edm2-img64-s-fid", f"--models={models}"], monkeypatch)


@pytest.mark.parametrize("text, want", [("0.28,1.61", (0.28, 1.61)), (" 0, inf ", (0.0, float("inf"))),
                                        ("none", None), ("", None)])
def test_guidance_interval_flag_parses(text, want):
    assert generate_mode.parse_guidance_interval(text) == want


@pytest.mark.parametrize("text", ["1", "1,2,3", "a,b", "2,1", "1,1", "-1,2", "nan,1"])
def test_guidance_interval_flag_refuses(text):
    with pytest.raises(ValueError, match="guidance_interval=0.28,1.61"):
        generate_mode.parse_guidance_interval(text)


# Slow (~15 s on 2 cores): a preset's network written and sampled through the command line.
@pytest.mark.slow
@pytest.mark.ci
def test_generate_with_a_preset_end_to_end(tmp_path):
    """`--mode=generate --preset=edm2-img64-s-autog-fid` on stand-ins of its two pickles:
    the grid holds exactly the images of `sample_images` with the converted net, the
    converted guide and the preset's guidance 1.7."""
    p = presets.PRESETS["edm2-img64-s-autog-fid"]
    write_models(tmp_path / "models", p.files)
    grid = tmp_path / "grid.png"
    r = run_cli("--mode=generate", f"--preset={p.name}", f"--models={tmp_path / 'models'}",
                "--seeds=3-4", "--steps=3", "--class_idx=1", f"--grid={grid}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Converting" in r.stdout and "guidance 1.7" in r.stdout
    got = np.asarray(PIL.Image.open(grid))
    assert got.shape == (8, 16, 3)                            # 2 images in a 1x2 grid
    net, v, _ = nets.load_net(presets.cache_path(str(tmp_path / "models" / p.net)))
    gnet, gv, _ = nets.load_net(presets.cache_path(str(tmp_path / "models" / p.guide)))
    want = np.asarray(sample_images(net, v, jax.numpy.asarray([3, 4], jax.numpy.uint32), 1,
                                    guide_net=gnet, guide_variables=gv, guidance=1.7,
                                    sampler=Heun(3)))
    np.testing.assert_array_equal(got, np.concatenate(list(want), axis=1))
    plain = np.asarray(sample_images(net, v, [3, 4], 1, sampler=Heun(3)))
    assert np.abs(want.astype(int) - plain).max() > 8         # the guide changes the images
