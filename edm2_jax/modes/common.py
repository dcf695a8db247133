"""What every mode shares: the `--config` and `--workdir` flags, the errors a user can act
on (`USER_ERRORS`, printed as one `error:` line: `report_errors`), and flag parsing that
names an unknown `--config.FIELD`.
"""
from __future__ import annotations

import pickle
import sys
import traceback
from typing import Callable

from absl import app, flags
from ml_collections import config_flags

from edm2_jax.run import checkpoints, integrity, lock
from edm2_jax.training.progress import NonFiniteLossError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:variant]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of the run (checkpoints, logs, samples).")

# Errors whose message names the problem and the fix: printed alone, exit status 1.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError,
               PermissionError, pickle.UnpicklingError, integrity.IntegrityError,
               checkpoints.CheckpointSaveError, lock.RunLockedError,
               checkpoints.NoCheckpointError, checkpoints.NonFiniteStateError,
               NonFiniteLossError)


def config():
    """`--config` with its `--config.field=value` overrides, or an error that names the
    file (config_flags loads it lazily, on first use; unknown fields: `parse_flags`)."""
    try:
        config = FLAGS.config
        if config is not None:
            config.get("seed")  # a file that failed to load raises here
        return config
    except OSError as e:
        cause = e.__cause__ or e
        raise FileNotFoundError(
            f"--config: {' '.join(str(cause).split())}. Give a config file and optional variant, "
            f"e.g. --config=configs/fashion_mnist.py:tiny or --config=configs/img64.py:xs"
        ) from None


def data_config() -> dict | None:
    """The data section of `--config`, if given."""
    return config().data.to_dict() if config() else None


def require_workdir() -> str:
    """`--workdir`; raises app.UsageError when it is not given."""
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    return FLAGS.workdir


def report_errors(run: Callable[[], object]) -> int:
    """Call `run()`; return the exit status: 0, or 1 after printing a `USER_ERRORS`
    error as one `error:` line (no traceback), or 1 (130 for Ctrl-C) after printing
    any other error's traceback. `app.UsageError` propagates (absl prints the usage)."""
    try:
        run()
    except app.UsageError:
        raise
    except USER_ERRORS as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, checkpoints.CheckpointSaveError) and e.strerror:
            msg = e.strerror  # without OSError's "[Errno N]" prefix: the message names it
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:  # noqa: BLE001 - printed, then the caller's bounded exit
        traceback.print_exc()
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with an unknown `--config.FIELD` (an AttributeError deep in
    ml_collections) reported as one `error:` line naming the field and the fix."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:
        given = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
        print(f"error: unknown config field {str(e).strip(chr(34))} in the overrides {given}: "
              f"each --config.FIELD must be a field of the config file (see "
              f"edm2_jax/configs.py base_config for all fields, e.g. --config.total_kimg, "
              f"--config.optim.ref_lr)", file=sys.stderr, flush=True)
        sys.exit(1)
