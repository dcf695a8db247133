"""Entry point: `python -m edm2_jax.main --config=configs/fashion_mnist.py --workdir=runs/fmnist`.

`--mode` picks one of `MODES` (`--help` lists them; each mode's flags are in
`edm2_jax/modes/`). Config fields are overridden with `--config.field=value`, e.g.
`--config.total_kimg=100`.

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

# The modes: what each runs, the modules whose flags it reads besides common's --config,
# --workdir and --plugins (`--mode=MODE --help` lists them), and its line in `--help`.
MODES = {
    "train": (lambda: train.run(process_setup=process.TrainingSetup()), (),
              "(default) train `--config` in `--workdir`, resuming if it holds a run."),
    "convert": (release.run_convert, (release,),
                "released weights or a release training state into `--workdir`."),
    "export": (release.run_export, (release, generate),
               "`--net=PATH --dst=FILE.pkl`: a network as the release's network pickle."),
    "generate": (generate.run, (generate,),
                 "images for `--seeds` from `--net` into `--outdir` and/or a `--grid` PNG."),
    "eval": (evaluate.run_eval, (evaluate, generate),
             "metrics (`--metrics=fid,fd_dinov2,cls`) of `--images` or of `--net`."),
    "ref": (evaluate.run_ref, (evaluate, generate),
            "reference statistics of `--images` or of `--config`'s data, to `--ref`."),
    "phema": (phema.run_phema, (phema, generate),
              "post-hoc EMA: `--workdir=RUN --sigma_rel=0.05,0.1` network checkpoints."),
    "phema_sweep": (phema.run_sweep, (phema, evaluate, generate),
                    "reconstruct each `--sigma_rel`, evaluate, plot, name the best."),
    "plan": (plan.run, (plan,), "`--tpu=v5p-64`: compile `--config` (or a run's) for a TPU "
             "slice here; HBM, flops, fit."),
}
MODE_FLAGS = {name: mode[1] for name, mode in MODES.items()}


def usage() -> str:
    """What `--help` prints: the first paragraph of this docstring and the modes."""
    lines = [f"  {name:<12} {mode[2]}" for name, mode in MODES.items()]
    return (__doc__.split("\n\n")[0] + "\n\nModes (`--mode`):\n" + "\n".join(lines)
            + "\nConfig fields are overridden with `--config.field=value`, e.g. "
            "`--config.total_kimg=100`.")


FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "train", list(MODES), "What to do.")
for _mode in dict.fromkeys((common, train, *(m for mode in MODES.values() for m in mode[1]))):
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
    MODES[FLAGS.mode][0]()


def _parse_flags(argv: list[str]) -> list[str]:
    """`common.parse_flags`, whose `--help` prints this docstring's usage and modes."""
    return common.parse_flags(argv, usage=usage(), mode_flags=MODE_FLAGS)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
