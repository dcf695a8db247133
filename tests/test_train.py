"""Training loop (docs/recipe.md §4-5): one step, its sharding and accumulation, EMA tracking,
and `train_and_evaluate` end to end (resume, bad input, NaN, the CLI).

Everything runs on a 1-level 8x8 network with 8 channels (7.8k parameters) so that XLA
compiles quickly. The end-to-end runs share the session's persistent XLA compilation cache
(tests/conftest.py), since a fresh, resumed and CLI run compile identical programs; the
4-step run itself is the session's `tiny_run`, which other test files read too.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
import PIL.Image
import pytest

from edm2_jax import configs
from edm2_jax import data as data_lib
from edm2_jax.ema import power as ema_lib
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import loop
from edm2_jax.training import state as state_lib
from edm2_jax.training import step as step_lib
from edm2_jax.model.mp import force_normalize
from edm2_jax.model.networks import init_variables
from edm2_jax.sampling.solvers import Heun
from tests.cpu_devices import tree_from_process
from tests.tolerances import EPS32, reorder_tol, scaled_err, tree_err
# The session's compilation cache, imported from here by the test files of the tiny runs.
from tests.conftest import xla_cache  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
FMNIST_CONFIG = REPO / "configs" / "fashion_mnist.py"
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# The tiny run: configs/fashion_mnist.py:tiny with these overrides (also given to the CLI
# as --config.<field>=<value>, so that it compiles the same programs). 4 steps of 8 images;
# a checkpoint every 2 steps, one EMA snapshot + sample grid at the end.
TINY_OVERRIDES = {
    "data.source": "folder", "data.num_workers": 0,
    "network.model_channels": 8, "network.channel_mult": (1,), "network.logvar_channels": 8,
    "batch_size": 8, "optim.rampup_kimg": 0.0,
    "total_kimg": 0.032, "status_kimg": 0.016, "checkpoint_kimg": 0.016, "snapshot_kimg": 0.032,
    "sample.num_steps": 2, "sample.grid_rows": 1, "sample.grid_cols": 2,
}


def _config_file(name: str, variant: str) -> ml_collections.ConfigDict:
    """`get_config(variant)` of `configs/<name>.py`."""
    return configs.config_file(str(REPO / "configs" / f"{name}.py"), variant)


def _load_fmnist_config(variant: str = "tiny") -> ml_collections.ConfigDict:
    return _config_file("fashion_mnist", variant)


def tiny_config(data_path, **overrides) -> ml_collections.ConfigDict:
    """The tiny run's config; an `objective` override brings its config section
    (`configs.with_objective`), which the other overrides may then set."""
    c = _load_fmnist_config("tiny")
    if "objective" in overrides:
        configs.with_objective(c, overrides["objective"])
    for field, value in {**TINY_OVERRIDES, "data.path": str(data_path), **overrides}.items():
        *parents, leaf = field.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def make_image_folder(path: Path, n: int = 16, resolution: int = 8, labels: bool = True) -> Path:
    """`n` random grayscale PNGs (+ dataset.json with 2 classes) in the release's layout."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    table = []
    for i in range(n):
        PIL.Image.fromarray(rng.integers(0, 256, (resolution, resolution), np.uint8)).save(
            path / f"img{i:03d}.png")
        table.append([f"img{i:03d}.png", i % 2])
    if labels:
        (path / "dataset.json").write_text(json.dumps({"labels": table}))
    return path


def _worst(a, b) -> float:
    """Largest error between two trees, each tensor scaled by its own max|b| and each
    scalar by the tree's magnitude (`tolerances.tree_err`)."""
    return tree_err(a, b)[0]


def gradient_scale(opt_state):
    """Adam's state with the second moment `nu` (~ g^2, so twice the relative rounding
    error of the gradient) replaced by its square root, to compare at the gradient's
    precision."""
    def f(path, x):
        is_nu = any(getattr(k, "name", getattr(k, "key", None)) == "nu" for k in path)
        return np.sqrt(x) if is_nu else x
    return jax.tree_util.tree_map_with_path(f, opt_state)


def state_err(state, ref) -> tuple[float, str]:
    """`(worst, where)` over a train state's params, EMAs and Adam moments (at the
    gradient's precision, scalars scaled by the gradient's magnitude) against `ref`'s,
    as in `tolerances.tree_err`."""
    errs = [tree_err(state[k], ref[k]) + (k,) for k in ("params", "ema")]
    if "opt_state" in state:
        errs.append(tree_err(gradient_scale(state["opt_state"]),
                             gradient_scale(ref["opt_state"])) + ("opt_state",))
    err, where, key = max(errs)
    return err, key + where


# --------------------------------------------------------------------------------------
# One step (no data source, no loop)

STEP_NET = dict(img_resolution=8, img_channels=1, label_dim=2)


def step_config(batch_size: int = 16) -> ml_collections.ConfigDict:
    c = tiny_config("", batch_size=batch_size)
    c.network.update(STEP_NET)
    # A wide EMA (beta = 0.5^1.6 at the second update) makes its closed form discriminate.
    c.ema.sigma_rels = (0.05, 0.25)
    return c


def step_reduction_terms(config) -> int:
    """Length of the longest float32 reduction of a training step: a scalar gain's
    gradient sums over batch x pixels x channels of the widest activation (a decoder
    block's input: its skip concatenated to the main path, 2 x the widest level)."""
    n = config.network
    return (int(config.batch_size) * n.img_resolution ** 2
            * 2 * n.model_channels * max(n.channel_mult))


# The same step computed in another order (device split, micro-batches, another CPU)
# agrees to this fraction of each tensor's scale: eps32 sqrt(16 * 8 * 8 * 16) = 1.5e-5
# (tests/tolerances.py). A missing all-reduce, shards in the wrong place or a dropped
# micro-batch are off by O(1) (negative controls in test_fsdp.py).
STEP_TOL = reorder_tol(step_reduction_terms(step_config()))


def random_state(config, seed: int = 0, weight_scale: float = 3.0) -> tuple:
    """A train state with N(0, weight_scale^2) weights (not yet normalised, so forced
    normalisation is visible) and non-zero gains (at init the zero `out_gain` would stop
    every gradient but its own). Host numpy arrays, so that donation cannot consume them.
    Filled from numpy: flax's own init compiles slowly on a busy CPU.
    Returns `(state, net, tx)`."""
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, int(config.batch_size))
    shapes = jax.eval_shape(lambda k: init_variables(net, k), jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if str(path[-1].key).endswith("gain"):
            return np.float32(0.7)
        return (weight_scale * rng.standard_normal(leaf.shape)).astype(np.float32)

    v = jax.tree_util.tree_map_with_path(fill, dict(shapes))
    state = {"step": np.int32(0), "params": v["params"], "buffers": v["buffers"],
             "opt_state": tx.init(v["params"]),
             "ema": ema_lib.init_ema_state(v["params"], tuple(config.ema.sigma_rels),
                                           float(config.ema.trad_halflife_kimg)),
             "rng": np.asarray(jax.random.PRNGKey(seed + 1))}
    # Same pytree as state_lib.init_train_state builds.
    ref = jax.eval_shape(lambda r: state_lib.init_train_state(config, net, tx, r),
                         jax.random.PRNGKey(0))
    assert jax.tree.structure(ref) == jax.tree.structure(state)
    return jax.device_get(state), net, tx


def random_batch(config, seed: int = 0) -> dict:
    rng = np.random.default_rng(100 + seed)
    b, r, c, L = (int(config.batch_size), config.network.img_resolution,
                  config.network.img_channels, config.network.label_dim)
    return {"image": rng.uniform(-1, 1, (b, r, r, c)).astype(np.float32),
            "label": np.eye(L, dtype=np.float32)[rng.integers(0, L, b)]}


def run_steps(config, num_accum: int = 1, num_devices: int = 1, steps: int = 1):
    """`steps` jitted steps from `random_state` on a mesh of `num_devices`; returns the
    states after each step and the metrics, as numpy."""
    state, net, tx = random_state(config)
    fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, num_accum),
                                 shard_lib.make_mesh(num_devices))
    states, metrics = [], []
    for i in range(steps):
        state, m = fn(state, random_batch(config, i))
        state, m = jax.device_get((state, m))
        states.append(state)
        metrics.append(m)
    return states, metrics


@pytest.fixture(scope="module")
def two_steps():
    """Two steps with one micro-batch on one device (the reference of several tests)."""
    config = step_config()
    states, metrics = run_steps(config, steps=2)
    return config, states, metrics


def _eqns(jaxpr):
    """Every equation of a closed jaxpr, those of its sub-jaxprs (jit, remat, custom
    derivatives, scan) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def test_global_norm_by_hand_in_one_reduction():
    import math
    import jax.numpy as jnp
    tree = {"a": jnp.arange(12.0).reshape(3, 4),
            "b": [jnp.full((5,), 3.0, jnp.bfloat16), jnp.full((2, 2, 2), -2.0)]}
    # 0^2 + ... + 11^2 = 506, 5 x 9 = 45, 8 x 4 = 32
    assert float(step_lib.global_norm(tree)) == pytest.approx(math.sqrt(583), rel=EPS32)
    assert step_lib.global_norm(tree).dtype == jnp.float32
    assert float(step_lib.global_norm({})) == 0.0
    reductions = [e for e in _eqns(jax.make_jaxpr(step_lib.global_norm)(tree).jaxpr)
                  if e.primitive.name == "reduce_sum"]
    assert len(reductions) == 1 and reductions[0].invars[0].aval.size == 12 + 5 + 8


@pytest.mark.parametrize("kernels", ["cpu", "xla"])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_step_logs_each_norm_in_the_backends_form(two_steps, kernels):
    """grad_norm, update_norm and param_norm: on the 'cpu' backend each is one reduction
    reading every parameter (XLA:CPU runs one faster than hundreds); on 'xla' (GPU, TPU) a
    reduction per parameter, with no copy of all parameters (on a GPU the concatenation's
    copies cost more than the reductions they save). The values are the per-leaf norms of
    the step's own arrays up to float32 summation order."""
    import optax
    config, states, metrics = two_steps
    config = ml_collections.ConfigDict(config.to_dict())
    config.backend.kernels = kernels
    state, net, tx = random_state(config)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    jaxpr = jax.make_jaxpr(step_lib.make_train_step(config, net, tx))(state, random_batch(config))
    whole = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name in ("reduce_sum", "concatenate")
             and any(getattr(v.aval, "size", 0) == n_params for v in e.invars + e.outvars)]
    names = sorted(e.primitive.name for e in whole)
    assert names == (["concatenate"] * 3 + ["reduce_sum"] * 3 if kernels == "cpu" else []), \
        [str(e)[:200] for e in whole]
    norm = float(optax.tree.norm(jax.tree.map(np.float64, states[1]["params"])))
    assert metrics[1]["param_norm"] == pytest.approx(norm, rel=reorder_tol(n_params))


def test_micro_batch_count_and_its_errors():
    c = step_config(batch_size=16)
    assert step_lib.num_micro_batches(c, 1) == 1
    c.batch_per_device = 4
    assert step_lib.num_micro_batches(c, 1) == 4
    assert step_lib.num_micro_batches(c, 2) == 2
    with pytest.raises(ValueError, match="not divisible by the 3 devices"):
        step_lib.num_micro_batches(c, 3)
    c.batch_per_device = 3
    with pytest.raises(ValueError, match="not a multiple of batch_per_device"):
        step_lib.num_micro_batches(c, 1)


def test_step_force_normalises_then_adam_then_ema(two_steps):
    """One step from weights W0: the online weights become normalize(W0) + Adam update
    (|update| < lr per element on Adam's first step), the lr is ref_lr (no ramp-up, before
    t_ref), and the first EMA update copies the post-update weights (beta = 0 at t = dt)."""
    config, states, metrics = two_steps
    state0, _, _ = random_state(config)
    s1 = states[0]
    lr = config.optim.ref_lr
    assert int(s1["step"]) == 1
    np.testing.assert_allclose(metrics[0]["lr"], lr, rtol=1e-6)
    normalised = jax.device_get(force_normalize(state0["params"]))
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), s1["params"], normalised)
    assert max(jax.tree.leaves(moved)) <= lr + 1e-6  # + float32 rounding of |W| ~ 3
    assert max(jax.tree.leaves(moved)) > lr / 2  # it did move
    # W0 ~ N(0, 9) is far from normalised: the stored weights really were replaced.
    w0 = state0["params"]["unet"]["enc_8x8_conv"]["weight"]
    w1 = s1["params"]["unet"]["enc_8x8_conv"]["weight"]
    fan_in = np.prod(w0.shape[:-1])
    np.testing.assert_allclose(np.linalg.norm(w1.reshape(-1, w1.shape[-1]), axis=0),
                               np.sqrt(fan_in), rtol=0.05)
    for key, e in s1["ema"]["power"].items():
        assert _worst(e, s1["params"]) < 8 * EPS32, key  # elementwise, as below


def test_ema_second_step_closed_form_and_not_normalised(two_steps):
    """Second update (t = 2 dt): ema = beta p1 + (1 - beta) p2 with
    beta = (1 - dt/t)^(gamma+1) = 0.5^(gamma+1) (Eq. 127); the EMA is a plain average of
    post-Adam weights and is never force-normalised."""
    config, (s1, s2), _ = two_steps
    p1, p2 = s1["params"], s2["params"]
    for sigma_rel in config.ema.sigma_rels:
        gamma = float(ema_lib.sigma_rel_to_gamma(sigma_rel))
        beta = 0.5 ** (gamma + 1)
        want = jax.tree.map(lambda a, b: beta * a.astype(np.float64) + (1 - beta) * b, p1, p2)
        got = s2["ema"]["power"][ema_lib.ema_key(sigma_rel)]
        # Elementwise float32 (two products, a sum, beta rounded): <= 2 eps32 of the
        # scale; 8 eps32 = 1e-6 leaves 4x.
        assert _worst(got, want) < 8 * EPS32, sigma_rel
        # Its weights keep the post-Adam norms, which forced normalisation would change.
        assert _worst(jax.device_get(force_normalize(got)), got) > 1e-4


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_accumulation_equals_one_full_batch(two_steps):
    """4 micro-batches of 4 (lax.scan) == 1 batch of 16: same objective, weights, EMAs
    and Adam moments, to summation-order error (STEP_TOL = 1.5e-5 of each tensor's
    scale; measured on an AMD EPYC 6.4e-7, Adam's first moment of a decoder conv)."""
    config, (ref, _), (ref_m, _) = two_steps
    (acc,), (acc_m,) = run_steps(config, num_accum=4)
    err, where = state_err(acc, ref)
    assert err <= STEP_TOL, (err, where)
    for k in ("objective", "loss/loss", "loss/logvar", "loss/sigma", "grad_norm"):
        assert scaled_err(acc_m[k], ref_m[k]) <= STEP_TOL, (k, acc_m[k], ref_m[k])
    np.testing.assert_array_equal(acc["rng"], ref["rng"])


def _sharded_step_npz(out: str, num_accum: int) -> None:
    """Run in a fresh process with 8 simulated CPU devices: one step on all 8."""
    assert jax.device_count() == 8, jax.devices()
    (state,), (metrics,) = run_steps(step_config(), num_accum=num_accum, num_devices=8)
    np.savez(out, *jax.tree.leaves((state, metrics)))


def _step_on_8_devices(tmp_path, like, num_accum: int = 1):
    """`(state, metrics)` of `_sharded_step_npz` in a process with 8 CPU devices,
    unflattened like `like`."""
    return tree_from_process("tests.test_train:_sharded_step_npz", tmp_path / "dev8.npz",
                             like, num_accum)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_sharded_step_equals_single_device(two_steps, tmp_path):
    """The same step with the batch split over 8 devices (SPMD, gradients all-reduced)
    gives the single-device weights, EMAs and Adam moments to float32 summation-order
    error (STEP_TOL = 1.5e-5 of each tensor's scale; measured on an AMD EPYC 7.5e-7,
    Adam's second moment of a decoder conv; objective 5.3e-7).

    Adam's first update, lr g / (|g| + eps), is close to lr sign(g), so an entry whose
    gradient were zero up to rounding could flip; none does for these seeds, and a
    missing or wrong all-reduce changes every gradient, not only such entries."""
    config, (ref, _), (ref_m, _) = two_steps
    state, metrics = _step_on_8_devices(tmp_path, (ref, ref_m))
    err, where = state_err(state, ref)
    assert err <= STEP_TOL, (err, where)
    assert scaled_err(metrics["objective"], ref_m["objective"]) <= STEP_TOL


@pytest.mark.slow
def test_sharded_accumulation_equals_single_device(two_steps, tmp_path):
    """2 interleaved micro-batches of 8 on 8 devices (1 image per device per round) ==
    one batch of 16 on one device."""
    config, (ref, _), (ref_m, _) = two_steps
    state, metrics = _step_on_8_devices(tmp_path, (ref, ref_m), num_accum=2)
    err, where = state_err(state, ref)
    assert err <= STEP_TOL, (err, where)
    assert scaled_err(metrics["objective"], ref_m["objective"]) <= STEP_TOL


# --------------------------------------------------------------------------------------
# train_and_evaluate end to end


def _restore(workdir, step=None) -> tuple[int, dict]:
    """(step, state as numpy) of a checkpoint in `workdir/checkpoints` (default latest)."""
    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                 options=ocp.CheckpointManagerOptions(create=False))
    step = mngr.latest_step() if step is None else step
    state = mngr.restore(step, args=ocp.args.StandardRestore())
    mngr.close()
    return step, jax.device_get(state)


def _steps(workdir, sub="checkpoints") -> list[int]:
    d = Path(workdir) / sub
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run):
    """`full`: 4 steps in one go (the session's `tiny_run`, read-only). `half`: the same
    config stopped after 2 steps (its total_kimg halved), with a pristine copy for tests
    that resume it differently."""
    root = tmp_path_factory.mktemp("runs")
    data, full, r_full = tiny_run["data"], tiny_run["run"], tiny_run["result"]
    half, pristine = root / "half", root / "half_pristine"
    r_half = loop.train_and_evaluate(tiny_config(data, total_kimg=0.016), str(half))
    shutil.copytree(half, pristine)
    return dict(data=data, full=full, half=half, pristine=pristine, r_full=r_full,
                r_half=r_half)


def _fresh_copy(runs, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(runs["pristine"], dst)
    return dst


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_run_writes_its_outputs(runs):
    full = runs["full"]
    assert runs["r_full"]["finished"] and runs["r_full"]["step"] == 4
    assert _steps(full) == [2, 4]
    assert _steps(full, "snapshots") == [4]
    assert (full / "samples" / "000000000032.png").exists()
    saved = json.loads((full / "config.json").read_text())
    assert saved["network"]["img_resolution"] == 8 and saved["network"]["label_dim"] == 2
    stats = [json.loads(line) for line in (full / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [2, 4]
    assert all(np.isfinite(s["loss/loss"]) for s in stats)
    from edm2_jax.run import snapshots
    (step, meta), = snapshots.list_snapshots(str(full))
    assert step == 4 and meta["nimg"] == 32 and meta["batch_size"] == 8
    assert meta["ema_keys"] == ["0.050", "0.100"]
    ema, _ = snapshots.restore_snapshot(str(full), 4)
    _, state = _restore(full, 4)
    assert _worst(ema, state["ema"]) == 0


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_resume_is_bitwise_identical(runs, monkeypatch):
    """Stopping after 2 steps and resuming (with a larger total_kimg, which may change)
    ends in exactly the state of the uninterrupted run; a finished run does nothing."""
    half = runs["half"]
    assert runs["r_half"]["finished"] and _steps(half) == [2]
    r = loop.train_and_evaluate(tiny_config(runs["data"]), str(half))
    assert r["finished"] and r["step"] == 4 and _steps(half) == [2, 4]
    (sa, a), (sb, b) = _restore(runs["full"]), _restore(half)
    assert sa == sb == 4
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(x, y)
    assert int(b["step"]) == 4
    # The full run's step-2 checkpoint was saved asynchronously while training went on
    # with donated buffers; it equals the half run's, saved as its last act.
    (_, a2), (_, b2) = _restore(runs["full"], 2), _restore(runs["pristine"], 2)
    for x, y in zip(jax.tree.leaves(a2), jax.tree.leaves(b2)):
        assert np.array_equal(x, y)
    # A finished run: nothing is built, trained or written.
    monkeypatch.setattr(step_lib, "make_train_step", lambda *a, **k: pytest.fail("trained"))
    before = sorted(p.name for p in half.rglob("*"))
    r = loop.train_and_evaluate(tiny_config(runs["data"]), str(half))
    assert r == {"kimg": 0.032, "finished": True}
    assert sorted(p.name for p in half.rglob("*")) == before


def test_config_mismatch_fails_before_any_step(runs, tmp_path, monkeypatch):
    run = _fresh_copy(runs, tmp_path)
    saved = (run / "config.json").read_text()
    monkeypatch.setattr(step_lib, "make_train_step", lambda *a, **k: pytest.fail("trained"))
    cfg = tiny_config(runs["data"], **{"network.model_channels": 16, "optim.ref_lr": 0.02})
    with pytest.raises(ValueError) as e:
        loop.train_and_evaluate(cfg, str(run))
    msg = str(e.value)
    assert "network.model_channels: checkpoint 8 vs now 16" in msg
    assert "optim.ref_lr" not in msg  # may change on resume (the rescue of a diverged run)
    assert "--workdir" in msg
    assert (run / "config.json").read_text() == saved  # the run's record is untouched
    assert _steps(run) == [2]


class _StopBeforeCompiling(Exception):
    pass


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_labels_wanted_but_data_unlabelled(tmp_path, monkeypatch):
    data = make_image_folder(tmp_path / "data", labels=False)
    with pytest.raises(ValueError, match="no dataset.json.*use_labels=False"):
        loop.train_and_evaluate(tiny_config(data), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "config.json").exists()
    # The fix the message names: an unconditional run, although the config's network
    # asked for 10 classes (the data decide). Stopped once its config is recorded.
    def stop(*args, **kwargs):
        raise _StopBeforeCompiling
    monkeypatch.setattr(step_lib, "jit_train_step", stop)  # config.json is written by then
    cfg = tiny_config(data, **{"data.use_labels": False})
    assert cfg.network.label_dim == 10
    with pytest.raises(_StopBeforeCompiling):
        loop.train_and_evaluate(cfg, str(tmp_path / "run"))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["network"]["label_dim"] == 0 and saved["data"]["use_labels"] is False


def test_missing_fashion_mnist_names_the_package(tmp_path):
    c = _load_fmnist_config("tiny")
    c.data.path = "/nonexistent"
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        loop.train_and_evaluate(c, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


# --------------------------------------------------------------------------------------
# Compute precision: the presets train in mixed precision on GPU/TPU, as the release does


def test_presets_default_to_auto_dtype_and_fashion_mnist_to_float32():
    for name, variant in (("img64", "xs"), ("img64", "s"), ("img512", "xs"), ("img512", "xxl"),
                          ("ablation", "e,img64-s")):
        assert _config_file(name, variant).network.dtype == "auto", (name, variant)
    for name, variant in (("fashion_mnist", "default"), ("fashion_mnist", "tiny"),
                          ("img512", "tiny"), ("ablation", "g"), ("ablation", "c,tiny")):
        assert _config_file(name, variant).network.dtype == "float32", (name, variant)


def test_auto_dtype_is_bfloat16_on_gpu_and_tpu_float32_on_cpu():
    from edm2_jax import configs
    assert configs.compute_dtype("auto", "gpu") == "bfloat16"
    assert configs.compute_dtype("auto", "tpu") == "bfloat16"
    assert configs.compute_dtype("auto", "cpu") == "float32"
    # A resumed run keeps the dtype its config.json records; an explicit dtype wins.
    assert configs.compute_dtype("auto", "gpu", recorded="float32") == "float32"
    assert configs.compute_dtype("auto", "cpu", recorded="bfloat16") == "bfloat16"
    for dtype in ("float32", "bfloat16"):
        assert configs.compute_dtype(dtype, "gpu") == configs.compute_dtype(dtype, "cpu") == dtype
    c = _config_file("img64", "xs")
    resolved = configs.resolve_dtype(c, "gpu")
    assert resolved.network.dtype == "bfloat16" and c.network.dtype == "auto"  # a copy
    assert resolved.network.model_channels == c.network.model_channels
    assert configs.resolve_dtype(c, "cpu").network.dtype == "float32"
    c.network.dtype = "float32"  # as --config.network.dtype=float32 sets it
    assert configs.resolve_dtype(c, "gpu").network.dtype == "float32"


def test_unknown_dtype_is_refused_naming_the_valid_ones():
    from edm2_jax import configs
    c = _config_file("img64", "xs")
    configs.validate(c)  # 'auto' is valid
    c.network.dtype = "float64"
    with pytest.raises(ValueError, match=r"--config.network.dtype='float64': one of auto, "
                                         r"float32, bfloat16, float16"):
        configs.validate(c)


def test_start_up_records_and_names_the_precision_in_force(tmp_path, monkeypatch, capsys):
    """`network.dtype='auto'` trains in float32 on the CPU: the config the run records
    (config.json) says float32 and so does the start-up line; a run whose config.json
    records bfloat16 resumes in bfloat16. Stopped before the network is initialised."""
    assert loop.setup.precision("float32") == "float32 compute"
    assert loop.setup.precision("bfloat16") == "bfloat16 compute (float32 params, EMAs, loss)"
    assert jax.default_backend() == "cpu"

    recorded = []
    check_config = loop.resume.check_config
    monkeypatch.setattr(loop.resume, "check_config",
                        lambda *a: recorded.append(check_config(*a)) or recorded[-1])

    def stop(*args, **kwargs):
        raise _StopBeforeCompiling
    monkeypatch.setattr(loop.setup, "restore_or_init", stop)
    data = make_image_folder(tmp_path / "data")
    run = tmp_path / "run"
    run.mkdir()  # a start refused here removes what it made: the folder is the caller's
    cfg = tiny_config(data, **{"network.dtype": "auto"})
    with pytest.raises(_StopBeforeCompiling):
        loop.train_and_evaluate(cfg, str(run))
    assert recorded[-1]["network"]["dtype"] == "float32"  # what config.json gets
    assert "parameters, float32 compute; batch" in capsys.readouterr().out
    assert cfg.network.dtype == "auto"  # the caller's config is left as it was

    (run / "config.json").write_text(json.dumps(
        dict(recorded[-1], network=dict(recorded[-1]["network"], dtype="bfloat16"))))
    with pytest.raises(_StopBeforeCompiling):
        loop.train_and_evaluate(cfg, str(run))
    assert recorded[-1]["network"]["dtype"] == "bfloat16"
    assert ("parameters, bfloat16 compute (float32 params, EMAs, loss); batch"
            in capsys.readouterr().out)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(runs, tmp_path, monkeypatch):
    """Resuming on data that turns NaN raises NonFiniteLossError before the next
    checkpoint; the checkpoint that was there is kept and still restores."""
    run = _fresh_copy(runs, tmp_path)
    _, good = _restore(run, 2)
    make_iterator = data_lib.make_iterator

    def nan_iterator(*args, **kwargs):
        for batch in make_iterator(*args, **kwargs):
            yield dict(batch, image=np.full_like(batch["image"], np.nan))

    monkeypatch.setattr(loop.data_lib, "make_iterator", nan_iterator)
    with pytest.raises(loop.NonFiniteLossError, match="non-finite loss.*step 2.*ref_lr"):
        loop.train_and_evaluate(tiny_config(runs["data"]), str(run))
    assert _steps(run) == [2]
    assert _steps(run, "snapshots") == [2]
    step, state = _restore(run)
    assert step == 2
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(good)):
        assert np.array_equal(x, y)


def _cli(config_arg: str, workdir, overrides: dict, env_extra: dict | None = None):
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "edm2_jax.main", f"--config={config_arg}",
                           f"--workdir={workdir}", *flags],
                          env=env, capture_output=True, text=True, cwd=REPO, timeout=900)


def _check_cli_outputs(workdir: Path, steps: list[int]) -> None:
    assert json.loads((workdir / "config.json").read_text())["batch_size"] > 0
    assert _steps(workdir) == steps
    assert _steps(workdir, "snapshots")
    assert (workdir / "stats.jsonl").read_text().strip()
    assert list((workdir / "samples").glob("*.png"))


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_cli_trains_the_tiny_config(runs, tmp_path, xla_cache):
    """`python -m edm2_jax.main --config=configs/fashion_mnist.py:tiny --config.x=...`
    on the tiny image folder (the same programs as `runs`, so compiled ones are reused)."""
    overrides = {**TINY_OVERRIDES, "data.path": runs["data"]}
    r = _cli(f"{FMNIST_CONFIG}:tiny", tmp_path / "run", overrides,
             {"JAX_COMPILATION_CACHE_DIR": xla_cache,
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    _check_cli_outputs(tmp_path / "run", [2, 4])


@pytest.mark.slow
@pytest.mark.skipif(not FMNIST_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_cli_fashion_mnist_tiny(tmp_path):
    """The documented smoke test, unchanged: Fashion-MNIST 32x32, 8 steps of 32."""
    r = _cli(f"{FMNIST_CONFIG}:tiny", tmp_path / "run", {})
    assert r.returncode == 0, r.stderr[-3000:]
    _check_cli_outputs(tmp_path / "run", [4, 8])


# --------------------------------------------------------------------------------------
# Evaluation during training (config.eval)

EVAL_OVERRIDES = {"eval.metrics": "cls", "eval.num_images": 8, "eval.num_steps": 2,
                  "eval.batch_size": 8, "eval.classifier_epochs": 1,
                  "eval.classifier_batch_size": 8}


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_eval_during_training_logs_the_metric_of_the_snapshot_ema(tmp_path, monkeypatch,
                                                                   xla_cache):
    """With eval.metrics='cls' the run logs eval/fd_cls etc. at its snapshot; the logged
    numbers are those of the snapshot's largest EMA measured afterwards from the snapshot
    on disk (same seeds, same classifier from the cache), and the tracked EMA is the one
    evaluated (the online weights give other numbers)."""
    from edm2_jax import nets
    from edm2_jax.sampling import seed_images
    from edm2_jax.evaluation.metrics import Metrics
    from edm2_jax.evaluation.classifier import TrainConfig
    monkeypatch.setenv("EDM2_JAX_CACHE", str(tmp_path / "cache"))
    data = make_image_folder(tmp_path / "data")
    run = tmp_path / "run"
    cfg = tiny_config(data, **EVAL_OVERRIDES)
    loop.train_and_evaluate(cfg, str(run))
    rows = [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/fd_cls" in r]
    assert [r["step"] for r in evals] == [4]  # one snapshot, at the end
    logged = evals[0]
    for k in ("eval/fd_cls", "eval/kid_cls", "eval/precision_cls", "eval/recall_cls"):
        assert np.isfinite(logged[k]), k
    assert 0.0 <= logged["eval/precision_cls"] <= 1.0 and 0.0 <= logged["eval/recall_cls"] <= 1.0

    suite = Metrics(["cls"], 8, data_config=cfg.data,
                    classifier_config=TrainConfig(epochs=1, batch_size=8), log=False)

    def measure(ema):
        net, variables, _ = nets.load_net(str(run / "snapshots" / "4"), ema)
        imgs = np.concatenate([b for _, b in seed_images.generate_images(
            net, variables, list(range(8)), batch_size=8, sampler=Heun(2), progress=False)])
        return suite(imgs)

    again = measure("0.100")
    for k in ("fd_cls", "kid_cls", "precision_cls", "recall_cls"):
        np.testing.assert_allclose(logged[f"eval/{k}"], again[k], rtol=1e-4, atol=1e-6)
    other = measure("0.050")
    assert abs(other["fd_cls"] - logged["eval/fd_cls"]) > 1e-6 * abs(logged["eval/fd_cls"])


def test_eval_of_an_untracked_ema_fails_before_any_step(tmp_path):
    data = make_image_folder(tmp_path / "data")
    cfg = tiny_config(data, **EVAL_OVERRIDES, **{"eval.sigma_rel": 0.2})
    with pytest.raises(ValueError, match=r"eval.sigma_rel=0.2 is not a tracked EMA"):
        loop.train_and_evaluate(cfg, str(tmp_path / "run"))
    assert _steps(tmp_path / "run") == []
    cfg = tiny_config(data, **{**EVAL_OVERRIDES, "eval.metrics": "cls,is"})
    with pytest.raises(ValueError, match=r"unknown metrics \['is'\]"):
        loop.train_and_evaluate(cfg, str(tmp_path / "run2"))


def test_mode_eval_of_the_reference_set_itself_is_the_perfect_score(tmp_path, monkeypatch):
    """`--mode=eval` (main_eval) of all 16 training images against the train split:
    identical sets, so FD 0 (to float64 round-off of a rank-deficient covariance),
    precision and recall 1; an image folder of the same files gives the same numbers;
    asking for more images than exist is an error naming --num_images."""
    from edm2_jax.evaluation.commands import main_eval
    from edm2_jax.evaluation.classifier import TrainConfig
    monkeypatch.setenv("EDM2_JAX_CACHE", str(tmp_path / "cache"))
    data = make_image_folder(tmp_path / "data")
    kw = dict(num_images=16, metrics="cls", ref=None, data_config=tiny_config(data).data,
              batch_size=8, ref_split="train",
              classifier_config=TrainConfig(epochs=1, batch_size=8))
    split = main_eval(images_dir=None, net_path=None, data_split_images="train", **kw)
    folder = main_eval(images_dir=str(data), net_path=None, **kw)
    for res in (split, folder):
        assert res["fd_cls"] < 1e-6
        assert res["precision_cls"] == 1.0 and res["recall_cls"] == 1.0
    with pytest.raises(ValueError, match="fewer than --num_images=17"):
        main_eval(images_dir=str(data), net_path=None, **dict(kw, num_images=17))
