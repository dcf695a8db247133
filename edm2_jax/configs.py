"""Config builders shared by the files in `configs/` (ml_collections, big_vision style).

`base_config()` holds every field with its default; `preset_config('img64-s')` fills in a
released preset from `presets.py`. Durations are in kimg (thousands of images), `t_ref`
in batches, learning rates absolute. The presets' `network.dtype` is 'auto', made
concrete once at start-up for the platform by `resolve_dtype`.
"""
from __future__ import annotations

import math

import ml_collections

from edm2_jax import backends, objectives
from edm2_jax.backends import cpu as cpu_backend
from edm2_jax.backends import gpu as gpu_backend
from edm2_jax.ema import power as ema
from edm2_jax.model import presets


# The values of `network.dtype`; 'auto' is resolved at start-up (`resolve_dtype`) to
# AUTO_DTYPES[platform], float32 on a platform not listed (the CPU).
DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_DTYPES = {"gpu": "bfloat16", "tpu": "bfloat16"}


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Network: keyword arguments of networks.Precond. dtype: the compute dtype of the
    # U-Net's convolutions and matmuls (analysis/precision.py; params, EMAs and the loss are
    # float32 whatever it is), a name in DTYPES; 'auto' is resolved at start-up
    # (`resolve_dtype`: bfloat16 on GPU/TPU, float32 on CPU).
    c.network = ml_collections.ConfigDict(dict(
        img_resolution=32, img_channels=1, label_dim=10, model_channels=32,
        channel_mult=(1, 2, 2), num_blocks=1, attn_resolutions=(8,), dropout=0.0,
        channels_per_head=64, sigma_data=0.5, logvar_channels=128, dtype="float32",
        # The paper's ablation (Sec. 2; configs/ablation.py, docs/ablation.md); these
        # defaults are config G. C->D mp_learned_layers, E->F group_norm, F->G
        # mp_fixed_layers (networks.py docstring); D->E is optim.forced_wn.
        mp_learned_layers=True, group_norm=False, mp_fixed_layers=True))

    # Loss (docs/recipe.md §4): ln(sigma) ~ N(P_mean, P_std^2). The data's standard
    # deviation is the network's `network.sigma_data` (the preconditioning's), one value.
    c.loss = ml_collections.ConfigDict(dict(P_mean=-0.8, P_std=1.6))

    # Optimiser: Adam + inverse-sqrt decay after t_ref batches, linear ramp-up.
    c.optim = ml_collections.ConfigDict(dict(
        ref_lr=0.0120, t_ref=35000, rampup_kimg=10_000.0,  # 10 Mimg = 1e7 images, as the release
        **presets.ADAM, grad_clip=0.0,  # grad_clip 0 = off
        # D->E of the paper's ablation (Sec. 2.3): forced weight normalisation of the
        # stored weights before every step (Eq. 66); False = plain Adam on unnormalised
        # weights (config D, with t_ref=0: no learning-rate decay).
        forced_wn=True))

    # EMA (docs/recipe.md §5): power-function EMAs by sigma_rel; traditional EMA off if 0.
    c.ema = ml_collections.ConfigDict(dict(
        sigma_rels=(0.05, 0.10), trad_halflife_kimg=0.0, trad_rampup_ratio=0.09))

    # Data: source in {'fashion_mnist', 'tfds', 'folder'} (folder = dir or zip of PNGs).
    # resolution 0 = the data's own; tfds images of another size are fitted by `transform`
    # ('center-crop-dhariwal' = ImageNet-64 as in the release, 'center-crop', 'none').
    # encoder (vae.ENCODERS): 'none' = pixels in [-1, 1]; 'sd-vae' = the release's
    # pre-encoded SD-VAE latents (a folder/zip of .npy, data/latents.py), decoded with
    # --vae=PATH when generating.
    c.data = ml_collections.ConfigDict(dict(
        source="fashion_mnist", path="", name="", split="train", data_dir="",
        use_labels=True, num_workers=2,
        resolution=0, transform="center-crop-dhariwal", xflip=False, encoder="none"))

    c.batch_size = 2048          # global batch (images per optimiser step)
    c.batch_per_device = 0       # micro-batch per device; 0 = no gradient accumulation
    # Durations in kimg (floats throughout), the release's defaults in its binary units:
    # status every 128Ki images, EMA snapshots every 8Mi, full checkpoints every 128Mi.
    c.total_kimg = 2**30 / 1000
    c.status_kimg = 128 * 2**10 / 1000
    c.checkpoint_kimg = 128 * 2**20 / 1000
    c.snapshot_kimg = 8 * 2**20 / 1000
    c.keep_checkpoints = 3
    # Resuming (checkpoints.TrainCheckpoints.restore_latest): resume_step N > 0 resumes from
    # checkpoint N and sets the newer checkpoints and snapshots aside (the rescue of a run
    # whose loss became NaN; applied once, as recorded in config.json); start_over=True
    # starts from step 0 when the run has checkpoints but none restores (the old outputs
    # are moved into WORKDIR/discarded-<time>/).
    c.resume_step = 0
    c.start_over = False
    # Device mesh (sharding.py): the batch is split over data x fsdp devices; fsdp > 1
    # also splits params, Adam state and EMAs over fsdp devices. -1 = all remaining
    # devices. May change between restarts (checkpoints are resharded on restore).
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1))

    # Training-dynamics diagnostics (training/probes.py), every status interval on a fixed
    # probe batch of probe_images training images x each of `sigmas`: activation RMS of
    # every block at act_sigmas (a subset of sigmas), weight RMS and effective learning
    # rate of every layer, loss and logvar per sigma; logged as diag/* to stats.jsonl and
    # TensorBoard; `python -m edm2_jax.analysis.diagnostics WORKDIR` plots them.
    c.diagnostics = ml_collections.ConfigDict(dict(
        enabled=False, probe_images=8, seed=0,
        sigmas=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0), act_sigmas=(0.1, 1.0, 10.0)))


    # Hardware backend (backends/): the kernels the network is built with and how the
    # step runs on the machine; every choice computes the same function (gradients
    # equal up to float32 summation order; attention='cudnn' in a bfloat16 network up
    # to the rounding of the logits), so a run may change it on resume.
    # kernels: 'auto' (XLA:CPU kernels on the CPU backend, else the model's own math),
    # 'xla' or 'cpu'; cpu_conv_grad: the 3x3-conv weight-gradient path of the CPU
    # kernels ('relayout', 'xla', 'matmul': `python benchmarks/conv_grad.py` says which
    # is fastest); cpu_barriers: the CPU kernels' fusion barriers; attention ('xla' |
    # 'cudnn': cuDNN's fused attention, GPUs, bfloat16 networks), clip_mask ('bits' |
    # 'bytes') and grad_layout ('xla' | 'stored'): GPU options of backends/gpu.py.
    c.backend = ml_collections.ConfigDict(dict(backends.DEFAULTS))

    # The training objective: a name of `objectives.REGISTRY` (the built-in ones are
    # listed where they are registered, edm2_jax/objectives/__init__.py). A config holds
    # its objective's own config section and no other (`with_objective`).
    c.objective = "edm2"   # another objective and its section: `with_objective`
    # The modules outside the package that define the run's objective and sampler,
    # recorded by the run (`training.setup.run_config`; edm2_jax/plugins.py).
    c.plugins = ()

    # Sample grids; rng: per-seed noise and labels from JAX keys ('jax') or drawn as the
    # release's per-seed torch generator draws them ('release', sampling.sample_images).
    c.sample = ml_collections.ConfigDict(dict(num_steps=32, grid_rows=8, grid_cols=8, seed=0,
                                              rng="jax"))

    # Evaluation during training (snapshot_outputs.TrainingEval): metrics '' = off, 'cls'
    # (classifier FD/KID/precision/recall; labelled data), 'fid', 'fd_dinov2' (DINOv2
    # ViT-L/14 weights file in `dinov2`) or a comma list, of num_images images of the
    # sigma_rel EMA (0 = largest tracked) at every snapshot, logged to stats.jsonl /
    # TensorBoard as eval/<metric>.
    c.eval = ml_collections.ConfigDict(dict(
        metrics="", num_images=1000, sigma_rel=0.0, num_steps=32, batch_size=100, seed=0,
        ref_split="test", classifier_epochs=3, classifier_batch_size=128, dinov2="",
        vae=""))
    return c


def config_file(path: str, variant: str = "") -> ml_collections.ConfigDict:
    """`get_config(variant)` of the config file at `path` (a `configs/*.py`, as
    `--config=PATH:VARIANT` names it; a relative path from the current directory), the
    file run as Python, as `--config` runs it. Config files build on one another with it:
    `configs.config_file(os.path.join(os.path.dirname(__file__), "fashion_mnist.py"),
    "tiny")`. Raises FileNotFoundError for a missing file, and what `get_config` raises."""
    import importlib.util
    import os
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    name = "edm2_jax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def with_objective(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """`c` (changed in place, and returned) training the objective `name` (registered,
    `objectives.REGISTRY`): `c.objective = name` and the objective's own config section
    (`Objective.section_fields()`: its fields with their defaults, values already in `c`'s
    section of that name kept), so that a config holds the section of its objective and
    no other. Raises ValueError naming the registered objectives for an unknown name."""
    cls = objectives.objective_class(name)
    c.objective = name
    if cls.section:
        old = c.get(cls.section)
        fields = cls.section_fields()
        if old is not None:
            fields.update({k: v for k, v in old.items() if k in fields})
        c[cls.section] = ml_collections.ConfigDict(fields)
    return c


def non_finite_fields(c, prefix: str = "") -> list[tuple[str, object]]:
    """`(dotted field, value)` of every float of config `c` (a ConfigDict or dict, in
    tuples and lists too) that is NaN or infinite: no field of a config takes one."""
    out = []
    for k, v in (c.items() if hasattr(c, "items") else []):
        field = f"{prefix}{k}"
        if hasattr(v, "items"):
            out += non_finite_fields(v, field + ".")
        elif any(isinstance(x, float) and not math.isfinite(x)
                 for x in (v if isinstance(v, (tuple, list)) else (v,))):
            out.append((field, v))
    return out


def validate(c: ml_collections.ConfigDict) -> objectives.Objective:
    """The objective of `c`, its settings checked (`objectives.check_config`), once every
    section of `c` is checked: raises ValueError naming the field and a valid value for a
    config that cannot train (checked before anything is written or compiled)."""
    def need(ok: bool, field: str, what: str):
        if not ok:
            value = c
            for part in field.split("."):
                value = value[part]
            raise ValueError(f"--config.{field}={value!r}: {what}")

    def number(field: str):
        value = c
        for part in field.split("."):
            value = value[part]
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    for field, _ in non_finite_fields(c)[:1]:
        need(False, field, "must be a finite number (not NaN or infinite)")
    need(isinstance(c.batch_size, int) and c.batch_size > 0, "batch_size",
         "the global batch must be a positive number of images, e.g. 64")
    need(isinstance(c.batch_per_device, int) and c.batch_per_device >= 0, "batch_per_device",
         "must be >= 0 (0 = no gradient accumulation)")
    for f in ("total_kimg", "status_kimg", "checkpoint_kimg", "snapshot_kimg"):
        v = number(f)
        need(v is not None and v > 0, f, "must be a positive number of kimg (thousands of "
             "images)" + (", e.g. 64" if f == "total_kimg" else ""))
    need(isinstance(c.keep_checkpoints, int) and c.keep_checkpoints >= 1, "keep_checkpoints",
         "keep at least 1 checkpoint")
    need(isinstance(c.resume_step, int) and c.resume_step >= 0, "resume_step",
         "a checkpoint step (0 = the newest)")
    need(len(c.ema.sigma_rels) > 0
         and all(0 < float(s) <= ema.SIGMA_REL_MAX for s in c.ema.sigma_rels),
         "ema.sigma_rels", f"one or more EMA widths in (0, {ema.SIGMA_REL_MAX:.3f}], e.g. "
         f"(0.05, 0.10)")
    v = number("optim.ref_lr")
    need(v is not None and v > 0, "optim.ref_lr", "must be positive")
    v = number("optim.t_ref")
    need(v is not None and v >= 0, "optim.t_ref",
         "a number of batches >= 0 (0 = no learning-rate decay)")
    need(not (c.optim.get("forced_wn", True) and not c.network.get("mp_learned_layers", True)),
         "optim.forced_wn", "forced weight normalisation needs magnitude-preserving learned "
         "layers: with network.mp_learned_layers=False (config C) set optim.forced_wn=False, "
         "or it would reset every standard layer's weight to norm sqrt(fan_in)")
    d = c.get("diagnostics")
    if d is not None and d.enabled:
        need(isinstance(d.probe_images, int) and d.probe_images > 0, "diagnostics.probe_images",
             "a positive number of images, e.g. 8")
        need(len(d.sigmas) > 0 and all(float(s) > 0 for s in d.sigmas), "diagnostics.sigmas",
             "one or more positive noise levels")
        need(set(map(float, d.act_sigmas)) <= set(map(float, d.sigmas)), "diagnostics.act_sigmas",
             f"must be among diagnostics.sigmas {tuple(d.sigmas)}")
    v = number("optim.grad_clip")
    need(v is not None and v >= 0, "optim.grad_clip", "must be >= 0 (0 = off)")
    need(str(c.sample.rng) in ("jax", "release"), "sample.rng", "'jax' or 'release'")
    b = c.get("backend")
    if b is not None:
        need(str(b.kernels) in backends.NAMES, "backend.kernels",
             f"one of {', '.join(backends.NAMES)}")
        need(str(b.cpu_conv_grad) in cpu_backend.CONV_GRADS, "backend.cpu_conv_grad",
             f"one of {', '.join(cpu_backend.CONV_GRADS)}")
        need(isinstance(b.cpu_barriers, bool), "backend.cpu_barriers", "True or False")
        need(str(b.get("attention", "xla")) in gpu_backend.ATTENTIONS, "backend.attention",
             f"one of {', '.join(gpu_backend.ATTENTIONS)}")
        need(str(b.get("clip_mask", "bits")) in gpu_backend.CLIP_MASKS, "backend.clip_mask",
             f"one of {', '.join(gpu_backend.CLIP_MASKS)}")
        need(str(b.get("grad_layout", "xla")) in gpu_backend.GRAD_LAYOUTS,
             "backend.grad_layout", f"one of {', '.join(gpu_backend.GRAD_LAYOUTS)}")
    objective = objectives.check_config(c)
    n = c.network
    need(isinstance(n.model_channels, int) and not isinstance(n.model_channels, bool)
         and n.model_channels > 0, "network.model_channels",
         "a positive number of channels at the first resolution, e.g. 128")
    need(isinstance(n.channel_mult, (tuple, list)) and len(n.channel_mult) > 0
         and all(isinstance(m, int) and not isinstance(m, bool) and m > 0
                 for m in n.channel_mult), "network.channel_mult",
         "one positive multiplier of model_channels per resolution, e.g. (1, 2, 2)")
    v = number("network.dropout")
    need(v is not None and 0 <= v < 1, "network.dropout",
         "a probability in [0, 1), e.g. 0.1 (0 = no dropout)")
    need(str(c.network.dtype) in DTYPES, "network.dtype",
         f"one of {', '.join(DTYPES)} (auto: bfloat16 on GPU/TPU, float32 on CPU)")
    return objective


def compute_dtype(dtype: str, platform: str, recorded: str | None = None) -> str:
    """The compute dtype a `network.dtype` of `dtype` trains in on `platform` (the name
    `jax.default_backend()` gives: 'cpu', 'gpu', 'tpu'): `dtype` itself, or for 'auto'
    the dtype `recorded` in the config.json of the run being resumed (a run keeps the
    precision it started with), else `AUTO_DTYPES[platform]` (bfloat16 on GPU and TPU,
    as the release trains every preset in mixed precision), else float32."""
    if str(dtype) != "auto":
        return dtype
    if recorded is not None and str(recorded) in DTYPES[1:]:
        return str(recorded)
    return AUTO_DTYPES.get(platform, "float32")


def resolve_dtype(c: ml_collections.ConfigDict, platform: str, recorded: str | None = None
                  ) -> ml_collections.ConfigDict:
    """A copy of `c` whose `network.dtype` is concrete (`compute_dtype`): the config a run
    trains with and records, made once at start-up (`training.setup.run_config`,
    `modes.release.import_training_state`) with `platform = jax.default_backend()`."""
    c = ml_collections.ConfigDict(c.to_dict())
    c.network.dtype = compute_dtype(c.network.dtype, platform, recorded)
    return c


def preset_config(name: str) -> ml_collections.ConfigDict:
    """Config of a released preset, e.g. 'img64-s' or 'img512-xxl', with network.dtype
    'auto' (`resolve_dtype`: bfloat16 on GPU/TPU, float32 on CPU).

    Raises KeyError naming the valid presets.
    """
    if name not in presets.NETWORK_PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(presets.NETWORK_PRESETS)}")
    c = base_config()
    c.network.update(presets.NETWORK_PRESETS[name])
    c.network.dtype = "auto"  # mixed precision on GPU/TPU, as the release trains them
    t = presets.TRAINING_PRESETS[name]
    c.loss.P_mean, c.loss.P_std = t["P_mean"], t["P_std"]
    c.optim.ref_lr, c.optim.t_ref, c.optim.rampup_kimg = t["ref_lr"], t["t_ref"], t["rampup_kimg"]
    c.batch_size = t["batch_size"]
    c.total_kimg = t["total_kimg"]
    return c
