"""What every mode shares: the `--config` and `--workdir` flags, the errors a user can act
on (`USER_ERRORS` and a missing flag, printed as one `error:` line: `report_errors`, as
is a stop by SIGTERM or SIGINT, `Interrupted`, saying what was kept), the
checks of every mode's flags before any work (`check_flags`: finite numbers, no flag of
another mode) and of every output location (`check_output_dir`, `check_run_dir`), flag
parsing that names an unknown `--config.FIELD` or a config file's variant error, and the
help (`--help`: the modes; `--mode=MODE --help`: that mode's flags).
"""
from __future__ import annotations

import ast
import errno
import math
import os
import pickle
import signal
import sys
import traceback
from types import ModuleType
from typing import Callable

from absl import app, flags
from ml_collections import config_flags

from edm2_jax import configs, paths, plugins
from edm2_jax.planner.plan import LibtpuMissingError
from edm2_jax.release.pickle_io import TorchMissingError
from edm2_jax.run import checkpoints, integrity, layout, lock
from edm2_jax.training.progress import NonFiniteLossError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:variant]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of the run (checkpoints, logs, samples).")
flags.DEFINE_string("plugins", None, "Python modules to import that define your own objectives or "
                    "samplers (comma-separated module names on PYTHONPATH; also the environment "
                    f"variable {plugins.ENV_VAR}): the only modules a run's or network's files may "
                    "name (edm2_jax/plugins.py).")

# Errors whose message names the problem and the fix: printed alone, exit status 1.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError,
               PermissionError, pickle.UnpicklingError, integrity.IntegrityError,
               checkpoints.CheckpointSaveError, lock.RunLockedError,
               checkpoints.NoCheckpointError, checkpoints.NonFiniteStateError,
               NonFiniteLossError, TorchMissingError, LibtpuMissingError)


def config():
    """`--config` with its `--config.field=value` overrides, or an error that names the
    file (config_flags loads it lazily, on first use; unknown fields: `parse_flags`)."""
    try:
        config = FLAGS.config
        if config is not None:
            config.get("seed")  # a file that failed to load raises here
        return config
    except OSError as e:
        raise FileNotFoundError(_unloadable_config(e)) from None


def _unloadable_config(e: OSError) -> str:
    """The message for a `--config` file that did not load (`e`: ml_collections' error,
    raised on first use of the config, whose cause names the file and the OS error)."""
    cause = e.__cause__ or e
    return (f"--config: {' '.join(str(cause).split())}. Give a config file and optional "
            f"variant, e.g. --config=configs/fashion_mnist.py:tiny or "
            f"--config=configs/img64.py:xs")


def config_file_value(field: str):
    """The value of `field` (dotted, e.g. 'optim.ref_lr') as the `--config` file sets it,
    before the `--config.FIELD` overrides (its `get_config(variant)` run again when one
    overrides `field`); None without `--config`."""
    flag = FLAGS["config"]
    if config() is None:
        return None
    node = (flag.parser.parse(config_flags.get_config_filename(flag))
            if field in config_flags.get_override_values(flag) else config())
    for part in field.split("."):
        node = node[part]
    return node


def data_config() -> dict | None:
    """The data section of `--config`, if given."""
    return config().data.to_dict() if config() else None


def require_workdir() -> str:
    """`--workdir`; raises app.UsageError when it is not given."""
    if not FLAGS.workdir:
        raise app.UsageError(f"--mode={FLAGS['mode'].value if 'mode' in FLAGS else 'train'} "
                             f"needs --workdir=DIR, the run directory (e.g. --workdir=runs/fmnist)")
    return FLAGS.workdir


# Flags that only one mode reads: given to another mode, they would be ignored.
MODE_ONLY_FLAGS = {"tpu": "plan", "sample_batch": "plan"}

INF = float("inf")
# The range of every numeric flag of every mode, `(lo, hi, what)` with `lo <= value <=
# hi`, checked before any work (`check_flags`): a value outside it is refused in one
# line naming the flag and its range, never run (a guidance weight of 1e30 gives black
# images; a seed of 2**32 wraps to 0). The bounds are what a sampler, a metric or a
# post-hoc EMA can use in float32 without overflow, wide enough for any setting a paper
# reports.
FLAG_RANGES = {
    "guidance": (0.0, 100.0, "a guidance weight, 1 = unguided"),
    "sigma_min": (1e-6, 1e3, "the lowest noise level of the schedule"),
    "sigma_max": (1e-5, 1e4, "the highest noise level of the schedule"),
    "rho": (0.1, 1e3, "the schedule's exponent (EDM Eq. 5; the release's 7)"),
    "S_churn": (0.0, 1e4, "the churn (EDM Sec. 4; 0 = deterministic)"),
    "S_min": (0.0, INF, "a noise level"),
    "S_max": (0.0, INF, "a noise level (inf = every step)"),
    "S_noise": (0.0, 10.0, "the churn noise's scale (the release's 1 to 1.007)"),
    "steps": (1, 10_000, "sampler steps"),
    "teacher_steps": (1, 10_000, "the teacher grid's Heun steps"),
    "batch": (1, 1 << 20, "images per batch"),
    "num_images": (2, 1 << 31, "images to measure (FID-50k: 50000)"),
    "class_idx": (0, 1 << 31, "a class index"),
    "subset_seed": (0, (1 << 32) - 1, "a seed"),
    "sample_batch": (0, 1 << 20, "the sampler's batch (0 = no sampler)"),
    "at_kimg": (0.0, 1e9, "a training time in kimg"),
}


def load_plugins() -> None:
    """Allow and import the modules the user names (`--plugins`, the environment's
    `EDM2_JAX_PLUGINS`, installed entry points; `edm2_jax.plugins`), before any flag that
    may name what they define is read. Raises ValueError naming a module that does not
    import."""
    plugins.allow(plugins.parse(FLAGS.plugins, "--plugins"))
    plugins.allow(plugins.parse(os.environ.get(plugins.ENV_VAR), plugins.ENV_VAR))
    plugins.load_allowed()


def check_flags(mode: str) -> None:
    """Before any work of `--mode=mode`: raise app.UsageError for a flag that only another
    mode reads (`MODE_ONLY_FLAGS`), ValueError for a numeric flag outside its range
    (`FLAG_RANGES`), a float flag given as NaN or an infinity (but where its default is
    that infinity, e.g. `--S_max=inf`) and for a `--config` value that is not finite
    (`configs.non_finite_fields`)."""
    for name, owner in MODE_ONLY_FLAGS.items():
        if name in FLAGS and FLAGS[name].present and mode != owner:
            raise app.UsageError(f"--{name} is a flag of --mode={owner}, not of --mode={mode} "
                                 f"(where it would be ignored); drop it, or run --mode={owner}")
    for name, (lo, hi, what) in FLAG_RANGES.items():
        value = FLAGS[name].value if name in FLAGS and FLAGS[name].present else None
        if value is None or isinstance(value, float) and not math.isfinite(value):
            continue  # NaN and infinities: below (an infinite default, S_max's, is taken)
        if not lo <= value <= hi:
            raise ValueError(f"--{name}={value:g}: out of range, {what} in [{lo:g}, {hi:g}]"
                             if isinstance(value, float) else
                             f"--{name}={value}: out of range, {what} in [{lo}, {hi}]")
    for name in sorted(FLAGS):
        flag = FLAGS[name]
        if (flag.present and isinstance(flag.parser, flags.FloatParser)
                and flag.value is not None and not math.isfinite(flag.value)
                and flag.value != flag.default):
            usual = flag.default if isinstance(flag.default, float) else None
            raise ValueError(f"--{name}={flag.value}: must be a finite number (not NaN or "
                             f"infinite)" + (f", e.g. its default --{name}={usual:g}"
                                             if usual is not None else ""))
    bad = configs.non_finite_fields(config()) if config() is not None else []
    if bad:
        field, value = bad[0]
        raise ValueError(f"--config.{field}={value!r}: must be a finite number (not NaN or "
                         f"infinite); give a number, e.g. the config file's")


def check_output_dir(path: str | None, flag: str) -> None:
    """`paths.check_output_dir` for a flag's directory, if given (before any work)."""
    if path:
        paths.check_output_dir(path, flag)


def check_output_file(path: str | None, flag: str) -> None:
    """`paths.check_output_file` for a flag's file, if given (before any work)."""
    if path:
        paths.check_output_file(path, flag)


def check_run_dir(workdir: str) -> None:
    """A training run's `--workdir`, before any work: writable (`check_output_dir`), and
    locally, once it holds checkpoints, with room for one more (the next save writes one
    as large as the newest before the oldest is removed). Raises
    `paths.OutputLocationError` naming the disk, its free space and the fix."""
    paths.check_output_dir(workdir, "--workdir")
    workdir = paths.normalize(workdir)
    if paths.is_url(workdir) or not os.path.isdir(workdir):
        return
    newest = layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS))[:1]
    if not newest:
        return
    need = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(newest[0])
               for f in files)
    free = paths.shutil.disk_usage(workdir).free
    if free < need:
        raise paths.OutputLocationError(
            f"--workdir={workdir}: {paths.disk_space(workdir)} has no room for the next "
            f"checkpoint, about {paths.human_bytes(need)} (the size of {newest[0]}); free "
            f"space there, or move the run to a larger disk and pass that --workdir")


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT (`signum`) in a mode other than training (`report_errors`),
    raised where the command runs so that what it holds is saved on the way out (an
    eval's partial state, `evaluation.stream`) and what it writes stays whole (outputs
    are renamed into place complete). Whoever saves something on the way out may set
    `kept` (what was kept and how to go on): the one `error:` line says it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


def _stop_on_signals() -> dict:
    """SIGTERM and SIGINT raise `Interrupted` in the main thread from now on (SIGTERM
    would end the process without a word, nothing saved). Returns the previous handlers
    (nothing outside the main thread, where signals cannot be caught)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}


def _interrupted_line(e: KeyboardInterrupt) -> tuple[str, int]:
    """The `error:` line and the exit status (128 + the signal: 130 for SIGINT, 143 for
    SIGTERM, the shell's convention) of a command stopped by a signal."""
    signum = getattr(e, "signum", signal.SIGINT)
    kept = getattr(e, "kept", None) or "what was complete is kept, nothing is left half-written"
    return (f"error: stopped by {signal.Signals(signum).name}: {kept}; re-run the same "
            f"command to finish", 128 + signum)


def report_errors(run: Callable[[], object]) -> int:
    """Call `run()`; return the exit status: 0, or 1 after printing a `USER_ERRORS`
    error or an `app.UsageError` (a missing flag) as one `error:` line (no traceback,
    no usage), also for a path whose names are longer than its file system allows
    (found where it is written), 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)
    after one `error:` line for a command stopped by a signal, or 1 after printing any
    other error's
    traceback. In every mode but `train` (whose loop finishes its step and saves a
    checkpoint, `training.preemption`), SIGTERM and SIGINT raise `Interrupted` where
    the command is (`_stop_on_signals`): an eval saves its partial state, a post-hoc EMA
    or a generate keeps its complete outputs, each says what it kept."""
    mode = FLAGS["mode"].value if "mode" in FLAGS else "train"
    previous = _stop_on_signals() if mode != "train" else {}
    try:
        run()
    except app.UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except USER_ERRORS as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, checkpoints.CheckpointSaveError) and e.strerror:
            msg = e.strerror  # without OSError's "[Errno N]" prefix: the message names it
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            traceback.print_exc()
            return 1
        print(f"error: {e.filename or e.strerror}: a name in this path is longer than its "
              f"file system allows; give a shorter one", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:  # a signal (Interrupted), or Ctrl-C before the handler
        line, rc = _interrupted_line(e)
        print(f"\n{line}", file=sys.stderr, flush=True)  # after a progress bar's line
        return rc
    except BaseException:  # noqa: BLE001 - printed, then the caller's bounded exit
        traceback.print_exc()
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def _config_file_error(argv: list[str], e: BaseException) -> str | None:
    """The `error:` line for an error raised by the `get_config(variant)` of the
    `--config` file (an unknown variant: the file's own message lists its variants), or
    None when `e` came from elsewhere."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, flags.IllegalFlagValueError) and "Error whilst parsing config file" in str(e):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        message = lines[-1]  # "ValueError: <the config file's message>"
    elif any(f.name == "get_config" for f in frames):
        message = f"{type(e).__name__}: {e.args[0] if e.args else e}"
    else:
        return None
    message = message.split(": ", 1)[-1]
    given = next((a for a in argv[1:] if a.startswith("--config=")), "--config")
    return (f"error: {given}: {message} (the config file rejects this variant; give "
            f"--config=FILE.py:VARIANT with one it accepts)")


HELP_FLAGS = ("--help", "--helpshort", "-h", "-?")


def _mode_of(argv: list[str]) -> str | None:
    """The value of the last `--mode=M` or `--mode M` of `argv`, if any."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith("--mode="):
            found = a.split("=", 1)[1]
        elif a == "--mode" and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def help_text(argv: list[str], usage: str, mode_flags: dict[str, tuple[ModuleType, ...]]
              ) -> str:
    """What `--help` prints: `usage` (the modes) and how to list a mode's flags; with
    `--mode=MODE` (a key of `mode_flags`), that mode's flags: common's, then those of the
    modules `mode_flags[MODE]` names."""
    mode = _mode_of(argv)
    if mode not in mode_flags:
        return (f"{usage.strip()}\n\nA mode's flags: python -m edm2_jax.main --mode=MODE "
                f"--help\n(e.g. --mode=generate --help); every flag: --helpfull.")
    parts = [f"Flags of --mode={mode}:"]
    for module in (sys.modules[__name__], *mode_flags[mode]):
        parts.append(FLAGS.module_help(module).strip())
    return "\n\n".join(parts)


def parse_flags(argv: list[str], usage: str = "", mode_flags: dict | None = None
                ) -> list[str]:
    """absl's flag parsing, each error one `error:` line (exit status 1, no usage): an
    unknown `--config.FIELD` (an AttributeError deep in ml_collections) naming the field
    and the fix, an error of the config file's `get_config(variant)` with its message
    (for an unknown variant, the variants it accepts), a config file that does not load
    (given with overrides, which ml_collections applies at once) as `config()` words it
    without them, any other flag error as absl words it. `--help` (`HELP_FLAGS`) prints
    `help_text` and exits with status 0; so does `--helpfull` (absl's list of every
    flag)."""
    if any(a in HELP_FLAGS for a in argv[1:]):
        print(help_text(argv[1:], usage, mode_flags or {}), flush=True)
        sys.exit(0)
    if "--helpfull" in argv[1:]:
        app.usage(shorthelp=False, writeto_stdout=True)
        sys.exit(0)
    try:
        return FLAGS(argv)
    except OSError as e:  # a --config.FIELD override is applied to a file that did not load
        if "Failed loading config file" not in str(e.__cause__ or e):
            raise
        line = f"error: {_unloadable_config(e)}"
    except flags.Error as e:
        line = _config_file_error(argv, e) or (
            f"error: {' '.join(str(e).split())} (--mode=MODE --help lists a mode's flags)")
    except (AttributeError, KeyError) as e:
        line = _config_file_error(argv, e)
        if line is None:
            given = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
            # ml_collections' KeyError reaches here as the repr of its message
            # (quotes, escaped quotes and a "\n"): print the message itself.
            what = str(e).strip(chr(34))
            try:
                what = ast.literal_eval(what) if what[:1] in "'\"" else what
            except (ValueError, SyntaxError):
                pass
            what = " ".join(str(what).split())
            line = (f"error: unknown config field {what} in the overrides "
                    f"{given}: each --config.FIELD must be a field of the config file (see "
                    f"edm2_jax/configs.py base_config for all fields, e.g. "
                    f"--config.total_kimg, --config.optim.ref_lr)")
    print(line, file=sys.stderr, flush=True)
    sys.exit(1)
