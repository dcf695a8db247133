"""Make the golden files of `tests/test_release_interop.py` and `tests/test_eval_options.py`
by running the authors' EDM2 release (NVlabs/edm2) on random weights.

    python tests/data/release_interop/make_golden.py --release=/path/to/edm2 [--out=DIR]
    python tests/data/release_interop/make_golden.py --release=/path/to/edm2 --check-export

The release is imported from `--release` at run time only; nothing of it is copied into
the files (they hold numbers, file names, class and argument names, and two torch
training states of tensors). It needs torch and what the release's modules import
(its `dnnlib` imports `requests`). The tests themselves never import the release: they
compare against these files (`tests/data/README.md`, section `release_interop/`, lists
them with their sha256; re-running this script on CPU with torch 2.x rewrites the same
numbers).

Files written to `--out` (default: this script's folder):

* `phema_rundir.json`: a release run directory with snapshots every 1024 images
  (kimg 0..6, two EMAs each, the pair at 0 kimg included) as the release's
  `reconstruct_phema.py` reads it: the inputs it lists, those it uses, the output time
  and the post-hoc coefficients it solves for, for the last time and for `kimg_to_nimg(3)`.
* `presets.json`: `train_edm2.py`'s presets (batch, duration in images) and the defaults of
  its `--status`, `--snapshot`, `--checkpoint` as it parses them.
* `release_rng.npz`: `generate_images.StackedRandomGenerator` draws for a list of seeds.
* `folder_subset.json`: the files `training.dataset.ImageFolderDataset(max_size, random_seed)`
  keeps of a 26-image folder, for a few (max_size, random_seed).
* `state_tiny/training-state-0000000.pt` + `state_tiny_step.npz`: a training state as the
  release's `CheckpointIO` saves it (a tiny `Precond` after 3 Adam steps with its
  `PowerFunctionEMA`), and one more step of it on given gradients.
* `state_train/training-state-0000000.pt`: the same for the 1-level net of
  `tests/test_train.py`'s tiny run after one step at nimg 8.
* `export_facts.json`: what the release's loader reads in its own network pickle of the
  tiny `Precond` (pickle globals, persistence meta, class, constructor arguments and
  their defaults, state-dict keys and shapes). The pickle itself (it embeds the
  release's source) is written to a temporary folder only.

`--check-export` (needs this repository's `edm2_jax` importable) additionally exports a
random edm2-jax network with `edm2_jax.release.export` and loads it with the release's own
loader, checking the state dict, the forward pass and a re-pickled copy; it writes nothing.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import pickle
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

# The tiny nets (keyword arguments of the release's Precond). TINY_NET is also the tests'
# `TINY_NET` (checked there against `export_facts.json`); TRAIN_NET is the network of
# `tests/test_train.py`'s tiny run after `setup.setup_data` (checked there too).
TINY_NET = dict(img_resolution=8, img_channels=2, label_dim=3, model_channels=4,
                channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4], channels_per_head=4,
                logvar_channels=8)
TRAIN_NET = dict(img_resolution=8, img_channels=1, label_dim=2, model_channels=8,
                 channel_mult=[1], num_blocks=1, attn_resolutions=[], logvar_channels=8)
STDS = [0.050, 0.100]            # the EMAs of every run directory / training state here
OUT_STDS = [0.075, 0.120]        # the post-hoc EMAs reconstructed
BATCH = 4                        # batch of the tiny training state
RNG_SEEDS = [0, 1, 7, 12345, 2**32 + 5, 987654321]
RNG_SHAPES = [(3, 5, 5), (4, 8, 8)]  # (C, H, W)
SUBSETS = [(26, 0), (5, 0), (5, 7), (20, 2**31 + 7)]


def import_release(path):
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "training", "networks_edm2.py")):
        sys.exit(f"{path} is not a checkout of https://github.com/NVlabs/edm2")
    sys.path.insert(0, path)
    import torch
    torch.set_num_threads(1)
    import dnnlib  # noqa: F401
    return torch


def tiny_net(torch, kwargs, seed):
    """Release `Precond(**kwargs)` (MPFourier buffers of `torch.manual_seed(0)`), every
    parameter, gains included, standard normal from `Generator().manual_seed(seed)`."""
    from training import networks_edm2
    torch.manual_seed(0)
    net = networks_edm2.Precond(**copy.deepcopy(kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net.eval().requires_grad_(False)


def write_json(out, name, obj):
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def make_phema(torch, out):
    import dnnlib
    import reconstruct_phema
    import training.phema
    from training import encoders
    calls = []
    solve = training.phema.solve_posthoc_coefficients

    def recording_solve(in_nimg, in_std, out_nimg, out_std):
        coefs = solve(in_nimg, in_std, out_nimg, out_std)
        calls.append(dict(in_nimg=[int(n) for n in in_nimg], in_std=[float(s) for s in in_std],
                          out_nimg=int(out_nimg), out_std=[float(s) for s in out_std],
                          coefs=np.asarray(coefs, np.float64).tolist()))
        return coefs

    training.phema.solve_posthoc_coefficients = recording_solve
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "00000-tiny")
        os.makedirs(run)
        names = []
        for k in range(7):
            for i, std in enumerate(STDS):
                data = dnnlib.EasyDict(encoder=encoders.StandardRGBEncoder(),
                                       dataset_kwargs={}, loss_fn=None)
                data.ema = tiny_net(torch, TINY_NET, seed=10 * k + i).to(torch.float16)
                name = f"network-snapshot-{k * 1024 // 1000:07d}-{std:.3f}.pkl"
                with open(os.path.join(run, name), "wb") as f:
                    pickle.dump(data, f)
                names.append(name)
        listed = reconstruct_phema.list_input_pickles(run)
        for case, out_nimg in (("last", None), ("kimg3", reconstruct_phema.kimg_to_nimg(3))):
            calls.clear()
            r = None
            for r in reconstruct_phema.reconstruct_phema(listed, out_std=list(OUT_STDS),
                                                         out_nimg=out_nimg, verbose=False):
                pass
            assert len(calls) == 1 and [o.std for o in r.out] == calls[0]["out_std"]
            cases[case] = dict(out_nimg_arg=out_nimg, **calls[0])
    training.phema.solve_posthoc_coefficients = solve
    write_json(out, "phema_rundir.json", dict(
        files=names, stds=STDS, out_stds=OUT_STDS,
        listed=[dict(name=os.path.basename(p.path), nimg=int(p.nimg), std=float(p.std))
                for p in listed],
        cases=cases))


def make_presets(out):
    import train_edm2
    opts = {p.name: p.default for p in train_edm2.cmdline.params}
    write_json(out, "presets.json", dict(
        presets={name: dict(batch=int(p.batch), duration=int(p.duration))
                 for name, p in train_edm2.config_presets.items()},
        defaults={k: dict(arg=opts[k], nimg=int(train_edm2.parse_nimg(opts[k])))
                  for k in ("status", "snapshot", "checkpoint")}))


def make_rng(torch, out):
    import generate_images
    arrays = {"seeds": np.array(RNG_SEEDS, np.uint64)}
    for c, h, w in RNG_SHAPES:
        rnd = generate_images.StackedRandomGenerator("cpu", RNG_SEEDS)
        tag = f"{c}x{h}x{w}"
        arrays[f"{tag}/noise"] = rnd.randn([len(RNG_SEEDS), c, h, w]).numpy()
        arrays[f"{tag}/labels"] = rnd.randint(1000, size=[len(RNG_SEEDS)]).numpy()
        for i in range(2):
            arrays[f"{tag}/churn{i}"] = rnd.randn_like(torch.zeros(len(RNG_SEEDS), c, h, w)).numpy()
    np.savez(os.path.join(out, "release_rng.npz"), **arrays)


def make_subset(out):
    import PIL.Image
    from training import dataset
    names = [f"{d}/{i:03d}.png" for d in ("a", "b") for i in range(13)]
    picks = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in ("a", "b"):
            os.makedirs(os.path.join(tmp, d))
        for i, n in enumerate(names):
            PIL.Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(os.path.join(tmp, n))
        for num, seed in SUBSETS:
            ds = dataset.ImageFolderDataset(path=tmp, max_size=num, random_seed=seed)
            picks.append(dict(num=num, seed=seed,
                              files=[ds._image_fnames[i] for i in ds._raw_idx]))
    write_json(out, "folder_subset.json", dict(folder=names, subsets=picks))


def save_training_state(torch, path, state, net, opt, ema):
    import dnnlib
    from torch_utils import distributed
    os.makedirs(os.path.dirname(path), exist_ok=True)
    distributed.CheckpointIO(state=dnnlib.EasyDict(state), net=net, loss_fn=None,
                             optimizer=opt, ema=ema).save(path, verbose=False)


def make_states(torch, out):
    from training import phema
    from training.training_loop import learning_rate_schedule

    # Tiny Precond, 3 Adam steps of batch BATCH on random gradients, PowerFunctionEMA.
    net = tiny_net(torch, TINY_NET, seed=3).train().requires_grad_(True)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    ema = phema.PowerFunctionEMA(net, stds=list(STDS))
    gen = torch.Generator().manual_seed(5)
    for k in range(3):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        ema.update(cur_nimg=(k + 1) * BATCH, batch_size=BATCH)
    save_training_state(torch, os.path.join(out, "state_tiny", "training-state-0000000.pt"),
                        dict(cur_nimg=3 * BATCH, total_elapsed_time=1.5), net, opt, ema)

    # One more step at the release's learning rate for nimg 12 (ref_lr 0.01, 3 reference
    # batches, ramp-up 1e-5 Mimg), then the EMA update at nimg 16.
    lr = learning_rate_schedule(cur_nimg=3 * BATCH, batch_size=BATCH, ref_lr=0.01,
                                ref_batches=3, rampup_Mimg=1e-5)
    gen = torch.Generator().manual_seed(9)
    keys = [k for k, _ in net.named_parameters()]
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in net.named_parameters()}
    for k, p in net.named_parameters():
        p.grad = grads[k].clone()
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    ema.update(cur_nimg=4 * BATCH, batch_size=BATCH)
    params = dict(net.named_parameters())
    arrays = {"keys": np.array(keys), "lr": np.float64(lr),
              "adam_step": np.int64(opt.state[params[keys[0]]]["step"])}
    for k in keys:
        arrays[f"g/{k}"] = grads[k].numpy()
        arrays[f"w/{k}"] = params[k].detach().numpy()
        arrays[f"mu/{k}"] = opt.state[params[k]]["exp_avg"].numpy()
        arrays[f"nu/{k}"] = opt.state[params[k]]["exp_avg_sq"].numpy()
    for s, e in zip(ema.stds, ema.emas):
        for k, v in e.named_parameters():
            arrays[f"ema{s:.3f}/{k}"] = v.detach().numpy()
    np.savez(os.path.join(out, "state_tiny_step.npz"), **arrays)

    # The net of tests/test_train.py's tiny run: one Adam step of batch 8 (nimg 8).
    from training import networks_edm2
    torch.manual_seed(0)
    net = networks_edm2.Precond(**copy.deepcopy(TRAIN_NET))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
    ema = phema.PowerFunctionEMA(net, stds=list(STDS))
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    ema.update(cur_nimg=8, batch_size=8)
    save_training_state(torch, os.path.join(out, "state_train", "training-state-0000000.pt"),
                        dict(cur_nimg=8, total_elapsed_time=0.0), net, opt, ema)
    return dict(TINY_NET=TINY_NET, TRAIN_NET=TRAIN_NET)


def _params(cls, skip=()):
    """`{name: default}` of the named constructor arguments of `cls` (the class under the
    release's persistence decorator); required ones left out."""
    from torch_utils import persistence
    if persistence.is_persistent(cls):
        cls = cls.__bases__[0]
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or name in skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.default is not p.empty:
            out[name] = p.default
    return out


def make_export_facts(torch, out, nets):
    from training import networks_edm2
    net = tiny_net(torch, TINY_NET, seed=4)
    globals_seen, metas = [], []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            if [module, name] not in globals_seen:
                globals_seen.append([module, name])
            return super().find_class(module, name)

    from torch_utils import persistence
    persistence.import_hook(lambda meta: metas.append(
        dict(type=meta.type, version=meta.version, class_name=meta.class_name)) or meta)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "network-snapshot-0000000-0.100.pkl")
        with open(path, "wb") as f:
            pickle.dump(dict(ema=net), f)
        with open(path, "rb") as f:
            theirs = Recorder(f).load()["ema"]
    persistence._import_hooks.clear()
    cls = networks_edm2.Precond
    # The Block arguments that UNet sets itself for every block (not passable).
    unet_sets = ("in_channels", "out_channels", "emb_channels", "flavor", "resample_mode",
                 "attention")
    write_json(out, "export_facts.json", dict(
        net_kwargs=nets,
        pickle_globals=globals_seen,
        # The persistence records of the pickle: the Precond's (the last one read), and
        # every (type, version) and class name met.
        precond_meta=metas[-1],
        persistent_types=sorted({(m["type"], m["version"]) for m in metas}),
        persistent_classes=sorted({m["class_name"] for m in metas}),
        precond_class=[cls.__module__, cls.__name__],
        precond_is_torch_module=isinstance(theirs, torch.nn.Module),
        init_kwargs=dict(theirs.init_kwargs),
        accepted_kwargs={"Precond": _params(networks_edm2.Precond),
                         "UNet": _params(networks_edm2.UNet),
                         "Block": _params(networks_edm2.Block, skip=unet_sets)},
        state_dict={k: [list(v.shape), str(v.dtype).replace("torch.", "")]
                    for k, v in theirs.state_dict().items()}))


def check_export(torch):
    """Our exported pickle, read by the release's loader into its Precond."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
    import jax
    from edm2_jax.model import networks
    from edm2_jax.release import convert, export
    from training import networks_edm2
    cfg = {**TINY_NET, "channel_mult": (1, 2), "attn_resolutions": (4,)}
    variables = jax.device_get(networks.init_variables(networks.precond_from_config(cfg),
                                                       jax.random.PRNGKey(4)))
    variables["params"] = jax.tree.map(
        lambda a: np.random.RandomState(a.size).standard_normal(a.shape).astype(np.float32),
        variables["params"])
    with tempfile.TemporaryDirectory() as tmp:
        pkl = export.export_network_pickle(variables, cfg, os.path.join(tmp, "x.pkl"))
        with open(pkl, "rb") as f:
            theirs = pickle.load(f)["ema"]
    assert isinstance(theirs, networks_edm2.Precond), type(theirs)
    sd = convert.variables_to_state_dict(variables)
    assert sorted(theirs.state_dict()) == sorted(sd)
    for k, v in theirs.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), sd[k])
    again = pickle.loads(pickle.dumps(copy.deepcopy(theirs)))
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma, labels = torch.tensor([0.5, 3.0]), torch.eye(3)[[0, 2]]
    np.testing.assert_array_equal(again(x, sigma, labels).numpy(), theirs(x, sigma, labels).numpy())
    print("export check: the release reads edm2_jax's exported pickle into its Precond "
          "(same state dict; a re-pickled copy gives the same output)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", required=True, help="checkout of https://github.com/NVlabs/edm2")
    ap.add_argument("--out", default=HERE, help="where to write (default: this folder)")
    ap.add_argument("--check-export", action="store_true",
                    help="only check that the release loads edm2_jax's exported pickle")
    args = ap.parse_args()
    torch = import_release(args.release)
    if args.check_export:
        check_export(torch)
        return
    os.makedirs(args.out, exist_ok=True)
    make_phema(torch, args.out)
    make_presets(args.out)
    make_rng(torch, args.out)
    make_subset(args.out)
    nets = make_states(torch, args.out)
    make_export_facts(torch, args.out, nets)
    for root, _, files in sorted(os.walk(args.out)):
        for name in sorted(files):
            if not name.endswith(".py"):
                p = os.path.join(root, name)
                print(f"{os.path.getsize(p):9d}  {os.path.relpath(p, args.out)}")


if __name__ == "__main__":
    main()
