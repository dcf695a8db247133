"""Reading a network: any path this project writes -> the network, its config, its
encoder and the sampler it is sampled with.

    net, variables, desc = nets.load_net("runs/fmnist", ema="0.100")
    nets.net_sampler("runs/fmnist-4step")   # solvers.FewStep(num_steps=4, teacher_steps=8, ...)

A path may be a network checkpoint (written by `--mode=convert` or post-hoc EMA), a
training run directory (its latest checkpoint; `ema='0.100'` picks the power EMA,
`ema='online'` the raw weights, default the largest sigma_rel), or one EMA snapshot
directory of a run (`RUN/snapshots/<step>`). Reading those is `run/network_dir.py`'s,
`run/snapshots.py`'s and `run/checkpoints.py`'s; this module picks which.

Owns `load_net` (the network and its variables; `load_variables` the arrays alone, for a
caller that builds the network itself), `net_config`, `net_encoder` and
`net_sampler` (from the metadata only: network.json or the run's config.json, checked
against the copy the run's checkpoints and snapshots keep: `run_config`),
`check_vae` (the decoder a net's samples need) and `load_guide` (the guide network of
`--guide`). `net_sampler` is the one place that decides how a network is sampled: by
the objective it was trained with (`objectives.from_metadata`). Used by
`--mode=generate`, `--mode=eval`, the post-hoc EMA sweep, `--mode=export`, the training
run's periodic evaluation and distillation (its teacher).
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from edm2_jax import objectives, paths
from edm2_jax.encoders import vae as vae_lib
from edm2_jax.model.networks import Precond, init_variables, precond_from_config
from edm2_jax.run import checkpoints, integrity, layout, records, snapshots
from edm2_jax.sampling import solvers
from edm2_jax.run import network_dir as ckpt_lib


def load_net(path: str, ema: str | None = None) -> tuple[Precond, dict, str]:
    """Load `(net, variables, description)` from any checkpoint kind (see module doc),
    its arrays of the shapes its network config builds (`check_shapes`).

    Raises FileNotFoundError naming what was looked for, KeyError for an unknown EMA,
    IntegrityError for arrays the network config does not build or, before any array is
    read, for a run's or snapshot's config.json edited since its checkpoints (`run_config`).
    """
    variables, desc, net_config = _read(path, ema)
    net = precond_from_config(net_config())
    check_shapes(jax.eval_shape(lambda r: init_variables(net, r), jax.random.PRNGKey(0)),
                 variables, desc)
    return net, variables, desc


def shape_differences(want: dict, variables: dict) -> list[str]:
    """'col/path: SHAPE where its network config builds SHAPE' for each array of
    `variables` (`{'params', 'buffers'}`) missing from `want`, absent from it, or of
    another shape (`want`: arrays or `jax.ShapeDtypeStruct`s of the same collections)."""
    def shapes(tree) -> dict:
        return {"/".join(str(getattr(k, "key", k)) for k in p): tuple(np.shape(x))
                for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    differ = []
    for col in ("params", "buffers"):
        a, b = shapes(want.get(col, {})), shapes(variables.get(col, {}))
        differ += [f"{col}/{k}: {'missing' if k not in b else b[k]} where its network "
                   f"config builds {a[k] if k in a else 'none'}"
                   for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return differ


def check_shapes(want: dict, variables: dict, what: str) -> None:
    """Raise IntegrityError naming `what`, the first arrays and both shapes when the
    arrays of `variables` (`{'params', 'buffers'}`) are not of the shapes of `want`
    (the same collections of the network its config builds, as arrays or
    `jax.ShapeDtypeStruct`s: `jax.eval_shape` of its initialisation, nothing allocated):
    a `.zarray` whose shape was edited (transposed, say) reads bytes the checksums
    accept as the wrong tensor."""
    differ = shape_differences(want, variables)
    if differ:
        raise integrity.IntegrityError(
            f"{what} is not the network its config describes ({'; '.join(differ[:3])}"
            f"{'; ...' if len(differ) > 3 else ''}): its files were edited or damaged; "
            f"write it again (--mode=convert, post-hoc EMA) or restore it")


def load_variables(path: str, ema: str | None = None) -> tuple[dict, str]:
    """`(variables, description)` of any checkpoint kind (see module doc): its arrays
    (`{'params', 'buffers'}`, checked against their checksums), without building its
    network or checking their shapes (`load_net` does both; a caller that builds the
    network itself checks them against its shapes: `check_shapes`). Raises as `load_net`
    does."""
    variables, desc, _ = _read(path, ema)
    return variables, desc


def _read(path: str, ema: str | None) -> tuple[dict, str, Callable[[], dict]]:
    """`(variables, description, net_config)` of `load_variables`, `net_config()` the
    network config of the same checkpoint (network.json's, already read; else its run's
    config.json's, checked before its arrays are read: `_run_network`)."""
    path = paths.normalize(path)  # local or gs://
    check_one_kind(path)
    if ckpt_lib.is_network_checkpoint(path):
        cfg, variables, _ = ckpt_lib.load_network(path)
        return variables, f"network checkpoint {path}", lambda: cfg

    snap = layout.snapshot_of(path)
    if snap:
        run_dir, step = snap
        network = _run_network(run_dir)
        tree, meta = snapshots.restore_snapshot(run_dir, step)
        key = ema or max(tree["power"], key=float)
        if key not in tree["power"]:
            raise KeyError(f"snapshot {path} has EMAs {sorted(tree['power'])}, not {key!r}")
        variables = {"params": tree["power"][key], "buffers": snapshots.run_buffers(run_dir)}
        return (variables,
                f"EMA {key} of snapshot {step} ({meta['nimg'] / 1000:.1f} kimg) in {run_dir}",
                network)

    if layout.is_run(path):
        network = _run_network(path)
        state = checkpoints.restore_latest_state(path)
        if ema == "online":
            params, what = state["params"], "online weights"
        else:
            key = ema or max(state["ema"]["power"], key=float)
            if key not in state["ema"]["power"]:
                raise KeyError(f"run {path} tracks EMAs {sorted(state['ema']['power'])}, not "
                               f"{key!r} (or use --ema=online)")
            params, what = state["ema"]["power"][key], f"EMA sigma_rel={key}"
        return ({"params": params, "buffers": state["buffers"]},
                f"{what} of run {path} at step {int(state['step'])}",
                network)
    raise FileNotFoundError(
        f"{path} is neither a network checkpoint (network.json + variables/), a training run "
        f"(config.json + checkpoints/), nor an EMA snapshot (RUN/snapshots/<step>)")


def _run_network(run_dir: str) -> Callable[[], dict]:
    """`net_config()` of `_read` for a run or its snapshot: its config.json checked now,
    before any array is read (`run_config`: an edited config.json is refused for every
    reader), its network section returned when called (FileNotFoundError then when the
    run has no config.json, `records.run_network_config`)."""
    config = run_config(run_dir)
    if config is None:
        return lambda: records.run_network_config(run_dir)
    return lambda: config["network"]


def check_one_kind(path: str) -> None:
    """Raise ValueError when `path` (normalised) is both a training run and a network
    checkpoint: which one is meant cannot be told."""
    if ckpt_lib.is_network_checkpoint(path) and layout.is_run(path):
        raise ValueError(f"{path} is both a training run and a network checkpoint "
                         f"(network.json + variables/, e.g. from --mode=convert into the run); "
                         f"move {ckpt_lib.NETWORK_JSON} and {ckpt_lib.VARIABLES}/ to a "
                         f"directory of their own and pass the one you mean")


def _metadata(path: str) -> tuple[dict | None, dict, dict | None]:
    """`(network config, network.json meta, the run's config.json)` of the network at
    `path`, from its metadata only (the run's config.json for a run or its snapshot,
    checked: `run_config`; None where there is none). Raises as `check_one_kind`."""
    path = paths.normalize(path)
    check_one_kind(path)
    if ckpt_lib.is_network_checkpoint(path):
        cfg, meta = ckpt_lib.read_network_json(path)
        return cfg, meta, None
    snap = layout.snapshot_of(path)
    config = run_config(snap[0] if snap else path)
    if config is None or "network" not in config:
        return None, {}, None
    return config["network"], {}, config


def run_config(run_dir: str) -> dict | None:
    """The run's config.json (None when there is none), checked against the copy of it
    that the run's newest checkpoint or EMA snapshot keeps (`records.kept_config`) in
    every field that decides what its networks are and how they are sampled: the network
    section and `data.encoder` (`records.run_config`), the objective and its section
    (`_check_objective_unedited`). Raises IntegrityError naming the fields, both values
    and the fix when config.json was edited."""
    config = records.run_config(run_dir)
    if config is not None:
        _check_objective_unedited(run_dir, config)
    return config


def _check_objective_unedited(run_dir: str, config: dict) -> None:
    """Raise IntegrityError when the run's config.json names another objective, or other
    settings of its objective's section, than the copy its newest checkpoint or snapshot
    keeps (`records.kept_config`): its networks would be sampled otherwise than trained.
    (`records.run_config` checks the network section the same way.)"""
    kept = records.kept_config(run_dir)
    if kept is None:
        return
    (what, was), now = kept, config
    kind = what.split()[0]
    differ = [f"objective: {kind} {objectives.name_of(was)!r} vs now "
              f"{objectives.name_of(now)!r}"] if objectives.name_of(was) != objectives.name_of(
                  now) else []
    section = (objectives.REGISTRY.get(objectives.name_of(now)) or objectives.Objective).section
    if not differ and section:
        a, b = was.get(section) or {}, now.get(section) or {}
        differ = [f"{section}.{k}: {kind} {a.get(k)!r} vs now {b.get(k)!r}"
                  for k in sorted(b) if k in a and a.get(k) != b.get(k)]
    if differ:
        raise integrity.IntegrityError(
            f"{layout.config_path(run_dir)} differs from the copy of the run's config that "
            f"{what} keeps ({'; '.join(differ)}): it was edited, and its "
            f"networks would be sampled otherwise than they were trained; put those "
            f"settings back")


def net_config(path: str) -> dict:
    """The network config (`Precond` kwargs) of the network at `path` (any kind
    `load_net` reads), from its metadata only. Raises FileNotFoundError as `load_net`
    does when `path` is none of those kinds."""
    cfg, _, _ = _metadata(path)
    if cfg is None:
        load_net(path)  # raises, naming what was looked for
    return cfg


def net_sampler(path: str, num_steps: int = 32) -> solvers.Sampler:
    """The sampler (a `sampling.solvers` value) of the network at `path` (any kind
    `load_net` reads), from its own metadata only: that of the objective it was trained
    with (`objectives.from_metadata`, `Objective.sampler(num_steps)`): a network
    checkpoint's network.json record (`objectives.record`, which a post-hoc EMA copies
    from its run), a run's or its snapshot's config.json. A diffusion network:
    `solvers.Heun(num_steps)`; a distilled student or generator: its few-step sampler
    (`solvers.FewStep`) on its own grid, whatever `num_steps`. Raises ValueError for a
    post-hoc EMA whose network.json records no objective (it cannot say how it is
    sampled without reading its source run)."""
    _, meta, config = _metadata(path)
    source = (f"{path}/{ckpt_lib.NETWORK_JSON}" if ckpt_lib.is_network_checkpoint(path)
              else f"the config.json of {path}")
    if meta.get("phema") and "objective" not in meta:
        raise ValueError(f"{path}: this post-hoc EMA's network.json records no objective, "
                         f"so how it is sampled is unknown; make it again with --mode=phema "
                         f"--workdir={meta.get('source', 'RUN')}")
    return objectives.from_metadata(meta, config, source).sampler(num_steps)


def net_encoder(path: str) -> str:
    """The encoder ('none' or 'sd-vae', `vae.ENCODERS`) of the network at `path` (any
    kind `load_net` reads), from its metadata only: network.json, or the run's
    config.json (`vae.encoder_of`). Raises what reading them raises; a path of no known
    kind gives 'none' (`load_net` then names the problem)."""
    path = paths.normalize(path)
    if ckpt_lib.is_network_checkpoint(path):
        cfg, meta = ckpt_lib.read_network_json(path)
        return vae_lib.encoder_of(cfg, meta)
    snap = layout.snapshot_of(path)
    config = run_config(snap[0] if snap else path)
    if config is None or "network" not in config:
        return "none"
    return vae_lib.encoder_of(config["network"], data_config=config.get("data"))


def check_vae(net_path: str, vae_path: str | None,
              guide_path: str | None = None) -> vae_lib.SDVAE | None:
    """The SD VAE that decodes the samples of the network at `net_path`, or None for a
    pixel-space net. Raises ValueError when a latent net comes without `--vae`, a
    pixel-space net with one, or the guide's space differs from the net's; the errors
    of `vae.load_vae` for a bad VAE file. Reads metadata and the VAE only."""
    encoder = net_encoder(net_path)
    if guide_path and net_encoder(guide_path) != encoder:
        raise ValueError(f"--guide={guide_path} works in encoder {net_encoder(guide_path)!r} "
                         f"space but --net={net_path} in {encoder!r}; guide a net with one "
                         f"trained on the same data")
    if encoder == "sd-vae" and not vae_path:
        raise ValueError(f"{net_path} is a latent network (SD-VAE latents): its samples are "
                         f"decoded by the SD VAE; pass --vae=PATH (the "
                         f"diffusion_pytorch_model.safetensors or folder of "
                         f"{vae_lib.SD_VAE_URL})")
    if encoder == "none" and vae_path:
        raise ValueError(f"--vae={vae_path} given, but {net_path} is a pixel-space network "
                         f"(encoder 'none'): its samples are images already; drop --vae")
    return vae_lib.load_vae(vae_path) if encoder == "sd-vae" else None


def load_guide(guide_path: str | None, guide_ema: str | None, guidance: float
               ) -> tuple[Precond, dict] | None:
    """`(net, variables)` of the guide network for `guidance` (`load_net`), or None
    without `guide_path`. Raises ValueError for guidance != 1 without a guide (it would
    be ignored)."""
    if not guide_path:
        if guidance != 1:
            raise ValueError(f"--guidance={guidance:g} needs --guide=PATH (an unconditional "
                             f"net for CFG, a smaller or earlier one for autoguidance)")
        return None
    gnet, gvars, gdesc = load_net(guide_path, guide_ema)
    print(f"Guidance {guidance:g} with guide {gdesc}")
    return gnet, gvars
