"""The training loop's set-up steps, in the order `loop.training_loop` takes them,
each failing before anything costly when its part of the config is wrong:

    objective = configs.validate(config)         # the objective, chosen and checked once
    start = setup_objective(objective, workdir)  # and the network it starts from
    source = setup_data(config)                  # the data: a broken dataset fails first
    config = run_config(config, workdir, start, source)   # the config, built once
    model = setup_model(config, start, num_devices)   # mesh, network, optimiser, shapes
    resume_step = effective_resume_step(int(config.resume_step), workdir)
    state, resumed, managers = restore_or_init(config, model, managers, resume_step)

and the lines the loop prints of them (`network_line`, `restore_line`); the evaluation's
set-up, between the config and the model, is `snapshot_outputs.setup_eval`'s.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import optax

from edm2_jax import configs
from edm2_jax import data as data_lib
from edm2_jax import objectives
from edm2_jax.model.networks import Precond
from edm2_jax.run import checkpoints, integrity, layout
from edm2_jax import nets
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import step as step_lib
from edm2_jax.training.state import init_train_state, make_network


def precision(dtype: str) -> str:
    """The precision a network of compute dtype `dtype` trains in, as the start-up line
    says it: 'float32 compute', or e.g. 'bfloat16 compute (float32 params, EMAs, loss)'
    (the policy of `edm2_jax/analysis/precision.py`)."""
    if str(dtype) == "float32":
        return "float32 compute"
    return f"{dtype} compute (float32 params, EMAs, loss)"


@dataclasses.dataclass(frozen=True)
class Start:
    """What a run starts from: its objective (`edm2_jax.objectives`), and the network
    the objective starts it from, if any (`Objective.start()`: path, EMA, its role and
    flag; its network config read from its metadata; its weights are read only when a
    fresh train state is made)."""
    objective: objectives.Objective
    network: objectives.StartNetwork | None = None
    init_config: dict | None = None

    @property
    def init_path(self) -> str | None:
        return self.network.path if self.network else None


def setup_objective(objective: objectives.Objective, workdir: str) -> Start:
    """The run's start: its `objective` (checked with the config: `configs.validate`) and
    the network config of the network it starts from: for a run resumed in `workdir`
    (checkpoints and its config.json there), the one config.json records, so that a
    resume needs nothing but the run; else the network's own, from its metadata alone.
    Raises ValueError (naming the flag) where the network to start from is not given,
    FileNotFoundError (naming the flag) where it is not there."""
    network = objective.start()
    if network is None:  # from a fresh network (e.g. sCT without one named): say so
        line = objective.describe()
        if line:
            print(line, flush=True)
        return Start(objective)
    if not network.path:
        raise ValueError(f"{network.flag} is empty: the run starts from its {network.role}; "
                         f"set {network.flag}=PATH (a run, snapshot or network checkpoint)")
    recorded = (layout.read_config(workdir) or {}).get("network")
    if recorded and layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS)):
        init_config = recorded  # a resume: the weights are in the train state
    else:
        try:
            init_config = nets.net_config(network.path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{network.flag}={network.path}: {e}") from None
    line = objective.describe()
    if line:
        print(line, flush=True)
    return Start(objective, network, dict(init_config))


def setup_data(config: ml_collections.ConfigDict) -> data_lib.Source:
    """The data source of `config.data`. Raises ValueError when the config wants labels
    the data lack, and the errors of `data.make_source`."""
    source = data_lib.make_source(config.data)
    if config.data.use_labels and not source.label_dim:
        raise ValueError(f"the config wants labels (data.use_labels=True) but {source.name} has "
                         f"none; set --config.data.use_labels=False for an unconditional model")
    return source


def run_config(config: ml_collections.ConfigDict, workdir: str, start: Start,
               source: data_lib.Source) -> ml_collections.ConfigDict:
    """The config the run trains with and records, built once from `config`:

    - `network.dtype` concrete (`configs.resolve_dtype`): 'auto' becomes, for a run
      resumed in `workdir`, the dtype its config.json records (a run keeps its
      precision), else this platform's (bfloat16 on GPU/TPU, float32 on CPU);
    - the network of `start.init_config` (the network the run starts from), in that dtype;
    - resolution, channels and label_dim from the data (each change printed);
    - `plugins`: the modules outside the package that define its objective and its
      sampler (`objectives.modules_of`), so that every later mode finds them.

    Raises ValueError where the network the run starts from does not fit the data."""
    recorded = ((layout.read_config(workdir) or {}).get("network") or {}).get("dtype")
    config = configs.resolve_dtype(config, jax.default_backend(), recorded)  # a copy
    if start.init_config is not None:
        dtype = config.network.dtype
        config.network = ml_collections.ConfigDict(dict(start.init_config))
        config.network.dtype = dtype
    for k, v in data_lib.network_kwargs(source).items():
        if k == "label_dim" and not config.data.use_labels:
            v = 0
        if config.network.get(k) == v:
            continue
        if start.init_config is not None:
            raise ValueError(f"the {start.network.role} {start.network.path} has "
                             f"network.{k}={config.network.get(k)}, the data {source.name} "
                             f"{v}; train it on data of its own kind (--config.data.*)")
        print(f"network.{k}: {config.network.get(k)} -> {v} (from the data)")
        config.network[k] = v
    objective = start.objective
    config.plugins = objectives.modules_of(objective, objective.sampler(
        int(config.sample.num_steps)))
    return config


@dataclasses.dataclass(frozen=True)
class Model:
    """What `setup_model` builds: the run's start (objective and initial network), the
    mesh, the network, the optimiser and its learning-rate schedule, the micro-batches
    per step, and the train state's shapes and shardings."""
    start: Start
    mesh: jax.sharding.Mesh
    net: Precond
    tx: optax.GradientTransformation
    lr_fn: Callable
    num_accum: int
    abstract_state: Any
    state_sharding: Any

    def train_step(self, config: ml_collections.ConfigDict) -> Callable:
        """The jitted training step (`step.make_train_step`) over the mesh."""
        return step_lib.jit_train_step(
            step_lib.make_train_step(config, self.net, self.tx, self.num_accum,
                                     self.start.objective, self.lr_fn),
            self.mesh, self.state_sharding)


def setup_model(config: ml_collections.ConfigDict, start: Start,
                num_devices: int | None = None, devices: list | None = None) -> Model:
    """The device mesh of `config.mesh` over the first `num_devices` of `devices`
    (default: all of `jax.devices()`; a TPU topology's to compile for it without one)
    and everything shaped by the config (nothing allocated). Raises ValueError for
    inconsistent batch sizes."""
    if num_devices is not None and num_devices == len(devices or jax.devices()):
        num_devices = None
    mesh = shard_lib.mesh_from_config(config, num_devices, devices)
    num_accum = step_lib.num_micro_batches(config, mesh.size)
    net = make_network(config)
    lr_fn = optim_lib.learning_rate_schedule(config.optim, int(config.batch_size))
    tx = optim_lib.make_optimizer(config.optim, int(config.batch_size), lr_fn)
    abstract_state = jax.eval_shape(
        lambda r: init_train_state(config, net, tx, r, objective=start.objective),
        jax.random.PRNGKey(config.seed))
    return Model(start, mesh, net, tx, lr_fn, num_accum, abstract_state,
                 shard_lib.state_shardings(mesh, abstract_state))


def restore_or_init(config: ml_collections.ConfigDict, model: Model,
                    managers: checkpoints.TrainCheckpoints, resume_step: int = 0
                    ) -> tuple[dict, bool, checkpoints.TrainCheckpoints]:
    """`(state, resumed, managers)`: the latest complete checkpoint (or checkpoint
    `resume_step`) on the model's shardings, checked against its integrity record
    (`checkpoints.TrainCheckpoints.restore_latest`), else a fresh state from `config.seed`
    (with the arrays of the network the run starts from, if any, checked against the
    shapes of the model's network in its train state: `nets.load_variables`, which first
    checks a run's or snapshot's config.json against the copy that run keeps,
    `nets.check_shapes`).
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
    start, variables = model.start, None
    if start.network is not None:  # the network the objective starts from
        role = start.network.role
        print(f"Loading the {role} {start.network.path}...", flush=True)
        variables, desc = nets.load_variables(start.network.path, start.network.ema or None)
        nets.check_shapes({k: model.abstract_state[k] for k in ("params", "buffers")},
                          variables, desc)  # the shapes of the network this run trains
        variables = jax.tree.map(np.asarray, dict(variables))
        print(f"{role.capitalize()}: {desc}", flush=True)
    frozen = {name: load_frozen_network(other, model.abstract_state[name])
              for name, other in start.objective.frozen_networks().items()}
    init_fn = jax.jit(lambda r, v, f: init_train_state(config, model.net, model.tx, r, v,
                                                       objective=start.objective, frozen=f),
                      out_shardings=model.state_sharding)
    state = init_fn(jax.random.PRNGKey(config.seed), variables, frozen or None)
    managers.reference_rms = {"params": integrity.rms(state["params"])}
    return state, False, managers


def load_frozen_network(network: objectives.StartNetwork, want: dict) -> dict:
    """The `{'params', 'buffers'}` of one of an objective's `frozen_networks`, as the
    arrays of `want` (its placeholder in the abstract train state: same structure, shapes
    and dtypes). Raises ValueError naming the flag when the network's arrays are not of
    those shapes (a network of another architecture than the one the run trains)."""
    print(f"Loading the {network.role} {network.path}...", flush=True)
    variables, desc = nets.load_variables(network.path, network.ema or None)
    differ = nets.shape_differences(want, variables)
    if differ:
        raise ValueError(
            f"{network.flag}={network.path}: {desc} is not of the architecture this run "
            f"trains ({'; '.join(differ[:2])}{'; ...' if len(differ) > 2 else ''}); the "
            f"{network.role} must be a network of the teacher's config (e.g. an earlier "
            f"snapshot of its run)")
    def name(path) -> str:
        return "/".join(str(getattr(k, "key", k)) for k in path)
    arrays = {name(p): x for p, x in jax.tree_util.tree_leaves_with_path(dict(variables))}
    print(f"{network.role.capitalize()}: {desc}", flush=True)
    return jax.tree_util.tree_map_with_path(
        lambda p, a: np.asarray(arrays[name(p)], a.dtype), want)


def effective_resume_step(step: int, workdir: str) -> int:
    """`step` (`config.resume_step`), or 0 when config.json records that an earlier run
    of this workdir applied it already (then the checkpoints after it are that run's
    progress, not the diverged ones it set aside)."""
    saved = layout.read_config(workdir) or {}
    newest = layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS))
    if step and saved.get("resume_step") == step and newest and int(
            os.path.basename(newest[0])) > step:
        print(f"--config.resume_step={step} was applied by an earlier run (config.json); "
              f"resuming from the newest checkpoint, {os.path.basename(newest[0])}", flush=True)
        return 0
    return step


def restore_line(workdir: str, resume_step: int) -> str:
    """The line that starts the train state's restore (`restore_or_init`)."""
    if layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS)):
        which = f"checkpoint {resume_step}" if resume_step else "the newest checkpoint"
        return f"Train state: restoring {which}..."
    return "Train state: initialising the network (compiles its initialisation first)..."


def network_line(model: Model, *, dtype: str, batch_size: int, sigma_rels: list) -> str:
    """The start-up line of the network: parameters, precision, batch, mesh and EMAs."""
    n_params = sum(int(np.prod(x.shape)) for x in
                   jax.tree.leaves(model.abstract_state["params"]))
    return (f"Network: {n_params:,} parameters, {precision(dtype)}; batch {batch_size} on "
            f"{model.mesh.size} device(s) of {jax.process_count()} process(es), mesh "
            f"{dict(model.mesh.shape)}, {model.num_accum} micro-batch(es) per step; EMAs "
            f"sigma_rel={sigma_rels}")
