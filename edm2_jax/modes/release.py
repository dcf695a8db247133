"""`--mode=convert` and `--mode=export`: the release's files into our runs and networks,
and our networks into the release's pickles.

  convert  `--src=edm2-img64-s-1073741-0.075.pkl --workdir=DIR`: released weights as a
           network checkpoint the rest of the project loads (`release.convert`);
           `--src=training-state-<kimg>.pt --config=... --workdir=DIR`: a release
           training state as checkpoint `cur_nimg / batch_size` of a run that
           `--mode=train` with the same config continues (`import_training_state`).
  export   `--net=PATH [--ema=KEY] --dst=FILE.pkl`: any network `nets.load_net`
           reads (network checkpoint, run, snapshot) as the release's network pickle.

    python -m edm2_jax.main --mode=convert --src=training-state-0134217.pt \
        --config=configs/img512.py:xs --workdir=runs/img512-xs    # then --mode=train
    python -m edm2_jax.main --mode=export --net=runs/img512-xs/phema/phema-0134217-0.100 \
        --dst=edm2-img512-xs-0134217-0.100.pkl
"""
from __future__ import annotations

import json
import os

import jax
from absl import app, flags

from edm2_jax import configs, nets, paths
from edm2_jax.modes import common
from edm2_jax.modes import generate as generate_mode  # noqa: F401 (--net, --ema)
from edm2_jax.release import convert, pickle_io
from edm2_jax.release import training_state as release_state
from edm2_jax.release.export import RELEASE_KWARGS, export_network_pickle
from edm2_jax.run import checkpoints, integrity, layout, network_dir
from edm2_jax.training import resume
from edm2_jax.training.from_release import train_state_from_release

FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "convert: released network pickle / state_dict (.pkl, .pt, .npz).")
flags.DEFINE_string("dst", None, "export: the release network pickle to write from --net.")
flags.DEFINE_string("net_overrides", None, "convert: JSON of Precond kwargs that win over what is "
                    "read from --src, e.g. '{\"channel_mult\": [1, 2, 3, 4]}'.")


def import_training_state(src: str, workdir: str, config) -> int:
    """Convert the release training state `src` into checkpoint `step` of a new
    edm2-jax run in `workdir` trained with `config` (plus its config.json); returns the
    step. `config` is the one `--mode=train` will get: its network must be the release
    net's and fit the data (as the presets do; a data-adapted network is what
    `training.setup.setup_data` returns). `--mode=train` with the same config continues
    from there. Raises FileExistsError when `workdir` already has checkpoints (nothing is
    overwritten) and what `read_training_state` / `train_state_from_release` raise."""
    if layout.is_run(workdir) or layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS)):
        raise FileExistsError(f"{workdir} already holds a run; convert the training state "
                              f"into a new --workdir")
    # config.json records the concrete compute dtype, which `--mode=train` then keeps.
    config = configs.resolve_dtype(config, jax.default_backend())
    step, state = train_state_from_release(release_state.read_training_state(src), config)
    paths.makedirs(workdir)  # local or gs://
    current = resume.check_config(workdir, config)
    managers = checkpoints.TrainCheckpoints(workdir, keep=int(config.keep_checkpoints))
    managers.reference_rms = {"params": integrity.rms(state["params"])}
    try:
        managers.save_state(step, state)
    finally:
        managers.close()
    resume.record_config(workdir, current)
    return step


def main_import_state(src: str, workdir: str, config) -> int:
    """CLI body of `--mode=convert --src=training-state-*.pt --config=... --workdir=DIR`."""
    if config is None:
        raise ValueError("converting a release training state needs the run's --config "
                         "(e.g. --config=configs/img512.py:xs) to continue training with")
    step = import_training_state(src, workdir, config)
    print(f"Converted {src} into checkpoint {step} of the run {workdir} "
          f"({step * int(config.batch_size) / 1000:g} kimg); continue it with --mode=train "
          f"and the same --config")
    return step


def main_export(net_path: str, dst: str, ema: str | None = None) -> str:
    """CLI body of `--mode=export --net=PATH [--ema=KEY] --dst=FILE.pkl`: any network
    `nets.load_net` reads (network checkpoint, run, snapshot) as a release pickle."""
    if not dst:
        raise ValueError("--mode=export needs --dst=FILE.pkl")
    pickle_io.import_torch("--mode=export (writing the release's pickles)")  # before any work
    net, variables, desc = nets.load_net(net_path, ema)
    config = {k: getattr(net, k) for k in RELEASE_KWARGS}
    # The release's use_fp16 as recorded (a converted release net's); else its default.
    use_fp16 = None
    if network_dir.is_network_checkpoint(paths.normalize(net_path)):
        use_fp16 = network_dir.read_network_json(paths.normalize(net_path))[1].get("use_fp16")
    path = export_network_pickle(jax.device_get(variables), config, dst, use_fp16=use_fp16)
    if use_fp16 is not None:
        desc += f" (use_fp16={bool(use_fp16)}, as recorded)"
    print(f"Exported {desc} -> {path} (the release's network pickle: generate_images.py "
          f"--net={path}, or a reconstruct_phema.py input when named "
          f"<prefix>-<kimg>-<sigma_rel>.pkl)")
    return path


def net_overrides() -> dict | None:
    """`--net_overrides` as a dict of Precond kwargs (None when not given); raises
    ValueError for anything but a JSON object."""
    if not FLAGS.net_overrides:
        return None
    try:
        value = json.loads(FLAGS.net_overrides)
    except ValueError as e:
        raise ValueError(f"--net_overrides={FLAGS.net_overrides!r} is not JSON ({e}); e.g. "
                         f"--net_overrides='{{\"channel_mult\": [1, 2, 3, 4]}}'") from None
    if not isinstance(value, dict):
        raise ValueError("--net_overrides must be a JSON object of Precond kwargs")
    return value


def run_convert() -> None:
    """`--mode=convert`: a release training state (`main_import_state`) or network
    (`convert.main_convert`)."""
    workdir = common.require_workdir()
    if not FLAGS.src:
        raise app.UsageError("--mode=convert needs --src=FILE")
    common.check_output_dir(workdir, "--workdir")  # before the source is read
    if release_state.is_training_state(FLAGS.src):
        main_import_state(FLAGS.src, workdir, common.config())
    else:
        convert.main_convert(FLAGS.src, workdir, net_overrides())


def run_export() -> None:
    """`--mode=export` (`main_export`)."""
    if not FLAGS.net:
        raise app.UsageError("--mode=export needs --net=PATH and --dst=FILE.pkl")
    common.check_output_file(FLAGS.dst, "--dst")  # before the network is read
    main_export(FLAGS.net, FLAGS.dst, FLAGS.ema)
