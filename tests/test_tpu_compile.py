"""The training step and the sampler compile for real TPU slices on this CPU (libtpu,
`edm2_jax/planner/plan.py`), as the run shards them: a single-host v5e 2x2 and a v5p
slice of 4 hosts with FSDP. The compiled program's shardings are the run's, its HBM holds
the train state's own bytes split by fsdp (a distribution-matching state's teacher and
fake denoiser too), and every convolution and matmul of the bf16 TPU program outside the
float32 layers takes bf16 operands. A distillation is planned from its teacher's network
config without its weights. `--mode=plan` refuses batches that cannot run in one line
before it compiles, and writes no file it was not asked for (libtpu's logs, JAX's
compilation cache).

Needs libtpu (`pip install -e ".[tpu]"`); without it the compiling tests skip, unless
`EDM2_JAX_REQUIRE_LIBTPU=1` (set by .ci/run), which makes a missing libtpu a failure.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from edm2_jax import configs, objectives, process
from edm2_jax.analysis import precision
from edm2_jax.planner import fit, plan, tpu_slices
from edm2_jax.model.networks import count_params
from edm2_jax.training import setup
from edm2_jax.training import sharding as shard_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



@pytest.fixture(scope="module")
def libtpu():
    """Skips without libtpu (fails instead under `EDM2_JAX_REQUIRE_LIBTPU=1`); sets what
    compiling for a TPU without one needs: no metadata server to ask, and the other
    pytest worker may hold libtpu's lock file."""
    if not plan.libtpu_installed():
        if os.environ.get("EDM2_JAX_REQUIRE_LIBTPU") == "1":
            pytest.fail(f"EDM2_JAX_REQUIRE_LIBTPU=1 but libtpu is not installed: {plan.INSTALL}")
        pytest.skip(f"needs libtpu: {plan.INSTALL}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPU_SKIP_MDS_QUERY", "1")
        mp.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        mp.setenv("TPU_LOG_DIR", "disabled")  # no log files in /tmp/tpu_logs
        yield


def tiny_config(fsdp: int = 1) -> object:
    """A small img512 network (8x8x4 latents, 10 classes, 2 levels) in bfloat16, batch 32.
    Its channels are multiples of 128, the TPU's tile, so that its arrays' HBM is their
    own bytes (narrower channels are padded: 32 channels take 4x their bytes)."""
    c = configs.preset_config("img512-xs")
    c.network.update(img_resolution=8, img_channels=4, label_dim=10, model_channels=128,
                     channel_mult=(1, 2), num_blocks=1, attn_resolutions=(4,), dropout=0.0,
                     dtype="bfloat16")
    c.batch_size = 32
    c.batch_per_device = 0
    c.mesh.fsdp = fsdp
    return c


class Compiled:
    """One compile of the tiny step and sampler for a slice: what the tests read."""

    def __init__(self, slice_name: str, fsdp: int):
        self.config = plan.tpu_config(tiny_config(fsdp))
        self.topology = plan.open_topology(tpu_slices.parse_slice(slice_name))
        objective = objectives.from_config(self.config)
        self.model = setup.setup_model(self.config, setup.Start(objective),
                                       devices=list(self.topology.devices))
        self.step = plan.lower_step(self.config, self.model).compile()
        self.sampler = plan.lower_sampler(self.model, objective, 32, 4).compile()


# Each slice's compile takes 30-45 s of a 2-core machine: with the end-to-end tests (`ci`),
# which keeps the quick suite under its 10 minutes.
@pytest.fixture(scope="module", params=[
    pytest.param(("v5e-4", 1), id="v5e-2x2", marks=[pytest.mark.slow, pytest.mark.ci]),
    pytest.param(("v5p-32", 4), id="v5p-32-fsdp4", marks=[pytest.mark.slow, pytest.mark.ci])])
def compiled(request, libtpu) -> Compiled:
    return Compiled(*request.param)


def test_slice_names_count_chips_or_tensorcores():
    """v4/v5p names count TensorCores (2 per chip), v5e/v6e names count chips."""
    cases = {"v5p-64": (32, (2, 4, 4), 8), "v5e-16": (16, (4, 4), 4), "v4-32": (16, (2, 2, 4), 4),
             "v6e-8": (8, (2, 4), 1), "v5litepod-4": (4, (2, 2), 1), "v5p-8": (4, (2, 2, 1), 1)}
    for name, (chips, shape, hosts) in cases.items():
        s = tpu_slices.parse_slice(name)
        assert (s.chips, s.shape, s.hosts) == (chips, shape, hosts), name
    for bad in ("v5p-63", "v5p-4", "v7-8", "h100-8", "v5e-3"):
        with pytest.raises(ValueError, match="--tpu="):
            tpu_slices.parse_slice(bad)


def test_topology_has_the_slices_chips_and_hosts(libtpu):
    """One device per chip and one process per host; libtpu's v4 has one device per
    TensorCore, which the run's mesh takes in their order."""
    for name in ("v5p-64", "v5e-16", "v6e-8", "v4-32"):
        s = tpu_slices.parse_slice(name)
        t = plan.open_topology(s)
        per_chip = 2 if name.startswith("v4") else 1
        assert (len(t.devices), t.processes) == (s.chips * per_chip, s.hosts), name
        mesh = shard_lib.make_mesh(data=-1, fsdp=4, devices=t.devices)
        assert dict(mesh.shape) == {"data": len(t.devices) // 4, "fsdp": 4}


def test_compiled_shardings_are_the_runs(compiled):
    """Input and output shardings of the compiled step equal `state_shardings` and
    `batch_sharding` of the run's mesh; the state is donated and returned as it came."""
    mesh, model = compiled.model.mesh, compiled.model
    (state_in, batch_in), _ = compiled.step.input_shardings
    state_out, metrics_out = compiled.step.output_shardings
    expected = shard_lib.state_shardings(mesh, model.abstract_state)
    for got_tree in (state_in, state_out):
        got = jax.tree.leaves(got_tree)
        want = jax.tree.leaves(expected)
        shapes = [a.shape for a in jax.tree.leaves(model.abstract_state)]
        assert len(got) == len(want) == len(shapes)
        for g, w, shape in zip(got, want, shapes):
            assert g.is_equivalent_to(w, len(shape)), (g, w, shape)
    for g in jax.tree.leaves(batch_in):
        assert g.is_equivalent_to(shard_lib.batch_sharding(mesh), 2)
    assert all(m.is_fully_replicated for m in jax.tree.leaves(metrics_out))
    fsdp = mesh.shape["fsdp"]
    split = [s for s in jax.tree.leaves(state_in) if not s.is_fully_replicated]
    assert bool(split) == (fsdp > 1)


def test_hbm_holds_the_train_states_own_bytes(compiled):
    """The compiled step's arguments are the train state split by fsdp (params, Adam's
    two moments and each EMA: float32 copies of the parameters, each split over fsdp
    devices) plus the device's batch, within the TPU's padding of small arrays (vectors
    of gains and biases)."""
    c, model = compiled.config, compiled.model
    fsdp = model.mesh.shape["fsdp"]
    n_params = count_params(model.net)
    copies = 1 + 2 + len(c.ema.sigma_rels)  # params, Adam mu and nu, the power EMAs
    own = n_params * 4 * copies / fsdp
    batch = 4 * c.batch_size // model.mesh.size * (8 * 8 * 4 + 10)
    state = shard_lib.state_bytes(model.abstract_state, fsdp)
    assert own <= state <= own * 1.2 + 4096  # small replicated gains, counters
    m = compiled.step.memory_analysis()
    assert state + batch <= m.argument_size_in_bytes <= 1.02 * (state + batch) + 2**16
    assert m.alias_size_in_bytes >= state  # the state is donated: updated in place
    assert 0 < m.temp_size_in_bytes < compiled.topology.hbm_bytes


def test_xla_counts_the_model_flops(compiled):
    """XLA's per-device flop count of the compiled step is the model's (3 x the forward
    pass's convolutions and matmuls, per image on the device) without FSDP, give or take
    the elementwise work it adds and the gradients it need not compute (of the input
    images: 0.85x to 0.98x on these networks); never less than 0.8x of it. With FSDP
    the partitioner's program counts more (1.9x at fsdp 4, 2 images per device), so the
    model's count is the lower bound the plan prints."""
    model = compiled.model
    images = compiled.config.batch_size // model.mesh.size
    want = 3 * plan.forward_flops(model.net, 1) * images
    got = plan.Program.of(compiled.step, 0.0, 0.0).xla_flops
    assert got >= 0.8 * want, (got, want)
    if model.mesh.shape["fsdp"] == 1:
        assert got <= 1.3 * want, (got, want)


def test_bf16_tpu_program_keeps_the_precision_policy(compiled):
    """In XLA's TPU program of the bf16 step and sampler every convolution and dot
    outside the float32 layers takes bf16 operands."""
    for program in (compiled.step, compiled.sampler):
        text = program.as_text()
        ops = precision.hlo_matmuls(text)
        outside = [m for m in ops if not m.float32_path]
        assert outside and all(m.primitive in ("convolution", "dot") for m in ops)
        bad = precision.audit_hlo(text, "bfloat16")
        assert not bad, "\n".join(map(str, bad[:10]))
    assert len(precision.audit_hlo(compiled.step.as_text(), "float32")) == len(
        [m for m in precision.hlo_matmuls(compiled.step.as_text()) if not m.float32_path])


def dmd_tiny_config(fsdp: int) -> object:
    """`tiny_config` trained by distribution matching (1 step on a grid of 4): the train
    state holds the teacher, the fake denoiser and its Adam moments besides the EDM2
    state."""
    c = tiny_config(fsdp)
    configs.with_objective(c, "dmd")
    c.distill.update(teacher="(not read)", steps=1, teacher_steps=4)
    return c


# ~1-2 min on 2 cores: the distribution-matching step compiled for a v5e-8 at fsdp 4.
@pytest.mark.slow
@pytest.mark.ci
def test_dmd_state_is_split_as_planned(libtpu):
    """The compiled distribution-matching step on a v5e-8 at fsdp 4 holds as arguments
    the plan's bytes of its state (`sharding.state_bytes`: 9 float32 copies of the
    parameters, the generator's with its Adam moments and two EMAs, the teacher, the
    fake denoiser and its Adam moments, each split over 4 chips) plus the chip's batch;
    had the teacher and fake stayed whole on every chip, 4 of those copies would count
    4 times."""
    config = plan.tpu_config(dmd_tiny_config(4))
    topology = plan.open_topology(tpu_slices.parse_slice("v5e-8"))
    objective = objectives.from_config(config)
    assert objective.name == "dmd"
    model = setup.setup_model(config, setup.Start(objective), devices=list(topology.devices))
    fsdp = model.mesh.shape["fsdp"]
    assert fsdp == 4
    copies = 1 + 2 + len(config.ema.sigma_rels) + 1 + 1 + 2
    own = count_params(model.net) * 4 * copies / fsdp
    state = shard_lib.state_bytes(model.abstract_state, fsdp)
    assert own <= state <= own * 1.2 + 4096
    m = plan.lower_step(config, model).compile().memory_analysis()
    batch = 4 * config.batch_size // model.mesh.size * (8 * 8 * 4 + 10)
    assert state + batch <= m.argument_size_in_bytes <= 1.02 * (state + batch) + 2**16
    whole = count_params(model.net) * 4 * 4 * (1 - 1 / fsdp)  # teacher, fake, Adam's 2
    assert m.argument_size_in_bytes < state + whole / 2


def test_plan_starts_from_the_teachers_network_config_without_its_weights(tmp_path,
                                                                         monkeypatch):
    """A distillation is planned with its teacher's network (its metadata), in the
    config's dtype, and none of its weights read; a teacher not on this machine, or not
    given, plans the config's own network; each says so in one line."""
    from edm2_jax.model.networks import init_variables, precond_from_config
    from edm2_jax.objectives.distill import network_config
    from edm2_jax.run import network_dir
    cfg = dict(img_resolution=8, img_channels=4, label_dim=10, model_channels=16,
               channel_mult=(1,), num_blocks=1, attn_resolutions=(), logvar_channels=8)
    net = precond_from_config(cfg)
    shapes = jax.eval_shape(lambda k: init_variables(net, k), jax.random.PRNGKey(0))
    teacher = network_dir.save_network(
        str(tmp_path / "teacher"),
        jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), dict(shapes)), network_config(net))

    def no_weights(*args, **kwargs):
        raise AssertionError("the plan read the teacher's weights")

    for reader in ("load_network", "restore_numpy", "restore_partial"):
        monkeypatch.setattr(network_dir, reader, no_weights)
    config = plan.tpu_config(dmd_tiny_config(1))
    for path, channels, said in ((teacher, 16, "network: " + teacher),
                                 (str(tmp_path / "absent"), 128, "is not on this machine"),
                                 ("", 128, "is not given")):
        config.distill.teacher = path
        lines = []
        planned, start = fit.plan_start(config, objectives.from_config(config), lines.append)
        assert planned.network.model_channels == channels and start.init_path == path
        assert start.objective.name == "dmd"
        assert planned.network.dtype == "bfloat16"
        assert len(lines) == 1 and said in lines[0] and "no weights are read" in lines[0]
        model = setup.setup_model(planned, start, num_devices=1)
        assert jax.tree.structure(model.abstract_state["teacher"]) == \
            jax.tree.structure(model.abstract_state["params"])
        assert model.net.model_channels == channels


def test_state_too_large_is_refused_before_compiling(libtpu):
    """img512-xxl's train state and gradients (params, Adam's two moments, two EMAs, the
    gradients: 6 float32 copies of 1.5 G parameters) exceed a v5e chip's 16 GiB unsplit:
    one error names the smallest fsdp that leaves them half the HBM, and half that fsdp
    would not."""
    config = plan.tpu_config(configs.preset_config("img512-xxl"))
    topology = plan.open_topology(tpu_slices.parse_slice("v5e-16"))
    model = setup.setup_model(config, setup.Start(objectives.from_config(config)),
                              devices=list(topology.devices))
    with pytest.raises(ValueError, match=r"--config\.mesh\.fsdp=(\d+)") as e:
        fit.check_state_fits(config, topology, model.abstract_state)
    fsdp = int(e.value.args[0].split("--config.mesh.fsdp=")[1].split()[0])
    floor = count_params(model.net) * 4 * (1 + 2 + len(config.ema.sigma_rels) + 1)
    assert floor > topology.hbm_bytes
    assert floor / fsdp <= topology.hbm_bytes / 2 < floor / (fsdp // 2)


def test_dmd_state_too_large_names_the_fsdp_that_splits_all_its_networks(libtpu):
    """img512-xxl trained by distribution matching (`configs/distill.py:dmd-img512-xxl`)
    on a v5e-8: its state and gradients are 11 float32 copies of 1.5 G parameters (the
    generator's 1 + 2 Adam moments + 2 EMAs + gradient, the teacher, the fake denoiser
    with its Adam moments and gradient), 62 GiB per chip unsplit. Every one of them
    splits by fsdp, so one error names the fsdp that leaves them half the HBM, as it
    does for the EDM2 state, and half that fsdp would not."""
    config = plan.tpu_config(_distill_config("dmd-img512-xxl"))
    config.distill.teacher = "(not read)"
    topology = plan.open_topology(tpu_slices.parse_slice("v5e-8"))
    model = setup.setup_model(config, setup.Start(objectives.from_config(config)),
                              devices=list(topology.devices))
    with pytest.raises(ValueError, match=r"--config\.mesh\.fsdp=(\d+)") as e:
        fit.check_state_fits(config, topology, model.abstract_state)
    message = e.value.args[0]
    assert "teacher" in message and "fake" in message
    fsdp = int(message.split("--config.mesh.fsdp=")[1].split()[0])
    floor = count_params(model.net) * 4 * (1 + 2 + len(config.ema.sigma_rels) + 1 + 1 + 4)
    assert floor / 2**30 == pytest.approx(62.4, abs=0.1)
    assert floor / fsdp <= topology.hbm_bytes / 2 < floor / (fsdp // 2)
    config.mesh.fsdp = fsdp
    assert fit.check_state_fits(config, topology, model.abstract_state) == \
        shard_lib.state_bytes(model.abstract_state, fsdp)


def _distill_config(variant: str):
    """`configs/distill.py:VARIANT`."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "distill_config", os.path.join(ROOT, "configs", "distill.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def test_entry_point_keeps_libtpu_quiet_without_a_tpu(libtpu):
    """With libtpu installed on a host without a TPU, a command's JAX start prints nothing
    of libtpu's (the entry point leaves it the CPU that JAX picks anyway)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",)}
    code = ("from edm2_jax import process; process.setup_entry_point(); import jax; "
            "print(jax.default_backend())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    if not process.has_tpu_chip():
        assert (r.stdout, r.stderr) == ("cpu\n", "")


def test_platform_env_only_where_libtpu_would_speak():
    assert process.platform_env({}, libtpu=True, tpu_chip=False, gpu=False) == {
        "JAX_PLATFORMS": "cpu"}
    assert process.platform_env({}, libtpu=False, tpu_chip=False, gpu=False) == {}
    assert process.platform_env({}, libtpu=True, tpu_chip=True, gpu=False) == {}
    assert process.platform_env({}, libtpu=True, tpu_chip=False, gpu=True) == {}
    assert process.platform_env({"JAX_PLATFORMS": ""}, libtpu=True, tpu_chip=False,
                                gpu=False) == {}
    np.testing.assert_equal(process.has_tpu_chip("/nonexistent"), False)


def test_mesh_that_does_not_tile_the_torus_is_refused_with_the_sizes_that_do(libtpu):
    """On a v5p-128 (a 4x4x4 torus) a mesh axis of 8 devices spans no product of the
    torus's axes: one error names the fsdp sizes that lay out, and each of those does."""
    devices = plan.open_topology(tpu_slices.parse_slice("v5p-128")).devices
    with pytest.raises(ValueError, match=r"one of \[1, 4, 16, 64\]"):
        shard_lib.make_mesh(fsdp=8, devices=devices)
    for fsdp in (1, 4, 16, 64):
        assert shard_lib.make_mesh(fsdp=fsdp, devices=devices).shape["fsdp"] == fsdp


@pytest.mark.parametrize("field,value,line", [
    ("batch_size", 0, "--config.batch_size=0: the global batch must be a positive number of "
                      "images, e.g. 64"),
    ("sample_batch", -1, "--sample_batch=-1: the sampler's seeds are split over the 4 devices "
                         "of the v5e-4, so its batch is a multiple of 4, e.g. --sample_batch=4 "
                         "(0 = no sampler)"),
    ("sample_batch", 5, "--sample_batch=5: the sampler's seeds are split over the 4 devices "
                        "of the v5e-4, so its batch is a multiple of 4, e.g. --sample_batch=8 "
                        "(0 = no sampler)")],
    ids=["batch_size_0", "sample_batch_negative", "sample_batch_not_split"])
def test_plan_refuses_batches_that_cannot_run_before_compiling(libtpu, monkeypatch, field,
                                                               value, line):
    """A global batch of 0 (a ZeroDivisionError), a negative sampler batch and one that
    does not split over the slice's devices (each JAX's error after a minute of
    compiling) are one ValueError naming the flag and a value that works, before
    anything compiles."""
    monkeypatch.setattr(plan, "_compile", lambda lowered: pytest.fail("compiled"))
    config, sample_batch = tiny_config(), None
    if field == "batch_size":
        config.batch_size = value
    else:
        sample_batch = value
    topology = plan.open_topology(tpu_slices.parse_slice("v5e-4"))
    with pytest.raises(ValueError) as e:
        plan.plan_run(config, topology, sample_batch, log=lambda _: None)
    assert str(e.value) == line


def _plan_cli(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`python -m edm2_jax.main --mode=plan` of the tiny Fashion-MNIST config for a v5e-4
    with `flags`, its compilation cache under `tmp_path` and libtpu's log directory left
    to the plan: `(result, the log files libtpu wrote for it)`.

    libtpu names its log files after the process id, which the system reuses: a file of
    an earlier process with the same id is not the plan's, so only files that appeared
    while the plan ran count."""
    env = dict(os.environ, EDM2_JAX_COMPILATION_CACHE=str(tmp_path / "xla"))
    env.pop("TPU_LOG_DIR", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "edm2_jax.main", "--mode=plan", "--tpu=v5e-4",
           f"--config={ROOT}/configs/fashion_mnist.py:tiny", *flags]
    before = set(glob.glob("/tmp/tpu_logs/*"))
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        out, err = p.communicate(timeout=600)
    logs = sorted(set(glob.glob(f"/tmp/tpu_logs/*.{p.pid}")) - before)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), logs


def test_cli_plan_refuses_a_sampler_batch_in_one_line_and_writes_no_tpu_logs(libtpu,
                                                                             tmp_path):
    """`--sample_batch=5` on a v5e-4 (4 devices): one `error:` line, exit status 1, before
    anything compiles; libtpu, loaded to lay the slice out, leaves no log file in
    /tmp/tpu_logs (the plan turns its log files off)."""
    r, logs = _plan_cli(tmp_path, "--sample_batch=5")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: --sample_batch=5: the sampler's seeds are split over "
                               "the 4 devices of the v5e-4"), lines
    assert "Compiling" not in r.stdout
    assert logs == []


@pytest.mark.slow
@pytest.mark.ci
def test_cli_plan_warns_nothing_and_leaves_no_files(libtpu, tmp_path):
    """A plan prints the plan and nothing on stderr, and writes neither to JAX's
    persistent compilation cache nor libtpu's log files. The cache could not load a
    program compiled for a topology without its devices: a plan that wrote its
    programs there warned, when repeated, "Error reading persistent compilation cache
    entry"; with nothing written there is nothing to read."""
    r, logs = _plan_cli(tmp_path, "--sample_batch=0", "--config.network.channel_mult=(1,)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training step: compiled in" in r.stdout and r.stderr.strip() == "", r.stderr
    assert logs == []
    assert not any((tmp_path / "xla").rglob("*"))
