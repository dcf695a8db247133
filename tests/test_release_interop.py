"""What the authors' release writes, edm2-jax reads, and back, checked against
what the release did on the same inputs: golden files made by running it
(`tests/data/release_interop/`, made by `make_golden.py` there; origins in
`tests/data/README.md`). The release is not imported here.

* A release run directory (`network-snapshot-<kimg>-<sigma_rel>.pkl`, snapshots every
  1024 images including the one at 0 kimg) is post-hoc EMA input as it stands: the same
  inputs, times (multiples of 1024 images) and coefficients as the release's
  `reconstruct_phema.py`, and the weights those coefficients give.
* A release training state converts into a run that continues as the release would.
* An exported network pickle is what the release's loader expects of its own pickles.

Tests that read or write PyTorch files skip without torch (CI installs it).
"""
from __future__ import annotations

import ast
import json
import pickle
import sys
import types

import jax
import numpy as np
import pytest

from edm2_jax import objectives
from edm2_jax.run import network_dir as checkpoint
from edm2_jax.release import convert, pickle_io
from edm2_jax.ema.inputs import find_snapshots
from edm2_jax.ema.reconstruction import main_phema, reconstruct
from tests.testdata import golden
from tests.tolerances import EPS32

GOLD = "release_interop"
STDS = (0.050, 0.100)
OUT_STDS = (0.075, 0.120)
# The tiny release Precond of the golden files (`make_golden.py`'s TINY_NET): 8x8, two
# levels, attention at 4x4 (two heads of 4 channels), 11.5k parameters.
TINY_NET = dict(img_resolution=8, img_channels=2, label_dim=3, model_channels=4,
                channel_mult=(1, 2), num_blocks=1, attn_resolutions=(4,), channels_per_head=4,
                logvar_channels=8)


def _json(name):
    return json.loads(golden(f"{GOLD}/{name}").read_text())


def _npz(name):
    with np.load(golden(f"{GOLD}/{name}")) as d:
        return {k: d[k] for k in d.files}


def _torch():
    return pytest.importorskip("torch", reason="PyTorch files need torch (.ci/run installs it)")


def _tiny_config():
    from edm2_jax import configs
    c = configs.base_config()
    c.network.update(TINY_NET)
    c.batch_size = BATCH
    c.optim.update(dict(ref_lr=0.01, t_ref=3, rampup_kimg=0.01))  # decay and ramp-up both active
    return c


def test_tiny_net_is_the_golden_files_net():
    assert _json("export_facts.json")["net_kwargs"]["TINY_NET"] == \
        {k: list(v) if isinstance(v, tuple) else v for k, v in TINY_NET.items()}


# --- post-hoc EMA of a release run directory ---------------------------------------------

@pytest.fixture(scope="module")
def release_run(tmp_path_factory):
    """A release run directory as its training loop writes it with `snapshot_nimg=1024`
    (kimg 0..6: nimg 0, 1024, ..., 6144), under the golden file names, each EMA a random
    network of float16 values written with our exporter (the release's pickle format).
    Returns `(run, {file name: state dict})`."""
    _torch()
    from edm2_jax.model import networks
    from edm2_jax.release import export
    gold = _json("phema_rundir.json")
    cfg = dict(_tiny_config().network.to_dict())
    variables = jax.device_get(networks.init_variables(networks.precond_from_config(cfg),
                                                       jax.random.PRNGKey(0)))
    run = tmp_path_factory.mktemp("release") / "00000-tiny"
    run.mkdir()
    written = {}
    for n, name in enumerate(gold["files"]):
        rs = np.random.RandomState(n)
        v = dict(variables, params=jax.tree.map(
            lambda a: rs.standard_normal(a.shape).astype(np.float16).astype(np.float32),
            variables["params"]))
        export.export_network_pickle(v, cfg, str(run / name))
        written[name] = convert.variables_to_state_dict(v)
    (run / "training-options.json").write_text("{}")
    return run, written


def _check_coefficients(meta, case, j):
    np.testing.assert_array_equal(meta["input_nimg"], case["in_nimg"])
    np.testing.assert_array_equal(meta["input_sigma_rel"], case["in_std"])
    np.testing.assert_allclose(meta["weights"], np.asarray(case["coefs"])[:, j], rtol=0, atol=1e-9)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_release_run_directory_is_phema_input_as_the_release_reads_it(release_run, tmp_path):
    """The release lists the 14 files (0 kimg included) and uses the 12 after nimg 0 for
    the last time, 6144 = 6Ki; we find the same inputs and times and solve for the same
    coefficients (<= 1e-9). The weights: our float32 sum of 12 products (coefficients
    rounded to float32) against the exact sum of the golden coefficients times the
    inputs: <= 12 eps32 sum|c_i w_i|, plus 1e-9 sum|w_i| for the coefficients' own error."""
    run, written = release_run
    gold = _json("phema_rundir.json")
    case = gold["cases"]["last"]
    assert sorted(p.name for p in run.glob("*.pkl")) == sorted(gold["files"]) and len(gold["files"]) == 14
    assert case["out_nimg"] == 6144 and min(case["in_nimg"]) == 1024  # the 0-kimg pair skipped
    assert case["out_std"] == list(OUT_STDS)

    kind, files = find_snapshots(str(run))
    assert kind == "pickles" and len(files) == 12
    assert [(f.label, f.nimg, f.sigma_rels) for f in files] == \
        [(p["name"], p["nimg"], (p["std"],)) for p in gold["listed"] if p["nimg"] > 0]
    paths = main_phema(str(run), list(OUT_STDS), out_dir=str(tmp_path / "out"))
    inputs = [written[f.label] for f in files]
    coefs = np.asarray(case["coefs"])
    assert coefs.shape == (12, 2)
    for j, path in enumerate(paths):
        _, v, meta = checkpoint.load_network(path)
        assert path.endswith(f"phema-0000006-{OUT_STDS[j]:.3f}")
        assert meta["nimg"] == case["out_nimg"]
        _check_coefficients(meta, case, j)

        ours = convert.variables_to_state_dict(v)
        assert sorted(ours) == sorted(inputs[0])
        for key, got in ours.items():
            if convert.release_key_to_path(key)[0] == "buffers":  # MPFourier: copied
                np.testing.assert_array_equal(got, inputs[-1][key], err_msg=key)
                continue
            want = sum(c * x[key].astype(np.float64) for c, x in zip(coefs[:, j], inputs))
            bound = (12 * EPS32 * sum(np.abs(c * x[key]) for c, x in zip(coefs[:, j], inputs))
                     + 1e-9 * sum(np.abs(x[key]) for x in inputs) + 1e-30)
            np.testing.assert_array_less(np.abs(got - want), bound, err_msg=key)


def test_at_kimg_names_a_release_snapshot_by_its_file_kimg(release_run, tmp_path):
    """`at_kimg=3` is the release's `kimg_to_nimg(3)` = 3072: its inputs and coefficients."""
    case = _json("phema_rundir.json")["cases"]["kimg3"]
    assert case["out_nimg"] == case["out_nimg_arg"] == 3072
    X = [checkpoint.read_network_json(p)[1] for p in reconstruct(
        str(release_run[0]), list(OUT_STDS), at_kimg=3, out_dir=str(tmp_path), progress=False)]
    assert len(X) == 2
    for j, meta in enumerate(X):
        assert meta["nimg"] == 3072
        _check_coefficients(meta, case, j)


# --- the release's numbers ---------------------------------------------------------------

def test_preset_durations_are_the_releases():
    """Every preset trains as long as the release's `train_edm2.py` preset and reports,
    snapshots and checkpoints at the release's default intervals (Ki/Mi: 2^10/2^20)."""
    from edm2_jax import configs
    from edm2_jax.model import presets
    gold = _json("presets.json")
    d = gold["defaults"]
    assert (d["status"]["nimg"], d["snapshot"]["nimg"], d["checkpoint"]["nimg"]) == \
        (128 << 10, 8 << 20, 128 << 20)
    for name in presets.NETWORK_PRESETS:
        c = configs.preset_config(name)
        theirs = gold["presets"][f"edm2-{name}"]
        assert c.batch_size == theirs["batch"]
        for ours, nimg in ((c.total_kimg, theirs["duration"]),
                           (c.status_kimg, d["status"]["nimg"]),
                           (c.snapshot_kimg, d["snapshot"]["nimg"]),
                           (c.checkpoint_kimg, d["checkpoint"]["nimg"])):
            assert round(ours * 1000) == nimg, (name, ours, nimg)
    assert configs.base_config().checkpoint_kimg * 1000 == 128 << 20  # 128Mi images, not 128Ki


@pytest.mark.parametrize("shape_chw", [(3, 5, 5), (4, 8, 8)])  # 75 (not 16k) and 256 values
def test_release_generator_draws_what_the_release_draws(shape_chw):
    """Seed k's initial noise, class and churn noise equal the release's
    `StackedRandomGenerator` draws (torch CPU, golden), in its order. torch computes
    Box-Muller in float32 with vectorised log/sincos (<= ~2 ulp each), we in float64
    rounded once: |difference| <= 16 eps32 r_max with r = sqrt(-2 ln u) <=
    sqrt(2 ln 2^24) < 5.8 (measured: 1.4e-6 at most). Labels are integers: equal."""
    from edm2_jax.release import rng as release_rng
    gold = _npz("release_rng.npz")
    seeds = [0, 1, 7, 12345, 2**32 + 5, 987654321]
    assert [int(s) for s in gold["seeds"]] == seeds
    c, h, w = shape_chw
    tag = f"{c}x{h}x{w}"
    noise, labels = gold[f"{tag}/noise"], gold[f"{tag}/labels"]
    churn = [gold[f"{tag}/churn{i}"] for i in range(2)]
    assert noise.shape == (len(seeds), c, h, w)
    ours, our_labels, our_churn = release_rng.release_draws(seeds, (h, w, c), 1000, churn_steps=2)
    tol = 16 * EPS32 * 5.8
    assert ours.shape == (len(seeds), h, w, c) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, noise.transpose(0, 2, 3, 1), rtol=0, atol=tol)
    np.testing.assert_array_equal(our_labels, labels)
    for i in range(2):
        np.testing.assert_allclose(our_churn[i], churn[i].transpose(0, 2, 3, 1), rtol=0, atol=tol)
    with pytest.raises(ValueError, match="fewer than 16"):
        release_rng.TorchCPUGenerator(0).randn((3, 2, 2))


# --- training states and exported networks -------------------------------------------------

BATCH = 4
STATE_TINY = f"{GOLD}/state_tiny/training-state-0000000.pt"
STATE_TRAIN = f"{GOLD}/state_train/training-state-0000000.pt"


def _read_release_state(path):
    """The release training state at `path` as `torch.load` reads it, its one global
    outside torch (`dnnlib.util.EasyDict`) read as a dict (independent of our reader)."""
    torch = _torch()

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.split(".")[0] == "dnnlib" and name == "EasyDict":
                return dict
            return super().find_class(module, name)

    mod = types.SimpleNamespace(__name__="easydict_as_dict", Unpickler=Unpickler,
                                load=lambda f, **kw: Unpickler(f, **kw).load())
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=mod)


@pytest.mark.slow  # ~15-25 s on 2 cores: a model set up, a checkpoint written and restored
def test_release_training_state_converts_and_continues(tmp_path):
    """The release's training state (golden: 3 torch Adam steps of batch 4 with its
    PowerFunctionEMA (0.05, 0.10)) restores (as --mode=train does) at step 3 with its
    weights, Adam moments and count and EMAs; our next Adam update and EMA update equal
    the release's on the same gradients (golden: `state_tiny_step.npz`). Float32 bounds:
    the EMA lerp and the weight update are a few roundings in another order (8 eps32 of
    their operands, |p before| + |update|: a weight the step nearly cancels keeps its
    absolute error); the update also carries the rounding of beta^t in the bias
    corrections 1 - beta^t, which optax forms in float32 (torch in float64), amplified by
    beta^t / (1 - beta^t) (and halved by the square root for beta2): 0.9^4 / 0.344 +
    0.5 0.99^4 / 0.039 = 14 eps32 more. The moments beta m + (1 - beta) g (torch: a lerp
    and an addcmul) are about four roundings each way: 8 eps32 of |m before| + |g|
    (|g|^2 for the second moment)."""
    from edm2_jax.ema import power as ema_lib
    from edm2_jax.training import optim as optim_lib
    from edm2_jax.modes import release as release_mode
    from edm2_jax.run import checkpoints, layout
    from edm2_jax.training import setup
    path = str(golden(STATE_TINY))
    data = _read_release_state(path)
    step = _npz("state_tiny_step.npz")
    keys = [str(k) for k in step["keys"]]
    assert data["state"]["cur_nimg"] == 3 * BATCH and list(data["ema"]["stds"]) == list(STDS)
    adam_in = [data["optimizer"]["state"][i] for i in range(len(keys))]
    assert {int(s["step"]) for s in adam_in} == {3} and int(step["adam_step"]) == 4
    before = {"params": {k: data["net"][k].numpy() for k in keys},
              "mu": {k: s["exp_avg"].numpy() for k, s in zip(keys, adam_in)},
              "nu": {k: s["exp_avg_sq"].numpy() for k, s in zip(keys, adam_in)}}
    ema_before = [{k: e[k].numpy() for k in keys} for e in data["ema"]["emas"]]
    buffers = {k: v.numpy() for k, v in data["net"].items() if k not in keys}

    config = _tiny_config()
    run = str(tmp_path / "run")
    assert release_mode.import_training_state(path, run, config) == 3
    model = setup.setup_model(config, setup.Start(objectives.from_config(config)))
    managers = checkpoints.TrainCheckpoints(run)
    state, resumed, managers = setup.restore_or_init(config, model, managers)
    managers.close()
    assert resumed and int(state["step"]) == 3 and layout.read_config(run) is not None
    state = jax.device_get(state)

    def sd(tree):
        return convert.variables_to_state_dict({"params": tree})

    adam = next(s for s in state["opt_state"] if hasattr(s, "mu"))
    assert int(adam.count) == 3
    for name, tree in (("params", state["params"]), ("mu", adam.mu), ("nu", adam.nu)):
        got = sd(tree)
        assert sorted(got) == sorted(keys), name
        for k in keys:
            np.testing.assert_array_equal(got[k], before[name][k], err_msg=f"{name} {k}")
    for s, e in zip(STDS, ema_before):
        got = sd(state["ema"]["power"][ema_lib.ema_key(s)])
        for k in keys:
            np.testing.assert_array_equal(got[k], e[k])

    # One more step on the golden gradients: the release's learning rate for nimg 12 and
    # our optimiser chain; then both EMA updates.
    lr = optim_lib.learning_rate(3 * BATCH, batch_size=BATCH, ref_lr=0.01, t_ref=3,
                                 rampup_kimg=0.01)
    np.testing.assert_allclose(float(lr), float(step["lr"]), rtol=4 * EPS32)
    tx = optim_lib.make_optimizer(config.optim, BATCH)
    g = {k: step[f"g/{k}"] for k in keys}
    g_tree = convert.state_dict_to_variables({**g, **buffers}, config.network.to_dict())[1]["params"]
    upd, new_opt = tx.update(g_tree, state["opt_state"], state["params"], nimg=3 * BATCH)
    new = jax.tree.map(lambda p, u: np.asarray(p) + np.asarray(u), state["params"], upd)
    new_ema = ema_lib.update_ema(state["ema"], new, 4 * BATCH, BATCH,
                                 sigma_rels=tuple(config.ema.sigma_rels))
    got, got_upd = sd(new), sd(jax.device_get(upd))
    b1t, b2t = 0.9 ** 4, 0.99 ** 4  # bias corrections of the 4th update
    k_adam = 8 + b1t / (1 - b1t) + 0.5 * b2t / (1 - b2t)  # = 22 (see the docstring)
    for k in keys:
        bound = k_adam * EPS32 * (np.abs(before["params"][k]) + np.abs(got_upd[k])) + 1e-30
        np.testing.assert_array_less(np.abs(got[k] - step[f"w/{k}"]), bound, err_msg=k)
    new_adam = jax.device_get(next(s for s in new_opt if hasattr(s, "mu")))
    assert int(new_adam.count) == int(step["adam_step"])
    for name, g_term in (("mu", lambda k: np.abs(g[k])), ("nu", lambda k: g[k] ** 2)):
        ours = sd(getattr(new_adam, name))
        for k in keys:
            bound = 8 * EPS32 * (np.abs(before[name][k]) + g_term(k)) + 1e-30
            np.testing.assert_array_less(np.abs(ours[k] - step[f"{name}/{k}"]), bound,
                                         err_msg=f"{name} {k}")
    for s in STDS:
        got = sd(jax.device_get(new_ema["power"][ema_lib.ema_key(s)]))
        for k in keys:
            want = step[f"ema{s:.3f}/{k}"]
            np.testing.assert_allclose(got[k], want, rtol=0,
                                       atol=8 * EPS32 * np.abs(want).max() + 1e-30)


def test_training_state_that_does_not_fit_the_config_is_refused(tmp_path):
    _torch()
    from edm2_jax.modes import release as release_mode
    path = str(golden(STATE_TINY))
    c = _tiny_config()
    c.ema.sigma_rels = (0.05, 0.2)
    with pytest.raises(ValueError, match=r"tracks power EMAs \['0.050', '0.100'\]"):
        release_mode.import_training_state(path, str(tmp_path / "a"), c)
    c = _tiny_config()
    c.batch_size = 5
    with pytest.raises(ValueError, match="not a whole number of --config.batch_size=5"):
        release_mode.import_training_state(path, str(tmp_path / "b"), c)
    c = _tiny_config()
    c.network.model_channels = 2
    with pytest.raises(ValueError, match="wrong shape"):
        release_mode.import_training_state(path, str(tmp_path / "c"), c)
    assert release_mode.import_training_state(path, str(tmp_path / "d"), _tiny_config()) == 3
    with pytest.raises(FileExistsError, match="already holds a run"):
        release_mode.import_training_state(path, str(tmp_path / "d"), _tiny_config())


class _RecordingUnpickler(pickle_io.ReleaseUnpickler):
    """Our reader of release pickles, noting the globals the pickle names."""

    def __init__(self, f):
        super().__init__(f)
        self.seen = []

    def find_class(self, module, name):
        if [module, name] not in self.seen:
            self.seen.append([module, name])
        return super().find_class(module, name)


def _module_src_base(src: str, class_name: str) -> str | None:
    """The dotted name of `class_name`'s base class in the module source `src`, its
    `from X import Y` imports resolved (None if not found)."""
    tree = ast.parse(src)
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                imported[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                imported[a.asname or a.name] = a.name
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name and len(node.bases) == 1:
            base = node.bases[0]
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                return f"{imported.get(base.value.id, base.value.id)}.{base.attr}"
    return None


@pytest.mark.slow  # ~14-23 s: a network written, exported, converted back
def test_export_round_trip_and_the_release_reads_it(tmp_path, monkeypatch):
    """ours -> release pickle -> convert gives identical variables; and the pickle is
    what the release's loader reads in its own network pickles (golden facts recorded
    from one, `export_facts.json`): only globals the release's pickles name, among them
    its persistence loader; a persistence record of the same type and version whose
    class derives from the release's `training.networks_edm2.Precond`; constructor
    arguments the release's Precond/UNet/Block accept that build its net for the same
    config (the recorded arguments, others at their defaults); a state dict with its
    keys, shapes and dtype. Our module source, run as the loader runs it (its class
    found by name, made with `__new__`, then `__setstate__(state)`) over a stand-in
    torch Module for the release's Precond, builds it from those arguments, loads the
    state dict and leaves it in eval mode; a state of the usual form (a re-pickled copy)
    goes to torch's own `__setstate__`. Not checked here: the release itself running
    it (`make_golden.py --release=PATH --check-export` does that)."""
    torch = _torch()
    from edm2_jax.model import networks
    from edm2_jax.release import export
    from edm2_jax.modes import release as release_mode
    facts = _json("export_facts.json")
    cfg = dict(_tiny_config().network.to_dict())
    net = networks.precond_from_config(cfg)
    variables = jax.device_get(networks.init_variables(net, jax.random.PRNGKey(4)))
    variables["params"] = jax.tree.map(
        lambda a: np.random.RandomState(a.size).standard_normal(a.shape).astype(np.float32),
        variables["params"])
    src = checkpoint.save_network(str(tmp_path / "ours"), variables, cfg)
    pkl = release_mode.main_export(src, str(tmp_path / "ours-0000001-0.100.pkl"))
    back = convert.convert(pkl, str(tmp_path / "back"))
    cfg2, v2, _ = checkpoint.load_network(back)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(v2)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(variables) == jax.tree.structure(v2)
    assert {k: cfg2[k] for k in ("model_channels", "channel_mult", "label_dim", "logvar_channels")} \
        == {"model_channels": 4, "channel_mult": [1, 2], "label_dim": 3, "logvar_channels": 8}

    # The pickle against the golden facts of the release's own pickle.
    with open(pkl, "rb") as f:
        u = _RecordingUnpickler(f)
        obj = u.load()
    assert set(obj) == {"ema"}
    loader = ["torch_utils.persistence", "_reconstruct_persistent_obj"]
    assert loader in facts["pickle_globals"] and loader in u.seen
    assert all(g in facts["pickle_globals"] for g in u.seen), u.seen
    meta = obj["ema"]
    assert isinstance(meta, pickle_io.PersistentObject)
    assert [meta.type, meta.version] in facts["persistent_types"]
    assert facts["precond_meta"]["class_name"] == "Precond" and facts["precond_is_torch_module"]
    assert _module_src_base(meta.module_src, meta.class_name) == ".".join(facts["precond_class"])

    kwargs, sd_ours = meta.state["edm2_jax_kwargs"], meta.state["edm2_jax_state_dict"]
    theirs = facts["init_kwargs"]
    defaults = {**facts["accepted_kwargs"]["Block"], **facts["accepted_kwargs"]["UNet"],
                **facts["accepted_kwargs"]["Precond"]}
    assert set(theirs) <= set(kwargs) and set(kwargs) <= set(theirs) | set(defaults), sorted(kwargs)
    for k, v in kwargs.items():
        assert v == theirs.get(k, defaults.get(k)), (k, v, theirs.get(k), defaults.get(k))
    sd = convert.variables_to_state_dict(variables)
    assert {k: [list(t.shape), str(t.dtype).replace("torch.", "")] for k, t in sd_ours.items()} \
        == facts["state_dict"]
    for k, t in sd_ours.items():
        np.testing.assert_array_equal(t.numpy(), sd[k])

    # Our module source, run as the loader runs it, over a stand-in for the release's Precond.
    class Precond(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.kw = kw

        def load_state_dict(self, state_dict):
            self.loaded = state_dict

    pkg = types.ModuleType("training")
    pkg.networks_edm2 = types.ModuleType("training.networks_edm2")
    pkg.networks_edm2.Precond = Precond
    monkeypatch.setitem(sys.modules, "training", pkg)
    monkeypatch.setitem(sys.modules, "training.networks_edm2", pkg.networks_edm2)
    module = types.ModuleType("_exported_module")
    exec(meta.module_src, module.__dict__)  # noqa: S102 - our own source (export._EXPORT_SRC)
    cls = module.__dict__[meta.class_name]
    built = cls.__new__(cls)
    built.__setstate__(meta.state)
    assert isinstance(built, Precond) and built.kw == kwargs and built.loaded is sd_ours
    assert not built.training
    again = cls.__new__(cls)
    again.__setstate__(dict(built.__dict__))
    assert again.kw == kwargs and not again.training
    with pytest.raises(FileExistsError):
        export.export_network_pickle(variables, cfg, pkl)


@pytest.mark.slow  # ~1-2 min on 2 cores: a training run of 3 steps (one compile)
def test_mode_train_continues_a_converted_release_state(tmp_path, capsys):
    """A release training state at nimg 8 (golden: one Adam step of batch 8 of the net
    of the tiny run) converted into a run: `train_and_evaluate` resumes it at step 1 and
    trains to the end (step 4)."""
    _torch()
    from edm2_jax.modes import release as release_mode
    from edm2_jax.run import layout
    from edm2_jax.training import loop
    from edm2_jax.training import setup
    from tests.test_train import make_image_folder, tiny_config
    from edm2_jax import objectives
    config = tiny_config(make_image_folder(tmp_path / "data"))
    config = setup.run_config(config, str(tmp_path / "run"),
                              setup.Start(objectives.from_config(config)),
                              setup.setup_data(config))
    n = config.network.to_dict()
    theirs = _json("export_facts.json")["net_kwargs"]["TRAIN_NET"]
    assert {k: list(n[k]) if isinstance(n[k], tuple) else n[k] for k in theirs} == theirs
    run = str(tmp_path / "run")
    assert release_mode.import_training_state(str(golden(STATE_TRAIN)), run, config) == 1
    capsys.readouterr()
    loop.train_and_evaluate(config, run)
    assert f"Resuming in {run} at step 1" in capsys.readouterr().out
    steps = layout.step_dirs(f"{run}/{layout.CHECKPOINTS}")
    assert [int(s.rsplit("/", 1)[-1]) for s in steps] == [4, 2, 1]  # 1: the converted state
