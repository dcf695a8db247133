"""The recipe of docs/architecture.md ("Your own objective and sampler"), executed: an
objective defined in a module of its own (`tests/objective_plain.py`, the EDM2 loss
without its uncertainty term) and registered in one line runs through training, resume,
post-hoc EMA, generation and the TPU plan, with no file of the package edited."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import nets, objectives
from edm2_jax.model import loss as loss_lib
from edm2_jax.sampling import solvers
from tests import objective_plain
from tests.test_tpu_compile import libtpu  # noqa: F401  (a fixture: TPU compiles here)
from tests.test_train import _restore, make_image_folder, tiny_config
from tests.test_train import xla_cache  # noqa: F401  (a fixture: the runs share compiles)


def test_a_registered_objective_is_picked_by_its_name_and_checked():
    """`config.objective` picks the registered class; a taken name or an unknown one is
    refused naming the choices; its loss is `lambda(sigma) (D - y)^2` evaluated by hand."""
    c = tiny_config("/nowhere", objective="edm_plain")
    obj = objectives.check_config(c)
    assert isinstance(obj, objective_plain.PlainEDM)
    assert obj.sampler(8) == solvers.Heun(8) and obj.flops_per_image(1.0) == 3
    assert obj.start() is None and obj.init_state({}) == {} and obj.trained == ()
    with pytest.raises(ValueError, match="taken by PlainEDM"):
        objectives.register(type("Other", (objectives.Objective,), {"name": "edm_plain"}))
    with pytest.raises(ValueError, match="'nothing'.*edm_plain"):
        objectives.from_config(dict(objective="nothing"))

    class Identity:      # D(x; sigma) = x / 2: the loss in closed form
        label_dim = 0

        @staticmethod
        def apply(variables, x, sigma, labels, train=False, rngs=None):
            return 0.5 * x

    y = jnp.full((2, 1, 1, 1), 0.4)
    draws = {"rnd_normal": jnp.array([0.0, 1.0]), "noise_unit": jnp.array([1.0, -1.0]).reshape(2, 1, 1, 1)}
    value, aux = obj.loss({}, {}, Identity, {}, y, None, draws=draws, dropout_rng=None,
                          batch_size=2)
    sigma = np.exp(np.array([0.0, 1.0]) * c.loss.P_std + c.loss.P_mean)
    x = 0.4 + np.array([1.0, -1.0]) * sigma
    want = np.asarray(loss_lib.loss_weight(sigma, 0.5)) * (0.5 * x - 0.4) ** 2
    np.testing.assert_allclose(value, want.sum() / 2, rtol=1e-6)
    np.testing.assert_allclose(aux["loss"], want.mean(), rtol=1e-6)


# Slow (~60 s on 2 cores): two tiny runs, a post-hoc EMA, images and a TPU compile.
@pytest.mark.slow
@pytest.mark.ci
def test_the_objective_trains_resumes_reconstructs_generates_and_plans(tmp_path, xla_cache,
                                                                       libtpu):
    from edm2_jax.planner import plan, tpu_slices
    from edm2_jax.ema import reconstruction
    from edm2_jax.modes.generate import main_generate
    from edm2_jax.training import loop
    from edm2_jax.training import state as state_lib
    data = make_image_folder(tmp_path / "data")
    over = {"objective": "edm_plain"}
    full, half = tmp_path / "full", tmp_path / "half"
    assert loop.train_and_evaluate(tiny_config(data, **over), str(full))["finished"]
    loop.train_and_evaluate(tiny_config(data, total_kimg=0.016, **over), str(half))
    assert loop.train_and_evaluate(tiny_config(data, **over), str(half))["finished"]
    (sa, a), (sb, b) = _restore(full), _restore(half)
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)
    # Its loss, not EDM2's, was trained: the uncertainty head got no gradient, so its
    # Adam moments are still exactly zero, and every other weight's are not.
    mu = {jax.tree_util.keystr(k): x for k, x in
          jax.tree_util.tree_leaves_with_path(a["opt_state"]) if "mu" in jax.tree_util.keystr(k)}
    head = [x for k, x in mu.items() if "logvar_linear" in k]
    unet = [x for k, x in mu.items() if "'unet'" in k and np.ndim(x) >= 2]
    assert len(head) == 1 and not np.any(head[0])
    assert unet and all(np.any(x) for x in unet)
    # A resume with another objective is refused: it is another run.
    with pytest.raises(ValueError, match="objective: checkpoint 'edm_plain' vs now 'edm2'"):
        loop.train_and_evaluate(tiny_config(data), str(full))
    # Post-hoc EMA and generation: sampled with its objective's sampler (the Heun one).
    out, = reconstruction.reconstruct(str(full), [0.07], out_dir=str(tmp_path / "phema"),
                               progress=False)
    assert nets.net_sampler(out) == nets.net_sampler(str(full)) == solvers.Heun(32)
    main_generate(out, "0-3", str(tmp_path / "png"), sampler=solvers.Heun(2))
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        f"{i:06d}.png" for i in range(4)]
    # The plan: compiled for a TPU slice, its flops the objective's own count.
    config = plan.tpu_config(tiny_config(data, **over))
    p = plan.plan_run(config, plan.open_topology(tpu_slices.parse_slice("v5e-4")),
                      sample_batch=0, log=lambda _: None)
    net = state_lib.make_network(config)   # the config's own network: the plan reads no data
    per_chip = int(config.batch_size) // 4
    assert p.step.flops == pytest.approx(3 * plan.forward_flops(net, 1) * per_chip)
