"""Post-hoc EMA (paper Sec. 3.2, App. C.3, Algorithm 3).

The solver against the authors' release (`tests/data/edm2_ref/phema.npz`, see
tests/data/README.md) and against numerical integration of the profiles; the paper's
claim on a real (tiny) training run: an EMA that was tracked but never shown to the
solver is reconstructed from the 0.05 / 0.10 snapshots, and more accurately when the
snapshots are more frequent; the streaming reconstruction from Orbax snapshots and from
imported release snapshots equals the plain weighted sum of the snapshots.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from scipy import integrate

from edm2_jax.run import network_dir as checkpoint
from edm2_jax.ema import power as ema
from edm2_jax.ema.inputs import (find_snapshots, import_release_snapshots, parse_release_name,
                                 release_kimg_to_nimg)
from edm2_jax.ema.reconstruction import main_phema, parse_per_tensor, reconstruct
from edm2_jax.ema.solver import profile_error, profile_inner_products, solve_weights
from edm2_jax.ema.sweep import run_data_config, sweep
from edm2_jax.ema import streaming
from tests.testdata import golden
from tests.tolerances import tree_magnitude, weighted_sum_tol

TRACKED = (0.05, 0.075, 0.10)   # tracked during the tiny run
SEEN = (0.05, 0.10)             # what the solver gets; 0.075 is held out
BATCH, STEPS, EVERY = 8, 300, 10


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]).astype(np.float64)


def _profile(t, gamma):
    return lambda tau: (gamma + 1) * tau ** gamma / t ** (gamma + 1) if tau <= t else 0.0


# --------------------------------------------------------------------------------------
# Solver


@pytest.mark.parametrize("t_a,s_a,t_b,s_b", [(1.0, 0.05, 1.0, 0.10), (0.3, 0.10, 1.0, 0.05),
                                             (2.0, 0.05, 0.7, 0.25), (5.0, 0.28, 5.0, 0.28)])
def test_inner_product_is_the_integral_of_the_two_profiles(t_a, s_a, t_b, s_b):
    g_a, g_b = (float(ema.sigma_rel_to_gamma(s)) for s in (s_a, s_b))
    pa, pb = _profile(t_a, g_a), _profile(t_b, g_b)
    want, _ = integrate.quad(lambda tau: pa(tau) * pb(tau), 0, min(t_a, t_b),
                             epsabs=0, epsrel=1e-12, limit=200)
    got = profile_inner_products(t_a, g_a, t_b, g_b)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-9)
    # Symmetric, and vectorised over broadcast inputs.
    np.testing.assert_allclose(profile_inner_products(t_b, g_b, t_a, g_a), got, rtol=1e-13)
    vec = profile_inner_products(np.array([[t_a], [t_b]]), np.array([[g_a], [g_b]]),
                                       np.array([t_a, t_b]), np.array([g_a, g_b]))
    assert vec.shape == (2, 2)
    np.testing.assert_allclose(vec[0, 1], got, rtol=1e-13)


def test_coefficients_match_the_release():
    d = np.load(golden("edm2_ref/phema.npz"))
    gamma = ema.sigma_rel_to_gamma(d["sigma_rel"])
    np.testing.assert_allclose(gamma, d["gamma"], rtol=0, atol=1e-9)
    g = float(ema.sigma_rel_to_gamma(float(d["beta_sigma_rel"])))
    beta = (1 - float(d["beta_dt"]) / d["beta_t_next"]) ** (g + 1)  # Eq. 127 in float64
    np.testing.assert_allclose(beta, d["beta"], rtol=0, atol=1e-9)

    t_final = d["in_nimg"].max()
    X = solve_weights(d["in_nimg"], d["in_sigma_rel"], t_final, d["out_sigma_rel"])
    assert X.shape == d["coefs_final"].shape == (32, 4) and X.dtype == np.float64
    np.testing.assert_allclose(X, d["coefs_final"], rtol=0, atol=1e-9)

    # Mid-training output: only the 16 snapshots at or before 64Mi take part.
    X = solve_weights(d["in_nimg"], d["in_sigma_rel"], d["out_nimg_mid"],
                            d["out_sigma_rel"])
    later = d["in_nimg"] > d["out_nimg_mid"]
    assert np.all(X[later] == 0)
    np.testing.assert_allclose(X[~later], d["coefs_mid"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(X.sum(0), 1, rtol=1e-12)


def test_a_snapshot_profile_is_reconstructed_by_that_snapshot_alone():
    t = np.repeat(np.arange(1, 9) * 1000.0, 2)
    s = np.tile([0.05, 0.10], 8)
    X = solve_weights(t, s, [5000, 8000], [0.10, 0.05])
    want = np.zeros((16, 2))
    want[9, 0] = 1   # (5000, 0.10)
    want[14, 1] = 1  # (8000, 0.05)
    np.testing.assert_allclose(X, want, atol=1e-9)
    np.testing.assert_allclose(profile_error(t, s, [5000, 8000], [0.10, 0.05], X), 0,
                               atol=1e-6)
    # A single 0.05 snapshot cannot be a 0.10 EMA: weight 1, but a large profile error.
    X1 = solve_weights([1000], [0.05], 1000, [0.10])
    assert X1[0, 0] == pytest.approx(1.0)
    assert profile_error([1000], [0.05], 1000, [0.10], X1)[0] > 0.5


def test_solver_errors_name_the_fix():
    with pytest.raises(ValueError, match="at least one snapshot"):
        solve_weights([], [], 1000, 0.1)
    for bad in (0.0, -0.1, 0.31):
        with pytest.raises(ValueError, match=r"sigma_rel must be in \(0, 0\.300"):
            solve_weights([1000, 2000], 0.05, 2000, bad)
        with pytest.raises(ValueError, match="snapshot sigma_rel"):
            solve_weights([1000, 2000], bad, 2000, 0.05)
    with pytest.raises(ValueError, match=r"no snapshot at or before.*at_kimg >= 1"):
        solve_weights([1000, 2000], 0.05, 500, 0.1)
    with pytest.raises(ValueError, match="passed 2 times.*each snapshot once"):
        solve_weights([1000, 1000, 2000], 0.05, 2000, 0.1)
    with pytest.raises(ValueError, match=r"nearly linearly dependent.*closest pair "
                       r"\(kimg 2, sigma_rel 0\.05\) and \(kimg 2, sigma_rel 0\.05\).*differ"):
        # Two EMAs of (almost) the same width: indistinguishable profiles. (Snapshot
        # spacing alone never gets there: the profiles' jump at t makes cond ~ t / dt.)
        solve_weights([1000, 2000, 2000], [0.05, 0.05, 0.05 + 1e-9], 2000, 0.1)
    with pytest.raises(ValueError, match="> 0"):
        solve_weights([0, 1000], 0.05, 1000, 0.1)


def test_per_tensor_spec_parsing():
    assert parse_per_tensor("emb_label=0.10;enc_.*=0.05") == [("emb_label", 0.10),
                                                                    ("enc_.*", 0.05)]
    assert parse_per_tensor("a=0.1,b=0.2") == [("a", 0.1), ("b", 0.2)]
    assert parse_per_tensor("x{1,2}=0.1;y=0.2") == [("x{1,2}", 0.1), ("y", 0.2)]
    assert parse_per_tensor(None) == []
    with pytest.raises(ValueError, match="REGEX=SIGMA_REL"):
        parse_per_tensor("emb_label")
    with pytest.raises(ValueError, match="invalid"):
        parse_per_tensor("([=0.1")
    with pytest.raises(ValueError, match="sigma_rel"):
        parse_per_tensor("a=0.5")


def test_release_names_give_time_and_width():
    # The release names a snapshot by kimg = nimg // 1000 of a multiple of 1024 images:
    # 0134217 is 128Mi = 134217728 images, 0008388 is 8Mi.
    assert parse_release_name("/x/edm2-img512-xs-0134217-0.050.pkl") == (128 << 20, 0.05)
    assert parse_release_name("edm2-img64-s-0008388-0.100") == (8 << 20, 0.1)
    assert parse_release_name("network-snapshot-0000006-0.050.pkl") == (6144, 0.05)
    assert parse_release_name("network-snapshot.pkl") is None
    for nimg in range(0, 1 << 20, 1024):
        assert release_kimg_to_nimg(nimg // 1000) == nimg
    with pytest.raises(ValueError, match="kimg 42 .*multiple of 1024"):
        release_kimg_to_nimg(42)  # 41984 -> 41, 43008 -> 43


def test_random_walk_error_shrinks_with_snapshot_frequency():
    # Additional check on a synthetic "training": a 64-d random walk with the exact
    # discrete EMA updates of ema.update_ema (Eq. 127), 4000 steps of 1 image.
    rng = np.random.default_rng(0)
    theta = np.cumsum(rng.normal(size=(4000, 64)), axis=0)
    gammas = {s: float(ema.sigma_rel_to_gamma(s)) for s in TRACKED}
    e = {s: np.zeros(64) for s in TRACKED}
    snaps = []
    for i, th in enumerate(theta):
        t = i + 1
        for s in TRACKED:
            beta = (1 - 1 / t) ** (gammas[s] + 1)
            e[s] = beta * e[s] + (1 - beta) * th
        if t % 50 == 0:
            snaps.append((t, e[0.05].copy(), e[0.10].copy()))
    errs = []
    for every in (1, 4, 16):  # snapshots every 50, 200, 800 steps
        sel = snaps[every - 1::every]
        tt = np.repeat([x[0] for x in sel], 2)
        V = np.stack([v for x in sel for v in x[1:]])
        X = solve_weights(tt, np.tile(SEEN, len(sel)), 4000, 0.075)
        errs.append(np.linalg.norm(X[:, 0] @ V - e[0.075]) / np.linalg.norm(e[0.05] - e[0.10]))
    assert errs[0] < 0.01 and errs[0] < errs[1] < errs[2], errs


# --------------------------------------------------------------------------------------
# A real tiny training run


def _tiny_config():
    from edm2_jax import configs
    c = configs.base_config()
    c.network.update(dict(img_resolution=8, img_channels=1, label_dim=0, model_channels=8,
                          channel_mult=(1,), num_blocks=1, attn_resolutions=()))
    c.batch_size = BATCH
    c.ema.sigma_rels = TRACKED
    c.optim.update(dict(ref_lr=0.01, t_ref=1000, rampup_kimg=0.0))
    return c


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """300 jitted EDM2 train steps of a 7.9k-parameter U-Net on 64 fixed random images,
    tracking sigma_rel 0.05, 0.075, 0.10. Keeps every 10th step's EMAs in memory, and
    writes a run directory whose snapshots (every 50 steps) hold only 0.05 and 0.10
    (no buffers: those come from the state checkpoint)."""
    from edm2_jax.run import checkpoints
    from edm2_jax.training import optim
    from edm2_jax.training import state as state_lib
    from edm2_jax.training import step as step_lib
    c = _tiny_config()
    net = state_lib.make_network(c)
    tx = optim.make_optimizer(c.optim, BATCH)
    # An 'rbg' key: XLA:CPU compiles threefry-heavy init/steps ~5x slower.
    state = jax.jit(lambda r: state_lib.init_train_state(c, net, tx, r))(
        jax.random.key(0, impl="rbg"))
    step_fn = jax.jit(step_lib.make_train_step(c, net, tx))
    images = np.random.default_rng(0).uniform(-1, 1, (64, 8, 8, 1)).astype(np.float32)
    workdir = tmp_path_factory.mktemp("run")
    with open(workdir / "config.json", "w") as f:
        json.dump(json.loads(c.to_json_best_effort()), f)
    mngrs = checkpoints.TrainCheckpoints(str(workdir))
    snaps = []  # (nimg, {sigma_rel: params tree (numpy)})
    for i in range(STEPS):
        j = (i * BATCH) % 64
        state, _ = step_fn(state, {"image": images[j:j + BATCH],
                                   "label": np.zeros((BATCH, 0), np.float32)})
        if (i + 1) % EVERY == 0:
            power = jax.device_get(state["ema"]["power"])
            snaps.append(((i + 1) * BATCH, {s: power[ema.ema_key(s)] for s in TRACKED}))
        if (i + 1) % 50 == 0:
            seen = {"power": {ema.ema_key(s): power[ema.ema_key(s)] for s in SEEN}}
            mngrs.save_snapshot(i + 1, (i + 1) * BATCH, seen, SEEN, BATCH)
    mngrs.save_state(STEPS, dict(state, rng=jax.random.key_data(state["rng"])))
    mngrs.close()
    return dict(workdir=str(workdir), snaps=snaps, buffers=jax.device_get(state["buffers"]),
                config=c)


def _weighted(snaps, X, sigma_rels):
    """sum_i X[i] * snapshot_i over (nimg, sigma_rel) inputs in the order of `inputs`."""
    trees = [snap[s] for _, snap in snaps for s in sigma_rels]
    return jax.tree.map(lambda *xs: sum(float(w) * np.asarray(x, np.float64)
                                        for w, x in zip(X, xs)), *trees)


def assert_reconstructed(got, want, snaps, *weights) -> None:
    """`got` (a float32 streaming reconstruction) equals `want` (float64 `_weighted` of
    `snaps` with one of `weights`) to `tolerances.weighted_sum_tol`: eps32 sqrt(n)
    sum|w| max|snapshot| (the coefficients alternate in sign, so sum|w| >> sum w = 1)."""
    scale = max(tree_magnitude(snap) for _, snap in snaps)
    atol = max(weighted_sum_tol(w, scale) for w in weights)
    err = float(np.abs(_flat(got) - _flat(want)).max())
    print(f"reconstruction error {err:.2e}, bound {atol:.2e}")
    assert err <= atol, (err, atol)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_reconstructed_ema_equals_the_tracked_ema(tiny_run):
    """The paper's claim (Sec. 3.2): sigma_rel 0.075, tracked but never given to the
    solver, is reconstructed from the 0.05 / 0.10 snapshots; the error shrinks as the
    snapshots get more frequent."""
    snaps = tiny_run["snaps"]
    final = snaps[-1][1]
    tracked = _flat(final[0.075])
    spread = np.linalg.norm(_flat(final[0.05]) - _flat(final[0.10]))
    errors = {}
    for every in (1, 5, 30):  # snapshots every 10, 50, 300 steps
        sel = snaps[every - 1::every]
        t = np.repeat([n for n, _ in sel], 2)
        X = solve_weights(t, np.tile(SEEN, len(sel)), STEPS * BATCH, 0.075)
        recon = _flat(_weighted(sel, X[:, 0], SEEN))
        errors[every * EVERY] = np.linalg.norm(recon - tracked) / spread
    print("reconstruction error of sigma_rel 0.075 relative to |ema_0.05 - ema_0.10|:",
          errors)
    # Measured: every 10 steps 3.8e-5, every 50 1.4e-2, one final snapshot pair 0.16.
    assert errors[10] < 1e-3
    assert errors[10] < errors[50] / 10 < errors[300] / 100
    assert errors[50] < 0.05


def test_reconstruct_from_a_training_run(tiny_run, tmp_path):
    """The streaming reconstruction (Orbax snapshots every 50 steps) equals the weighted
    sum of those snapshots, with the run's config and Fourier buffers."""
    workdir = tiny_run["workdir"]
    paths = reconstruct(workdir, [0.075, 0.05], out_dir=str(tmp_path / "out"),
                              batch_outputs=1, progress=False)
    assert [os.path.basename(p) for p in paths] == ["phema-0000002-0.075",
                                                   "phema-0000002-0.050"]
    sel = tiny_run["snaps"][4::5]
    t = np.repeat([n for n, _ in sel], 2)
    X = solve_weights(t, np.tile(SEEN, len(sel)), STEPS * BATCH, [0.075, 0.05])
    for k, p in enumerate(paths):
        net_config, variables, meta = checkpoint.load_network(p)
        want = _weighted(sel, X[:, k], SEEN)
        assert_reconstructed(variables["params"], want, sel, X[:, k])
        assert jax.tree.structure(variables["buffers"]) == jax.tree.structure(
            tiny_run["buffers"])
        np.testing.assert_array_equal(_flat(variables["buffers"]), _flat(tiny_run["buffers"]))
        assert net_config == json.loads(tiny_run["config"].network.to_json())
        assert meta["phema"] and meta["nimg"] == STEPS * BATCH
        assert meta["inputs"][0] == "snapshots/50:0.050" and len(meta["inputs"]) == 12
        np.testing.assert_allclose(meta["weights"], X[:, k], rtol=1e-12)
    # 0.05 at the last snapshot's time is that snapshot itself.
    _, v, _ = checkpoint.load_network(paths[1])
    assert_reconstructed(v["params"], sel[-1][1][0.05], sel, X[:, 1])
    # Outputs are never overwritten; exist_ok keeps a matching one.
    with pytest.raises(FileExistsError, match="exist_ok"):
        reconstruct(workdir, [0.05], out_dir=str(tmp_path / "out"), progress=False)
    assert reconstruct(workdir, [0.05], out_dir=str(tmp_path / "out"), exist_ok=True,
                             progress=False) == paths[1:]
    with pytest.raises(ValueError, match=r"no snapshot at or before.*at_kimg >= 0\.4"):
        reconstruct(workdir, [0.05], at_kimg=0.2, out_dir=str(tmp_path / "o2"))


def test_sweep_finds_the_held_out_ema(tiny_run, tmp_path, capsys):
    """With the distance to the tracked 0.075 EMA as the metric, a sweep over sigma_rel
    is best at 0.075."""
    tracked = _flat(tiny_run["snaps"][-1][1][0.075])

    def metric(path):
        return float(np.linalg.norm(_flat(checkpoint.load_network(path)[1]["params"]) - tracked))

    sigma_rels = [0.05, 0.065, 0.075, 0.085, 0.10]
    csv_path, png_path = sweep(tiny_run["workdir"], sigma_rels, metric,
                                     out_dir=str(tmp_path), metric_name="dist")
    import csv
    rows = list(csv.DictReader(open(csv_path)))
    assert [float(r["sigma_rel"]) for r in rows] == sigma_rels
    assert min(rows, key=lambda r: float(r["dist"]))["sigma_rel"] == "0.075"
    assert "best sigma_rel 0.075 (dist " in capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
        assert os.path.getsize(png_path) > 1000
    except ImportError:
        assert png_path is None


def test_sweep_says_a_poor_reconstruction_in_one_line(tiny_run, tmp_path, capsys):
    """An EMA the snapshots cannot express (0.25 from the first snapshot's 0.05 and 0.10
    alone) is swept with one `warning:` line naming its profile error, not Python's
    warning format with a source line."""
    sweep(tiny_run["workdir"], [0.25], lambda path: 0.0, at_kimg=0.4,  # the first
                out_dir=str(tmp_path), metric_name="zero")
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "relative error" in line]
    assert len(said) == 1 and said[0].startswith("warning: post-hoc EMA sigma_rel 0.25"), err
    assert "save snapshots more often" in said[0]
    assert "UserWarning" not in err and "warnings.warn" not in err


def test_main_phema_prints_outputs(tiny_run, tmp_path, capsys):
    paths = main_phema(tiny_run["workdir"], [0.08], at_kimg=1.6, out_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert "6 snapshot file(s) (12 EMAs" in out and paths[0] in out
    # The figure printed with each output is explained on one line of its own.
    explained = [line for line in out.splitlines() if line.strip().startswith("(profile error:")]
    assert len(explained) == 1 and "relative L2 distance" in explained[0], out
    meta = json.load(open(os.path.join(paths[0], "network.json")))["meta"]
    assert meta["kimg"] == 1.6 and len(meta["inputs"]) == 8  # steps 50..200 only
    # A sweep without --config takes its reference data from the run's config.json.
    assert run_data_config(tiny_run["workdir"]) == tiny_run["config"].data.to_dict()
    assert run_data_config(str(tmp_path)) is None


# --------------------------------------------------------------------------------------
# Streaming details on synthetic snapshots


def _synthetic_run(root: Path, n_steps=5, with_buffers=True):
    from edm2_jax.run import checkpoints
    rng = np.random.default_rng(1)
    shapes = {"unet": {"enc_8x8_conv": {"weight": (3, 3, 2, 4)}, "emb_label": {"weight": (5, 4)}},
              "out_gain": (1,)}
    buffers = {"unet": {"emb_fourier": {"freqs": rng.normal(size=8).astype(np.float32)}}}
    with open(root / "config.json", "w") as f:
        json.dump({"network": {"img_resolution": 8}}, f)
    m = checkpoints.TrainCheckpoints(str(root))
    snaps = []
    for k in range(1, n_steps + 1):
        trees = {s: jax.tree.map(lambda sh: rng.normal(size=sh).astype(np.float32), shapes,
                                 is_leaf=lambda x: isinstance(x, tuple)) for s in SEEN}
        m.save_snapshot(k * 10, k * 1000, {"power": {ema.ema_key(s): t for s, t in trees.items()}},
                        SEEN, 100, buffers=buffers if with_buffers else None)
        snaps.append((k * 1000, trees))
    m.close()
    return snaps, buffers


def test_streaming_batches_and_per_tensor(tmp_path):
    """3 outputs in batches of 2, with 'emb' tensors at sigma_rel 0.10 and the rest at each
    output's own; buffers from the snapshots."""
    snaps, buffers = _synthetic_run(tmp_path)
    sig = [0.06, 0.08, 0.12]
    paths = reconstruct(str(tmp_path), sig, per_tensor="emb_=0.10", batch_outputs=2,
                              progress=False)
    assert all("-pt" in os.path.basename(p) for p in paths)
    t = np.repeat([n for n, _ in snaps], 2)
    X = solve_weights(t, np.tile(SEEN, 5), 5000, sig + [0.10])
    assert np.all(np.abs(X[:, 3] - np.eye(10)[9]) < 1e-9)  # 0.10 at 5000 = last snapshot
    for k, p in enumerate(paths):
        cfg, v, meta = checkpoint.load_network(p)
        own, emb = _weighted(snaps, X[:, k], SEEN), _weighted(snaps, X[:, 3], SEEN)
        assert_reconstructed(v["params"]["unet"]["enc_8x8_conv"]["weight"],
                             own["unet"]["enc_8x8_conv"]["weight"], snaps, X[:, k])
        assert_reconstructed(v["params"]["out_gain"], own["out_gain"], snaps, X[:, k])
        assert_reconstructed(v["params"]["unet"]["emb_label"]["weight"],
                             emb["unet"]["emb_label"]["weight"], snaps, X[:, 3])
        np.testing.assert_array_equal(v["buffers"]["unet"]["emb_fourier"]["freqs"],
                                      buffers["unet"]["emb_fourier"]["freqs"])
        assert cfg == {"img_resolution": 8}
        assert meta["per_tensor"][0]["regex"] == "emb_" and meta["sigma_rel"] == sig[k]
    with pytest.raises(ValueError, match="match no parameter.*unet/"):
        reconstruct(str(tmp_path), [0.06], per_tensor="nothing_here=0.1",
                          out_dir=str(tmp_path / "x"))


def test_reader_paths_agree(tmp_path, monkeypatch):
    """Chunks that split tensors and cross per-tensor groups, no prefetch, Orbax's restore
    instead of the direct TensorStore reader (checkpoints without `_METADATA`, or arrays
    it cannot open: warned), and inputs in Orbax's per-array (non-OCDBT) layout all give
    the weighted sum of the snapshots."""
    (tmp_path / "run").mkdir()
    snaps, _ = _synthetic_run(tmp_path / "run")
    sig = [0.06, 0.12]
    X = solve_weights(np.repeat([n for n, _ in snaps], 2), np.tile(SEEN, 5), 5000,
                            sig + [0.10])

    def check(paths):
        for k, p in enumerate(paths):
            v = checkpoint.load_network(p)[1]["params"]
            own, emb = _weighted(snaps, X[:, k], SEEN), _weighted(snaps, X[:, 2], SEEN)
            own["unet"]["emb_label"] = emb["unet"]["emb_label"]
            assert_reconstructed(v, own, snaps, X[:, k], X[:, 2])

    def run(name, src=tmp_path / "run"):
        return reconstruct(str(src), sig, per_tensor="emb_=0.10", progress=False,
                                 out_dir=str(tmp_path / name))

    def no_orbax(*a):
        pytest.fail("read through Orbax")
    with monkeypatch.context() as m:
        m.setattr(streaming, "_EmaReader", no_orbax)
        m.setattr(streaming, "_CHUNK", 7)  # tensors of 72, 20 and 1 elements
        m.setattr(streaming, "_PREFETCH", 0)
        check(run("small_chunks"))
    with monkeypatch.context() as m:
        m.setattr(streaming, "orbax_tree_keys", lambda d: None)
        check(run("orbax"))

    def fail(*a, **kw):
        raise ValueError("unknown layout")
    with monkeypatch.context() as m:
        m.setattr(streaming, "_TensorStoreReader", fail)
        m.setattr(streaming, "_warned_fallback", False)
        with pytest.warns(UserWarning, match="Orbax's restore instead.*unknown layout"):
            check(run("fallback"))
    # The same snapshots as imported release snapshots in the per-array layout.
    nets = tmp_path / "nets"
    for nimg, trees in snaps:
        for s_rel, t in trees.items():
            checkpoint.save_network(str(nets / f"edm2-t-{nimg // 1000:07d}-{s_rel:.3f}"),
                                    {"params": t, "buffers": {}}, {"img_resolution": 8},
                                    low_memory=True)
    assert not os.path.exists(nets / "edm2-t-0000001-0.050" / "variables" / "manifest.ocdbt")
    with monkeypatch.context() as m:
        m.setattr(streaming, "_EmaReader", no_orbax)
        check(run("per_array", nets))


def test_snapshots_of_another_network_are_refused(tmp_path):
    snaps, _ = _synthetic_run(tmp_path, n_steps=2)
    from edm2_jax.run import checkpoints
    m = checkpoints.TrainCheckpoints(str(tmp_path))
    other = {"unet": {"enc_8x8_conv": {"weight": np.zeros((3, 3, 2, 5), np.float32)},
                      "emb_label": {"weight": np.zeros((5, 4), np.float32)}},
             "out_gain": np.zeros(1, np.float32)}
    m.save_snapshot(30, 3000, {"power": {ema.ema_key(s): other for s in SEEN}}, SEEN, 100)
    m.close()
    with pytest.raises(ValueError, match=r"snapshots/30: the EMA at power/0\.050 has other "
                                         r"tensors.*shape \(3, 3, 2, 5\).*same network"):
        reconstruct(str(tmp_path), [0.06], out_dir=str(tmp_path / "o"))


def test_missing_inputs_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="snapshots/<step>"):
        reconstruct(str(tmp_path), [0.05])
    (tmp_path / "edm2-img64-s.pkl").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="not named like the release's snapshots"):
        reconstruct(str(tmp_path), [0.05])
    (tmp_path / "edm2-img64-s-0000000-0.050.pkl").write_bytes(b"")  # nimg 0 is no input
    with pytest.raises(FileNotFoundError, match="network-snapshot-0008388-0.050.pkl"):
        reconstruct(str(tmp_path), [0.05])
    run = tmp_path / "run"
    run.mkdir()
    _synthetic_run(run, n_steps=2, with_buffers=False)
    with pytest.raises(FileNotFoundError, match="buffers"):
        reconstruct(str(run), [0.05])


def test_reconstruct_from_imported_release_snapshots(tiny_run, tmp_path):
    """Release raw snapshots (`edm2-...-<kimg>-<sigma_rel>.pkl`; here npz state dicts under
    those names) imported with `convert`, then reconstructed at the release's times: the
    multiples of 1024 images that the names' kimg stand for (100 -> 100352)."""
    from edm2_jax.release import convert
    src = tmp_path / "release"
    src.mkdir()
    sel = tiny_run["snaps"][9::10]  # steps 100, 200, 300 -> pretend kimg 100, 200, 300
    for i, (_, snap) in enumerate(sel):
        for s in SEEN:
            sd = convert.variables_to_state_dict({"params": snap[s],
                                                  "buffers": tiny_run["buffers"]})
            np.savez(src / f"edm2-tiny-{(i + 1) * 100:07d}-{s:.3f}.npz", **sd)
    nets = import_release_snapshots(str(src), str(tmp_path / "nets"))
    assert len(nets) == 6
    paths = reconstruct(str(tmp_path / "nets"), [0.075], progress=False)
    assert paths == [str(tmp_path / "nets" / "phema" / "phema-0000300-0.075")]
    t = [release_kimg_to_nimg(k) for k in (100, 200, 300)]
    assert t == [100352, 200704, 300032]
    X = solve_weights(np.repeat(t, 2), np.tile(SEEN, 3), t[-1], 0.075)
    _, v, meta = checkpoint.load_network(paths[0])
    assert_reconstructed(v["params"], _weighted(sel, X[:, 0], SEEN), sel, X[:, 0])
    np.testing.assert_array_equal(_flat(v["buffers"]), _flat(tiny_run["buffers"]))
    assert meta["inputs"][0] == "edm2-tiny-0000100-0.050:0.050"
    # The outputs (meta phema=True) are not taken as inputs by a second reconstruction.
    assert len(find_snapshots(str(tmp_path / "nets"))[1]) == 6
