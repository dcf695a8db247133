"""A command that cannot succeed ends at once with one `error:` line naming the problem and
the fix: exit status 1, nothing else on stderr (no traceback, no usage), before anything is
compiled or sampled, and every file that existed before is byte-identical after.

Each case runs `python -m edm2_jax.main ...` in a subprocess. Disks that refuse writes are
real: a read-only and a full tmpfs (`mount`, which needs root; those cases are skipped
without it). No network: gcsfs is pointed at a closed loopback port; a missing gcsfs is a
`gcsfs` package on PYTHONPATH whose import fails.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = f"--config={ROOT}/configs/fashion_mnist.py:tiny"
DINOV2_URL = "dinov2_vitl14_pretrain.pth"
NET = dict(img_resolution=8, img_channels=1, label_dim=3, model_channels=8, channel_mult=(1,),
           num_blocks=1, attn_resolutions=())


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, EDM2_JAX_COMPILATION_CACHE="off", **(env or {}))
    return subprocess.run([sys.executable, "-m", "edm2_jax.main", *args], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=120)


def tree(root: Path) -> dict[str, str]:
    """`{relative path: sha256}` of every file under `root`."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def assert_one_error(r: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-4000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


class Tmpfs:
    """tmpfs mounts under a test's directory (root only), unmounted at the end."""

    def __init__(self, base: Path):
        self.base, self.mounts = base, []

    def mount(self, name: str, size: str = "1m") -> Path:
        d = self.base / name
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
        self.mounts.append(d)
        return d

    def read_only(self, d: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)

    def fill(self, d: Path, leave: int = 0) -> None:
        """Fill the disk of `d`, leaving about `leave` bytes free."""
        free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize - leave
        with open(d / "filler", "wb") as f:
            try:
                while free > 0:
                    n = f.write(b"\0" * min(free, 1 << 16))
                    free -= n
                    f.flush()
            except OSError:  # full already
                pass

    def close(self) -> None:
        for d in reversed(self.mounts):
            subprocess.run(["umount", str(d)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    t = Tmpfs(tmp_path)
    yield t
    t.close()


@pytest.fixture(scope="module")
def netdir(tmp_path_factory):
    """A tiny network checkpoint (`--net`)."""
    import jax

    from edm2_jax.model.networks import init_variables, precond_from_config
    from edm2_jax.run import network_dir
    v = init_variables(precond_from_config(NET), jax.random.PRNGKey(0))
    return network_dir.save_network(str(tmp_path_factory.mktemp("net") / "n"), v, NET)


def fake_run(d: Path, checkpoint_bytes: int = 0) -> Path:
    """A run directory: config.json and, with `checkpoint_bytes`, a checkpoint 1 of that size."""
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    if checkpoint_bytes:
        c = d / "checkpoints" / "1"
        c.mkdir(parents=True)
        (c / "_CHECKPOINT_METADATA").write_text("{}")
        (c / "data").write_bytes(b"\1" * checkpoint_bytes)
    return d


def no_network() -> dict:
    """gcsfs pointed at a closed loopback port: the bucket cannot be reached."""
    return {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1", "NO_GCE_CHECK": "True",
            "GCE_METADATA_HOST": "127.0.0.1:1", "GCE_METADATA_IP": "127.0.0.1:1",
            "EDM2_JAX_GCS_PROBE_TIMEOUT_S": "20"}


def without_gcsfs(tmp_path: Path) -> dict:
    shim = tmp_path / "shim" / "gcsfs"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'gcsfs'\", name='gcsfs')\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(ROOT)])}


def needs_gcsfs():
    if importlib.util.find_spec("gcsfs") is None:
        pytest.skip("gcsfs is not installed (the gcs extra)")


# ---------------------------------------------------------------------------------------
# Each case: a setup (tmp_path, tmpfs, netdir) -> (args, env, words of the line, root)


def read_only_run(mode):
    def setup(tmp_path, tmpfs, netdir):
        d = tmpfs.mount("ro")
        fake_run(d / "run", checkpoint_bytes=1000)
        tmpfs.read_only(d)
        args = [TINY] if mode == "train" else ["--mode=phema"]
        return [*args, f"--workdir={d}/run"], {}, ["read-only", str(d)], d
    return setup


def full_disk_fresh(tmp_path, tmpfs, netdir):
    d = tmpfs.mount("full")
    tmpfs.fill(d)
    return [TINY, f"--workdir={d}/run"], {}, ["is full", "0 B free", str(d), "another disk"], d


def full_disk_rerun(tmp_path, tmpfs, netdir):
    d = tmpfs.mount("full", size="2m")
    fake_run(d / "run", checkpoint_bytes=600_000)
    tmpfs.fill(d, leave=200_000)
    return ([TINY, f"--workdir={d}/run"], {},
            ["no room for the next checkpoint", "free of 2.0 MiB", "checkpoints/1"], d)


def corrupt_dinov2(suffix):
    def setup(tmp_path, tmpfs, netdir):
        (tmp_path / "imgs").mkdir()
        import numpy as np
        import PIL.Image
        for i in range(2):
            PIL.Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / f"imgs/{i}.png")
        bad = tmp_path / f"bad{suffix}"
        bad.write_bytes(os.urandom(5000))
        return (["--mode=ref", "--metrics=fd_dinov2", f"--dinov2={bad}",
                 f"--images={tmp_path}/imgs", f"--ref={tmp_path}/out.pkl"], {},
                [str(bad), "corrupt or not a DINOv2 checkpoint", DINOV2_URL], tmp_path)
    return setup


def gcs_unreachable(mode):
    def setup(tmp_path, tmpfs, netdir):
        needs_gcsfs()
        args = {"train": [TINY, "--workdir=gs://edm2-cli-test/run"],
                "phema": ["--mode=phema", "--workdir=gs://edm2-cli-test/run"],
                "generate": ["--mode=generate", f"--net={netdir}",
                             "--outdir=gs://edm2-cli-test/out"]}[mode]
        return args, no_network(), ["cannot reach the bucket gs://edm2-cli-test", "network",
                                    "credentials"], tmp_path
    return setup


def gcs_without_gcsfs(mode):
    def setup(tmp_path, tmpfs, netdir):
        args = [TINY] if mode == "train" else ["--mode=phema"]
        return ([*args, "--workdir=gs://edm2-cli-test/run"], without_gcsfs(tmp_path),
                ["needs gcsfs", "pip install -e '.[gcs]'"], tmp_path)
    return setup


def unknown_variant(tmp_path, tmpfs, netdir):
    return ([f"--config={ROOT}/configs/fashion_mnist.py:zzz", f"--workdir={tmp_path}/run"], {},
            ["fashion_mnist.py:zzz", "unknown variant 'zzz'", "'default' or 'tiny'"], tmp_path)


def unknown_field(tmp_path, tmpfs, netdir):
    return ([TINY, f"--workdir={tmp_path}/run", "--config.total_kimgg=1"], {},
            ["unknown config field 'total_kimgg'", 'Did you mean "total_kimg"'], tmp_path)


def unknown_dtype(tmp_path, tmpfs, netdir):
    return ([TINY, f"--workdir={tmp_path}/run", "--config.network.dtype=float64"], {},
            ["--config.network.dtype='float64'", "one of auto, float32, bfloat16, float16"],
            tmp_path)


def no_workdir(tmp_path, tmpfs, netdir):
    return [TINY], {}, ["needs --workdir=DIR"], tmp_path


def existing_file(flag):
    def setup(tmp_path, tmpfs, netdir):
        f = tmp_path / "a_file"
        f.write_text("keep me")
        args = {"--workdir": [TINY, f"--workdir={f}"],
                "--outdir": ["--mode=generate", f"--net={netdir}", f"--outdir={f}"],
                "--outdir/sub": ["--mode=generate", f"--net={netdir}", f"--outdir={f}/sub"],
                "--phema-outdir": ["--mode=phema", f"--workdir={fake_run(tmp_path / 'run')}",
                                   f"--outdir={f}"]}[flag]
        words = [str(f), "is a file"] + (["pass a directory"] if "sub" not in flag else [])
        return args, {}, words, tmp_path
    return setup


def output_is_directory(flag):
    def setup(tmp_path, tmpfs, netdir):
        d = tmp_path / "a_dir"
        d.mkdir()
        (d / "x").write_text("keep me")
        args = {"--grid": ["--mode=generate", f"--net={netdir}", f"--grid={d}"],
                "--dst": ["--mode=export", f"--net={netdir}", f"--dst={d}"],
                "--out_json": ["--mode=eval", f"--net={netdir}", f"--out_json={d}"]}[flag]
        return args, {}, [f"{flag}={d} is a directory", "path of a file"], tmp_path
    return setup


def generate_read_only(tmp_path, tmpfs, netdir):
    d = tmpfs.mount("ro")
    (d / "old.png").write_bytes(b"png")
    tmpfs.read_only(d)
    return (["--mode=generate", f"--net={netdir}", f"--outdir={d}/out", "--seeds=0-3"], {},
            ["--outdir", "read-only", "writable disk"], d)


def bad_ref(kind):
    """An `--ref` .npz whose statistics are no mean and covariance, or of features of
    another size than the metric's: refused as it is read, before the network is loaded
    or any image generated."""
    def setup(tmp_path, tmpfs, netdir):
        import numpy as np
        d = 100 if kind == "dim100" else 2048
        sigma = {"not_psd": -np.eye(d), "asymmetric": np.eye(d) + np.triu(np.ones((d, d)), 1),
                 "nan": np.full((d, d), np.nan), "dim100": np.eye(d)}[kind]
        bad = tmp_path / "ref.npz"
        np.savez(bad, mu=np.zeros(d), sigma=sigma)
        words = {"not_psd": "not positive semi-definite", "asymmetric": "not symmetric",
                 "nan": "NaN or Inf",
                 "dim100": "100-dimensional features, but fid measures the 2048"}[kind]
        return (["--mode=eval", f"--net={netdir}", "--metrics=fid", f"--ref={bad}",
                 "--num_images=10", f"--out_json={tmp_path}/eval.json"], {},
                [str(bad), words], tmp_path)
    return setup


def zero_steps(mode):
    """`--steps=0` is refused before any network is read or anything computed (eval
    trained its classifier first; generate printed 'Generating ... (-1 evaluations)')."""
    def setup(tmp_path, tmpfs, netdir):
        args = {"generate": ["--mode=generate", f"--net={netdir}", "--seeds=0-1",
                             f"--outdir={tmp_path}/out"],
                "eval": ["--mode=eval", f"--net={netdir}", "--metrics=cls", "--num_images=4",
                         f"--out_json={tmp_path}/eval.json"]}[mode]
        return ([*args, "--steps=0"], {}, ["--steps=0", "out of range, sampler steps"],
                tmp_path)
    return setup


def bad_network(field, value, words):
    """A network field that builds no network: refused by `configs.validate`, before the
    workdir is made (it was a 50-line traceback after train.lock)."""
    def setup(tmp_path, tmpfs, netdir):
        return ([TINY, f"--workdir={tmp_path}/run", f"--config.network.{field}={value}"], {},
                [f"--config.network.{field}={value}", *words], tmp_path)
    return setup


def non_finite(mode, flag, value):
    """A float flag or config value that is NaN or infinite, refused before any work in
    every mode (`--guidance=nan` gave black images, and eval a `"guidance": NaN` line
    that is not JSON)."""
    def setup(tmp_path, tmpfs, netdir):
        args = {"generate": ["--mode=generate", f"--net={netdir}", "--seeds=0-1",
                             f"--outdir={tmp_path}/out"],
                "eval": ["--mode=eval", f"--net={netdir}", "--metrics=cls", "--num_images=4",
                         f"--out_json={tmp_path}/eval.json"],
                "phema": ["--mode=phema", f"--workdir={fake_run(tmp_path / 'run')}"],
                "train": [TINY, f"--workdir={tmp_path}/run"]}[mode]
        return [*args, f"--{flag}={value}"], {}, [f"--{flag}={value}", "finite" if mode !=
                                                  "phema" else "EMA widths"], tmp_path
    return setup


def tpu_outside_plan(tmp_path, tmpfs, netdir):
    return (["--mode=generate", f"--net={netdir}", f"--outdir={tmp_path}/out", "--tpu=v5p-8"],
            {}, ["--tpu is a flag of --mode=plan", "--mode=generate"], tmp_path)


CASES = {
    "config_model_channels_zero": bad_network("model_channels", "0", ["positive"]),
    "config_channel_mult_empty": bad_network("channel_mult", "()", ["one positive multiplier"]),
    "config_dropout_above_1": bad_network("dropout", "1.5", ["[0, 1)"]),
    "config_nan": non_finite("train", "config.loss.P_std", "nan"),
    "generate_guidance_nan": non_finite("generate", "guidance", "nan"),
    "generate_guidance_inf": non_finite("generate", "guidance", "inf"),
    "eval_guidance_nan": non_finite("eval", "guidance", "nan"),
    "phema_sigma_rel_nan": non_finite("phema", "sigma_rel", "nan"),
    "tpu_outside_plan": tpu_outside_plan,
    "generate_steps_zero": zero_steps("generate"),
    "eval_steps_zero": zero_steps("eval"),
    "eval_ref_not_psd": bad_ref("not_psd"),
    "eval_ref_asymmetric": bad_ref("asymmetric"),
    "eval_ref_nan": bad_ref("nan"),
    "eval_ref_of_other_features": bad_ref("dim100"),
    "train_read_only_workdir": read_only_run("train"),
    "phema_read_only_workdir": read_only_run("phema"),
    "train_full_disk_fresh": full_disk_fresh,
    "train_full_disk_rerun": full_disk_rerun,
    "dinov2_corrupt_pth": corrupt_dinov2(".pth"),
    "dinov2_corrupt_safetensors": corrupt_dinov2(".safetensors"),
    "train_gcs_unreachable": gcs_unreachable("train"),
    "phema_gcs_unreachable": gcs_unreachable("phema"),
    "generate_outdir_gcs_unreachable": gcs_unreachable("generate"),
    "train_gcs_without_gcsfs": gcs_without_gcsfs("train"),
    "phema_gcs_without_gcsfs": gcs_without_gcsfs("phema"),
    "config_unknown_variant": unknown_variant,
    "config_unknown_field": unknown_field,
    "config_unknown_dtype": unknown_dtype,
    "no_workdir": no_workdir,
    "workdir_is_a_file": existing_file("--workdir"),
    "generate_outdir_is_a_file": existing_file("--outdir"),
    "generate_outdir_under_a_file": existing_file("--outdir/sub"),
    "phema_outdir_is_a_file": existing_file("--phema-outdir"),
    "generate_grid_is_a_directory": output_is_directory("--grid"),
    "export_dst_is_a_directory": output_is_directory("--dst"),
    "eval_out_json_is_a_directory": output_is_directory("--out_json"),
    "generate_outdir_read_only": generate_read_only,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_refused_with_one_line_before_any_work(case, tmp_path, tmpfs, netdir):
    args, env, words, root = CASES[case](tmp_path, tmpfs, netdir)
    before = tree(root)
    r = run_cli(*args, env=env)
    line = assert_one_error(r, *words)
    assert "Traceback" not in r.stderr and "needs torch" not in line
    assert "First step done" not in r.stdout and "Generating" not in r.stdout  # no work
    assert tree(root) == before


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_refused_start_leaves_no_workdir_behind(tmp_path):
    """A start refused after the run's lock is taken (the data folder is not there) removes
    what it made and nothing else: a new workdir, and the new folders above it, are gone;
    an existing empty workdir stays empty; a run's files are byte-identical, with no
    train.lock added."""
    missing = ["--config.data.source=folder", f"--config.data.path={tmp_path}/no_data"]
    r = run_cli(TINY, f"--workdir={tmp_path}/new/run", *missing)
    assert_one_error(r, "no_data")
    assert not (tmp_path / "new").exists()

    (tmp_path / "empty").mkdir()
    assert_one_error(run_cli(TINY, f"--workdir={tmp_path}/empty", *missing), "no_data")
    assert list((tmp_path / "empty").iterdir()) == []

    run = fake_run(tmp_path / "run", checkpoint_bytes=1000)
    before = tree(run)
    assert_one_error(run_cli(TINY, f"--workdir={run}", *missing), "no_data")
    assert tree(run) == before


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_help_names_the_modes_and_how_to_list_a_modes_flags():
    """`--help` (and `-h`) exits 0 with a short page: every mode and how to list a mode's
    flags; `--mode=generate --help` lists generate's flags, not plan's."""
    from edm2_jax.main import MODES
    for flag in ("--help", "-h"):
        r = run_cli(flag)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        lines = r.stdout.strip().splitlines()
        assert len(lines) <= 25, r.stdout
        assert all(any(ln.strip().startswith(m + " ") for ln in lines) for m in MODES), r.stdout
        assert "--mode=MODE --help" in r.stdout
    r = run_cli("--mode=generate", "--help")
    assert r.returncode == 0 and "--guidance" in r.stdout and "--tpu" not in r.stdout, r.stdout


def test_unretrieved_future_errors_of_a_failed_save_are_quiet():
    """The futures of a failed asynchronous save, collected at exit with their exception
    unread, print nothing once the entry point has quieted background errors."""
    code = ("import asyncio, gc\n"
            "from edm2_jax import process_exit\n"
            "process_exit.quiet_background_errors()\n"
            "async def fail():\n"
            "    raise OSError(28, 'No space left on device')\n"
            "async def save():\n"
            "    asyncio.gather(fail())  # never awaited, as a failed save leaves it\n"
            "    await asyncio.sleep(0.01)\n"
            "asyncio.run(save())\n"
            "gc.collect()\n"
            "print('done')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    assert "never retrieved" not in r.stderr and r.stderr.strip() == "", r.stderr
