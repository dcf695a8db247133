"""Entry point: `python -m edm2_jax.main --config=configs/fashion_mnist.py --workdir=runs/fmnist`.

Modes (`--mode`; each with its flags in `edm2_jax/modes/`):
  train        (default) train `--config` in `--workdir`, resuming if it holds a run.
  convert      released weights or a release training state into `--workdir`.
  export       `--net=PATH --dst=FILE.pkl`: a network as the release's network pickle.
  eval         metrics (`--metrics=fid,fd_dinov2,cls`) of `--images` or of `--net`.
  ref          reference statistics of `--images` or of `--config`'s data, to `--ref`.
  phema        post-hoc EMA: `--workdir=RUN --sigma_rel=0.05,0.1` network checkpoints.
  phema_sweep  reconstruct each `--sigma_rel`, evaluate, plot, name the best.
  generate     images for `--seeds` from `--net` into `--outdir` and/or a `--grid` PNG.
  plan         `--tpu=v5p-64`: compile `--config` for a TPU slice here; HBM, flops, fit.
Config fields are overridden with `--config.field=value`, e.g. `--config.total_kimg=100`.

Sets up the process first (`process.py`: XLA flags, host allocator, CPU devices, the
compilation cache), then runs the mode and ends within a bounded time
(`process_exit.py`); an error a user can act on is one `error:` line, exit status 1
(`modes/common.py`).
"""
from __future__ import annotations

import sys

from edm2_jax import process, process_exit


def start_line(argv: list[str]) -> str | None:
    """The line printed first, before JAX is imported (seconds, more on loaded cores), so
    that a training start is never silent: for `--mode=train` (the default), naming
    `--config` and `--workdir`; None for `--help`, `--list_presets` and the other
    modes (they announce their own stages)."""
    def value(name: str) -> str | None:  # of the last --name=V or --name V
        found = None
        for i, a in enumerate(argv):
            if a.startswith(f"--{name}="):
                found = a.split("=", 1)[1]
            elif a == f"--{name}" and i + 1 < len(argv):
                found = argv[i + 1]
        return found
    quick = ("--help", "--list_presets")
    if any(a in ("-h", "-?") or a.startswith(quick) for a in argv) or value(
            "mode") not in (None, "train"):
        return None
    what = ", ".join(v for v in (value("config"), value("workdir")) if v)
    return f"edm2-jax train{f' ({what})' if what else ''}: importing JAX..."


if __name__ == "__main__":
    process.setup_entry_point()  # before JAX starts; may re-execute this process
    if _line := start_line(sys.argv[1:]):  # after the re-exec: printed once
        print(_line, flush=True)

from absl import app, flags  # noqa: E402

from edm2_jax.modes import common, evaluate, generate, phema, plan, release, train  # noqa: E402

MODES = {
    "train": lambda: train.run(process_setup=process.TrainingSetup()),
    "convert": release.run_convert,
    "export": release.run_export,
    "generate": generate.run,
    "eval": evaluate.run_eval,
    "ref": evaluate.run_ref,
    "phema": phema.run_phema,
    "phema_sweep": phema.run_sweep,
    "plan": plan.run,
}

# The modules whose flags each mode reads, besides common's --config and --workdir
# (`--mode=MODE --help` lists them).
MODE_FLAGS = {"train": (), "convert": (release,), "export": (release, generate),
              "generate": (generate,), "eval": (evaluate, generate),
              "ref": (evaluate, generate), "phema": (phema, generate),
              "phema_sweep": (phema, evaluate, generate), "plan": (plan,)}

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "train", list(MODES), "What to do.")
for _mode in (common, train, generate, evaluate, phema, release, plan):  # all listed by --help
    flags.adopt_module_key_flags(_mode)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        process_exit.quiet_background_errors()
    process.enable_compilation_cache()
    rc = common.report_errors(_dispatch)
    process_exit.exit_bounded(rc)
    return rc


def _dispatch():
    common.load_plugins()  # what --sampler and --config.objective may name
    common.check_flags(FLAGS.mode)  # before any work
    MODES[FLAGS.mode]()


def _parse_flags(argv: list[str]) -> list[str]:
    """`common.parse_flags`, whose `--help` prints this docstring's usage and modes."""
    return common.parse_flags(argv, usage="\n\n".join(__doc__.split("\n\n")[:2]),
                              mode_flags=MODE_FLAGS)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
