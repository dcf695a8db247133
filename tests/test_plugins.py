"""The door from outside: an objective and a sampler defined in a module outside the
package (`tests/plugin_rectified_flow.py`, rectified flow with an Euler sampler), never
installed with it, run through the command line in every mode, found again from what
the run and its networks recorded; and a network naming a module the user did not allow
is refused without importing it (`edm2_jax/plugins.py`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import PIL.Image
import pytest

from edm2_jax import nets, objectives, plugins
from edm2_jax.model.networks import Precond, init_variables
from edm2_jax.run import network_dir
from edm2_jax.sampling import sampler as sampler_lib
from edm2_jax.sampling import solvers
from tests.test_train import TINY_OVERRIDES, make_image_folder

REPO = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).with_name("plugin_rectified_flow.py")


def _module_dir(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / "modules"
    d.mkdir(exist_ok=True)
    (d / f"{name}.py").write_text(text)
    return d


def _tiny_network(path: Path, meta: dict) -> str:
    net = Precond(img_resolution=8, img_channels=1, label_dim=0, model_channels=8,
                  channel_mult=(1,), num_blocks=1, attn_resolutions=(), logvar_channels=8)
    variables = init_variables(net, jax.random.PRNGKey(0))
    cfg = dict(img_resolution=8, img_channels=1, label_dim=0, model_channels=8,
               channel_mult=[1], num_blocks=1, attn_resolutions=[], logvar_channels=8)
    return network_dir.save_network(str(path), variables, cfg, meta)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_network_naming_a_module_not_allowed_is_refused_importing_nothing(tmp_path,
                                                                             monkeypatch):
    """A stranger's network.json naming an objective of module `payload_mod` (which
    would write a file on import): `nets.net_sampler` raises PluginNotAllowedError, one
    line naming the module and how to allow it; the module is not imported. Once the user
    allows it (`plugins.allow`, what --plugins does), it is imported and found."""
    marker = tmp_path / "imported"
    code = (f"open({str(marker)!r}, 'w').write('ran')\n"
            "from edm2_jax import objectives\n"
            "class Payload(objectives.Objective):\n    name = 'payload_objective'\n"
            "objectives.register(Payload)\n")
    monkeypatch.syspath_prepend(str(_module_dir(tmp_path, "payload_mod", code)))
    net = _tiny_network(tmp_path / "net", {"objective": "payload_objective",
                                          "plugins": ["payload_mod"]})
    with pytest.raises(plugins.PluginNotAllowedError) as e:
        nets.net_sampler(net)
    message = str(e.value)
    assert "\n" not in message and "payload_mod" in message
    assert "--plugins=payload_mod" in message and plugins.ENV_VAR in message
    assert not marker.exists() and "payload_mod" not in sys.modules
    # A module name that is not one (a path, an attribute) is refused as such.
    bad = _tiny_network(tmp_path / "bad", {"objective": "x", "plugins": ["../evil"]})
    with pytest.raises(ValueError, match="not a Python module name"):
        nets.net_sampler(bad)
    monkeypatch.setattr(plugins, "_allowed", {"payload_mod"})
    try:
        assert nets.net_sampler(net) == solvers.Heun(32)
        assert marker.read_text() == "ran"
    finally:
        objectives.REGISTRY.pop("payload_objective", None)
        sys.modules.pop("payload_mod", None)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_the_command_line_refuses_a_stranger_network_in_one_line(tmp_path):
    """The same refusal from `--mode=generate`: exit 1, one `error:` line, no traceback,
    and the module's code never ran."""
    marker = tmp_path / "imported"
    mods = _module_dir(tmp_path, "payload_mod", f"open({str(marker)!r}, 'w').write('ran')\n")
    net = _tiny_network(tmp_path / "net", {"objective": "payload_objective",
                                          "plugins": ["payload_mod"]})
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{mods}{os.pathsep}{REPO}")
    env.pop(plugins.ENV_VAR, None)
    r = subprocess.run([sys.executable, "-m", "edm2_jax.main", "--mode=generate",
                        f"--net={net}", "--seeds=0", f"--outdir={tmp_path / 'png'}"],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "payload_mod" in errors[0] and "--plugins" in errors[0]
    assert "Traceback" not in r.stderr and not marker.exists()


def test_sampler_registry_and_interface():
    """A sampler is a registered `solvers.Sampler` dataclass with its capabilities stated
    apart; `sample_images` takes any such value and refuses others; the registry refuses
    a taken name and a class that is not a Sampler."""
    assert solvers.SAMPLERS["heun"] is solvers.Heun
    assert solvers.Heun.takes_churn and solvers.Heun.takes_guidance_interval
    assert not solvers.FewStep.takes_churn and not solvers.FewStep.takes_guidance_interval
    assert solvers.FewStep.release_draws and not solvers.Sampler.release_draws
    assert solvers.from_settings(solvers.Heun(3, rho=5.0).settings()) == solvers.Heun(3, rho=5.0)
    with pytest.raises(ValueError, match="taken by Heun"):
        solvers.register(type("Other", (solvers.Heun,), {"name": "heun"}))
    with pytest.raises(ValueError, match="frozen dataclass subclass"):
        solvers.register(object)
    with pytest.raises(ValueError, match="sampler value"):
        sampler_lib.sample_images(None, None, [0], sampler="heun")
    with pytest.raises(ValueError, match="has no setting sigma_maxx"):
        solvers.from_settings({"sampler": "heun", "sigma_maxx": 1.0})


def _run(argv, env, timeout=900):
    r = subprocess.run([sys.executable, "-m", "edm2_jax.main", *argv], env=env,
                       capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


# Slow (~3 min on 2 cores): seven processes, each compiling its programs.
@pytest.mark.slow
@pytest.mark.ci
def test_an_outside_objective_and_sampler_run_through_every_mode(tmp_path, xla_cache,
                                                                  libtpu):
    """Rectified flow with its Euler sampler, from a module on PYTHONPATH allowed by
    `EDM2_JAX_PLUGINS`: train, resume, phema, generate (`--sampler=rf_euler`), eval and
    plan through the command line, the modes after training without `--config`. The
    run records the module (config.json, network.json); a flag the Euler sampler does
    not take is refused in one line; the images are the sampler's (a different step
    count gives other images, the same one the same)."""
    mods = tmp_path / "modules"
    mods.mkdir()
    shutil.copy(PLUGIN, mods / "rf_plugin.py")
    data = make_image_folder(tmp_path / "data", n=160)  # the classifier's batch is 128
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{mods}{os.pathsep}{REPO}",
               JAX_COMPILATION_CACHE_DIR=xla_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **{plugins.ENV_VAR: "rf_plugin"})
    env["EDM2_JAX_CACHE"] = str(tmp_path / "cache")
    run = tmp_path / "run"
    overrides = {**TINY_OVERRIDES, "data.path": str(data), "objective": "rectified_flow"}
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    config = "--config=configs/fashion_mnist.py:tiny"
    r = _run([config, f"--workdir={run}", *flags, "--config.total_kimg=0.016"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run([config, f"--workdir={run}", *flags], env)                   # resume
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Resum" in r.stdout + r.stderr
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["objective"] == "rectified_flow" and recorded["plugins"] == ["rf_plugin"]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir())[-1] == 4

    out = tmp_path / "phema"
    r = _run(["--mode=phema", f"--workdir={run}", "--sigma_rel=0.07", f"--outdir={out}"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    net, = [p for p in out.iterdir() if (p / "network.json").exists()]
    meta = json.loads((net / "network.json").read_text())["meta"]
    assert meta["objective"] == "rectified_flow" and meta["plugins"] == ["rf_plugin"]

    def generate(steps, outdir, *extra):
        return _run(["--mode=generate", f"--net={net}", "--seeds=0-1", f"--outdir={outdir}",
                     "--sampler=rf_euler", f"--steps={steps}", *extra], env)

    r = generate(3, tmp_path / "png3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rf_euler sampler, 3 steps" in r.stdout
    r = generate(2, tmp_path / "png2", "--sampler_opts=t_max=1.0")
    assert r.returncode == 0, r.stderr[-3000:]
    read = lambda d: np.stack([np.asarray(PIL.Image.open(d / f"00000{i}.png")) for i in (0, 1)])
    assert np.abs(read(tmp_path / "png3").astype(int) - read(tmp_path / "png2")).max() > 0
    r = generate(2, tmp_path / "refused", "--sigma_max=10")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1
    assert "--sigma_max=10" in errors[0] and "rf_euler" in errors[0]
    assert not (tmp_path / "refused").exists()

    r = _run(["--mode=eval", f"--net={run}", "--metrics=cls", "--num_images=8", "--batch=8",
              "--steps=2", f"--out_json={tmp_path / 'eval.jsonl'}"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(row["fd_cls"]) and row["num_steps"] == 2

    r = _run(["--mode=plan", f"--workdir={run}", "--tpu=v5e-4", "--sample_batch=0"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TFLOP" in r.stdout or "flops" in r.stdout.lower()


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))


from tests.test_tpu_compile import libtpu  # noqa: E402,F401  (a fixture: TPU compiles here)
