"""Launch scripts: they check their inputs, print what they would run with --dry-run, and
pass shellcheck (when it is installed)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["launch/single_gpu.sh", "launch/slurm.sbatch", "launch/tpu_pod.sh"]


def run(*args, env=None):
    extra = env or {}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM") and k != "EDM2_JAX_COMPILATION_CACHE"}
    env.update(extra)
    # `python` is this interpreter (the dry-run reads the config's network.dtype with it).
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    r = subprocess.run(["shellcheck", "-x", *SCRIPTS, "launch/common.sh", "launch/ablation_fmnist.sh"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_dry_run_prints_the_command():
    r = run("launch/single_gpu.sh", "--config=configs/img64.py:xs", "--workdir=runs/x", "--dry-run",
            "--", "--config.batch_per_device=32")
    assert r.returncode == 0, r.stderr
    assert "python -m edm2_jax.main --config=configs/img64.py:xs --workdir=runs/x --config.batch_per_device=32" in r.stdout
    r = run("launch/slurm.sbatch", "--config=configs/img512.py:xl", "--workdir=/lustre/x", "--dry-run")
    assert r.returncode == 0 and "srun --kill-on-bad-exit=1 python -m edm2_jax.main" in r.stdout
    r = run("launch/tpu_pod.sh", "--tpu=pod", "--zone=us-east5-a", "--config=configs/img64.py:m",
            "--workdir=gs://b/r", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "gcloud compute tpus tpu-vm ssh pod --zone=us-east5-a --worker=all" in r.stdout
    # The install step, on every worker, before the training command.
    lines = [line.replace("\\", "") for line in r.stdout.splitlines()]  # printf %q escapes
    scp = next(i for i, line in enumerate(lines) if "tpu-vm scp" in line)
    pip = next(i for i, line in enumerate(lines) if "pip install" in line)
    train = next(i for i, line in enumerate(lines) if "edm2_jax.main" in line)
    assert "git archive --format=tar.gz" in lines[scp - 1] and "--worker=all" in lines[scp]
    assert "'jax[tpu]'" in lines[pip] and "-e ./edm2-jax" in lines[pip] and "--worker=all" in lines[pip]
    assert "edm2-jax'[gcs]'" in lines[pip]  # gcsfs for the gs:// workdir (paths.py)
    assert scp < pip < train
    r = run("launch/tpu_pod.sh", "--tpu=pod", "--zone=z", "--config=configs/img64.py:m",
            "--workdir=gs://b/r", "--dry-run", "--skip-install")
    assert r.returncode == 0 and "pip install" not in r.stdout and "edm2_jax.main" in r.stdout


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_dry_run_prints_the_compute_dtype():
    """The presets' 'auto' (bfloat16 on GPU/TPU), an explicit override, Fashion-MNIST's
    float32; each line before the command."""
    auto = "network.dtype: auto (bfloat16 on GPU/TPU, float32 on CPU"
    r = run("launch/single_gpu.sh", "--config=configs/img64.py:xs", "--workdir=runs/x", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(auto), r.stdout
    r = run("launch/single_gpu.sh", "--config=configs/img64.py:xs", "--workdir=runs/x", "--dry-run",
            "--", "--config.network.dtype=float32")
    assert r.stdout.splitlines()[0] == "network.dtype: float32", r.stdout
    r = run("launch/slurm.sbatch", "--config=configs/fashion_mnist.py", "--workdir=/lustre/x",
            "--dry-run")
    assert "network.dtype: float32\ncompilation cache: ~/.cache/edm2_jax/xla on each node (" in r.stdout, r.stdout
    assert "(a resumed run compiles in seconds; EDM2_JAX_COMPILATION_CACHE)\n+ srun" in r.stdout
    r = run("launch/tpu_pod.sh", "--tpu=pod", "--zone=z", "--config=configs/img512.py:xl",
            "--workdir=gs://b/r", "--dry-run", "--skip-install")
    assert r.returncode == 0 and auto in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_inputs_are_checked(script):
    tpu = ["--tpu=t", "--zone=z"] if "tpu" in script else []
    r = run(script, "--config=configs/nope.py", "--workdir=w", *tpu, "--dry-run")
    assert r.returncode == 2 and "configs/nope.py not found" in r.stderr
    r = run(script, "--config=configs/img64.py", *tpu, "--dry-run")
    assert r.returncode == 2 and "--workdir is required" in r.stderr
    r = run(script, "--bogus")
    assert r.returncode == 2 and "unknown argument" in r.stderr


@pytest.mark.slow
def test_ablation_script_end_to_end(tmp_path):
    # The whole protocol of docs/ablation.md at smoke size: train with diagnostics, one
    # post-hoc EMA sweep, the best EMA's classifier metrics and FID-N, then the table.
    import json
    import sys
    env = dict(os.environ, KIMG="0.128", BASE="tiny", SWEEP="0.05,0.1", SWEEP_N="20",
               EVAL_N="20", LETTERS="g", RUNS=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", "launch/ablation_fmnist.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "abl0.128-g"
    assert (run / "diagnostics.png").stat().st_size > 0
    (csv_path,) = (run / "phema").glob("sweep-*-fd_cls.csv")
    assert len(csv_path.read_text().strip().splitlines()) == 3  # header + 2 sigma_rels
    ev = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert ev["num_images"] == 20 and "fd_cls" in ev and "fid20" in ev
    r = subprocess.run([sys.executable, "-m", "edm2_jax.analysis.diagnostics", "--compare", str(run)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "(fid20)" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_dry_run_names_the_compilation_cache_and_the_pod_workers_get_it():
    """The persistent XLA cache a run's compiled step is kept in (a resumed run loads it
    in seconds): printed by every launcher's dry run, and the one this shell sets is the
    one the TPU workers use."""
    r = run("launch/single_gpu.sh", "--config=configs/img64.py:xs", "--workdir=runs/x", "--dry-run",
            env={"EDM2_JAX_COMPILATION_CACHE": "/scratch/xla cache"})
    assert "compilation cache: /scratch/xla cache on this host (a resumed run" in r.stdout, r.stdout
    r = run("launch/single_gpu.sh", "--config=configs/img64.py:xs", "--workdir=runs/x", "--dry-run",
            env={"EDM2_JAX_COMPILATION_CACHE": "off"})
    assert "compilation cache: off" in r.stdout, r.stdout
    r = run("launch/tpu_pod.sh", "--tpu=pod", "--zone=z", "--config=configs/img64.py:m",
            "--workdir=gs://b/r", "--dry-run", "--skip-install",
            env={"EDM2_JAX_COMPILATION_CACHE": "/mnt/disk/xla"})
    assert "compilation cache: /mnt/disk/xla on each worker" in r.stdout, r.stdout
    train = next(line for line in r.stdout.splitlines() if "edm2_jax.main" in line)
    assert "EDM2_JAX_COMPILATION_CACHE=/mnt/disk/xla python -m edm2_jax.main" in train.replace("\\", "")
    r = run("launch/tpu_pod.sh", "--tpu=pod", "--zone=z", "--config=configs/img64.py:m",
            "--workdir=gs://b/r", "--dry-run", "--skip-install")
    train = next(line for line in r.stdout.splitlines() if "edm2_jax.main" in line)
    assert "EDM2_JAX_COMPILATION_CACHE" not in train


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_tpu_dry_run_plans_the_run_for_its_slice():
    """With --type, the TPU dry run runs --mode=plan for that slice after the commands
    (a slice name it does not know: one error line, exit status 1); without, it says how."""
    base = ("launch/tpu_pod.sh", "--tpu=pod", "--zone=z", "--config=configs/img512.py:tiny",
            "--workdir=gs://b/r", "--dry-run", "--skip-install")
    r = run(*base)
    assert r.returncode == 0 and "--type=ACCELERATOR_TYPE" in r.stdout
    r = run(*base, "--type=v5p-63")
    assert r.returncode == 1 and "edm2_jax.main" in r.stdout
    assert r.stderr.strip().splitlines() == [
        "error: --tpu=v5p-63: v5p slices count TensorCores, 2 per chip, a power of two of at "
        "least 8, e.g. v5p-16"]
