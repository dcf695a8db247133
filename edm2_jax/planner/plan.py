"""What a training run needs on a TPU slice, from XLA's TPU compiler on a machine without
a TPU: libtpu compiles for a topology it is only told of (`jax.experimental.topologies`),
so the training step (and the sampler) compile here for the slice's chips, with the
mesh, shardings and micro-batches the run uses (`training.setup.setup_model`).

    topology = open_topology(tpu_slices.parse_slice("v5p-64"))
    print("\\n".join(plan_run(config, topology).lines()))

Per device (a chip; on v4, whose libtpu topology has one device per TensorCore, half a
chip): HBM is what the compiled program holds at its peak (`memory_analysis`: arguments,
temporaries, outputs not aliased to a donated argument, code); the step's flops are the
model's (every convolution and matmul of the forward jaxpr, x the objective's forward
passes, 3 for EDM2's, x the images per device), whose time at the chip's peak bounds the
step's. XLA's own per-device count (`cost_analysis()['flops']`, printed beside it) agrees
without FSDP: img64-xs on a v5e 2x2, 304 GFLOP at 1 image per chip against the model's
270, 2,075 at 8 against 2,157 (elementwise work added, input gradients left out); with
FSDP the partitioned program counts more (1.9x on a small network at fsdp 4, 2 images
per chip: tests/test_tpu_compile.py), and it counts a loop's body once (img512-xs on a
v6e-8, 8 micro-batches: 8.29 TFLOP per chip against the model's 69.05; its 32-step
sampler 1.12 against 73.63). Its modelled time (`optimal_seconds`) is not used: it can
come out negative.

A run that cannot fit is refused with a ValueError naming the fix (more `mesh.fsdp`, a
smaller `batch_per_device`, another slice): from the array sizes alone before compiling
where those decide it (`fit.py`: the train state, every network of it split by fsdp as
the run splits it, and its gradients over the HBM), else from the compiled program. A
distillation is planned from its teacher's network config, no weights read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections

from edm2_jax import configs, objectives
from edm2_jax.planner import fit, tpu_slices
from edm2_jax.model.networks import init_variables
from edm2_jax.analysis.precision import matmul_flops
from edm2_jax.sampling import sampler as sampler_lib
from edm2_jax.training import setup
from edm2_jax.training import sharding as shard_lib

GIB = fit.GIB
INSTALL = 'pip install -e ".[tpu]" (or pip install "jax[tpu]")'


class LibtpuMissingError(ImportError):
    """Compiling for a TPU slice needs libtpu, which is not installed."""


class _OverHbm(Exception):
    """XLA refused to compile a program over the TPU's HBM (its message)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice (`tpu_slices.Slice`) and its devices as libtpu describes them
    (`devices`: one per chip, or per TensorCore on v4; `processes`: the hosts' JAX
    processes they belong to)."""

    slice: tpu_slices.Slice
    devices: tuple
    processes: int

    @property
    def devices_per_chip(self) -> int:
        return len(self.devices) // self.slice.chips

    @property
    def hbm_bytes(self) -> float:
        """HBM per device, bytes."""
        return self.slice.chip.hbm_gib * GIB / self.devices_per_chip


def libtpu_installed() -> bool:
    """Whether libtpu can be loaded (the `libtpu` package, or `$TPU_LIBRARY_PATH`)."""
    return (importlib.util.find_spec("libtpu") is not None
            or os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", "")))


@contextlib.contextmanager
def _stderr_to(path: str):
    """File descriptor 2 into `path` for the block: libtpu's start-up lines on a host
    without a TPU (no accelerator type, no worker hostnames) are not the caller's."""
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def open_topology(tpu_slice: tpu_slices.Slice) -> Topology:
    """The devices of `tpu_slice` as libtpu lays them out over its hosts (one process
    per host). Raises LibtpuMissingError (with the install command) without libtpu."""
    if not libtpu_installed():
        raise LibtpuMissingError(f"compiling for a TPU slice needs libtpu, which is not "
                                 f"installed: {INSTALL}")
    from jax.experimental import topologies
    bounds = list(tpu_slice.host_shape) + [1] * (3 - len(tpu_slice.host_shape))
    with tempfile.NamedTemporaryFile(suffix=".log") as log, _stderr_to(log.name):
        desc = topologies.get_topology_desc(platform="tpu", topology_name=tpu_slice.topology,
                                            chips_per_host_bounds=bounds)
    devices = tuple(desc.devices)
    return Topology(tpu_slice, devices, len({d.process_index for d in devices}))


def forward_flops(net: Any, batch: int) -> float:
    """Model flops of one forward pass of `net` on `batch` images
    (`precision.matmul_flops` of its jaxpr: convolutions and matmuls, elementwise work
    not counted)."""
    v = jax.eval_shape(lambda r: init_variables(net, r), jax.random.PRNGKey(0))
    x, sigma, labels = _net_inputs(net, batch)
    return matmul_flops(jax.make_jaxpr(lambda v, x, s, l: net.apply(v, x, s, l))(
        v, x, sigma, labels))


def _net_inputs(net: Any, batch: int, sharding: Any = None) -> tuple:
    """`(x, sigma, labels)` shapes of a batch of `batch` (float32, each on `sharding`)."""
    def struct(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
    shape = (batch, net.img_resolution, net.img_resolution, net.img_channels)
    labels = struct((batch, net.label_dim)) if net.label_dim else None
    return struct(shape), struct((batch,)), labels


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's figures per device: `compile_s` seconds; bytes of its
    `arguments`, `temp`, unaliased `outputs` and `code`; `peak` their sum; `flops` the
    model's, `xla_flops` XLA's count (see module docstring)."""

    compile_s: float
    arguments: int
    temp: int
    outputs: int
    code: int
    flops: float
    xla_flops: float

    @property
    def peak(self) -> int:
        return self.arguments + self.temp + self.outputs + self.code

    @classmethod
    def of(cls, compiled: Any, compile_s: float, flops: float) -> "Program":
        m = compiled.memory_analysis()
        outputs = max(0, m.output_size_in_bytes - m.alias_size_in_bytes)
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        return cls(compile_s, m.argument_size_in_bytes, m.temp_size_in_bytes, outputs,
                   m.generated_code_size_in_bytes, flops, float(cost.get("flops", 0.0)))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan_run` found: the slice, the run's shape, and its programs."""

    topology: Topology
    mesh_shape: dict
    batch_size: int
    micro_batches: int
    dtype: str
    state: int
    step: Program
    sampler: Program | None
    sample_batch: int
    sample_steps: int
    state_holds: str = "params, Adam moments, EMAs"   # `fit.state_words`

    def lines(self) -> list[str]:
        """The report, one string per line (per device figures; see module docstring)."""
        t = self.topology
        n = len(t.devices)
        unit = "chip" if t.devices_per_chip == 1 else "device (TensorCore)"
        per = self.batch_size // n
        out = [f"{t.slice.name}: {t.slice.chips} chips ({t.slice.topology}), {n} devices in "
               f"{t.processes} host process{'es' * (t.processes > 1)}; mesh data="
               f"{self.mesh_shape['data']} x fsdp={self.mesh_shape['fsdp']}; batch "
               f"{self.batch_size} = {per} per {unit.split()[0]} in {self.micro_batches} "
               f"micro-batch{'es' * (self.micro_batches > 1)}; {self.dtype} compute",
               *self._program_lines("training step", self.step, per, unit)]
        if self.sampler is not None:
            out += self._program_lines(f"sampler ({self.sample_steps} Heun steps, batch "
                                       f"{self.sample_batch})", self.sampler,
                                       self.sample_batch // n, unit)
        return out

    def _program_lines(self, what: str, p: Program, images: int, unit: str) -> list[str]:
        t, chip = self.topology, self.topology.slice.chip
        seconds = p.flops / (chip.peak_tflops * 1e12 / t.devices_per_chip)
        lines = [f"{what}: compiled in {p.compile_s:.0f} s on this machine",
                 f"  HBM per {unit}: {_size(p.peak)} of {_size(t.hbm_bytes)} (arguments "
                 f"{_size(p.arguments)}, temporaries {_size(p.temp)}, outputs "
                 f"{_size(p.outputs)}, code {_size(p.code)})"]
        if what == "training step":
            lines.append(f"  train state per {unit} ({self.state_holds}; split by fsdp): "
                         f"{_size(self.state)}")
        lines += [f"  model flops per {unit}: {_flops(p.flops)} ({images} "
                  f"image{'s' * (images != 1)}; XLA's count, a loop's body once: "
                  f"{_flops(p.xla_flops)})",
                  f"  lower bound at the {chip.generation} bf16 peak ({chip.peak_tflops:g} "
                  f"TFLOP/s per chip): {seconds * 1e3:,.2f} ms, i.e. at most "
                  f"{images * len(t.devices) / seconds:,.0f} img/s for the slice (flops "
                  f"alone; memory traffic and communication add to it)"]
        return lines


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / 2**20:.1f} MiB"


def _flops(f: float) -> str:
    return f"{f / 1e12:.2f} TFLOP" if f >= 1e11 else f"{f / 1e9:.3f} GFLOP"


def _compile(lowered: Any) -> tuple[Any, float]:
    """`(compiled, seconds)`; a program over the TPU's HBM is a ValueError (XLA's words)."""
    t = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise _OverHbm(" ".join(str(e).split())[:300]) from None
    return compiled, time.perf_counter() - t


def tpu_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` as a TPU resolves its 'auto' settings: `network.dtype`
    bfloat16 (`configs.resolve_dtype`) and `backend.kernels` 'xla' (the model's own math,
    the micro-batch loop rolled; this machine's 'auto' would pick its CPU kernels)."""
    config = configs.resolve_dtype(config, "tpu")
    if str(config.backend.kernels) == "auto":
        config.backend.kernels = "xla"
    return config


def sampler_batch(config: ml_collections.ConfigDict, topology: Topology,
                  sample_batch: int | None = None) -> int:
    """The sampler's batch of a plan: `sample_batch` (`--sample_batch`), default
    `config.eval.batch_size` rounded up to a multiple of the devices; 0 = no sampler.
    Raises ValueError naming the flag and a batch that works when it is negative or
    does not split over the devices (its seeds are split over all of them)."""
    n = len(topology.devices)
    if sample_batch is None:
        flag, value = "--config.eval.batch_size", int(config.eval.batch_size)
        batch = -(-value // n) * n
    else:
        flag, value = "--sample_batch", int(sample_batch)
        batch = value
    if batch < 0 or batch % n:
        raise ValueError(f"{flag}={value}: the sampler's seeds are split over the {n} devices "
                         f"of the {topology.slice.name}, so its batch is a multiple of {n}, "
                         f"e.g. --sample_batch={max(n, -(-value // n) * n)} (0 = no sampler)")
    return batch


def plan_run(config: ml_collections.ConfigDict, topology: Topology,
             sample_batch: int | None = None, log: Callable[[str], None] = print) -> Plan:
    """Compile `config`'s training step for `topology` as the run would shard it (mesh
    of `config.mesh` over the slice's devices, `batch_per_device` micro-batches), and
    its Heun sampler (`config.sample.num_steps` steps) at `sample_batch` images
    (`sampler_batch`). The network's 'auto' settings are the TPU's (`tpu_config`).
    Raises ValueError before compiling for a config that cannot train
    (`configs.validate`), batches that do not split over the devices, and, naming the
    fix, a train state over the HBM (`fit.check_state_fits`); after, for a compiled
    program over it. `log` gets a line on the network the objective starts from
    (`fit.plan_start`) and one as the compiles start."""
    configs.validate(config)
    config = tpu_config(config)
    n = len(topology.devices)
    sample_batch = sampler_batch(config, topology, sample_batch)
    objective = objectives.from_config(config)
    config, start = fit.plan_start(config, objective, log)
    model = setup.setup_model(config, start, devices=list(topology.devices))
    state = fit.check_state_fits(config, topology, model.abstract_state)
    per_device = int(config.batch_size) // n // model.num_accum
    fixes = fit.fixes(config, topology, per_device)
    log(f"Compiling for {topology.slice.name} ({topology.slice.topology}) with libtpu...")
    try:
        step = _compile_step(config, model)
        sampler = _compile_sampler(config, model, objective, sample_batch) if sample_batch else None
    except _OverHbm as e:
        raise ValueError(f"{topology.slice.name}: the program does not fit the HBM ({e}); "
                         f"use {fixes}") from None
    plan = Plan(topology, dict(model.mesh.shape), int(config.batch_size), model.num_accum,
                str(config.network.dtype), state, step, sampler, sample_batch,
                int(config.sample.num_steps), fit.state_words(model.abstract_state))
    if step.peak > topology.hbm_bytes:
        raise ValueError(f"{topology.slice.name}: the training step needs "
                         f"{step.peak / GIB:.1f} GiB per device (arguments "
                         f"{step.arguments / GIB:.1f}, train state {state / GIB:.1f}, "
                         f"temporaries {step.temp / GIB:.1f}) of its "
                         f"{topology.hbm_bytes / GIB:.1f} GiB HBM; use {fixes}")
    return plan


def abstract_step_inputs(config: ml_collections.ConfigDict, model: setup.Model) -> tuple:
    """`(state, batch)` as `jax.ShapeDtypeStruct`s on the shardings the run uses
    (`model.state_sharding`, `sharding.batch_sharding`): `batch` is
    `{'image': f32 [B, H, W, C], 'label': f32 [B, L]}`."""
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         model.abstract_state, model.state_sharding)
    image, _, label = _net_inputs(model.net, int(config.batch_size),
                                  shard_lib.batch_sharding(model.mesh))
    if label is None:
        label = jax.ShapeDtypeStruct((int(config.batch_size), 0), jnp.float32,
                                     sharding=shard_lib.batch_sharding(model.mesh))
    return state, {"image": image, "label": label}


def lower_step(config: ml_collections.ConfigDict, model: setup.Model) -> Any:
    """The run's jitted training step (`Model.train_step`) lowered for its mesh."""
    return model.train_step(config).lower(*abstract_step_inputs(config, model))


def _compile_step(config: ml_collections.ConfigDict, model: setup.Model) -> Program:
    compiled, seconds = _compile(lower_step(config, model))
    images = int(config.batch_size) // model.mesh.size
    per_image = model.start.objective.flops_per_image(forward_flops(model.net, 1))
    return Program.of(compiled, seconds, per_image * images)


def lower_sampler(model: setup.Model, objective: objectives.Objective, batch: int,
                  num_steps: int) -> Any:
    """The objective's sampler (`Objective.sampler(num_steps)`, run by
    `sampling.sampler.sample_images`) of the network's weights (replicated, float32) for `batch` seeds split over the
    mesh, lowered."""
    net, mesh = model.net, model.mesh
    rep, split = shard_lib.replicated(mesh), shard_lib.batch_sharding(mesh)
    variables = {k: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                                 model.abstract_state[k]) for k in ("params", "buffers")}
    seeds = jax.ShapeDtypeStruct((batch,), jnp.uint32, sharding=split)
    labels = (jax.ShapeDtypeStruct((batch, net.label_dim), jnp.float32, sharding=split)
              if net.label_dim else None)
    sampler = objective.sampler(num_steps)
    fn = jax.jit(lambda v, s, l: sampler_lib.sample_images(net, v, s, l, sampler=sampler))
    return fn.lower(variables, seeds, labels)


def _compile_sampler(config: ml_collections.ConfigDict, model: setup.Model,
                     objective: objectives.Objective, batch: int) -> Program:
    steps = int(config.sample.num_steps)
    compiled, seconds = _compile(lower_sampler(model, objective, batch, steps))
    evaluations = objective.sampler(steps).evaluations
    flops = evaluations * forward_flops(model.net, 1) * batch / model.mesh.size
    return Program.of(compiled, seconds, flops)
