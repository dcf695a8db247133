"""The cost of the integrity checks (a checksum and finiteness per array,
edm2_jax/run/integrity.py) on a state checkpoint's save and restore, state only, no data
or training:

    python benchmarks/integrity_cost.py --config=configs/fashion_mnist.py --workdir=/tmp/cost
    python benchmarks/integrity_cost.py --config=configs/img64.py:xs --workdir=/tmp/cost \
        --step_time=0

Times, alternately (`--repeats` pairs, medians), the digest alone, a save of the train
state with `checkpoints.TrainCheckpoints` (digest + Orbax) and with Orbax alone, the same
for the restore, and (unless `--step_time=0`) one jitted training step on a random batch
of the config's `batch_size`, against which it reports the digest's share. Prints a JSON
summary (also written to `--json`); the figures are in benchmarks/README.md ("Cost of the
checksums").
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import time
from pathlib import Path

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from ml_collections import config_flags  # noqa: E402, F401 (config files import it)

from edm2_jax import objectives  # noqa: E402
from edm2_jax.run import checkpoints, integrity  # noqa: E402
from edm2_jax.training import setup  # noqa: E402
from edm2_jax.training import state as state_lib  # noqa: E402
from edm2_jax.training import step as step_lib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def integrity_cost(config_arg: str, root: Path, repeats: int, step_time: bool) -> dict:
    """Seconds of the integrity checks on save and restore of `config_arg`'s train
    state (module doc); the medians of `repeats` alternated measurements."""
    path, _, variant = config_arg.partition(":")
    spec = importlib.util.spec_from_file_location("cfg", REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(*([variant] if variant else []))
    model = setup.setup_model(config, setup.Start(objectives.from_config(config)))
    init = jax.jit(lambda r: state_lib.init_train_state(config, model.net, model.tx, r),
                   out_shardings=model.state_sharding)
    state = jax.block_until_ready(init(jax.random.PRNGKey(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    integrity.digest_tree(state)  # compile
    t_digest, t_save, t_save0, t_rest, t_rest0 = [], [], [], [], []
    for i in range(repeats):
        t_digest.append(timed(lambda: integrity.digest_tree(state)))
        for ours in (True, False) if i % 2 == 0 else (False, True):
            d = root / f"cost-{i}-{ours}"
            shutil.rmtree(d, ignore_errors=True)
            if ours:
                def save():
                    m = checkpoints.TrainCheckpoints(str(d), keep=1)
                    m.save_state(1, state)
                    m.close()
                t_save.append(timed(save))
                def restore():
                    m = checkpoints.TrainCheckpoints(str(d), keep=1)
                    jax.block_until_ready(m.restore_latest(model.abstract_state,
                                                           model.state_sharding))
                    m.close()
                t_rest.append(timed(restore))
            else:
                def save0():
                    m = ocp.CheckpointManager(d / "checkpoints", item_handlers=ocp.StandardCheckpointHandler(),
                                              options=ocp.CheckpointManagerOptions(create=True))
                    m.save(1, args=ocp.args.StandardSave(state))
                    m.wait_until_finished()
                    m.close()
                t_save0.append(timed(save0))
                target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      model.abstract_state, model.state_sharding)
                def restore0():
                    m = ocp.CheckpointManager(d / "checkpoints", item_handlers=ocp.StandardCheckpointHandler(),
                                              options=ocp.CheckpointManagerOptions(create=False))
                    jax.block_until_ready(m.restore(1, args=ocp.args.StandardRestore(target)))
                    m.close()
                t_rest0.append(timed(restore0))
            shutil.rmtree(d, ignore_errors=True)
    med = statistics.median
    out = {"config": config_arg, "elements": n, "state_bytes": nbytes,
           "digest_s": med(t_digest), "digest_GBps": nbytes / med(t_digest) / 1e9,
           "save_s": med(t_save), "save_orbax_only_s": med(t_save0),
           "restore_s": med(t_rest), "restore_orbax_only_s": med(t_rest0),
           "repeats": repeats, "backend": jax.default_backend(),
           "devices": jax.device_count()}
    if step_time:
        step = step_lib.jit_train_step(step_lib.make_train_step(config, model.net, model.tx,
                                                                model.num_accum),
                                       model.mesh, model.state_sharding)
        b = int(config.batch_size)
        net = config.network
        batch = {"image": np.random.default_rng(0).uniform(
                     -1, 1, (b, net.img_resolution, net.img_resolution, net.img_channels)
                 ).astype(np.float32),
                 "label": np.eye(max(net.label_dim, 1), dtype=np.float32)[
                     np.arange(b) % max(net.label_dim, 1)][:, :net.label_dim]}
        state, _ = step(state, batch)  # compile
        times = []
        for _ in range(max(3, repeats)):
            t = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
        steps_per_ckpt = max(1, round(float(config.checkpoint_kimg) * 1000 / b))
        out.update(step_s=med(times), steps_per_checkpoint=steps_per_ckpt,
                   digest_pct_of_step=100 * med(t_digest) / med(times),
                   digest_pct_per_step_amortised=100 * med(t_digest) / (med(times) * steps_per_ckpt))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="CONFIG[:variant], a path under the repository")
    ap.add_argument("--workdir", required=True, help="scratch directory for the checkpoints")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per kind")
    ap.add_argument("--step_time", type=int, default=1, help="also time one training step")
    ap.add_argument("--json", default="", help="also write the summary here")
    args = ap.parse_args()
    root = Path(args.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    res = integrity_cost(args.config, root, args.repeats, bool(args.step_time))
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
