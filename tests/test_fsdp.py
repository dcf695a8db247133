"""Scale-out (sharding.py): the `('data', 'fsdp')` mesh, FSDP shardings of params, Adam
state and EMAs, and bfloat16 compute.

The claim for every mesh is the one of data parallelism: the same step on 8 devices, with
the batch split over all of them and (FSDP) each weight, Adam moment and EMA split along
`'fsdp'`, is the single-device step up to float32 summation order (<= 1e-6 relative),
with and without gradient accumulation. Multi-device runs are subprocesses with 8
simulated CPU devices (XLA_FLAGS must be set before jax is imported), all cases in one
process so that jax starts once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from edm2_jax import sharding as shard_lib
from edm2_jax import train
from tests.test_train import (REPO, _rel, _steps, _worst, make_image_folder,  # noqa: F401
                              random_batch, random_state, step_config, tiny_config, xla_cache)

# (data, fsdp, batch_per_device) on 8 devices; batch 16, so batch_per_device 1 = 2
# interleaved micro-batches. The first (data parallel, FSDP and accumulation at once) runs
# in the quick suite, the others (each alone) with the slow tests.
MESH_CASES = [(2, 4, 1), (8, 1, 0), (1, 8, 0), (2, 4, 0)]
QUICK_CASES = (0,)
CASE_PARAMS = [pytest.param(i, id=f"data{d}-fsdp{f}-accum{2 if b else 1}",
                            marks=() if i in QUICK_CASES else pytest.mark.slow)
               for i, (d, f, b) in enumerate(MESH_CASES)]


def test_fsdp_spec_splits_the_largest_divisible_axis():
    assert shard_lib.fsdp_spec((3, 3, 16, 32), 4) == P(None, None, None, "fsdp")
    assert shard_lib.fsdp_spec((3, 3, 64, 32), 4) == P(None, None, "fsdp")
    # Ties go to the later axis: output channels, local to forced weight normalisation.
    assert shard_lib.fsdp_spec((32, 32), 8) == P(None, "fsdp")
    assert shard_lib.fsdp_spec((3, 3, 8, 6), 4) == P(None, None, "fsdp")   # 6 % 4 != 0
    assert shard_lib.fsdp_spec((3, 3, 5, 6), 4) == P()                      # nothing divides
    assert shard_lib.fsdp_spec((), 4) == P()                                # scalars (gains)
    assert shard_lib.fsdp_spec((3, 3, 16, 32), 1) == P()                    # no FSDP


def test_mesh_sizes_must_multiply_to_the_devices():
    n = jax.device_count()
    mesh = shard_lib.make_mesh()
    assert dict(mesh.shape) == {"data": n, "fsdp": 1}
    with pytest.raises(ValueError, match="mesh.fsdp=3 must be >= 1 and divide"):
        shard_lib.make_mesh(fsdp=3 * n)
    with pytest.raises(ValueError, match=r"set --config.mesh.data=-1"):
        shard_lib.make_mesh(data=2 * n)


def run_steps_on_mesh(config, mesh, num_accum: int = 1, steps: int = 2):
    """`steps` steps from `test_train.random_state` with the state sharded by
    `sharding.state_shardings`; returns `(states, metrics, shard_shapes)` as numpy, with
    `shard_shapes` the shape of device 0's piece of every state leaf after the last step
    (keyed by path)."""
    state, net, tx = random_state(config)
    shardings = shard_lib.state_shardings(mesh, state)
    fn = train.jit_train_step(train.make_train_step(config, net, tx, num_accum), mesh,
                              shardings)
    states, metrics = [], []
    for i in range(steps):
        state, m = fn(state, random_batch(config, i))
        states.append(jax.device_get(state))
        metrics.append(jax.device_get(m))
    shard_shapes = {jax.tree_util.keystr(path): list(x.addressable_shards[0].data.shape)
                    for path, x in jax.tree_util.tree_leaves_with_path(state)}
    return states, metrics, shard_shapes


def _mesh_cases_npz(out: str, cases: list[int]) -> None:
    """In a fresh process with 8 simulated CPU devices: two steps on the meshes
    `MESH_CASES[i] for i in cases`, saved as `<case>/<leaf index>` arrays plus the shard
    shapes as JSON."""
    assert jax.device_count() == 8, jax.devices()
    arrays, shapes = {}, {}
    for case in cases:
        data, fsdp, per_device = MESH_CASES[case]
        config = step_config()
        config.batch_per_device = per_device
        mesh = shard_lib.make_mesh(data=data, fsdp=fsdp)
        num_accum = train.num_micro_batches(config, mesh.size)
        assert num_accum == (2 if per_device else 1)
        states, metrics, shard_shapes = run_steps_on_mesh(config, mesh, num_accum)
        for i, leaf in enumerate(jax.tree.leaves((states, metrics))):
            arrays[f"{case}/{i}"] = leaf
        shapes[case] = shard_shapes
    np.savez(out, shapes=json.dumps(shapes), **arrays)


@pytest.fixture(scope="module")
def reference():
    """Two steps on one device, one batch of 16 (the reference of every mesh)."""
    config = step_config()
    states, metrics, _ = run_steps_on_mesh(config, shard_lib.make_mesh(1))
    return config, states, metrics


@pytest.fixture(scope="module")
def mesh_cases(reference, tmp_path_factory):
    """`get(case) -> (states, metrics, shard_shapes)` of `_mesh_cases_npz`; the quick
    cases run together in one subprocess, the slow ones in another."""
    done: dict = {}

    def get(case: int):
        if case not in done:
            group = [i for i in range(len(MESH_CASES))
                     if (i in QUICK_CASES) == (case in QUICK_CASES)]
            done.update(_run_mesh_cases(reference, tmp_path_factory, group))
        return done[case]
    return get


def _run_mesh_cases(reference, tmp_path_factory, cases: list[int]) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "cases.npz"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_fsdp import _mesh_cases_npz
        _mesh_cases_npz({str(out)!r}, {cases!r})
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    _, states, metrics = reference
    treedef = jax.tree.structure((states, metrics))
    results = {}
    with np.load(out) as f:
        shapes = json.loads(str(f["shapes"]))
        for case in cases:
            leaves = [f[f"{case}/{i}"] for i in range(treedef.num_leaves)]
            s, m = jax.tree.unflatten(treedef, leaves)
            results[case] = (s, m, shapes[str(case)])
    return results


def _gradient_scale(opt_state):
    """Adam's state with the second moment `nu` (~ g^2, so twice the relative rounding
    error of the gradient) replaced by its square root, to compare at the gradient's
    precision."""
    def f(path, x):
        is_nu = any(getattr(k, "name", getattr(k, "key", None)) == "nu" for k in path)
        return np.sqrt(x) if is_nu else x
    return jax.tree_util.tree_map_with_path(f, opt_state)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_step_on_8_devices_equals_single_device(reference, mesh_cases, case):
    """Two steps on 8 devices (data parallel, FSDP, both, with 2 micro-batches) give the
    single-device weights, Adam state and EMAs to float32 summation-order error
    (<= 1e-6 relative; measured 8e-8 .. 7.4e-7)."""
    _, ref_states, ref_metrics = reference
    states, metrics, _ = mesh_cases(case)
    for s, r in zip(states, ref_states):
        for key in ("params", "ema"):
            assert _worst(s[key], r[key]) <= 1e-6, key
        assert _worst(_gradient_scale(s["opt_state"]), _gradient_scale(r["opt_state"])) <= 1e-6
        np.testing.assert_array_equal(s["rng"], r["rng"])
        assert int(s["step"]) == int(r["step"])
    for m, r in zip(metrics, ref_metrics):
        np.testing.assert_allclose(m["objective"], r["objective"], rtol=1e-6)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fsdp_really_splits_the_state(reference, mesh_cases, case):
    """Each device holds 1/fsdp of every weight, Adam moment and EMA with an axis
    divisible by fsdp (all of this network's weights but the scalar gains), and a full
    copy of the step counter, PRNG key and Fourier buffers."""
    _, (ref_state, _), _ = reference
    _, fsdp, _ = MESH_CASES[case]
    shard_shapes = mesh_cases(case)[2]
    split = 0
    for path, x in jax.tree_util.tree_leaves_with_path(ref_state):
        name = jax.tree_util.keystr(path)
        want = list(x.shape)
        if name.split("'")[1] in shard_lib.FSDP_STATE_KEYS:
            spec = shard_lib.fsdp_spec(x.shape, fsdp)
            if spec != P():
                want[len(spec) - 1] //= fsdp
                split += 1
        assert shard_shapes[name] == want, name
    n_weights = sum(np.ndim(x) > 0 for x in jax.tree.leaves(ref_state["params"]))
    # params + Adam mu, nu + 2 EMAs, every weight of which has 8 output channels.
    assert split == (5 * n_weights if fsdp > 1 else 0)


def test_bfloat16_compute_keeps_float32_state(reference):
    """network.dtype='bfloat16': the network runs in bfloat16 but params, Adam moments
    and EMAs stay float32, and the step is the float32 step to bfloat16 precision
    (objective within 1%, update direction cosine > 0.99)."""
    _, (ref, _), (ref_m, _) = reference
    config = step_config()
    config.network.dtype = "bfloat16"
    states, metrics, _ = run_steps_on_mesh(config, shard_lib.make_mesh(1), steps=1)
    (s,), (m,) = states, metrics
    for key in ("params", "opt_state", "ema"):
        dtypes = {x.dtype for x in jax.tree.leaves(s[key])}
        assert dtypes - {np.dtype(np.int32)} == {np.dtype(np.float32)}, (key, dtypes)
    assert np.isfinite(m["objective"])
    np.testing.assert_allclose(m["objective"], ref_m["objective"], rtol=1e-2)
    state0, _, _ = random_state(config)
    start = jax.device_get(jax.tree.map(jnp.asarray, state0["params"]))
    from edm2_jax.mp import force_normalize
    start = jax.device_get(force_normalize(start))
    d_bf16 = np.concatenate([np.ravel(a - b) for a, b in
                             zip(jax.tree.leaves(s["params"]), jax.tree.leaves(start))])
    d_f32 = np.concatenate([np.ravel(a - b) for a, b in
                            zip(jax.tree.leaves(ref["params"]), jax.tree.leaves(start))])
    cos = d_bf16 @ d_f32 / (np.linalg.norm(d_bf16) * np.linalg.norm(d_f32))
    assert cos > 0.99, cos


# --------------------------------------------------------------------------------------
# train_and_evaluate with FSDP: a sharded checkpoint, resumed on another mesh


def _fsdp_run(data: str, workdir: str) -> None:
    """In a process with 8 simulated CPU devices: the tiny run to step 2 on a
    data 2 x fsdp 4 mesh."""
    assert jax.device_count() == 8, jax.devices()
    train.train_and_evaluate(tiny_config(data, total_kimg=0.016, **{"mesh.fsdp": 4}), workdir)


def _close(a, b, tensors: float, scalars: float) -> None:
    """Every array of `a` within `tensors` (scalars: `scalars`) of `b`, relative."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert _rel(x, y) <= (tensors if np.ndim(y) else scalars), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_fsdp_run_checkpoints_and_resumes_on_one_device(tmp_path, xla_cache):
    """A run on 8 devices with FSDP (data 2 x fsdp 4) writes a sharded step-2 checkpoint
    and EMA snapshot equal to the single-device run's and readable on one device; resumed
    on 1 device (a different mesh) it ends where the single-device run ends.

    From the real init (gains 0) the scalar gains' gradients are sums over every pixel
    of the batch with heavy cancellation and the gains stay tiny (~lr), so summation
    order shows there: at step 2 tensors agree to <= 1e-6 relative and scalars to <= 1e-4
    (measured 1.7e-6); two steps later every gradient has been scaled by those gains,
    so all agree to <= 1e-4 (measured 1.2e-5)."""
    from edm2_jax import checkpoint_train as ct
    data = make_image_folder(tmp_path / "data")
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    train.train_and_evaluate(tiny_config(data), str(single))
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_fsdp import _fsdp_run
        _fsdp_run({str(data)!r}, {str(sharded)!r})
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=xla_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh {'data': 2, 'fsdp': 4}" in r.stdout
    assert _steps(sharded) == [2]

    def state(run, step):  # numpy, readable on 1 device although written by 8
        s = ct.restore_numpy(str(run / "checkpoints" / str(step) / "default"))
        s["opt_state"] = _gradient_scale(s["opt_state"])
        return s

    for key in ("params", "opt_state", "ema"):
        _close(state(sharded, 2)[key], state(single, 2)[key], 1e-6, 1e-4)
    ema, _ = ct.restore_snapshot(str(sharded), 2)  # the EMA snapshot, on 1 device
    _close(ema, state(single, 2)["ema"], 1e-6, 1e-4)
    # Resumed on one device (mesh.fsdp 4 -> 1 may change between restarts).
    res = train.train_and_evaluate(tiny_config(data), str(sharded))
    assert res["finished"] and _steps(sharded) == [2, 4]
    for key in ("params", "opt_state", "ema"):
        _close(state(sharded, 4)[key], state(single, 4)[key], 1e-4, 1e-4)
