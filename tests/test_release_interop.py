"""What the authors' release writes, edm2-jax reads (issue 13), checked against the
release itself run on the same files (`tests/release_oracle.py`; skips without torch).

* A release run directory (`network-snapshot-<kimg>-<sigma_rel>.pkl`, snapshots every
  1024 images including the one at 0 kimg) is post-hoc EMA input as it stands: the same
  inputs, times (multiples of 1024 images) and coefficients as the release's
  `reconstruct_phema.py`, and the same reconstructed weights.
"""
from __future__ import annotations

import pickle

import jax
import numpy as np
import pytest

from edm2_jax import checkpoint, convert, phema
from tests.release_oracle import release, release_modules_forgotten, tiny_release_net  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("release_modules_forgotten")
from tests.tolerances import EPS32

STDS = (0.050, 0.100)
OUT_STDS = (0.075, 0.120)


@pytest.fixture(scope="module")
def release_run(tmp_path_factory):
    """A release run directory as its training loop writes it with `snapshot_nimg=1024`
    (kimg 0..6: nimg 0, 1024, ..., 6144), every EMA a random fp16 network."""
    torch, m = release()
    from training import encoders
    run = tmp_path_factory.mktemp("release") / "00000-tiny"
    run.mkdir()
    for k in range(7):
        for i, std in enumerate(STDS):
            data = m["dnnlib"].EasyDict(encoder=encoders.StandardRGBEncoder(),
                                        dataset_kwargs={}, loss_fn=None)
            data.ema = tiny_release_net(seed=10 * k + i).to(torch.float16)
            with open(run / f"network-snapshot-{k * 1024 // 1000:07d}-{std:.3f}.pkl", "wb") as f:
                pickle.dump(data, f)
    (run / "training-options.json").write_text("{}")
    return run


def _release_reconstruction(run, out_nimg=None):
    """The release's `reconstruct_phema` on `run`: (in_nimg, in_std, coefs, out nets)."""
    _, m = release()
    rp = m["reconstruct_phema"]
    in_pkls = rp.list_input_pickles(str(run))
    r = None
    for r in rp.reconstruct_phema(in_pkls, out_std=list(OUT_STDS), out_nimg=out_nimg,
                                  out_dir=None, verbose=False):
        pass
    out_nimg = r.out[0].nimg
    used = [p for p in in_pkls if 0 < p.nimg <= out_nimg]
    in_nimg = np.array([p.nimg for p in used])
    in_std = np.array([p.std for p in used])
    coefs = m["phema"].solve_posthoc_coefficients(in_nimg, in_std, out_nimg, list(OUT_STDS))
    return in_nimg, in_std, out_nimg, coefs, [o.net for o in r.out]


def test_release_run_directory_is_phema_input_as_the_release_reads_it(release_run, tmp_path):
    in_nimg, in_std, out_nimg, coefs, nets = _release_reconstruction(release_run)
    assert out_nimg == 6144 and in_nimg.min() == 1024  # 6 kimg = 6Ki; the 0-kimg pair skipped

    kind, files = phema.find_snapshots(str(release_run))
    assert kind == "pickles" and len(files) == 12
    paths = phema.main_phema(str(release_run), list(OUT_STDS), out_dir=str(tmp_path / "out"))
    inputs = [convert.variables_to_state_dict(phema.inputs.release_pickle_variables(
        f.directory)[1]) for f in files]
    for j, path in enumerate(paths):
        _, v, meta = checkpoint.load_network(path)
        assert path.endswith(f"phema-0000006-{OUT_STDS[j]:.3f}")
        assert meta["nimg"] == out_nimg
        np.testing.assert_array_equal(meta["input_nimg"], in_nimg)
        np.testing.assert_array_equal(meta["input_sigma_rel"], in_std)
        np.testing.assert_allclose(meta["weights"], coefs[:, j], rtol=0, atol=1e-9)

        # The weights: the release sums in float32 and stores float16; ours stay float32.
        # |ours - release| <= float16 rounding (2^-11 relative, 2^-25 absolute below
        # 2^-14) + two float32 sums of 12 terms in other orders (12 eps sum|c_i w_i|).
        ours = convert.variables_to_state_dict(v)
        theirs = {k: t.float().numpy() for k, t in nets[j].state_dict().items()}
        assert sorted(ours) == sorted(theirs)
        for key, got in ours.items():
            terms = [np.abs(c) * np.abs(x[key]) for c, x in zip(coefs[:, j], inputs)]
            bound = 12 * EPS32 * np.sum(terms, axis=0) + 2.0 ** -25
            np.testing.assert_array_less(np.abs(got - theirs[key]),
                                         2.0 ** -11 * np.abs(theirs[key]) + bound + 1e-30)


def test_at_kimg_names_a_release_snapshot_by_its_file_kimg(release_run, tmp_path):
    _, m = release()
    in_nimg, _, out_nimg, coefs, _ = _release_reconstruction(
        release_run, out_nimg=m["reconstruct_phema"].kimg_to_nimg(3))
    assert out_nimg == 3072
    X = [checkpoint.read_network_json(p)[1] for p in phema.reconstruct(
        str(release_run), list(OUT_STDS), at_kimg=3, out_dir=str(tmp_path), progress=False)]
    for j, meta in enumerate(X):
        assert meta["nimg"] == 3072
        np.testing.assert_array_equal(meta["input_nimg"], in_nimg)
        np.testing.assert_allclose(meta["weights"], coefs[:, j], rtol=0, atol=1e-9)


def test_preset_durations_are_the_releases():
    """Every preset trains as long as the release's `train_edm2.py` preset and reports,
    snapshots and checkpoints at the release's default intervals (Ki/Mi: 2^10/2^20)."""
    _, m = release()
    import train_edm2
    from edm2_jax import configs, presets
    opts = {p.name: p.default for p in train_edm2.cmdline.params}
    for name in presets.NETWORK_PRESETS:
        c = configs.preset_config(name)
        theirs = train_edm2.config_presets[f"edm2-{name}"]
        assert c.batch_size == theirs.batch
        for ours, nimg in ((c.total_kimg, theirs.duration),
                           (c.status_kimg, train_edm2.parse_nimg(opts["status"])),
                           (c.snapshot_kimg, train_edm2.parse_nimg(opts["snapshot"])),
                           (c.checkpoint_kimg, train_edm2.parse_nimg(opts["checkpoint"]))):
            assert round(ours * 1000) == nimg, (name, ours, nimg)
    assert configs.base_config().checkpoint_kimg * 1000 == 128 << 20  # not 128Ki (issue 13)


@pytest.mark.parametrize("shape_chw", [(3, 5, 5), (4, 8, 8)])  # 75 (not 16k) and 256 values
def test_release_generator_draws_what_the_release_draws(shape_chw):
    """Seed k's initial noise, class and churn noise equal the release's
    `StackedRandomGenerator` draws (torch CPU), in its order. torch computes Box-Muller
    in float32 with vectorised log/sincos (<= ~2 ulp each), we in float64 rounded once:
    |difference| <= 16 eps32 r_max with r = sqrt(-2 ln u) <= sqrt(2 ln 2^24) < 5.8
    (measured: 1.4e-6 at most). Labels are integers: equal."""
    torch, _ = release()
    import generate_images as release_gen
    from edm2_jax import release_rng
    seeds = [0, 1, 7, 12345, 2**32 + 5, 987654321]
    c, h, w = shape_chw
    rnd = release_gen.StackedRandomGenerator("cpu", seeds)
    noise = rnd.randn([len(seeds), c, h, w]).numpy()
    labels = rnd.randint(1000, size=[len(seeds)]).numpy()
    churn = [rnd.randn_like(torch.zeros(len(seeds), c, h, w)).numpy() for _ in range(2)]
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


def _tiny_config():
    from edm2_jax import configs
    c = configs.base_config()
    c.network.update(dict(img_resolution=8, img_channels=2, label_dim=3, model_channels=32,
                          channel_mult=(1, 2), num_blocks=1, attn_resolutions=(4,),
                          logvar_channels=8))
    c.batch_size = BATCH
    c.optim.update(dict(ref_lr=0.01, t_ref=3, rampup_kimg=0.01))  # decay and ramp-up both active
    return c


@pytest.fixture(scope="module")
def release_training_state(tmp_path_factory):
    """A release training state after 3 steps of torch's Adam on random gradients, with
    its PowerFunctionEMA (0.05, 0.10) updated at each, saved as its CheckpointIO does."""
    torch, m = release()
    net = tiny_release_net(seed=3).train().requires_grad_(True)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    ema = m["phema"].PowerFunctionEMA(net, stds=[0.050, 0.100])
    gen = torch.Generator().manual_seed(5)
    for k in range(3):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        ema.update(cur_nimg=(k + 1) * BATCH, batch_size=BATCH)
    state = m["dnnlib"].EasyDict(cur_nimg=3 * BATCH, total_elapsed_time=1.5)
    path = tmp_path_factory.mktemp("state") / "training-state-0000000.pt"
    torch.save(dict(state=state, net=net.state_dict(), loss_fn=None,
                    optimizer=opt.state_dict(), ema=ema.state_dict()), path)
    return path, net, opt, ema


@pytest.mark.slow  # ~15-25 s on 2 cores: a model set up, a checkpoint written and restored
def test_release_training_state_converts_and_continues(release_training_state, tmp_path):
    """The converted run restores (as --mode=train does) at step 3 with the release's
    weights, Adam moments and count and EMAs; its next Adam update and EMA update equal
    the release's on the same gradients. Float32 bounds: the EMA lerp and the weight
    update are a few roundings in another order (8 eps32 of their operands, |p before| +
    |update|: a weight the step nearly cancels keeps its absolute error); the update
    also carries the rounding of beta^t in the bias corrections 1 - beta^t, which optax
    forms in float32 (torch in float64), amplified by beta^t / (1 - beta^t) (and halved
    by the square root for beta2): 0.9^4 / 0.344 + 0.5 0.99^4 / 0.039 = 14 eps32 more."""
    torch, m = release()
    from edm2_jax import ema as ema_lib, release_state, rundir, train
    path, net, opt, ema = release_training_state
    config = _tiny_config()
    run = str(tmp_path / "run")
    assert release_state.import_training_state(str(path), run, config) == 3
    model = train.setup_model(config)
    managers = rundir.TrainCheckpoints(run)
    state, resumed, managers = train.restore_or_init(config, model, managers)
    managers.close()
    assert resumed and int(state["step"]) == 3 and rundir.read_config(run) is not None
    state = jax.device_get(state)

    def sd(tree):
        return convert.variables_to_state_dict({"params": tree})

    adam = next(s for s in state["opt_state"] if hasattr(s, "mu"))
    assert int(adam.count) == 3
    keys = [k for k, _ in net.named_parameters()]
    for name, tree in (("params", state["params"]), ("mu", adam.mu), ("nu", adam.nu)):
        got = sd(tree)
        assert sorted(got) == sorted(keys), name
        for i, k in enumerate(keys):
            want = {"params": dict(net.named_parameters())[k],
                    "mu": opt.state[dict(net.named_parameters())[k]]["exp_avg"],
                    "nu": opt.state[dict(net.named_parameters())[k]]["exp_avg_sq"]}[name]
            np.testing.assert_array_equal(got[k], want.detach().numpy(), err_msg=f"{name} {k}")
    for s, e in zip(ema.stds, ema.emas):
        got = sd(state["ema"]["power"][ema_lib.ema_key(s)])
        for k, v in e.named_parameters():
            np.testing.assert_array_equal(got[k], v.detach().numpy())

    # One more step on the same gradients: torch's Adam at the release's learning rate
    # for nimg 12, and our optimiser chain; then both EMA updates.
    from training.training_loop import learning_rate_schedule
    from edm2_jax import optim as optim_lib
    lr = learning_rate_schedule(cur_nimg=3 * BATCH, batch_size=BATCH, ref_lr=0.01,
                                ref_batches=3, rampup_Mimg=1e-5)
    gen = torch.Generator().manual_seed(9)
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in net.named_parameters()}
    for k, p in net.named_parameters():
        p.grad = grads[k].clone()
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    ema.update(cur_nimg=4 * BATCH, batch_size=BATCH)
    tx = optim_lib.make_optimizer(config.optim, BATCH)
    g_tree = convert.state_dict_to_variables(
        {**{k: v.numpy() for k, v in grads.items()},
         **{k: b.numpy() for k, b in net.named_buffers()}}, config.network.to_dict())[1]["params"]
    upd, _ = tx.update(g_tree, state["opt_state"], state["params"], nimg=3 * BATCH)
    new = jax.tree.map(lambda p, u: np.asarray(p) + np.asarray(u), state["params"], upd)
    new_ema = ema_lib.update_ema(state["ema"], new, 4 * BATCH, BATCH,
                                 sigma_rels=tuple(config.ema.sigma_rels))
    got, got_upd, before = sd(new), sd(jax.device_get(upd)), sd(state["params"])
    b1t, b2t = 0.9 ** 4, 0.99 ** 4  # bias corrections of the 4th update
    k_adam = 8 + b1t / (1 - b1t) + 0.5 * b2t / (1 - b2t)  # = 22 (see the docstring)
    for k, p in net.named_parameters():
        want = p.detach().numpy()
        bound = k_adam * EPS32 * (np.abs(before[k]) + np.abs(got_upd[k])) + 1e-30
        np.testing.assert_array_less(np.abs(got[k] - want), bound, err_msg=k)
    for s, e in zip(ema.stds, ema.emas):
        got = sd(jax.device_get(new_ema["power"][ema_lib.ema_key(s)]))
        for k, v in e.named_parameters():
            want = v.detach().numpy()
            np.testing.assert_allclose(got[k], want, rtol=0,
                                       atol=8 * EPS32 * np.abs(want).max() + 1e-30)


def test_training_state_that_does_not_fit_the_config_is_refused(release_training_state, tmp_path):
    from edm2_jax import release_state
    path = str(release_training_state[0])
    c = _tiny_config()
    c.ema.sigma_rels = (0.05, 0.2)
    with pytest.raises(ValueError, match=r"tracks power EMAs \['0.050', '0.100'\]"):
        release_state.import_training_state(path, str(tmp_path / "a"), c)
    c = _tiny_config()
    c.batch_size = 5
    with pytest.raises(ValueError, match="not a whole number of --config.batch_size=5"):
        release_state.import_training_state(path, str(tmp_path / "b"), c)
    c = _tiny_config()
    c.network.model_channels = 16
    with pytest.raises(ValueError, match="wrong shape"):
        release_state.import_training_state(path, str(tmp_path / "c"), c)
    assert release_state.import_training_state(path, str(tmp_path / "d"), _tiny_config()) == 3
    with pytest.raises(FileExistsError, match="already holds a run"):
        release_state.import_training_state(path, str(tmp_path / "d"), _tiny_config())


@pytest.mark.slow  # ~14-23 s: a network written, exported, converted back, run by the release
def test_export_round_trip_and_the_release_reads_it(tmp_path):
    """ours -> release pickle -> convert gives identical variables; the release's own
    loader reads the pickle into its Precond with the same state dict and the same
    output, and its re-pickled copy (as reconstruct_phema writes) reads again."""
    torch, m = release()
    from edm2_jax import networks, release_state
    cfg = dict(_tiny_config().network.to_dict())
    net = networks.precond_from_config(cfg)
    variables = jax.device_get(networks.init_variables(net, jax.random.PRNGKey(4)))
    variables["params"] = jax.tree.map(
        lambda a: np.random.RandomState(a.size).standard_normal(a.shape).astype(np.float32),
        variables["params"])
    src = checkpoint.save_network(str(tmp_path / "ours"), variables, cfg)
    pkl = release_state.main_export(src, str(tmp_path / "ours-0000001-0.100.pkl"))
    back = convert.convert(pkl, str(tmp_path / "back"))
    cfg2, v2, _ = checkpoint.load_network(back)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(v2)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(variables) == jax.tree.structure(v2)
    assert {k: cfg2[k] for k in ("model_channels", "channel_mult", "label_dim", "logvar_channels")} \
        == {"model_channels": 32, "channel_mult": [1, 2], "label_dim": 3, "logvar_channels": 8}

    import copy
    with open(pkl, "rb") as f:
        theirs = pickle.load(f)["ema"]
    assert isinstance(theirs, m["networks_edm2"].Precond)
    sd = convert.variables_to_state_dict(variables)
    assert sorted(theirs.state_dict()) == sorted(sd)
    for k, v in theirs.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), sd[k])
    again = pickle.loads(pickle.dumps(copy.deepcopy(theirs)))
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma, labels = torch.tensor([0.5, 3.0]), torch.eye(3)[[0, 2]]
    np.testing.assert_array_equal(again(x, sigma, labels).numpy(), theirs(x, sigma, labels).numpy())
    with pytest.raises(FileExistsError):
        release_state.export_network_pickle(variables, cfg, pkl)


@pytest.mark.slow  # ~1-2 min on 2 cores: a training run of 3 steps (one compile)
def test_mode_train_continues_a_converted_release_state(tmp_path, capsys):
    """A release training state at nimg 8 (one Adam step of batch 8) converted into a
    run: `train_and_evaluate` resumes it at step 1 and trains to the end (step 4)."""
    torch, m = release()
    from edm2_jax import release_state, rundir, train
    from tests.test_train import make_image_folder, tiny_config
    _, config = train.setup_data(tiny_config(make_image_folder(tmp_path / "data")))
    n = config.network
    torch.manual_seed(0)
    net = m["networks_edm2"].Precond(
        img_resolution=n.img_resolution, img_channels=n.img_channels, label_dim=n.label_dim,
        model_channels=n.model_channels, channel_mult=list(n.channel_mult),
        num_blocks=n.num_blocks, attn_resolutions=list(n.attn_resolutions),
        logvar_channels=n.logvar_channels)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
    ema = m["phema"].PowerFunctionEMA(net, stds=list(config.ema.sigma_rels))
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    ema.update(cur_nimg=8, batch_size=8)
    src = tmp_path / "training-state-0000000.pt"
    torch.save(dict(state=dict(cur_nimg=8, total_elapsed_time=0.0), net=net.state_dict(),
                    loss_fn=None, optimizer=opt.state_dict(), ema=ema.state_dict()), src)
    run = str(tmp_path / "run")
    assert release_state.import_training_state(str(src), run, config) == 1
    capsys.readouterr()
    train.train_and_evaluate(config, run)
    assert f"Resuming in {run} at step 1" in capsys.readouterr().out
    steps = rundir.step_dirs(f"{run}/{rundir.CHECKPOINTS}")
    assert [int(s.rsplit("/", 1)[-1]) for s in steps] == [4, 2, 1]  # 1: the converted state
