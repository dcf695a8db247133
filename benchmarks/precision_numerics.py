"""Numerics of a bfloat16 network against the float32 one: the training loss over a run,
and the sampler's images per seed.

    python benchmarks/precision_numerics.py                  # 200 steps, 64 seeds: ~11 min, 2 cores
    python benchmarks/precision_numerics.py --out=numerics.json  # also writes numerics.md
    python benchmarks/precision_numerics.py --config=configs/fashion_mnist.py:tiny \
        --steps=16 --seeds=8 --probe_every=1                    # a minute

Training. Three runs of the real step (`step.make_train_step`, jitted by
`step.jit_train_step`) from one initial state (`state.init_train_state`) on the same
Fashion-MNIST batches (`data.make_iterator`; a fixed synthetic set where the data is not
installed); the same state rng gives every run the same noise levels and noise:

  f32      `network.dtype = float32`;
  bf16     `network.dtype = bfloat16` (the policy of `edm2_jax/analysis/precision.py`);
  control  float32, its initial U-Net weights rounded to bfloat16 as the bf16 network
           rounds them (every layer outside `precision.FLOAT32_LAYERS`): one perturbation
           of relative size up to u, then exact float32.

Training is chaotic: any perturbation of the weights, however small, grows until the
runs' weights are unrelated; from then on their losses differ by the loss's own noise.
So the bf16 loss is compared with three scales, measured every `--probe_every` steps at
the f32 run's state and batch (`probe`):

  rounding  what bf16 rounding alone can do to the objective at one state (`probe`'s
            `rounding`, below) and what it does (`tf`: the bf16 objective at the f32 state);
  control   what a bf16-sized perturbation of float32 training becomes (the control run);
  noise     the objective's minibatch sampling std, std(per-image loss) / sqrt(B): the
            resolution of one step's loss; over a window of n steps the mean's standard
            error is noise / sqrt(n) (`se`).

Within bf16 noise, per window of steps: the bf16 run's mean |loss - f32 loss| against
`noise`, its mean loss - f32 mean loss against `se`, and both against the control's.

Rounding bound of the objective at one state. bfloat16 keeps 8 significant bits, unit
roundoff u = 2^-8 (`U_BF16`; a rounding's relative error is at most u, RMS u / sqrt(3)).
One evaluation of F (the U-Net output) in bf16 takes R roundings of a bf16 result on its
way (`bf16_roundings`, counted on the traced program: an overcount of any one path);
magnitude-preserving layers carry a relative error at its size, so the errors add as a
random walk: RMS(dF) <= eps RMS(F) per image, `eps = u sqrt(R / 3)` (`forward_tol`). The
objective `mean_b sum_p [r^2 exp(-lv) + lv]`, `r = F - target`, moves by
`sum_bp g_bp dF_bp / B + sum_bp dF_bp^2 exp(-lv_b) / B` with `g = 2 r exp(-lv)`. The
rounded weights are the same for every pixel and image, so dF is coherent over them (not
a random walk over pixels), and Cauchy-Schwarz is the bound:

    |dobjective| <= (eps |g| |F| + eps^2 sum_b exp(-lv_b) |F_b|^2) / B    (`rounding`)

with |.| the L2 norm over the batch. From one state on, the two runs' weights differ too
(the gradients and updates are rounded): during the learning-rate ramp-up that adds less
than the rounding at the state, later it grows with the chaos.

Sampler. `sampler.sample_images(raw=True)` per seed with the f32 and the bf16 network on
the same weights (the f32 run's last), and the per-image RMS and max difference in [-1, 1]
units and uint8 levels. Bound (per image, RMS over pixels): the Heun sampler integrates
dx/dt = (x - D) / t from t = sigma_max down to 0; a change dD of the denoiser changes its
solution by d(dx)/dt = ((I - J) dx - dD) / t, J = dD/dx = Cov[y | x] / t^2. Where the
posterior of the clean image is log-concave (Brascamp-Lieb) J <= I, the flow does not
expand differences as t decreases, and |dx(0)| <= int |dD(t)| dt / t; discretely, Heun
step i weighs its two evaluations by (t_i - t_i+1) / (2 t_i) and (t_i - t_i+1) / (2 t_i+1)
(its correction only lowers the first where t_i / t_i+1 <= 3: on the EDM schedule, for
N >= 22 steps), the last, Euler, step by 1 (`heun_weights`). With dD = c_out dF,
RMS(dF) <= eps RMS(F):

    RMS(x_bf16 - x_f32) <= eps sum_k w_k c_out(t_k) RMS(F_k)          (`rms_bound`)

about eps sigma_data asinh(sigma_max / sigma_data) = 2.9 eps for RMS(F) = 1. The late
steps add little (c_out -> t) but carry what the earlier ones added (J -> I), the steps at
sigma >> sigma_data add the most and the flow contracts them (J -> 0), so the sum is an
upper bound. A seed whose posterior is split between modes (J > I: a trajectory at a
decision boundary) can flip to another image; such seeds are outliers of the distribution
over seeds, not of rounding. The largest of P pixel differences of RMS s stays below
sqrt(2 ln 2P) s if they are Gaussian (`max_bound`; a model: the differences follow the
image's edges), and uint8 levels (x 127.5, truncated) differ by at most
ceil(127.5 max|dx|) (`u8_bound`).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

if __name__ == "__main__":  # first: the host allocator and CPU devices of edm2_jax.main
    from edm2_jax import process
    process.setup_entry_point()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import load_config  # noqa: E402

from edm2_jax import data  # noqa: E402
from edm2_jax.model import loss as loss_lib  # noqa: E402
from edm2_jax.analysis import precision  # noqa: E402
from edm2_jax.model.mp import force_normalize  # noqa: E402
from edm2_jax.model.networks import precond_coefficients  # noqa: E402
from edm2_jax.sampling import sampler as sampler_lib  # noqa: E402
from edm2_jax.sampling import solvers  # noqa: E402
from edm2_jax.sampling import schedule
from edm2_jax.sampling import seeds as seeds_lib
from edm2_jax.training import optim as optim_lib  # noqa: E402
from edm2_jax.training import sharding as shard_lib  # noqa: E402
from edm2_jax.training import state as state_lib  # noqa: E402
from edm2_jax.training import step as step_lib  # noqa: E402

U_BF16 = 2.0 ** -8  # bfloat16 unit roundoff: 8 significant bits (ml_dtypes eps 2^-7 / 2)

# Primitives whose bfloat16 result is exact (moves, selects, sign): not a rounding.
EXACT_PRIMITIVES = frozenset((
    "reshape", "broadcast_in_dim", "transpose", "slice", "squeeze", "expand_dims",
    "concatenate", "pad", "select_n", "max", "min", "neg", "abs", "copy", "copy_p",
    "dynamic_slice", "dynamic_update_slice", "gather", "rev", "sign", "stop_gradient"))


# ---------------------------------------------------------------------------------------
# Error analysis.

def bf16_roundings(net, variables) -> int:
    """R: equations of `net`'s traced forward pass that round to a bfloat16 result
    (arithmetic, convolutions, matmuls, float32 -> bfloat16 casts); moves and selects
    (`EXACT_PRIMITIVES`) and the call wrappers around nested programs do not count. All
    of the program's, so more than any one path from input to output takes."""
    r = net.img_resolution
    x = jax.ShapeDtypeStruct((1, r, r, net.img_channels), jnp.float32)
    sigma = jax.ShapeDtypeStruct((1,), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, net.label_dim), jnp.float32) if net.label_dim else None
    jaxpr = jax.make_jaxpr(lambda v, x, s, l: net.apply(v, x, s, l))(
        jax.eval_shape(lambda: variables), x, sigma, labels)
    count = 0

    def walk(jp):
        nonlocal count
        for eqn in jp.eqns:
            subs = list(precision.sub_jaxprs(eqn.params))
            for sub in subs:
                walk(sub)
            if subs or eqn.primitive.name in EXACT_PRIMITIVES:
                continue
            if not any(str(v.aval.dtype) == "bfloat16" for v in eqn.outvars):
                continue
            if (eqn.primitive.name == "convert_element_type"
                    and str(eqn.invars[0].aval.dtype) == "bfloat16"):
                continue
            count += 1

    walk(jaxpr.jaxpr)
    return count


def forward_tol(n_roundings: int) -> float:
    """eps = u sqrt(R / 3): RMS relative error of a bfloat16 evaluation of F against the
    float32 one, for R roundings of RMS u / sqrt(3) each adding as a random walk (module
    docstring). 0 for R = 0 (a float32 network)."""
    return U_BF16 * math.sqrt(n_roundings / 3)


def heun_weights(t_steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The noise levels `t_k` of the sampler's 2N - 1 denoiser evaluations and the weight
    `w_k` of each in the result: Heun step i from t_i to t_i+1 > 0 evaluates D at t_i and
    at t_i+1 with coefficients (t_i - t_i+1) / (2 t_i) and (t_i - t_i+1) / (2 t_i+1); the
    last step (to t_N = 0) is Euler, coefficient 1. Heun's correction changes the first
    coefficient by a factor in [2 - t_i / t_i+1, 1]: these bound the sampler's where
    t_i / t_i+1 <= 3 (`max_step_ratio`). `t_steps`: `edm_sigma_steps`, [N + 1]."""
    t = np.asarray(t_steps, np.float64)
    ts, ws = [], []
    for i in range(len(t) - 2):
        h = t[i] - t[i + 1]
        ts += [t[i], t[i + 1]]
        ws += [h / (2 * t[i]), h / (2 * t[i + 1])]
    ts.append(t[-2])
    ws.append(1.0)
    return np.asarray(ts), np.asarray(ws)


# ---------------------------------------------------------------------------------------
# Training: batches, runs, probes.

def max_step_ratio(t_steps: np.ndarray) -> float:
    """The largest t_i / t_i+1 over the Heun steps (all but the last, to t_N = 0)."""
    t = np.asarray(t_steps, np.float64)
    return float(np.max(t[:-2] / t[1:-1]))


def make_batches(config, steps: int, seed: int = 0) -> tuple[list[dict], str]:
    """`steps` batches of `config` (`{'image': f32 [B, H, W, C] in [-1, 1], 'label':
    f32 one-hot [B, L]}`) from `data.make_iterator` over `config.data`'s source, or, where
    that is not installed, from a fixed synthetic set (pixels uniform in [-1, 1], random
    classes). Returns `(batches, description)`."""
    batch = int(config.batch_size)
    try:
        source = data.make_source(config.data)
    except FileNotFoundError as e:
        print(f"note: {e}; training on a fixed synthetic set", file=sys.stderr)
        rng = np.random.default_rng(seed)
        c = config.network
        r, ch, L = c.img_resolution, c.img_channels, c.label_dim
        return [{"image": rng.uniform(-1, 1, (batch, r, r, ch)).astype(np.float32),
                 "label": np.eye(L, dtype=np.float32)[rng.integers(0, L, batch)]}
                for _ in range(steps)], "synthetic"
    it = data.make_iterator(source, global_batch=batch, seed=seed, num_workers=0)
    return [next(it) for _ in range(steps)], data.describe(source)


def with_dtype(config, dtype: str):
    """A copy of `config` with `network.dtype = dtype`."""
    c = copy.deepcopy(config)
    c.network.dtype = dtype
    return c


def initial_state(config, seed: int = 0) -> dict:
    """The train state `state.init_train_state` gives `config`, on the host."""
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, int(config.batch_size))
    return jax.device_get(state_lib.init_train_state(config, net, tx, jax.random.PRNGKey(seed)))


def round_unet_to_bf16(state: dict) -> dict:
    """`state` with every parameter outside `precision.FLOAT32_LAYERS` rounded to bfloat16
    and back (round to nearest even): the weights a bf16 network computes with."""
    def rnd(path, leaf):
        if any(getattr(k, "key", None) in precision.FLOAT32_LAYERS for k in path):
            return leaf
        return np.asarray(jnp.asarray(leaf).astype(jnp.bfloat16).astype(jnp.float32))
    return dict(state, params=jax.tree_util.tree_map_with_path(rnd, state["params"]))


def make_probe(config):
    """`probe(state, batch) -> dict` at a state before its step, with the step's own noise
    levels and noise (drawn from `state['rng']` as `step.make_train_step` draws them):
    `objective` (float32 network), `tf` (the bf16 network's objective at the same
    weights), `noise` (std of the per-image loss / sqrt(B)), `rounding` (the bound on the
    change of the objective that bf16 rounding of F at relative RMS `eps` can make, module
    docstring) and `eps` (`forward_tol` of the bf16 network)."""
    lc = config.loss
    net32 = state_lib.make_network(with_dtype(config, "float32"))
    net16 = state_lib.make_network(with_dtype(config, "bfloat16"))
    batch_size = int(config.batch_size)
    eps = None

    @jax.jit
    def measure(state, batch):
        images, labels = batch["image"], batch["label"] if net32.label_dim else None
        _, k_sigma, k_noise, k_drop = jax.random.split(state["rng"], 4)
        rnd = jax.random.normal(k_sigma, (batch_size,), jnp.float32)
        noise = jax.random.normal(k_noise, images.shape, jnp.float32)
        params = force_normalize(state["params"])
        tf, _ = loss_lib.edm2_loss(params, state["buffers"], net16, images, labels,
                                   P_mean=lc.P_mean, P_std=lc.P_std, sigma_data=config.network.sigma_data,
                                   train=True, rnd_normal=rnd, noise_unit=noise,
                                   dropout_rng=k_drop)
        sigma = jnp.exp(rnd * lc.P_std + lc.P_mean)
        x = images + noise * sigma[:, None, None, None]
        D, lv = net32.apply({"params": params, "buffers": state["buffers"]}, x, sigma, labels,
                            train=True, return_logvar=True, rngs={"dropout": k_drop})
        per_image = jnp.sum(loss_lib.uncertainty_loss(D, images, sigma, lv, config.network.sigma_data),
                            axis=(1, 2, 3))
        c_skip, c_out, _, _ = precond_coefficients(sigma, config.network.sigma_data, 4)
        F = (D - c_skip * x) / c_out
        r = (D - images) / c_out
        inv_var = jnp.exp(-lv)
        g = 2 * r * inv_var[:, None, None, None]
        F2 = jnp.sum(jnp.square(F), axis=(1, 2, 3))  # |F_b|^2
        return {"objective": jnp.mean(per_image), "tf": tf,
                "noise": jnp.std(per_image) / math.sqrt(batch_size),
                "first": jnp.sqrt(jnp.sum(jnp.square(g)) * jnp.sum(F2)) / batch_size,
                "second": jnp.sum(inv_var * F2) / batch_size}

    def probe(state, batch):
        nonlocal eps
        if eps is None:
            eps = forward_tol(bf16_roundings(net16, {"params": state["params"],
                                                     "buffers": state["buffers"]}))
        out = {k: float(v) for k, v in measure(state, batch).items()}
        out["rounding"] = eps * out.pop("first") + eps ** 2 * out.pop("second")
        out["eps"] = eps
        return out

    return probe


def train(config, state: dict, batches: list[dict], probe=None, probe_every: int = 10):
    """Run the jitted training step of `config` from `state` over `batches`, one step each,
    on a data-parallel mesh of all devices. Returns `(curve, final_state, probes)`: `curve`
    a dict of per-step float64 arrays of the step's metrics (`objective`,
    `loss/weighted_mse`, ...), `final_state` on the host, `probes` a list of
    `(step, probe(state, batch))` before every `probe_every`-th step when `probe` is given."""
    mesh = shard_lib.make_mesh(None)
    batch_size = int(config.batch_size)
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch_size)
    num_accum = step_lib.num_micro_batches(config, mesh.size)
    step_fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, num_accum), mesh)
    # The step donates its state: give it a copy, never the caller's (host) arrays.
    state = jax.device_put(jax.tree.map(np.array, state), shard_lib.replicated(mesh))
    curve: dict[str, list[float]] = {}
    probes = []
    for k, batch in enumerate(batches):
        batch = shard_lib.global_batch(mesh, batch)
        if probe is not None and k % probe_every == 0:
            probes.append((k, probe(state, batch)))
        state, metrics = step_fn(state, batch)
        for name, value in jax.device_get(metrics).items():
            curve.setdefault(name, []).append(float(value))
    return {k: np.asarray(v) for k, v in curve.items()}, jax.device_get(state), probes


def windows(steps: int, n: int = 4) -> list[tuple[int, int]]:
    """`n` equal windows of `range(steps)`, e.g. 200 -> (0, 50) ... (150, 200)."""
    edges = np.linspace(0, steps, n + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def loss_summary(f32: dict, bf16: dict, control: dict, probes: list) -> list[dict]:
    """Per window: the mean objective of each run, the mean |bf16 - f32| and |control -
    f32| of the objective (absolute: the objective crosses zero, its logvar term is
    signed) and of the weighted MSE (relative: positive), the mean signed differences,
    the mean probe scales and `se`, the standard error of the window's mean objective."""
    steps = len(f32["objective"])
    rows = []
    for a, b in windows(steps):
        sl = slice(a, b)
        o32, o16, oc = (c["objective"][sl] for c in (f32, bf16, control))
        m32, m16, mc = (c["loss/weighted_mse"][sl] for c in (f32, bf16, control))
        ps = [p for k, p in probes if a <= k < b]
        rows.append({
            "steps": f"{a}-{b}", "f32": float(o32.mean()), "bf16": float(o16.mean()),
            "control": float(oc.mean()),
            "bf16_abs_diff": float(np.abs(o16 - o32).mean()),
            "control_abs_diff": float(np.abs(oc - o32).mean()),
            "bf16_mean_diff": float((o16 - o32).mean()),
            "control_mean_diff": float((oc - o32).mean()),
            "bf16_rel_diff_wmse": float((np.abs(m16 - m32) / m32).mean()),
            "control_rel_diff_wmse": float((np.abs(mc - m32) / m32).mean()),
            "noise": float(np.mean([p["noise"] for p in ps])) if ps else math.nan,
            "se": (float(np.mean([p["noise"] for p in ps])) / math.sqrt(b - a)
                   if ps else math.nan),
            "rounding": float(np.mean([p["rounding"] for p in ps])) if ps else math.nan,
            "tf_abs_diff": (float(np.mean([abs(p["tf"] - p["objective"]) for p in ps]))
                            if ps else math.nan)})
    return rows


# ---------------------------------------------------------------------------------------
# Sampling.

def sampler_comparison(config, variables: dict, seeds, num_steps: int = 32) -> dict:
    """The f32 and bf16 networks of `config` on the same `variables`, sampled per seed
    (`sampler.sample_images`, deterministic Heun, random class per seed). Returns per-seed
    arrays: `rms`, `max` (|x_bf16 - x_f32| in [-1, 1] units), `u8_max`, `u8_frac` (largest
    uint8 level difference, fraction of pixels that differ), the a-priori bounds
    `rms_bound`, `max_bound`, `u8_bound` (module docstring) and `injected` (the sum of
    `rms_bound` with the measured RMS(D_bf16 - D_f32) at the f32 trajectory's points in
    place of eps c_out RMS(F)), and scalars `eps` (`forward_tol`), `eps_measured`
    (largest RMS(dF) / RMS(F) over the evaluations and seeds), `roundings` (R),
    `max_step_ratio` (<= 3 for the bound to hold) and `trajectory_rms_err` (this loop's
    f32 images against the sampler's)."""
    net32 = state_lib.make_network(with_dtype(config, "float32"))
    net16 = state_lib.make_network(with_dtype(config, "bfloat16"))
    seeds = np.asarray(seeds)
    heun = solvers.Heun(num_steps)
    x32 = np.asarray(sampler_lib.sample_images(net32, variables, seeds, sampler=heun, raw=True),
                     np.float64)
    x16 = np.asarray(sampler_lib.sample_images(net16, variables, seeds, sampler=heun, raw=True),
                     np.float64)
    u32 = np.asarray(sampler_lib.decode_uint8(x32), np.int32)
    u16 = np.asarray(sampler_lib.decode_uint8(x16), np.int32)
    axes = (1, 2, 3)
    diff = x16 - x32
    roundings = bf16_roundings(net16, variables)
    eps = forward_tol(roundings)

    # The injected errors along the f32 trajectory (the schedule and Heun steps of
    # `solvers.edm_sampler`, float32 on the device).
    t_steps = schedule.edm_sigma_steps(num_steps)
    shape = (net32.img_resolution, net32.img_resolution, net32.img_channels)
    labels = seeds_lib.random_labels(seeds, net32.label_dim) if net32.label_dim else None

    @jax.jit
    def evaluate(x, t):
        sigma = jnp.full((x.shape[0],), t, jnp.float32)
        D32 = net32.apply(variables, x, sigma, labels)
        D16 = net16.apply(variables, x, sigma, labels)
        c_skip, c_out, _, _ = precond_coefficients(sigma, net32.sigma_data, 4)
        F = (D32 - c_skip * x) / c_out
        rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a), axis=(1, 2, 3)))  # noqa: E731
        return D32, rms(F), rms(D16 - D32), rms((D16 - D32) / c_out)

    ts, ws = heun_weights(t_steps)
    bound = np.zeros(len(seeds))
    injected = np.zeros(len(seeds))
    eps_measured = 0.0
    k = 0

    def record(x, t):
        nonlocal k, eps_measured
        D, *rms = evaluate(x, jnp.float32(t))
        rms_F, rms_dD, rms_dF = (np.asarray(a, np.float64) for a in rms)
        c_out = t * net32.sigma_data / math.sqrt(t * t + net32.sigma_data ** 2)
        bound[:] += ws[k] * eps * c_out * rms_F
        injected[:] += ws[k] * rms_dD
        eps_measured = max(eps_measured, float(np.max(rms_dF / rms_F)))
        k += 1
        return D

    x = seeds_lib.seed_noise(seeds, shape) * float(t_steps[0])
    for i in range(num_steps):
        t_cur, t_next = float(t_steps[i]), float(t_steps[i + 1])
        d = (x - record(x, t_cur)) / t_cur
        x_next = x + (t_next - t_cur) * d
        if i < num_steps - 1:
            d2 = (x_next - record(x_next, t_next)) / t_next
            x_next = x + (t_next - t_cur) * (0.5 * d + 0.5 * d2)
        x = x_next
    max_bound = math.sqrt(2 * math.log(2 * math.prod(shape))) * bound
    return {"seeds": seeds, "rms": np.sqrt(np.mean(diff ** 2, axis=axes)),
            "max": np.abs(diff).max(axis=axes), "u8_max": np.abs(u16 - u32).max(axis=axes),
            "u8_frac": (u16 != u32).mean(axis=axes), "rms_bound": bound, "max_bound": max_bound,
            "u8_bound": np.ceil(127.5 * max_bound), "injected": injected,
            "eps": eps, "eps_measured": eps_measured, "roundings": roundings,
            "max_step_ratio": max_step_ratio(t_steps),
            "trajectory_rms_err": float(np.sqrt(np.mean((np.asarray(x, np.float64) - x32) ** 2)))}


def sampler_summary(s: dict) -> dict:
    """The distribution over seeds of `sampler_comparison`'s per-seed figures."""
    out = {"seeds": len(s["seeds"]), "eps": s["eps"], "eps_measured": s["eps_measured"],
           "max_step_ratio": s["max_step_ratio"],
           "roundings": s["roundings"], "trajectory_rms_err": s["trajectory_rms_err"],
           "seeds_over_bound": int(np.sum((s["rms"] > s["rms_bound"]) | (s["max"] > s["max_bound"])
                                          | (s["u8_max"] > s["u8_bound"])))}
    for key in ("rms", "max", "u8_max", "u8_frac", "injected", "rms_bound", "max_bound",
                "u8_bound"):
        v = np.asarray(s[key], np.float64)
        out[key] = {"min": float(v.min()), "median": float(np.median(v)),
                    "p90": float(np.quantile(v, 0.9)), "max": float(v.max())}
    return out


# ---------------------------------------------------------------------------------------
# Report.

def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(result: dict) -> str:
    """The markdown report of `main`'s `result`."""
    f32, bf16, ctrl = (result["curves"][k]["objective"] for k in ("f32", "bf16", "control"))
    every = max(1, len(f32) // 20)
    parts = [f"# bf16 against float32: {result['config']}, {result['data']}, "
             f"batch {result['batch_size']}, {len(f32)} steps, {result['device']}",
             "", "## Objective every %d steps" % every, "",
             table(["step", "f32", "bf16", "control", "bf16-f32", "control-f32"],
                   [[k, f32[k], bf16[k], ctrl[k], bf16[k] - f32[k], ctrl[k] - f32[k]]
                    for k in range(0, len(f32), every)]),
             "", "## Windows: means over the steps (noise = std(per-image loss)/sqrt(B) "
                 "at the f32 state, se = noise/sqrt(steps), rounding = the bound on what "
                 "bf16 rounding does to the objective at one state, tf = what it does)", "",
             table(["steps", "f32", "bf16", "control", "|bf16-f32|", "|control-f32|",
                    "bf16-f32", "control-f32", "rel wmse bf16", "rel wmse control",
                    "noise", "se", "rounding", "tf"],
                   [[w["steps"], w["f32"], w["bf16"], w["control"], w["bf16_abs_diff"],
                     w["control_abs_diff"], w["bf16_mean_diff"], w["control_mean_diff"],
                     w["bf16_rel_diff_wmse"], w["control_rel_diff_wmse"], w["noise"],
                     w["se"], w["rounding"], w["tf_abs_diff"]] for w in result["windows"]])]
    s = result["sampler"]
    parts += ["", f"## Sampler: {s['seeds']} seeds, Heun {result['sample_steps']} steps, "
                  f"the f32 run's final weights", "",
              f"R = {s['roundings']} bf16 roundings per evaluation, eps = u sqrt(R/3) = "
              f"{s['eps']:.4f} (measured RMS(dF)/RMS(F), worst evaluation: "
              f"{s['eps_measured']:.4f}); largest t_i/t_i+1 {s['max_step_ratio']:.2f} "
              f"(<= 3 for the bound); seeds over a bound: {s['seeds_over_bound']}; "
              f"RMS of this script's Heun loop against the sampler's f32 images: "
              f"{s['trajectory_rms_err']:.2g}",
              "", table(["per seed", "min", "median", "p90", "max"],
                        [[k] + [s[k][q] for q in ("min", "median", "p90", "max")]
                         for k in ("rms", "max", "u8_max", "u8_frac", "injected",
                                   "rms_bound", "max_bound", "u8_bound")])]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/fashion_mnist.py",
                    help="config file[:variant], as for edm2_jax.main")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--probe_every", type=int, default=10,
                    help="measure noise and rounding scales every this many steps")
    ap.add_argument("--seeds", type=int, default=64, help="images per sampler")
    ap.add_argument("--sample_steps", type=int, default=32, help="Heun steps N (2N-1 evals)")
    ap.add_argument("--seed", type=int, default=0, help="initial state and data order")
    ap.add_argument("--out", default="", help="write the result as JSON here and the "
                                               "report next to it (.md)")
    args = ap.parse_args()
    if args.steps < 1 or args.seeds < 1 or args.sample_steps < 2 or args.probe_every < 1:
        ap.error("--steps, --seeds, --probe_every must be >= 1 and --sample_steps >= 2")

    t0 = time.perf_counter()
    config = with_dtype(load_config(args.config), "float32")
    batches, described = make_batches(config, args.steps, args.seed)
    state0 = initial_state(config, args.seed)
    curves, probes = {}, []
    curves["f32"], final32, probes = train(config, state0, batches, make_probe(config),
                                           args.probe_every)
    curves["bf16"], _, _ = train(with_dtype(config, "bfloat16"), state0, batches)
    curves["control"], _, _ = train(config, round_unet_to_bf16(state0), batches)
    variables = {"params": final32["params"], "buffers": final32["buffers"]}
    sampler = sampler_comparison(config, variables, np.arange(args.seeds), args.sample_steps)
    dev = jax.devices()[0]
    result = {
        "config": args.config, "data": described, "batch_size": int(config.batch_size),
        "device": f"{len(jax.devices())}x{dev.platform}:{dev.device_kind}",
        "sample_steps": args.sample_steps, "wall_s": time.perf_counter() - t0,
        "curves": {k: {m: v.tolist() for m, v in c.items()} for k, c in curves.items()},
        "probes": [dict(p, step=k) for k, p in probes],
        "windows": loss_summary(curves["f32"], curves["bf16"], curves["control"], probes),
        "sampler": sampler_summary(sampler),
        "sampler_per_seed": {k: np.asarray(sampler[k]).tolist() for k in
                             ("seeds", "rms", "max", "u8_max", "u8_frac", "injected",
                              "rms_bound", "max_bound", "u8_bound")}}
    text = report(result)
    print(text)
    print(f"wall {result['wall_s']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
