"""Named generation presets: the release's (NVlabs/edm2 `generate_images.py --preset`) and
the guidance-interval settings of Kynkäänniemi et al. 2024 for EDM2-XXL, resolved to
network checkpoints converted from the release's pickles in a folder of the user's.

A preset names a main network and, for guidance, a guide network (both pickle files of
the release's post-hoc EMA reconstructions, `RELEASE_URL`), the guidance weight `w` of
`D_g + w (D - D_g)` (Karras et al. 2024, arXiv:2406.02507, Eq. 1), optionally a guidance
interval `(sigma_lo, sigma_hi]` (Kynkäänniemi et al. 2024, arXiv:2404.07724: a Heun step
from `t_i` is guided iff `sigma_lo < t_i <= sigma_hi`, `sampler.sample_images`), and the
figure the authors report for it (FID or FD_DINOv2 of 50,000 images, ImageNet).

File names read `edm2-<data>-<size>[-uncond]-<kimg>-<sigma_rel>.pkl`: the training data
(`img512`: ImageNet 512x512 as SD-VAE latents, generated with `--vae`; `img64`: ImageNet
64x64 pixels), the network size (xs ... xxl), `uncond` for the unconditional nets that
guide in classifier-free guidance, the training length in kimg (2147483 = 2^31 images)
and the EMA length sigma_rel (Karras et al. 2024, CVPR, Sec. 3). The release evaluates
img512 presets against its `img512.pkl` reference statistics, img64 ones against
`img64.pkl` (`REFS_URL`).

Nothing is downloaded: `resolve(name, models_dir)` finds the pickles in `models_dir`,
converts each on first use (`release.convert.convert`) into a network checkpoint beside
it, `<models_dir>/<stem>.edm2jax/`, and reuses that checkpoint afterwards.

    python -m edm2_jax.main --list_presets
    python -m edm2_jax.main --mode=generate --preset=edm2-img64-s-autog-fid --models=models \
        --seeds=0-63 --grid=grid.png
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import shutil
import socket
import time

from edm2_jax import paths
from edm2_jax.release.convert import convert
from edm2_jax.run import integrity, network_dir

RELEASE_URL = "https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/"
REFS_URL = "https://nvlabs-fi-cdn.nvidia.com/edm2/dataset-refs/"
CACHE_SUFFIX = ".edm2jax"   # <stem>.edm2jax/: the network checkpoint of <stem>.pkl
_PARTIAL = ".partial-"      # .<stem>.edm2jax.partial-<host>-<pid>/: a conversion under way


@dataclasses.dataclass(frozen=True)
class Preset:
    """One named preset.

    name: e.g. 'edm2-img512-xxl-guid-fid'. net, guide: pickle file names in the release's
    folder (`RELEASE_URL`); guide None for an unguided preset. guidance: the weight w
    (1.0 unguided). metric: 'fid' or 'fd_dinov2', the figure the preset is tuned for, and
    reported: its value as the authors report it (None: not published for this setting).
    guidance_interval: `(sigma_lo, sigma_hi)` or None (guided at every step). note: where
    the setting comes from, when not the release's table.
    """
    name: str
    net: str
    guide: str | None
    guidance: float
    metric: str
    reported: float | None
    guidance_interval: tuple[float, float] | None = None
    note: str = ""

    @property
    def data(self) -> str:
        """'img512' (SD-VAE latents of ImageNet 512x512) or 'img64' (64x64 pixels)."""
        return self.name.split("-")[1]

    @property
    def latent(self) -> bool:
        """Whether the nets generate SD-VAE latents (decoded by `--vae`)."""
        return self.data == "img512"

    @property
    def ref(self) -> str:
        """File name of the release's reference statistics for this preset's data."""
        return f"{self.data}.pkl"

    @property
    def files(self) -> tuple[str, ...]:
        """The pickles the preset needs: the net, then the guide if any."""
        return (self.net,) + ((self.guide,) if self.guide else ())

    def figure(self) -> str:
        """'fid 1.81' / 'fd_dinov2 33.09' / 'fd_dinov2 -' (not reported)."""
        return f"{self.metric} {'-' if self.reported is None else f'{self.reported:.2f}'}"


# The release's table (its `generate_images.py` `config_presets`) as facts: preset name,
# net and guide file (without "edm2-" and ".pkl"), guidance, the metric its comment
# reports and the value (50,000 images, the release's protocol).
_RELEASE = (
    ("img512-xs-fid", "img512-xs-2147483-0.135", None, 1.0, "fid", 3.53),
    ("img512-xs-dino", "img512-xs-2147483-0.200", None, 1.0, "fd_dinov2", 103.39),
    ("img512-s-fid", "img512-s-2147483-0.130", None, 1.0, "fid", 2.56),
    ("img512-s-dino", "img512-s-2147483-0.190", None, 1.0, "fd_dinov2", 68.64),
    ("img512-m-fid", "img512-m-2147483-0.100", None, 1.0, "fid", 2.25),
    ("img512-m-dino", "img512-m-2147483-0.155", None, 1.0, "fd_dinov2", 58.44),
    ("img512-l-fid", "img512-l-1879048-0.085", None, 1.0, "fid", 2.06),
    ("img512-l-dino", "img512-l-1879048-0.155", None, 1.0, "fd_dinov2", 52.25),
    ("img512-xl-fid", "img512-xl-1342177-0.085", None, 1.0, "fid", 1.96),
    ("img512-xl-dino", "img512-xl-1342177-0.155", None, 1.0, "fd_dinov2", 45.96),
    ("img512-xxl-fid", "img512-xxl-0939524-0.070", None, 1.0, "fid", 1.91),
    ("img512-xxl-dino", "img512-xxl-0939524-0.150", None, 1.0, "fd_dinov2", 42.84),
    ("img64-s-fid", "img64-s-1073741-0.075", None, 1.0, "fid", 1.58),
    ("img64-m-fid", "img64-m-2147483-0.060", None, 1.0, "fid", 1.43),
    ("img64-l-fid", "img64-l-1073741-0.040", None, 1.0, "fid", 1.33),
    ("img64-xl-fid", "img64-xl-0671088-0.040", None, 1.0, "fid", 1.33),
    # Classifier-free guidance: the guide is the unconditional XS net of the same EMA length.
    ("img512-xs-guid-fid", "img512-xs-2147483-0.045", "img512-xs-uncond-2147483-0.045",
     1.40, "fid", 2.91),
    ("img512-xs-guid-dino", "img512-xs-2147483-0.150", "img512-xs-uncond-2147483-0.150",
     1.70, "fd_dinov2", 79.94),
    ("img512-s-guid-fid", "img512-s-2147483-0.025", "img512-xs-uncond-2147483-0.025",
     1.40, "fid", 2.23),
    ("img512-s-guid-dino", "img512-s-2147483-0.085", "img512-xs-uncond-2147483-0.085",
     1.90, "fd_dinov2", 52.32),
    ("img512-m-guid-fid", "img512-m-2147483-0.030", "img512-xs-uncond-2147483-0.030",
     1.20, "fid", 2.01),
    ("img512-m-guid-dino", "img512-m-2147483-0.015", "img512-xs-uncond-2147483-0.015",
     2.00, "fd_dinov2", 41.98),
    ("img512-l-guid-fid", "img512-l-1879048-0.015", "img512-xs-uncond-2147483-0.015",
     1.20, "fid", 1.88),
    ("img512-l-guid-dino", "img512-l-1879048-0.035", "img512-xs-uncond-2147483-0.035",
     1.70, "fd_dinov2", 38.20),
    ("img512-xl-guid-fid", "img512-xl-1342177-0.020", "img512-xs-uncond-2147483-0.020",
     1.20, "fid", 1.85),
    ("img512-xl-guid-dino", "img512-xl-1342177-0.030", "img512-xs-uncond-2147483-0.030",
     1.70, "fd_dinov2", 35.67),
    ("img512-xxl-guid-fid", "img512-xxl-0939524-0.015", "img512-xs-uncond-2147483-0.015",
     1.20, "fid", 1.81),
    ("img512-xxl-guid-dino", "img512-xxl-0939524-0.015", "img512-xs-uncond-2147483-0.015",
     1.70, "fd_dinov2", 33.09),
    # Autoguidance: the guide is a smaller, shorter-trained conditional net.
    ("img512-s-autog-fid", "img512-s-2147483-0.070", "img512-xs-0134217-0.125",
     2.10, "fid", 1.34),
    ("img512-s-autog-dino", "img512-s-2147483-0.120", "img512-xs-0134217-0.165",
     2.45, "fd_dinov2", 36.67),
    ("img512-xxl-autog-fid", "img512-xxl-0939524-0.075", "img512-m-0268435-0.155",
     2.05, "fid", 1.25),
    ("img512-xxl-autog-dino", "img512-xxl-0939524-0.130", "img512-m-0268435-0.205",
     2.30, "fd_dinov2", 24.18),
    ("img512-s-uncond-autog-fid", "img512-s-uncond-2147483-0.070",
     "img512-xs-uncond-0134217-0.110", 2.85, "fid", 3.86),
    ("img512-s-uncond-autog-dino", "img512-s-uncond-2147483-0.090",
     "img512-xs-uncond-0134217-0.125", 2.90, "fd_dinov2", 90.39),
    ("img64-s-autog-fid", "img64-s-1073741-0.045", "img64-xs-0134217-0.110",
     1.70, "fid", 1.01),
    ("img64-s-autog-dino", "img64-s-1073741-0.105", "img64-xs-0134217-0.175",
     2.20, "fd_dinov2", 31.85),
)

_INTERVAL_NOTE = ("guidance interval of Kynkäänniemi et al. 2024 (their generate_zip.py: "
                  "steps {steps} of the 32-step schedule); their EDM2-XXL and XS-uncond "
                  "pickles came from the authors' own drive, these are the release's "
                  "edm2-img512-xxl-guid-{kind} files, whose EMA lengths were chosen for "
                  "guidance at every step, so the figure may differ")
# (name, guidance, (sigma_lo, sigma_hi), metric, reported, steps, release preset whose nets it uses)
_INTERVAL = (
    ("img512-xxl-guid-interval-fid", 2.0, (0.28, 1.61), "fid", 1.40, "[17, 22]", "fid"),
    ("img512-xxl-guid-interval-dino", 2.9, (0.60, 5.0), "fd_dinov2", None, "[13, 19]",
     "dino"),
)


def _pkl(stem: str | None) -> str | None:
    return f"edm2-{stem}.pkl" if stem else None


def _table() -> dict[str, Preset]:
    table = {f"edm2-{n}": Preset(f"edm2-{n}", _pkl(net), _pkl(guide), float(w), metric, fig)
             for n, net, guide, w, metric, fig in _RELEASE}
    for n, w, interval, metric, fig, steps, kind in _INTERVAL:
        nets = table[f"edm2-img512-xxl-guid-{kind}"]
        table[f"edm2-{n}"] = Preset(f"edm2-{n}", nets.net, nets.guide, w, metric, fig,
                                    interval, _INTERVAL_NOTE.format(steps=steps, kind=kind))
    return table


PRESETS: dict[str, Preset] = _table()


def get(name: str) -> Preset:
    """The preset `name`. Raises ValueError naming the closest preset names (difflib)
    and `--list_presets`."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, list(PRESETS), n=4, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(f"unknown preset --preset={name}: {hint}--list_presets lists all "
                     f"{len(PRESETS)}")


def table() -> str:
    """Every preset as a text table (name, net, guide, guidance, interval, reported
    figure) with the notes: what `--list_presets` prints."""
    rows = [("preset", "net", "guide", "guidance", "interval", "reported")]
    for p in PRESETS.values():
        lo_hi = p.guidance_interval
        rows.append((p.name, p.net, p.guide or "-", f"{p.guidance:.2f}" if p.guide else "-",
                     f"({lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" if lo_hi else "-", p.figure()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [
        "",
        f"Pickles: {RELEASE_URL}<file>, into --models=DIR (converted on first use into "
        f"DIR/<file stem>{CACHE_SUFFIX}/).",
        "img512 presets generate SD-VAE latents (give --vae=PATH) and are evaluated against "
        f"img512.pkl, img64 presets against img64.pkl ({REFS_URL}).",
        "Reported: the authors' figure for 50,000 images (the release's table; "
        "interval: Kynkäänniemi et al. 2024).",
    ]
    lines += [f"{p.name}: {p.note}." for p in PRESETS.values() if p.note]
    return "\n".join(lines)


def check_vae(preset: Preset, vae_path: str | None) -> None:
    """Before any conversion: an img512 (latent) preset needs `--vae`, an img64 (pixel)
    one refuses it. Raises ValueError naming the fix."""
    if preset.latent and not vae_path:
        raise ValueError(f"--preset={preset.name} generates SD-VAE latents (ImageNet "
                         f"512x512): pass --vae=PATH, the SD VAE that decodes them (the "
                         f"diffusion_pytorch_model.safetensors or folder of "
                         f"stabilityai/sd-vae-ft-mse)")
    if not preset.latent and vae_path:
        raise ValueError(f"--vae={vae_path} given, but --preset={preset.name} generates "
                         f"64x64 pixels, which need no decoder; drop --vae")


@dataclasses.dataclass(frozen=True)
class ResolvedPreset:
    """A preset with its networks as local network checkpoints (`nets.load_net` reads them).

    net_path, guide_path: the converted checkpoints (guide_path None when unguided);
    guidance, guidance_interval: the sampler's settings (`sampler.sample_images`).
    """
    preset: Preset
    net_path: str
    guide_path: str | None
    guidance: float
    guidance_interval: tuple[float, float] | None

    @property
    def name(self) -> str:
        return self.preset.name


def cache_path(pickle_path: str) -> str:
    """Where the network checkpoint converted from `pickle_path` lives:
    `<dir>/<stem>.edm2jax`."""
    stem = os.path.splitext(os.path.basename(pickle_path))[0]
    return os.path.join(os.path.dirname(os.path.abspath(pickle_path)), stem + CACHE_SUFFIX)


def _complete(path: str) -> bool:
    """A network checkpoint whose network.json (written last, atomically) reads back."""
    if not network_dir.is_network_checkpoint(path):
        return False
    try:
        network_dir.read_network_json(path)
    except (integrity.IntegrityError, OSError):  # unreadable: convert again
        return False
    return True


def _remove_dead_partials(dest: str) -> None:
    """Delete the partial conversions into `dest` that a killed process of this host
    left behind (`.<name>.partial-<host>-<pid>`, the process gone)."""
    folder, name = os.path.split(dest)
    prefix = f".{name}{_PARTIAL}{socket.gethostname()}-"
    for entry in os.listdir(folder):
        pid = entry[len(prefix):]
        if entry.startswith(prefix) and pid.isdigit() and not network_dir.pid_alive(int(pid)):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def converted(pickle_path: str) -> str:
    """The network checkpoint of the release pickle `pickle_path`, converted on first
    use and cached at `cache_path(pickle_path)`; a complete cached one is reused.

    The conversion writes into a hidden partial directory of this process and renames
    it into place once complete, so a killed conversion never leaves a checkpoint that
    looks finished: an incomplete one found at the cache path (no readable
    network.json) is removed and converted again, and partial directories of dead
    processes of this host are removed. Returns the checkpoint's path. Raises
    PermissionError when the folder is not writable, and what `convert` raises
    (ValueError for a file that is no EDM2 network, e.g. a truncated download).
    """
    dest = cache_path(pickle_path)
    if _complete(dest):
        return dest
    folder = os.path.dirname(dest)
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"--models={folder} is not writable: the converted network "
                              f"{os.path.basename(dest)} is cached beside its pickle; make "
                              f"the folder writable or copy the pickles to one that is")
    _remove_dead_partials(dest)
    if os.path.lexists(dest):  # left by a conversion that did not finish
        print(f"Removing the incomplete conversion {dest}")
        shutil.rmtree(dest) if os.path.isdir(dest) else os.remove(dest)
    partial = os.path.join(folder, f".{os.path.basename(dest)}{_PARTIAL}"
                                   f"{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    size = paths.human_bytes(os.path.getsize(pickle_path))
    print(f"Converting {os.path.basename(pickle_path)} ({size}, first use) -> {dest}",
          flush=True)
    t = time.time()
    try:
        convert(pickle_path, partial)
        try:
            os.rename(partial, dest)
        except OSError:  # another process finished the same conversion first
            if not _complete(dest):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"Converted in {time.time() - t:.1f} s", flush=True)
    return dest


def check_files(preset: Preset, models_dir: str) -> None:
    """Raise FileNotFoundError, one line naming every pickle of `preset` missing from
    `models_dir` and its download address, or the folder itself when it is missing."""
    if paths.is_url(models_dir):
        raise ValueError(f"--models={models_dir}: give a local folder (the pickles are "
                         f"converted beside them)")
    if not os.path.isdir(models_dir):
        raise FileNotFoundError(f"--models={models_dir} is not a folder; give the folder "
                                f"holding the release's pickles ({', '.join(preset.files)}, "
                                f"from {RELEASE_URL})")
    missing = [f for f in preset.files if not os.path.isfile(os.path.join(models_dir, f))]
    if missing:
        raise FileNotFoundError(
            f"--preset={preset.name} needs {' and '.join(missing)} in --models={models_dir}, "
            f"where {'they are' if len(missing) > 1 else 'it is'} missing; download "
            f"{'them' if len(missing) > 1 else 'it'} from the release: "
            f"{' '.join(RELEASE_URL + f for f in missing)}")


def resolve(name: str, models_dir: str) -> ResolvedPreset:
    """The preset `name` with its pickles from `models_dir` converted (`converted`).

    Every file is checked (`check_files`) before any is converted. Raises ValueError for
    an unknown name (`get`), FileNotFoundError for a missing folder or pickle, and what
    `converted` raises.
    """
    preset = get(name)
    check_files(preset, models_dir)
    net, guide = (converted(os.path.join(models_dir, f)) if f else None
                  for f in (preset.net, preset.guide))
    return ResolvedPreset(preset, net, guide, preset.guidance, preset.guidance_interval)
