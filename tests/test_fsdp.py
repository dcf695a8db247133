"""Scale-out (sharding.py): the `('data', 'fsdp')` mesh, FSDP shardings of every network
of the train state (params, Adam state, EMAs, and an objective's teacher, fake denoiser
and its Adam state), and bfloat16 compute.

The claim for every mesh is the one of data parallelism: the same step on 8 devices, with
the batch split over all of them and (FSDP) each weight, Adam moment and EMA split along
`'fsdp'`, is the single-device step up to float32 summation order, with and without
gradient accumulation. The bound is derived, not measured: `test_train.STEP_TOL`
= eps32 sqrt(n) of each tensor's scale, n = 16 * 8 * 8 * 16 the longest reduction of the
step (tests/tolerances.py). Negative controls (FSDP shards on the wrong devices, a dropped
micro-batch) show that a broken step is off by orders of magnitude more. Multi-device
runs are subprocesses with 8 simulated CPU devices (XLA_FLAGS must be set before jax is
imported), all cases in one process so that jax starts once.
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

from edm2_jax import configs
from edm2_jax import objectives
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import loop, setup
from edm2_jax.training import step as step_lib
from tests.cpu_devices import tree_from_process
from tests.test_train import (REPO, STEP_TOL, _steps, make_image_folder,  # noqa: F401
                              random_batch, random_state, state_err, step_config,
                              step_reduction_terms, tiny_config, xla_cache)
from tests.tolerances import reorder_tol, scaled_err, tree_err

# (data, fsdp, batch_per_device) on 8 devices; batch 16, so batch_per_device 1 = 2
# interleaved micro-batches. The first (data parallel, FSDP and accumulation at once) runs
# in the quick suite, the others (each alone) with the slow tests.
MESH_CASES = [(2, 4, 1), (8, 1, 0), (1, 8, 0), (2, 4, 0)]
QUICK_CASES = (0,)
CONTROL_CASE = 0  # the negative controls run on this mesh (data 2 x fsdp 4, 2 micro-batches)
CONTROLS = ("fsdp_shards_rotated", "micro_batch_dropped")
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


def test_state_spec_splits_every_entry_but_counter_key_and_buffers():
    """One rule for the whole train state: an array of any entry is split by `fsdp_spec`
    (an objective's own entries too), those of the step counter, the PRNG key and the
    MPFourier buffers are not, even where an axis divides fsdp (the key's 2 words at
    fsdp 2)."""
    def spec(top, shape, fsdp):
        return shard_lib.state_spec((jax.tree_util.DictKey(top),), shape, fsdp)

    for top in ("params", "opt_state", "ema", "teacher", "fake", "fake_opt", "anything"):
        assert spec(top, (3, 3, 16, 32), 4) == shard_lib.fsdp_spec((3, 3, 16, 32), 4), top
        assert spec(top, (3, 3, 16, 32), 1) == P(), top
    assert spec("rng", (2,), 2) == P()
    assert spec("buffers", (64,), 8) == P()
    assert spec("step", (), 8) == P()


def test_mesh_sizes_must_multiply_to_the_devices():
    n = jax.device_count()
    mesh = shard_lib.make_mesh()
    assert dict(mesh.shape) == {"data": n, "fsdp": 1}
    with pytest.raises(ValueError, match="mesh.fsdp=3 must be >= 1 and divide"):
        shard_lib.make_mesh(fsdp=3 * n)
    with pytest.raises(ValueError, match=r"set --config.mesh.data=-1"):
        shard_lib.make_mesh(data=2 * n)


def run_steps_on_mesh(config, mesh, num_accum: int = 1, steps: int = 2,
                      controls: bool = False):
    """`steps` steps from `test_train.random_state` with the state sharded by
    `sharding.state_shardings`; returns `(states, metrics, shard_shapes)` as numpy, with
    `shard_shapes` the shape of device 0's piece of every state leaf after the last step
    (keyed by path). With `controls`, also `{name: state}` after one deliberately broken
    step of the same compiled function (`broken_inputs`)."""
    state, net, tx = random_state(config)
    shardings = shard_lib.state_shardings(mesh, state)
    fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, num_accum), mesh,
                                 shardings)
    states, metrics = [], []
    for i in range(steps):
        state, m = fn(state, random_batch(config, i))
        states.append(jax.device_get(state))
        metrics.append(jax.device_get(m))
    shard_shapes = {jax.tree_util.keystr(path): list(x.addressable_shards[0].data.shape)
                    for path, x in jax.tree_util.tree_leaves_with_path(state)}
    if not controls:
        return states, metrics, shard_shapes
    broken = {name: jax.device_get(fn(s, b)[0])
              for name, (s, b) in broken_inputs(config, mesh, num_accum).items()}
    return states, metrics, shard_shapes, broken


def broken_inputs(config, mesh, num_accum: int) -> dict:
    """`{name: (state, batch)}` for the first step, each broken in one way a real bug
    would break it:

    - `fsdp_shards_rotated`: every FSDP-split weight and EMA holds, on device k, the shard
      of device k + 1 (shards assembled in the wrong device order);
    - `micro_batch_dropped`: the images and labels of the last micro-batch (the rows that
      `make_train_step` interleaves into it) replaced by those of the first, as if the
      accumulation loop had consumed the first micro-batch twice and never the last.
    """
    fsdp = mesh.shape[shard_lib.FSDP]
    state, _, _ = random_state(config)

    def rotate(x):
        spec = shard_lib.fsdp_spec(np.shape(x), fsdp)
        if spec == P():
            return x
        axis = len(spec) - 1
        return np.roll(x, -x.shape[axis] // fsdp, axis=axis)

    rotated = dict(state, params=jax.tree.map(rotate, state["params"]),
                   ema=jax.tree.map(rotate, state["ema"]))
    batch = random_batch(config, 0)
    dropped = {k: v.copy() for k, v in batch.items()}
    for v in dropped.values():
        v[num_accum - 1::num_accum] = v[0::num_accum]
    out = {"micro_batch_dropped": (random_state(config)[0], dropped)}
    if fsdp > 1:
        out["fsdp_shards_rotated"] = (rotated, batch)
    return out


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
        num_accum = step_lib.num_micro_batches(config, mesh.size)
        assert num_accum == (2 if per_device else 1)
        controls = case == CONTROL_CASE
        states, metrics, shard_shapes, *broken = run_steps_on_mesh(config, mesh, num_accum,
                                                                   controls=controls)
        for i, leaf in enumerate(jax.tree.leaves((states, metrics))):
            arrays[f"{case}/{i}"] = leaf
        for name, state in (broken[0] if controls else {}).items():
            for i, leaf in enumerate(jax.tree.leaves(state)):
                arrays[f"{name}/{i}"] = leaf
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

    def get(case: int | str):
        """`case`: an index of MESH_CASES, or 'controls' for `{name: state}` of the
        negative controls (run with CONTROL_CASE)."""
        if case not in done:
            quick = (CONTROL_CASE if case == "controls" else case) in QUICK_CASES
            group = [i for i in range(len(MESH_CASES)) if (i in QUICK_CASES) == quick]
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
    state_def = jax.tree.structure(states[0])
    with np.load(out) as f:
        shapes = json.loads(str(f["shapes"]))
        for case in cases:
            leaves = [f[f"{case}/{i}"] for i in range(treedef.num_leaves)]
            s, m = jax.tree.unflatten(treedef, leaves)
            results[case] = (s, m, shapes[str(case)])
        if CONTROL_CASE in cases:
            results["controls"] = {
                name: jax.tree.unflatten(state_def, [f[f"{name}/{i}"]
                                                     for i in range(state_def.num_leaves)])
                for name in CONTROLS}
    return results


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_step_on_8_devices_equals_single_device(reference, mesh_cases, case):
    """Two steps on 8 devices (data parallel, FSDP, both, with 2 micro-batches) give the
    single-device weights, Adam state and EMAs to float32 summation-order error:
    STEP_TOL = eps32 sqrt(16 * 8 * 8 * 16) = 1.5e-5 of each tensor's scale (scalar gains
    and their Adam moments: of the tree's magnitude); measured on an AMD EPYC 4.2e-8 ..
    1.2e-6 (Adam's moments of a decoder conv, the worst), objective <= 7.5e-7."""
    _, ref_states, ref_metrics = reference
    states, metrics, _ = mesh_cases(case)
    for s, r in zip(states, ref_states):
        err, where = state_err(s, r)
        assert err <= STEP_TOL, (err, where)
        np.testing.assert_array_equal(s["rng"], r["rng"])
        assert int(s["step"]) == int(r["step"])
    for m, r in zip(metrics, ref_metrics):
        assert scaled_err(m["objective"], r["objective"]) <= STEP_TOL


def test_broken_step_on_8_devices_fails_the_bound(reference, mesh_cases):
    """Negative controls for the bound above, on the data 2 x fsdp 4 mesh with 2
    micro-batches (`broken_inputs`): FSDP shards on the wrong devices, or the last
    micro-batch dropped, must leave the first step more than 1000 x STEP_TOL = 1.5e-2
    away from the single-device step. Measured on an AMD EPYC: rotated shards 1.87
    (weights of emb_label), dropped micro-batch 0.51 (Adam's first moment of a decoder
    conv; 1.4e-2 on the weights alone), against 1.2e-6 for the correct step."""
    _, (ref, _), _ = reference
    controls = mesh_cases("controls")
    assert sorted(controls) == sorted(CONTROLS)
    for name, state in controls.items():
        err, where = state_err(state, ref)
        assert err > 1000 * STEP_TOL, (name, err, where)


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
        if name.split("'")[1] not in shard_lib.REPLICATED_STATE_KEYS:
            spec = shard_lib.fsdp_spec(x.shape, fsdp)
            if spec != P():
                want[len(spec) - 1] //= fsdp
                split += 1
        assert shard_shapes[name] == want, name
    n_weights = sum(np.ndim(x) > 0 for x in jax.tree.leaves(ref_state["params"]))
    # params + Adam mu, nu + 2 EMAs, every weight of which has 8 output channels.
    assert split == (5 * n_weights if fsdp > 1 else 0)


def _dmd_state_shards(out: str) -> None:
    """In a process with 8 simulated CPU devices: the shard shape of every array of a
    DMD train state on a data 1 x fsdp 8 mesh, as the run shards it
    (`setup.setup_model`: shapes and shardings, nothing allocated), in the state's leaf
    order, then the bytes per device the plan counts for that state
    (`sharding.state_bytes`)."""
    assert jax.device_count() == 8, jax.devices()
    config = dmd_config()
    model = setup.setup_model(config, setup.Start(objectives.from_config(config)))
    assert dict(model.mesh.shape) == {"data": 1, "fsdp": 8}
    shards = [np.asarray(s.shard_shape(x.shape), np.int64) for x, s in
              zip(jax.tree.leaves(model.abstract_state), jax.tree.leaves(model.state_sharding))]
    np.savez(out, *shards, np.int64(shard_lib.state_bytes(model.abstract_state, 8)))


def dmd_config():
    """The test step's network (8 channels throughout) trained by distribution
    matching (teacher, fake denoiser and its Adam state in the train state) at fsdp 8."""
    config = step_config()
    configs.with_objective(config, "dmd")
    config.distill.update(teacher="(shapes only)", steps=2, teacher_steps=4)
    config.mesh.fsdp = 8
    return config


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_fsdp_splits_every_network_of_a_dmd_state(tmp_path):
    """On 8 devices with fsdp 8, every array of a DMD train state with an axis divisible
    by 8 is split 8 ways along `fsdp_spec`'s axis, in the generator's params, Adam
    moments and EMAs and in the objective's frozen teacher, fake denoiser and the fake's
    Adam moments alike; the step counter, PRNG key and Fourier buffers are whole on
    every device; and the bytes per device the plan counts (`sharding.state_bytes`) are
    the sum of the shards."""
    from edm2_jax.training import optim, state as state_lib
    config = dmd_config()
    objective = objectives.from_config(config)
    assert objective.name == "dmd"
    net = state_lib.make_network(config)
    tx = optim.make_optimizer(config.optim, int(config.batch_size))
    state = jax.eval_shape(lambda r: state_lib.init_train_state(config, net, tx, r,
                                                                objective=objective),
                           jax.random.PRNGKey(0))
    shards, state_bytes = tree_from_process("tests.test_fsdp:_dmd_state_shards",
                                            tmp_path / "shards.npz", (state, 0))
    split, total = {}, 0
    for (path, x), shard in zip(jax.tree_util.tree_leaves_with_path(state),
                                jax.tree.leaves(shards)):
        top, shard, want = path[0].key, list(shard), list(x.shape)
        if top not in shard_lib.REPLICATED_STATE_KEYS and any(n % 8 == 0 for n in want):
            want[len(shard_lib.fsdp_spec(x.shape, 8)) - 1] //= 8
            split[top] = split.get(top, 0) + 1
        assert shard == want, (jax.tree_util.keystr(path), shard)
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    n_weights = sum(np.ndim(x) > 0 for x in jax.tree.leaves(state["params"]))
    # Every weight has 8 output channels: each network's copy of it is split.
    assert split == {"params": n_weights, "opt_state": 2 * n_weights,
                     "ema": 2 * n_weights, "teacher": n_weights, "fake": n_weights,
                     "fake_opt": 2 * n_weights}, split
    assert any(np.shape(x) and np.shape(x)[-1] % 8 == 0
               for x in jax.tree.leaves(state["buffers"]))  # divisible, yet replicated
    assert int(state_bytes) == total


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
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
    from edm2_jax.model.mp import force_normalize
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
    loop.train_and_evaluate(tiny_config(data, total_kimg=0.016, **{"mesh.fsdp": 4}), workdir)


@pytest.mark.slow
def test_fsdp_run_checkpoints_and_resumes_on_one_device(tmp_path, xla_cache):
    """A run on 8 devices with FSDP (data 2 x fsdp 4) writes a sharded step-2 checkpoint
    and EMA snapshot equal to the single-device run's and readable on one device; resumed
    on 1 device (a different mesh) it ends where the single-device run ends.

    At step 2 params, Adam moments and EMAs agree to the step's summation-order bound
    (`state_err` <= tol = eps32 sqrt(8 * 32 * 32 * 16) = 4.3e-5; scalars scaled by their
    tree's magnitude). From the real init (gains 0) the scalar gains are still tiny (~lr)
    at step 2, and every later gradient is proportional to them: the step-4 state carries,
    besides its own summation error, the step-2 relative error of each gain on its path,
    so it must agree to tol + sum over the gains of |dgain| / |gain| at step 2. Measured
    on an AMD EPYC: step 2 2.2e-6; gains' relative errors <= 7.7e-7 (sum 9.6e-7); step 4
    5.0e-6 against 4.4e-5."""
    from edm2_jax.run import network_dir, snapshots
    data = make_image_folder(tmp_path / "data")
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    loop.train_and_evaluate(tiny_config(data), str(single))
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
        return network_dir.restore_numpy(str(run / "checkpoints" / str(step) / "default"))

    tol = reorder_tol(step_reduction_terms(tiny_config(data)))
    ref2 = state(single, 2)
    err2 = state_err(state(sharded, 2), ref2)
    assert err2[0] <= tol, err2
    ema, _ = snapshots.restore_snapshot(str(sharded), 2)  # the EMA snapshot, on 1 device
    assert tree_err(ema, ref2["ema"])[0] <= tol
    # Resumed on one device (mesh.fsdp 4 -> 1 may change between restarts).
    res = loop.train_and_evaluate(tiny_config(data), str(sharded))
    assert res["finished"] and _steps(sharded) == [2, 4]
    carried = sum(abs(float(x) - float(y)) / max(abs(float(y)), 1e-30)
                  for x, y in zip(jax.tree.leaves(state(sharded, 2)["params"]),
                                  jax.tree.leaves(ref2["params"])) if np.size(y) == 1)
    err4 = state_err(state(sharded, 4), state(single, 4))
    print(f"step 2: {err2} (bound {tol:.2e}); gains carry {carried:.2e}; step 4: {err4} "
          f"(bound {tol + carried:.2e})")
    assert err4[0] <= tol + carried, err4
