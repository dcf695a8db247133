"""`--mode=generate`: images for `--seeds` from `--net` (network checkpoint, run dir or EMA
snapshot) into `--outdir` and/or a `--grid` PNG; `--guide`/`--guidance` for
(auto)guidance; a latent (img512) net's samples are decoded by the SD VAE of `--vae`.

    python -m edm2_jax.main --mode=generate --net=runs/fmnist --seeds=0-63 --grid=grid.png

A named preset (`--preset=NAME --models=DIR`, `sampling/presets.py`; `--list_presets`
prints them) stands for `--net`, `--guide`, `--guidance` and `--guidance_interval`: the
release's pickles in DIR, converted on first use. Giving any of those flags (or `--ema`,
`--guide_ema`) together with `--preset` is an error: a preset's figures are those of its
exact settings; to vary one, pass the networks yourself (`--list_presets` names the files).

    python -m edm2_jax.main --mode=generate --preset=edm2-img512-xxl-guid-interval-fid \
        --models=models/ --vae=sd-vae-ft-mse/ --seeds=0-63 --grid=grid.png

A latent network (SD-VAE latents: an img512 net of the release, or a run on latent data)
needs `--vae=PATH`, the SD VAE whose decoder turns its samples into RGB; a pixel-space
net refuses one. Both are checked from the metadata before any weights are read
(`nets.check_vae`).

Owns `main_generate` (the body of the mode: `nets.load_net`, then
`sampling.seed_images.generate_images`) and `sampler_flags`, the sampler of `--net` as
`nets.net_sampler` decides it unless the flags say otherwise.

Also defines the flags that `--mode=eval` shares (`--net`, `--ema`, `--batch`, `--steps`,
the schedule, `--preset`, `--models`, `--guidance_interval`), as does `--mode=phema_sweep`
(`--batch`, `--steps`, `--vae`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags

from edm2_jax import nets, paths
from edm2_jax.evaluation import stream
from edm2_jax.modes import common  # noqa: F401 - every mode's flags (--config, --workdir)
from edm2_jax.sampling import guidance, presets, seed_images, solvers
from edm2_jax.sampling.sampler import save_image_grid
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN
from edm2_jax.training import sharding

FLAGS = flags.FLAGS
flags.DEFINE_string("net", None, "generate/eval: network checkpoint, training run dir or "
                    "RUN/snapshots/<step>.")
flags.DEFINE_string("ema", None, "generate/eval: which EMA of a run ('0.100', 'online'); "
                    "default largest sigma_rel.")
flags.DEFINE_string("seeds", "0-63", "generate/eval: seeds, e.g. '0-49999' or '1,5,7-9' (eval "
                    "default: 0..num_images-1).")
flags.DEFINE_string("outdir", None, "generate, eval: directory for PNGs.")
flags.DEFINE_bool("subdirs", False, "generate: one subdirectory per 1000 seeds.")
flags.DEFINE_string("grid", None, "generate: also write all images as one grid PNG here.")
flags.DEFINE_integer("class_idx", None, "generate/eval: class for every image (default "
                     "random per seed).")
flags.DEFINE_integer("batch", 64, "generate/eval: images per batch (split over devices).")
flags.DEFINE_integer("steps", 32, "generate/eval: sampler steps N (Heun: 2N-1 network "
                     "evaluations; a few-step student's sampler: N evaluations, by default "
                     "the steps it was distilled for).")
flags.DEFINE_string("sampler", "auto", "generate/eval: a registered sampler (edm2_jax.sampling."
                    "solvers.SAMPLERS: 'heun', the EDM sampler; 'few_step', the few-step sampler of "
                    "a distilled student or generator: --steps evaluations on the teacher's grid of "
                    "--teacher_steps, of a diffusion net DDIM on that grid; or one a --plugins "
                    "module registers), or 'auto': the sampler the network was trained for (its "
                    "objective's).")
flags.DEFINE_string("sampler_opts", None, "generate/eval: settings of the sampler, "
                    "FIELD=VALUE[,FIELD=VALUE...] (its dataclass fields, e.g. 'rho=5,S_noise=1.003'; "
                    "a field the sampler does not have is refused).")
flags.DEFINE_integer("teacher_steps", None, "generate/eval: with --sampler=few_step, the "
                     "teacher's grid of Heun steps (default: the network's own, else 32).")
flags.DEFINE_string("vae", None, "generate, eval, phema_sweep: the SD VAE that decodes a latent (img512) net's "
                    "samples: its diffusion_pytorch_model.safetensors / .bin or diffusers folder.")
flags.DEFINE_string("guide", None, "generate/eval: guide network (unconditional for CFG, smaller/earlier for autoguidance).")
flags.DEFINE_string("guide_ema", None, "generate/eval: which EMA of the guide run.")
flags.DEFINE_float("guidance", 1.0, "generate/eval: guidance weight w in D_g + w (D - D_g).")
flags.DEFINE_float("S_churn", 0.0, "generate/eval: stochastic churn.")
flags.DEFINE_float("S_min", 0.0, "generate/eval: churn lower sigma.")
flags.DEFINE_float("S_max", float("inf"), "generate/eval: churn upper sigma.")
flags.DEFINE_float("S_noise", 1.0, "generate/eval: churn noise scale.")
flags.DEFINE_float("sigma_min", SIGMA_MIN, "generate/eval: lowest noise level of the sampler's schedule.")
flags.DEFINE_float("sigma_max", SIGMA_MAX, "generate/eval: highest noise level of the sampler's schedule.")
flags.DEFINE_enum("rng", "jax", ["jax", "release"], "generate/eval: per-seed noise and labels "
                  "from JAX keys, or drawn as the release's per-seed torch generator does "
                  "(a converted release net then gives the release's image for a seed).")
flags.DEFINE_float("rho", RHO, "generate/eval: time-step exponent of the schedule (EDM Eq. 5).")


def parse_guidance_interval(text) -> tuple[float, float] | None:
    """`--guidance_interval`: 'LO,HI' -> `(sigma_lo, sigma_hi)`, the noise levels between
    which the Heun steps are guided (`sigma_lo < t_i <= sigma_hi`, Kynkäänniemi et al.
    2024; `guidance.check_guidance_interval`); HI may be 'inf'. '' or 'none' -> None
    (every step). Raises ValueError for other text, NaN, or unless `0 <= LO < HI`."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none")):
        return None
    try:
        return guidance.check_guidance_interval(text.split(",") if isinstance(text, str)
                                                else text)
    except ValueError:
        raise ValueError("give two noise levels LO,HI with 0 <= LO < HI, e.g. "
                         "--guidance_interval=0.28,1.61 (HI may be inf)") from None


class _IntervalParser(flags.ArgumentParser):
    syntactic_help = "LO,HI (noise levels, HI may be inf)"

    def parse(self, argument):
        return parse_guidance_interval(argument)

    def flag_type(self):
        return "interval"


class _IntervalSerializer(flags.ArgumentSerializer):
    def serialize(self, value):
        return "" if value is None else f"{value[0]!r},{value[1]!r}"


class _ListPresetsFlag(flags.BooleanFlag):
    """`--list_presets`: prints the preset table and exits with status 0 while the flags
    are parsed, whatever the mode (as absl's `--help` prints the usage)."""

    def __init__(self):
        super().__init__("list_presets", False, "print the named presets (--preset) with "
                         "their files, guidance, interval and reported figure, and exit.")

    def parse(self, argument):
        super().parse(argument)
        if self.value:
            print(presets.table(), flush=True)
            sys.exit(0)


flags.DEFINE(_IntervalParser(), "guidance_interval", None,
             "generate/eval: guide only the sampler steps whose noise level t_i is in "
             "(LO, HI], e.g. '0.28,1.61' (HI may be inf); default every step.",
             serializer=_IntervalSerializer())
flags.DEFINE_string("preset", None, "generate/eval: a named preset (--list_presets): sets "
                    "--net, --guide, --guidance, --guidance_interval from --models.")
flags.DEFINE_string("models", None, "generate/eval with --preset: local folder holding the "
                    "release's network pickles (each converted on first use into "
                    "<stem>.edm2jax/ beside it).")
flags.DEFINE_flag(_ListPresetsFlag())

# What a preset sets: giving one of these with --preset is an error.
PRESET_SETS = ("net", "ema", "guide", "guide_ema", "guidance", "guidance_interval")


def check_preset() -> presets.Preset | None:
    """`--preset`, checked before any conversion (cheap): no flag it sets given as well,
    a known name, `--models` holding its pickles, `--vae` fitting its data. None
    without `--preset`. Raises ValueError / FileNotFoundError naming the fix."""
    if not FLAGS.preset:
        if FLAGS.models:
            raise ValueError(f"--models={FLAGS.models} is read only with --preset=NAME; "
                             f"name a preset (--list_presets) or drop --models")
        return None
    given = [f"--{f}" for f in PRESET_SETS if FLAGS[f].present]
    if given:
        raise ValueError(f"--preset={FLAGS.preset} sets the networks and guidance itself; "
                         f"drop {', '.join(given)}, or drop --preset and give --net/--guide/"
                         f"--guidance/--guidance_interval yourself (--list_presets names "
                         f"each preset's files)")
    preset = presets.get(FLAGS.preset)
    if not FLAGS.models:
        raise ValueError(f"--preset={preset.name} needs --models=DIR, the folder holding "
                         f"{' and '.join(preset.files)} (from {presets.RELEASE_URL})")
    presets.check_files(preset, FLAGS.models)
    presets.check_vae(preset, FLAGS.vae)
    return preset


def resolve_preset(preset: presets.Preset | None) -> presets.ResolvedPreset | None:
    """`presets.resolve` (converting the pickles on first use), announced on one line."""
    if preset is None:
        return None
    guide = (f", guide {preset.guide}, guidance {preset.guidance:g}" if preset.guide else "")
    lo_hi = preset.guidance_interval
    interval = f" in sigma ({lo_hi[0]:g}, {lo_hi[1]:g}]" if lo_hi else ""
    print(f"Preset {preset.name}: net {preset.net}{guide}{interval} (reported: "
          f"{preset.figure()})", flush=True)
    return presets.resolve(preset.name, FLAGS.models)


def network_flags(resolved: presets.ResolvedPreset | None) -> dict:
    """The networks and guidance (`net_path`, `ema`, `guide_path`, `guide_ema`,
    `guidance`): the preset's, else the flags'. Raises ValueError for
    `--guidance_interval` without guidance (no `--guide`, or `--guidance=1`)."""
    if resolved:
        return dict(net_path=resolved.net_path, ema=None, guide_path=resolved.guide_path,
                    guide_ema=None, guidance=resolved.guidance)
    if FLAGS.guidance_interval and (not FLAGS.guide or FLAGS.guidance == 1):
        raise ValueError("--guidance_interval limits guidance to some noise levels; it needs "
                         "guidance: --guide=PATH and --guidance=W (W != 1), or drop it")
    return dict(net_path=FLAGS.net, ema=FLAGS.ema, guide_path=FLAGS.guide,
                guide_ema=FLAGS.guide_ema, guidance=FLAGS.guidance)


def own_sampler() -> solvers.Sampler | None:
    """The sampler `--net` was trained to be sampled with (`nets.net_sampler`), or None
    without `--net`."""
    return nets.net_sampler(FLAGS.net) if FLAGS.net else None


def sampler_flags(resolved: presets.ResolvedPreset | None = None) -> dict:
    """The sampler's settings from the flags (`seed_images.generate_images` kwargs:
    `sampler`, a `solvers.Sampler` value, `rng` and `guidance_interval`). `--sampler=auto`:
    the network's own (`nets.net_sampler`), its settings replaced by those flags given;
    `--sampler=NAME`: that registered sampler from the flags over its defaults (a
    network's own settings where its own sampler is that one). `--steps` sets
    `num_steps`; `SAMPLER_FLAGS` set the field of their name; `--sampler_opts` any field.
    A preset: the Heun sampler with its guidance interval. Checked here, before any
    network is read or anything computed: raises ValueError naming the flag for an
    unregistered sampler, a flag or option the sampler does not take, a schedule that is
    none (e.g. `--steps=0`), a guidance interval or `--rng=release` with a sampler
    without them."""
    interval = resolved.guidance_interval if resolved else FLAGS.guidance_interval
    own = None if resolved else own_sampler()
    name = FLAGS.sampler if FLAGS.sampler != "auto" else (own.name if own else "heun")
    if name not in solvers.SAMPLERS:
        raise ValueError(f"--sampler={name}: not a registered sampler; use auto or one of "
                         f"{', '.join(sorted(solvers.SAMPLERS))} (a sampler of your own: "
                         f"register it in a module and name that module with --plugins)")
    cls = solvers.SAMPLERS[name]
    base = own if isinstance(own, cls) else None
    fields = cls.options()
    given_flags = [f for f in SAMPLER_FLAGS if FLAGS[f].present]
    refused = [f for f in given_flags if f not in fields]
    if refused:
        raise ValueError(f"{' '.join(f'--{f}={getattr(FLAGS, f)}' for f in refused)}: "
                         f"{_sampler_words(cls)} has no such setting (its settings: "
                         f"{', '.join(fields)}); drop it, or choose another --sampler")
    given = {f: getattr(FLAGS, f) for f in SAMPLER_FLAGS if f in fields
             and (FLAGS[f].present or base is None) and getattr(FLAGS, f) is not None}
    if FLAGS["steps"].present or base is None:
        given["num_steps"] = FLAGS.steps
    given.update(parse_sampler_opts(FLAGS.sampler_opts, cls))
    if interval and not cls.takes_guidance_interval:
        raise ValueError(f"--guidance_interval: {_sampler_words(cls)} evaluates the guided "
                         f"network on every step; drop it (or pass --sampler=heun)")
    if FLAGS.rng == "release" and not cls.release_draws:
        raise ValueError(f"--rng=release draws as the release does on an EDM schedule, which "
                         f"{_sampler_words(cls)} does not follow; drop --rng")
    try:
        sampler = dataclasses.replace(base, **given) if base else cls(**given)
    except (TypeError, ValueError) as e:
        shown = " ".join(f"--{f}={getattr(FLAGS, f)}" for f in SHOWN_FLAGS
                         if f == "steps" or f in fields and getattr(FLAGS, f) is not None)
        raise ValueError(f"{shown}: {e}") from None
    return dict(sampler=sampler, rng=FLAGS.rng, guidance_interval=interval)


def _sampler_words(cls: type[solvers.Sampler]) -> str:
    return f"--sampler={cls.name}"


def parse_sampler_opts(text: str | None, cls: type[solvers.Sampler]) -> dict:
    """`--sampler_opts` ('rho=5,S_noise=1.003') as `{field: value}` of the sampler class
    `cls`, each value of its field's type (a number, or true/false). Raises ValueError
    naming the option for a field `cls` has not (listing its fields) or a value that is
    not of its type."""
    if not text:
        return {}
    fields, out = cls.options(), {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in fields:
            raise ValueError(f"--sampler_opts={text}: {key!r} is not a setting of "
                             f"--sampler={cls.name} (its settings: {', '.join(fields)}); "
                             f"give FIELD=VALUE pairs")
        kind = fields[key]
        try:
            if kind is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                out[key] = value.lower() == "true"
            else:
                out[key] = kind(float(value)) if kind is int and "." not in value else kind(value)
        except ValueError:
            raise ValueError(f"--sampler_opts={text}: {key}={value!r} is not a "
                             f"{kind.__name__}") from None
    return out


# The flags that set a sampler's field of the same name (`solvers.Heun`, `FewStep`, a
# registered sampler with such a field).
SAMPLER_FLAGS = ("teacher_steps", "sigma_min", "sigma_max", "rho", "S_churn", "S_min",
                 "S_max", "S_noise")
SHOWN_FLAGS = ("steps", "sigma_min", "sigma_max", "rho", "teacher_steps")  # in its errors


def check_output_name(path: str | None, flag: str) -> None:
    """Raise `paths.OutputLocationError` naming `flag` when the local `path` has a name
    (or is itself) longer than its file system allows (`paths.name_problem`), before any
    work: it would fail only when the first image is written."""
    if not path or paths.is_url(path):
        return
    problem = paths.name_problem(paths.normalize(path))
    if problem:
        raise paths.OutputLocationError(f"{flag}={paths.normalize(path)}: {problem}; give a "
                                        f"shorter one")


def check_outputs(outdir: str | None, grid: str | None) -> None:
    """`--outdir` and `--grid`, before any weights are read or any image sampled: each
    writable (`paths.check_output_dir` / `check_output_file`: not a file or a directory,
    a reachable bucket) with names the file system takes (`check_output_name`), and a
    `--grid` that does not exist yet: a command never replaces a file it did not write
    (a run's own sample grid, `RUN/samples/*.png`, say). Raises OutputLocationError,
    FileExistsError."""
    if outdir:
        paths.check_output_dir(outdir, "--outdir")
        check_output_name(outdir, "--outdir")
    if grid:
        paths.check_output_file(grid, "--grid")
        check_output_name(grid, "--grid")
        if paths.exists(grid):
            raise FileExistsError(f"--grid={grid} exists; give a new file name (or delete it "
                                  f"first): generate never replaces a file")


def _remove_unfinished_pngs(outdir: str | None, subdirs: bool, seeds: set[int],
                            since: float) -> None:
    """After a stop by a signal: delete the PNGs of `seeds` (those of batches not done)
    that this command wrote (modified after `since`): a batch stopped while its PNGs
    were written may have left one cut short. Where `seed_images.generate_images` writes
    them; local `outdir` only."""
    if not outdir or paths.is_url(outdir):
        return
    per_dir = seed_images.MAX_SEEDS_PER_DIR
    for seed in seeds:
        d = os.path.join(outdir, f"{seed - seed % per_dir:06d}") if subdirs else outdir
        png = os.path.join(d, f"{seed:06d}.png")
        try:
            if os.stat(png).st_mtime >= since - 1:
                os.remove(png)
        except OSError:
            pass


def main_generate(net_path: str, seeds: str, outdir: str | None, *, ema: str | None = None,
                  batch_size: int = 64, class_idx: int | None = None, subdirs: bool = False,
                  guide_path: str | None = None, guide_ema: str | None = None,
                  guidance: float = 1.0, grid: str | None = None, vae_path: str | None = None,
                  **sampler_kw) -> None:
    """CLI body of `--mode=generate` (see module doc): `net_path` is any network
    `nets.load_net` reads. `vae_path`: `--vae`, checked first (`nets.check_vae`).
    `sampler_kw`: `sampler` (a `solvers.Sampler` value; default `solvers.Heun()`), `rng`
    and `guidance_interval` of `seed_images.generate_images`. The outputs
    are checked first (`paths.check_output_dir`: writable, not a file, a reachable
    bucket), before any weights are read or any image sampled. Stopped by a signal
    (`common.Interrupted`), it keeps the PNGs of the batches done (whole: those of the
    batch in flight are deleted) and writes no grid."""
    seed_list = seed_images.parse_seeds(seeds)
    if not outdir and not grid:
        raise ValueError("--mode=generate needs --outdir=DIR and/or --grid=FILE.png")
    check_outputs(outdir, grid)
    vae = nets.check_vae(net_path, vae_path, guide_path)
    net, variables, desc = nets.load_net(net_path, ema)
    sampler_kw = dict(sampler_kw)
    sampler = sampler_kw["sampler"] = sampler_kw.get("sampler") or solvers.Heun()
    how = sampler.describe()
    print(f"Generating {len(seed_list)} images from {desc} with {how}"
          + (f", decoded by the SD VAE {vae.path}" if vae else ""))
    guide = nets.load_guide(guide_path, guide_ema, guidance)
    t = time.time()
    all_imgs, done = [], []
    try:
        for seeds, imgs in seed_images.generate_images(
                net, variables, seed_list, outdir=outdir, batch_size=batch_size,
                class_idx=class_idx, subdirs=subdirs, guide=guide, guidance=guidance, vae=vae,
                **sampler_kw):
            done += list(seeds)
            if grid:
                all_imgs.append(imgs)
    except KeyboardInterrupt as e:  # SIGTERM or SIGINT (`common.Interrupted`)
        mine = set(stream.process_share(seed_list, batch_size))  # this process's seeds
        _remove_unfinished_pngs(outdir, subdirs, mine - set(done), since=t)
        e.kept = (f"the PNGs of the {len(done)} of {len(seed_list)} seeds done are kept in "
                  f"{outdir}" if outdir else "nothing was written") + (
                  f" (--grid={grid} is written only once every image is done)" if grid else "")
        raise
    dt = time.time() - t
    print(f"{len(seed_list)} images in {dt:.1f} s ({len(seed_list) / dt:.2f} img/s)"
          + (f" -> {outdir}" if outdir else ""))
    if grid and jax.process_index() == 0:
        imgs = np.concatenate(all_imgs)
        cols = int(np.ceil(np.sqrt(len(imgs))))
        rows = int(np.ceil(len(imgs) / cols))
        paths.write_through_local(grid, lambda local: save_image_grid(imgs, local, rows, cols))
        print(f"Grid -> {grid}")


def run() -> None:
    """`--mode=generate` (`main_generate`), from `--net` or `--preset`."""
    sharding.maybe_initialize_distributed()  # one of several hosts: each takes its share
    preset = check_preset()
    if not preset and not FLAGS.net:
        raise app.UsageError("--mode=generate needs --net=PATH (or --preset=NAME --models=DIR)")
    if preset:  # what main_generate checks first, before the conversion
        seed_images.parse_seeds(FLAGS.seeds)
        if not FLAGS.outdir and not FLAGS.grid:
            raise ValueError("--mode=generate needs --outdir=DIR and/or --grid=FILE.png")
    check_outputs(FLAGS.outdir, FLAGS.grid)  # before the net's metadata is read
    resolved = resolve_preset(preset)
    main_generate(
        seeds=FLAGS.seeds, outdir=FLAGS.outdir, batch_size=FLAGS.batch,
        class_idx=FLAGS.class_idx, subdirs=FLAGS.subdirs, grid=FLAGS.grid,
        vae_path=FLAGS.vae, **network_flags(resolved), **sampler_flags(resolved))
