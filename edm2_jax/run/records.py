"""The integrity record saved with each checkpoint and EMA snapshot of a run.

A step's record is `integrity.digest_tree` of what was saved (a checksum per array, the
paths of NaN/inf arrays, the parameters' RMS; a state checkpoint's also carries the run's
initial RMS, `reference_rms`, and the entries its saver keeps with it,
`TrainCheckpoints.save_state(extra=)`: the training loop's config and status interval,
read back by `TrainCheckpoints.restored` and `kept_entry`). It lives in Orbax's per-step
`_CHECKPOINT_METADATA` under `custom_metadata.integrity` (`step_metadata` writes it
there), so Orbax renames it into place atomically with the arrays, and in the run's own
copy `WORKDIR/records/<kind>/<step>.json` (`save_record`, written just before that
rename), so that losing one file does not lose the checksums. `step_record` reads
both: when they disagree, or when both are missing (every step is saved with them), the
step is not trusted (IntegrityError).

A copy of the run's config is kept with its networks: in each state checkpoint's record
(`KEPT_CONFIG`) and beside each EMA snapshot's record (`with_kept_config`); the readers
of a run's networks compare config.json with the newest copy (`kept_config`,
`run_config`), so that an edited config.json is refused even where `checkpoints/` is gone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Callable, Sequence

from absl import logging as absl_logging

from edm2_jax import paths
from edm2_jax.run import integrity
from edm2_jax.run import layout
from edm2_jax.run.layout import STEP_METADATA

# A checkpoint is healthy when finite and its params' RMS is within this factor of the
# run's initial RMS (forced weight normalisation keeps it near 1; a diverging run's grows
# by orders of magnitude before the loss turns NaN).
HEALTHY_RMS_FACTOR = 10.0


def step_metadata(record: dict) -> dict:
    """The Orbax `custom_metadata` of a step saved with integrity record `record`."""
    return {"integrity": record}


def _owner(step_dir: str) -> tuple[str, str, int] | None:
    """`(workdir, kind, step)` of `WORKDIR/<kind>/<step>` (kind `checkpoints` or
    `snapshots`), or None for a step directory outside a run's layout."""
    step_dir = paths.normalize(step_dir)
    root, name = os.path.split(step_dir)
    workdir, kind = os.path.split(root)
    if not name.isdigit() or kind not in (layout.CHECKPOINTS, layout.SNAPSHOTS):
        return None
    return workdir, kind, int(name)


def save_record(step_dir: str, record: dict) -> None:
    """Write the run's own copy of the integrity record of step `step_dir` (atomically;
    call on one process)."""
    workdir, kind, step = _owner(step_dir)
    path = layout.record_path(workdir, kind, step)
    paths.makedirs(os.path.dirname(path))
    paths.write_text_atomic(path, json.dumps(record))


def prune_records(workdir: str, kind: str, below: int) -> None:
    """Delete the run's own records of the steps of `kind` below `below` whose step
    directories are gone (deleted by Orbax's `max_to_keep`, or set aside)."""
    root = os.path.join(workdir, layout.RECORDS, kind)
    steps = {n for n in paths.listdir(os.path.join(workdir, kind)) if n.isdigit()}
    for name in paths.listdir(root):
        step = name.removesuffix(".json")
        if step.isdigit() and int(step) < below and step not in steps:
            paths.Path(os.path.join(root, name)).unlink(missing_ok=True)


class _MissingStepMetadata(logging.Filter):
    """Drops Orbax's warning that a step's `_CHECKPOINT_METADATA` does not exist."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Metadata file does not exist") and any(
            str(a).endswith(STEP_METADATA) for a in (record.args or ())))


@contextlib.contextmanager
def quiet_missing_step_metadata():
    """Orbax's managers warn on absl's logger, for every step whose `_CHECKPOINT_METADATA`
    is missing, each time they list or restore the steps; `step_record` reads the run's
    own copy of what it held (and says so when both are lost), so within this context
    (also a decorator) that warning alone is dropped, from every thread."""
    logger, quiet = absl_logging.get_absl_logger(), _MissingStepMetadata()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _read(path: str, in_orbax_metadata: bool) -> dict | None:
    """The integrity record in JSON file `path` (Orbax's step metadata, or our own copy),
    None when the file or the record is missing. Raises IntegrityError when unreadable."""
    if not paths.isfile(path):
        return None
    try:
        record = json.loads(paths.read_text(path))
        if in_orbax_metadata:
            record = (record.get("custom_metadata") or {}).get("integrity")
        if record is not None and not isinstance(record.get("digests"), dict):
            raise ValueError("no digests")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise integrity.IntegrityError(f"{path} is unreadable ({e})") from None
    return record


def step_record(step_dir: str) -> dict:
    """The integrity record of checkpoint or snapshot `step_dir`: Orbax's copy (in its
    `_CHECKPOINT_METADATA`) or the run's own (`save_record`). Raises IntegrityError when
    a copy is unreadable, when the two differ, and when both are missing: every step is
    saved with its record, so a step without one cannot be checked (a lost record must
    not turn the checksums off)."""
    orbax = _read(os.path.join(step_dir, STEP_METADATA), True)
    owner = _owner(step_dir)
    own_path = layout.record_path(*owner) if owner else None
    own = _read(own_path, False) if own_path else None
    if orbax is not None and own is not None and _canonical(orbax) != _canonical(own):
        raise integrity.IntegrityError(
            f"{step_dir}: its integrity record differs from the run's copy {own_path} "
            f"(one of them was altered)")
    record = orbax if orbax is not None else own
    if record is None:
        copies = f"{STEP_METADATA} and {own_path} are" if own_path else f"{STEP_METADATA} is"
        raise integrity.IntegrityError(
            f"{step_dir} has no integrity record ({copies} missing or hold none) though its "
            f"run records one for every step, so what it holds cannot be checked")
    return record


# The entry of a state checkpoint's record that keeps the run's config (as config.json
# holds it), so that a deleted or edited config.json is noticed; EMA snapshots keep it
# too, in their Orbax step metadata beside the record (`with_kept_config`), so that a run
# without checkpoints (pruned, or copied without them) still has it.
KEPT_CONFIG = "config"
# The fields of the copy compared with config.json by the readers of a run's networks
# (`run_config`): what builds a network and the space its samples are in. (The objective
# and its section: `nets.run_config`, which knows the objectives.)
SAMPLING_FIELDS = ("network", "data.encoder")


def with_kept_config(custom_metadata: dict | None, config: dict) -> dict:
    """The Orbax `custom_metadata` of a step (`step_metadata`) with a copy of the run's
    `config` beside its integrity record (what an EMA snapshot keeps)."""
    return dict(custom_metadata or {}, **{KEPT_CONFIG: config})


def _metadata_config(step_dir: str) -> dict | None:
    """The copy of the run's config kept in the Orbax step metadata of `step_dir`
    (`with_kept_config`), None when there is none or it is unreadable."""
    path = os.path.join(step_dir, STEP_METADATA)
    try:
        config = (json.loads(paths.read_text(path)).get("custom_metadata") or {}).get(
            KEPT_CONFIG) if paths.isfile(path) else None
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def kept_config(workdir: str) -> tuple[str, dict] | None:
    """`(what, config)`: the copy of the run's config that its newest checkpoint keeps
    (`KEPT_CONFIG` in its record), else its newest EMA snapshot (`with_kept_config`);
    `what` names it ('checkpoint 4', 'snapshot 4'). None when none keeps one (a run
    saved before they were kept)."""
    kept = kept_entry(workdir, KEPT_CONFIG)
    if kept is not None and isinstance(kept[1], dict):
        return f"checkpoint {kept[0]}", kept[1]
    for d in layout.step_dirs(os.path.join(workdir, layout.SNAPSHOTS)):
        config = _metadata_config(d)
        if config is not None:
            return f"snapshot {os.path.basename(d)}", config
    return None


def _field(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def differences(was: dict, now: dict, fields: Sequence[str], kind: str) -> list[str]:
    """`'field: <kind> A vs now B'` for each field of `fields` (dotted; a section is
    compared field by field) whose value differs between the kept copy `was` and `now`.
    `data.encoder` unset is 'none', as `vae.encoder_of` reads it."""
    out = []
    for f in fields:
        a, b = _field(was, f), _field(now, f)
        if f == "data.encoder":
            a, b = a or "none", b or "none"
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            out += [f"{f}.{k}: {kind} {a.get(k)!r} vs now {b.get(k)!r}"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{f}: {kind} {a!r} vs now {b!r}")
    return out


def run_config(workdir: str) -> dict | None:
    """The run's config.json (None when there is none), its `SAMPLING_FIELDS` (the
    network section, `data.encoder`) checked against the copy its newest checkpoint or
    snapshot keeps (`kept_config`; none in a run saved before it was kept). Raises
    IntegrityError naming the fields and the fix when they differ: the networks of the
    run would be built, or their samples decoded, otherwise than they were trained."""
    config = layout.read_config(workdir)
    kept = kept_config(workdir)
    if config is None or kept is None:
        return config
    what, was = kept
    differ = differences(was, config, SAMPLING_FIELDS, what.split()[0])
    if differ:
        raise integrity.IntegrityError(
            f"{layout.config_path(workdir)} differs from the copy of the run's config that "
            f"{what} keeps ({'; '.join(differ[:4])}): it was edited, and the "
            f"run's networks were not trained with it. Put those settings back in "
            f"config.json.")
    return config


def run_network_config(workdir: str) -> dict:
    """The `network` section of the run's config.json (the `Precond` kwargs), checked as
    `run_config` checks it. Raises FileNotFoundError when the run has no config.json,
    IntegrityError when it was edited."""
    config = run_config(workdir)
    if config is None:
        raise FileNotFoundError(f"{layout.config_path(workdir)} is missing; a training run's "
                                f"network is described by its config.json (written by "
                                f"loop.train_and_evaluate)")
    return config["network"]


def kept_entry(workdir: str, key: str) -> tuple[int, object] | None:
    """`(step, record[key])` of the run's newest checkpoint whose integrity record keeps
    `key` (an entry given to `TrainCheckpoints.save_state(extra=)`, e.g. the run's
    config), None when none does; a step whose record is unreadable is passed over."""
    for d in layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS)):
        try:
            record = step_record(d)
        except integrity.IntegrityError:
            continue
        if key in record:
            return int(os.path.basename(d)), record[key]
    return None


def _canonical(record: dict) -> str:
    return json.dumps(record, sort_keys=True)


def is_healthy(record: dict, reference_rms: dict | None) -> bool:
    """Whether a checkpoint's record says its arrays are finite and its parameters'
    RMS within `HEALTHY_RMS_FACTOR` of the run's initial RMS (`reference_rms`)."""
    if record.get("nonfinite"):
        return False
    ref = (reference_rms or record.get("reference_rms") or {}).get("params")
    value = record.get("rms", {}).get("params")
    return not ref or value is None or value <= HEALTHY_RMS_FACTOR * ref


def check_host_tree(tree: dict, record: dict | None, what: str, fix: str,
                    prefix: str = "") -> None:
    """Check the host NumPy arrays `tree` against `record` (the arrays under `prefix` of
    what was saved). Raises IntegrityError naming `what` and ending with `fix` when they
    differ or are not finite."""
    try:
        integrity.check(record, integrity.digest_tree_numpy(tree), what, prefix)
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"{e}. {fix}") from None


def read_checked(read: Callable[[], dict], record: dict | None, what: str, fix: str,
                 prefix: str = "") -> dict:
    """`read()` (an Orbax item as host NumPy arrays, e.g. `network_dir.restore_numpy`)
    checked by `check_host_tree`. Raises IntegrityError naming `what` and ending with
    `fix` when it cannot be read (a truncated or damaged file: TensorStore's
    OUT_OF_RANGE, DATA_LOSS, ...) as when what it reads differs from `record`."""
    try:
        tree = read()
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise integrity.IntegrityError(
            f"{what} is unreadable ({integrity.one_line(e)}). {fix}") from None
    check_host_tree(tree, record, what, fix, prefix)
    return tree
