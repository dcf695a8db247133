"""The training loop's set-up steps, in the order `loop.train_and_evaluate` takes them,
each failing before anything costly when its part of the config is wrong:

    config = setup_precision(config, workdir)    # network.dtype 'auto' made concrete
    config = setup_teacher(config)               # a distillation run: the teacher's network
    source, config = setup_data(config)          # the data first: a broken dataset fails
    eval_key, evaluator = setup_eval(config, is_main)   # before anything is compiled
    model = setup_model(config, num_devices)     # mesh, network, optimiser, shapes
    state, resumed, managers = restore_or_init(config, model, managers, resume_step)
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections
import optax

from edm2_jax import configs
from edm2_jax import data as data_lib
from edm2_jax.model.networks import Precond
from edm2_jax.run import checkpoints, integrity, layout
from edm2_jax.sampling import generate
from edm2_jax.training import distill as distill_lib
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import step as step_lib
from edm2_jax.training.periodic_eval import TrainingEval
from edm2_jax.training.state import init_train_state, make_network


def setup_precision(config: ml_collections.ConfigDict, workdir: str
                    ) -> ml_collections.ConfigDict:
    """A copy of `config` whose `network.dtype` is concrete (`configs.resolve_dtype`), the
    one the run trains in and records: 'auto' becomes, for a run resumed in `workdir`,
    the dtype its config.json records (a run keeps its precision), else this platform's
    (`jax.default_backend()`: bfloat16 on GPU/TPU, float32 on CPU)."""
    saved = layout.read_config(workdir) or {}
    recorded = (saved.get("network") or {}).get("dtype")
    return configs.resolve_dtype(config, jax.default_backend(), recorded)


def precision(dtype: str) -> str:
    """The precision a network of compute dtype `dtype` trains in, as the start-up line
    says it: 'float32 compute', or e.g. 'bfloat16 compute (float32 params, EMAs, loss)'
    (the policy of `edm2_jax/model/precision.py`)."""
    if str(dtype) == "float32":
        return "float32 compute"
    return f"{dtype} compute (float32 params, EMAs, loss)"


def setup_teacher(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """For a distillation run (`config.distill.teacher`, `distill.py`): a copy of
    `config` whose network is the teacher's (its `dtype` the config's), read from the
    teacher's metadata alone; any other config unchanged. Raises ValueError naming the
    flag for a teacher path that holds no network, FileNotFoundError where there is
    nothing."""
    if not distill_lib.enabled(config):
        return config
    distill_lib.check_settings(config.distill)
    path = str(config.distill.teacher)
    try:
        teacher_cfg = generate.net_config(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--config.distill.teacher={path}: {e}") from None
    config = ml_collections.ConfigDict(config.to_dict())
    dtype = config.network.dtype
    config.network = ml_collections.ConfigDict(dict(teacher_cfg))
    config.network.dtype = dtype
    print(f"Teacher: {path}" + (f" (EMA {config.distill.teacher_ema})"
                                if str(config.distill.teacher_ema) else "")
          + f"; student: {config.distill.steps} step(s) on a grid of "
          f"{config.distill.teacher_steps} Heun steps", flush=True)
    return config


def setup_data(config: ml_collections.ConfigDict
               ) -> tuple[data_lib.Source, ml_collections.ConfigDict]:
    """The data source, and a copy of `config` whose network matches the data
    (resolution, channels, label_dim; each change printed). Raises ValueError when the
    config wants labels the data lack, and the errors of `data.make_source`."""
    source = data_lib.make_source(config.data)
    src_kw = data_lib.network_kwargs(source)
    config = ml_collections.ConfigDict(config.to_dict())
    if config.data.use_labels and not source.label_dim:
        raise ValueError(f"the config wants labels (data.use_labels=True) but {source.name} has "
                         f"none; set --config.data.use_labels=False for an unconditional model")
    for k, v in src_kw.items():
        if k == "label_dim" and not config.data.use_labels:
            v = 0
        if config.network.get(k) != v and distill_lib.enabled(config):
            raise ValueError(f"the teacher {config.distill.teacher} has network.{k}="
                             f"{config.network.get(k)}, the data {source.name} {v}; distil "
                             f"it on data of its own kind (--config.data.*)")
        if config.network.get(k) != v:
            print(f"network.{k}: {config.network.get(k)} -> {v} (from the data)")
            config.network[k] = v
    return source, config


def setup_eval(config: ml_collections.ConfigDict, is_main: bool
               ) -> tuple[str | None, TrainingEval | None]:
    """`(ema_key, evaluator)` of the evaluation at every snapshot (`config.eval`), or
    `(None, None)` when none is wanted. The key is checked on every process; only
    process 0 evaluates (`evaluator` None elsewhere). Raises ValueError for a bad eval
    config."""
    if not str(config.eval.metrics).strip():
        return None, None
    key = TrainingEval.ema_key_of(config)
    return key, TrainingEval(config) if is_main else None


@dataclasses.dataclass(frozen=True)
class Model:
    """What `setup_model` builds: the mesh, the network and optimiser, the micro-batches
    per step, and the train state's shapes and shardings."""
    mesh: jax.sharding.Mesh
    net: Precond
    tx: optax.GradientTransformation
    num_accum: int
    abstract_state: Any
    state_sharding: Any


def setup_model(config: ml_collections.ConfigDict, num_devices: int | None = None) -> Model:
    """The device mesh of `config.mesh` over the first `num_devices` devices (default:
    all) and everything shaped by the config (nothing allocated). Raises ValueError for
    inconsistent batch sizes."""
    if num_devices == jax.device_count():
        num_devices = None
    mesh = shard_lib.mesh_from_config(config, num_devices)
    num_accum = step_lib.num_micro_batches(config, mesh.size)
    net = make_network(config)
    tx = optim_lib.make_optimizer(config.optim, int(config.batch_size))
    abstract_state = jax.eval_shape(lambda r: init_train_state(config, net, tx, r),
                                    jax.random.PRNGKey(config.seed))
    if distill_lib.enabled(config):  # the frozen teacher, shaped as the params
        abstract_state = dict(abstract_state, teacher=abstract_state["params"])
    return Model(mesh, net, tx, num_accum, abstract_state,
                 shard_lib.state_shardings(mesh, abstract_state))


def restore_or_init(config: ml_collections.ConfigDict, model: Model,
                    managers: checkpoints.TrainCheckpoints, resume_step: int = 0
                    ) -> tuple[dict, bool, checkpoints.TrainCheckpoints]:
    """`(state, resumed, managers)`: the latest complete checkpoint (or checkpoint
    `resume_step`) on the model's shardings, checked against its integrity record
    (`checkpoints.TrainCheckpoints.restore_latest`), else a fresh state from `config.seed`.
    When the run has checkpoints but none restores, or has lost them (snapshots and
    the records of its checkpoints left, `checkpoints/` empty), raises NoCheckpointError,
    unless
    `config.start_over`: then the run's outputs are moved aside and it starts from
    step 0 (with new managers, returned)."""
    try:
        state = managers.restore_latest(model.abstract_state, model.state_sharding,
                                        resume_step=resume_step)
    except checkpoints.NoCheckpointError:
        if not config.start_over:
            raise
        managers.close()
        moved = layout.discard_outputs(managers.workdir)
        print(f"Starting over (--config.start_over=True): the run's former outputs are in "
              f"{moved}", flush=True)
        managers = checkpoints.TrainCheckpoints(managers.workdir, keep=managers.keep)
        state = None
    else:
        if config.start_over and state is not None:
            print(f"--config.start_over=True ignored: checkpoint {int(state['step'])} "
                  f"restores (to start over anyway, use a new --workdir)", flush=True)
    if state is not None:
        return state, True, managers
    if distill_lib.enabled(config):
        print(f"Loading the teacher {config.distill.teacher}...", flush=True)
        _, teacher, desc = distill_lib.load_teacher(str(config.distill.teacher),
                                                    str(config.distill.teacher_ema))
        print(f"Teacher: {desc}", flush=True)
        init_fn = jax.jit(lambda r, v: distill_lib.init_distill_state(
            config, model.net, model.tx, r, v), out_shardings=model.state_sharding)
        state = init_fn(jax.random.PRNGKey(config.seed), teacher)
    else:
        init_fn = jax.jit(lambda r: init_train_state(config, model.net, model.tx, r),
                          out_shardings=model.state_sharding)
        state = init_fn(jax.random.PRNGKey(config.seed))
    managers.reference_rms = {"params": integrity.rms(state["params"])}
    return state, False, managers


def effective_resume_step(config: ml_collections.ConfigDict, workdir: str) -> int:
    """`config.resume_step`, or 0 when config.json records that an earlier run of this
    workdir applied it already (then the checkpoints after it are that run's progress,
    not the diverged ones it set aside)."""
    step = int(config.resume_step)
    saved = layout.read_config(workdir) or {}
    newest = layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS))
    if step and saved.get("resume_step") == step and newest and int(
            os.path.basename(newest[0])) > step:
        print(f"--config.resume_step={step} was applied by an earlier run (config.json); "
              f"resuming from the newest checkpoint, {os.path.basename(newest[0])}", flush=True)
        return 0
    return step
