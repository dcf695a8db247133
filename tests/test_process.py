"""edm2_jax.process: the XLA flags, allocator and CPU-device settings the entry points
set up (re-executing themselves where needed).

The settings are pure functions of the environment, checked here case by case; one
subprocess checks the re-exec itself (same PID, same arguments, the settings seen by
the new process and by JAX). That a step over 2 devices equals the 1-device step up to
float32 summation order is tests/test_fsdp.py's (8 devices)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from edm2_jax import process as CE

GLIBC_LINUX = sys.platform == "linux" and CE._glibc_linux()


@pytest.fixture
def no_tcmalloc(monkeypatch):
    monkeypatch.setattr(CE.ctypes.util, "find_library", lambda name: None)


@pytest.fixture
def fake_tcmalloc(monkeypatch):
    monkeypatch.setattr(CE.ctypes.util, "find_library",
                        lambda name: "libtcmalloc_minimal.so.4" if name == CE.TCMALLOC else None)


def test_device_count_auto_is_two_where_two_cores_are_usable():
    assert CE.cpu_devices({}, cores=1) == 1
    assert CE.cpu_devices({}, cores=2) == 2
    assert CE.cpu_devices({}, cores=64) == 2
    assert CE.cpu_devices({CE.DEVICES_ENV: "off"}, cores=64) == 1
    assert CE.cpu_devices({CE.DEVICES_ENV: "3"}, cores=2) == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match=CE.DEVICES_ENV):
            CE.cpu_devices({CE.DEVICES_ENV: bad})


@pytest.mark.skipif(not GLIBC_LINUX, reason="the allocator settings are for Linux with glibc")
def test_launch_env_adds_tcmalloc_where_installed(fake_tcmalloc):
    add = CE.launch_env({"LD_PRELOAD": "libfoo.so"}, cores=2)
    assert add["LD_PRELOAD"] == "libfoo.so:libtcmalloc_minimal.so.4"
    assert int(add["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert add["XLA_FLAGS"] == f"{CE.DEVICE_COUNT_FLAG}=2" and add[CE.DEVICES_SET] == "2"
    # Already in effect (a re-executed process, or the user's own LD_PRELOAD): unchanged.
    assert "LD_PRELOAD" not in CE.launch_env({"LD_PRELOAD": add["LD_PRELOAD"]}, cores=2)


@pytest.mark.skipif(not GLIBC_LINUX, reason="the allocator settings are for Linux with glibc")
def test_launch_env_falls_back_to_glibc_huge_pages(no_tcmalloc):
    add = CE.launch_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, cores=1)
    assert add == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"}
    assert CE.launch_env({CE.MALLOC_ENV: "thp"}, cores=1) == {"GLIBC_TUNABLES": CE.THP_TUNABLE}
    with pytest.raises(FileNotFoundError, match="apt-get install libtcmalloc-minimal4"):
        CE.launch_env({CE.MALLOC_ENV: "tcmalloc"}, cores=1)
    with pytest.raises(ValueError, match=CE.MALLOC_ENV):
        CE.launch_env({CE.MALLOC_ENV: "jemalloc"}, cores=1)


@pytest.mark.skipif(not GLIBC_LINUX, reason="the allocator settings are for Linux with glibc")
def test_posthoc_ema_runs_under_the_allocator_that_holds_least(fake_tcmalloc, tmp_path):
    """`--mode=phema` peaks at 16.7 parameter copies under tcmalloc and 9.0 under glibc
    with 2 arenas (`benchmarks/phema_memory.py`): `auto` gives it the latter, every other
    mode tcmalloc; a user's choice stands. The re-executed entry point runs under it."""
    phema = ["-m", "edm2_jax.main", "--mode=phema", "--workdir=w"]
    assert CE.launch_env({}, cores=1, argv=phema) == {"GLIBC_TUNABLES": CE.ARENA_TUNABLE}
    assert CE.launch_env({}, cores=1, argv=["-m", "edm2_jax.main", "--mode", "phema"]) == {
        "GLIBC_TUNABLES": CE.ARENA_TUNABLE}
    for other in (["-m", "edm2_jax.main", "--workdir=w"], ["--mode=phema_sweep"],
                  ["--mode=generate"]):
        assert "LD_PRELOAD" in CE.launch_env({}, cores=1, argv=other), other
    assert "LD_PRELOAD" in CE.launch_env({CE.MALLOC_ENV: "tcmalloc"}, cores=1, argv=phema)
    assert CE.launch_env({CE.MALLOC_ENV: "off"}, cores=1, argv=phema) == {}
    assert CE.malloc_in_effect({"GLIBC_TUNABLES": CE.ARENA_TUNABLE}) == "arena"
    script = tmp_path / "probe.py"
    script.write_text("import os\nfrom edm2_jax import process\nprocess.reexec()\n"
                      "print(process.malloc_in_effect(), os.environ.get('LD_PRELOAD'))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", CE.MALLOC_ENV, CE.APPLIED)}
    out = subprocess.run([sys.executable, str(script), "--mode=phema"], env=env, text=True,
                         capture_output=True, timeout=120, check=True).stdout
    assert out.split() == ["arena", "None"], out


def test_launch_env_leaves_a_users_device_count_and_off_switches_alone(fake_tcmalloc):
    flags = "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"
    assert CE.launch_env({CE.MALLOC_ENV: "off", "XLA_FLAGS": flags}, cores=2) == {}
    assert CE.launch_env({CE.MALLOC_ENV: "off", CE.DEVICES_ENV: "off"}, cores=2) == {}
    add = CE.launch_env({CE.MALLOC_ENV: "off", "XLA_FLAGS": "--xla_cpu_foo=1"}, cores=4)
    assert add["XLA_FLAGS"] == f"--xla_cpu_foo=1 {CE.DEVICE_COUNT_FLAG}=2"


def test_default_xla_flags_add_the_ynn_fusion_unless_set_or_switched_off(monkeypatch):
    monkeypatch.setattr(CE, "_jaxlib_version", lambda: (0, 10, 2))
    assert CE.default_xla_flags({}) == {"XLA_FLAGS": CE.YNN_FLAG}
    assert CE.default_xla_flags({"XLA_FLAGS": "--xla_cpu_foo=1"}) == {
        "XLA_FLAGS": f"--xla_cpu_foo=1 {CE.YNN_FLAG}"}
    assert CE.default_xla_flags({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="}) == {}
    assert CE.default_xla_flags({CE.XLA_DEFAULTS_ENV: "0"}) == {}
    monkeypatch.setattr(CE, "_jaxlib_version", lambda: (0, 10, 1))  # does not know the flag
    assert CE.default_xla_flags({}) == {}


def test_usable_devices_only_shrinks_the_split_the_entry_point_chose(monkeypatch):
    def fits(d):
        return 33 % d == 0 if batch == 33 else 64 % d == 0
    monkeypatch.setenv(CE.DEVICES_SET, "2")
    batch = 64
    assert CE.usable_devices(batch, 2, fits) == 2
    batch = 33
    assert CE.usable_devices(batch, 2, fits) == 1
    # The user's own device count (not the entry point's): all devices, the step then says why
    # the batch does not split.
    monkeypatch.delenv(CE.DEVICES_SET)
    assert CE.usable_devices(batch, 2, fits) == 2
    monkeypatch.setenv(CE.DEVICES_SET, "4")
    assert CE.usable_devices(batch, 8, fits) == 8


@pytest.mark.skipif(not GLIBC_LINUX, reason="the re-exec is for Linux with glibc")
def test_reexec_keeps_pid_and_arguments_and_jax_sees_the_devices(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from edm2_jax import process
        process.reexec()
        import jax
        print(os.getpid(), os.environ.get(process.APPLIED), os.environ.get("GLIBC_TUNABLES"),
              jax.device_count(), jax.default_backend(), "|".join(sys.argv[1:]))
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "LD_PRELOAD", "GLIBC_TUNABLES", CE.APPLIED, CE.DEVICES_SET)}
    env.update({CE.MALLOC_ENV: "thp", CE.DEVICES_ENV: "2", "JAX_PLATFORMS": "cpu"})
    proc = subprocess.Popen([sys.executable, str(script), "a b", "--x=1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    pid, applied, tunables, n_dev, backend, args = out.strip().split(" ", 5)
    assert int(pid) == proc.pid  # exec, not a child process
    assert applied == "1" and CE.THP_TUNABLE in tunables
    assert (int(n_dev), backend) == (2, "cpu")
    assert args == "a b|--x=1"


def test_ynn_fusion_flag_and_several_cpu_devices_never_combine(monkeypatch):
    """The YNN fusion flag with the batch split over several CPU devices gives wrong
    rows (tests/test_sampling_devices.py): the defaults pick one or the other."""
    monkeypatch.setattr(CE, "_jaxlib_version", lambda: (0, 10, 2))
    # The flag is left out where XLA_FLAGS or EDM2_JAX_CPU_DEVICES ask for devices.
    assert CE.default_xla_flags({"XLA_FLAGS": f"{CE.DEVICE_COUNT_FLAG}=2"}) == {}
    assert CE.default_xla_flags({CE.DEVICES_ENV: "2"}) == {}
    assert CE.default_xla_flags({CE.DEVICES_ENV: "1"}) == {"XLA_FLAGS": CE.YNN_FLAG}
    assert CE.default_xla_flags({CE.DEVICES_ENV: "auto"}) == {"XLA_FLAGS": CE.YNN_FLAG}
    # With the flag in effect, auto devices is one; without it, two.
    assert CE.cpu_devices({"XLA_FLAGS": CE.YNN_FLAG}, cores=2) == 1
    assert CE.cpu_devices({"XLA_FLAGS": ""}, cores=2) == 2
    assert "XLA_FLAGS" not in CE.launch_env({"XLA_FLAGS": CE.YNN_FLAG, CE.MALLOC_ENV: "off"},
                                            cores=2)
    env = {CE.XLA_DEFAULTS_ENV: "0", CE.MALLOC_ENV: "off", "XLA_FLAGS": ""}
    assert CE.launch_env(env, cores=2)["XLA_FLAGS"] == f"{CE.DEVICE_COUNT_FLAG}=2"
    # A user's XLA_FLAGS holding both are warned about, in one line.
    both = {"XLA_FLAGS": f"{CE.YNN_FLAG} {CE.DEVICE_COUNT_FLAG}=2"}
    line = CE.ynn_with_devices_warning(both)
    assert line.startswith("warning:") and "\n" not in line
    assert CE.ynn_with_devices_warning({"XLA_FLAGS": CE.YNN_FLAG}) is None


def test_sampling_modes_split_the_cpu_instead_of_the_ynn_flag():
    train = ["-m", "edm2_jax.main", "--config=c.py", "--workdir=w"]
    assert CE.ynn_for_command(train, {})
    assert CE.ynn_for_command([*train, "--mode=train"], {})
    assert not CE.ynn_for_command(["-m", "edm2_jax.main", "--mode=generate", "--net=n"], {})
    assert not CE.ynn_for_command(["-m", "edm2_jax.main", "--mode", "eval"], {})
    # A user's own setting of either switch decides as for any mode.
    assert CE.ynn_for_command(["--mode=generate"], {CE.XLA_DEFAULTS_ENV: "1"})
    assert CE.ynn_for_command(["--mode=generate"], {CE.DEVICES_ENV: "off"})


@pytest.mark.skipif(not GLIBC_LINUX, reason="the re-exec is for Linux with glibc")
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_training_start_prints_its_first_line_once_before_importing_jax(tmp_path):
    """`python -m edm2_jax.main` (re-executing itself for the allocator) prints the
    start line once, in the re-executed process, before JAX is imported (`-X importtime`
    writes each import as it completes; the flag survives the re-exec)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "LD_PRELOAD", "GLIBC_TUNABLES", CE.APPLIED, CE.DEVICES_SET)}
    env.update({CE.MALLOC_ENV: "thp", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "edm2_jax.main",
                        "--config=configs/fashion_mnist.py:tiny", f"--workdir={tmp_path}/run",
                        "--config.no_such_field=1"], cwd=root, env=env, timeout=300,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = r.stdout.splitlines()
    start = f"edm2-jax train (configs/fashion_mnist.py:tiny, {tmp_path}/run): importing JAX..."
    assert lines.count(start) == 1, r.stdout[-3000:]
    jax_import = next(i for i, x in enumerate(lines)
                      if re.fullmatch(r"import time:.*\|\s+jax(\.\S+)?\s*", x))
    assert lines.index(start) < jax_import
    assert r.returncode == 1 and "error: unknown config field no_such_field" in r.stdout


def test_the_start_line_is_for_training_only():
    from edm2_jax.main import start_line
    assert start_line(["--config=c.py:tiny", "--workdir=w"]) == \
        "edm2-jax train (c.py:tiny, w): importing JAX..."
    assert start_line(["--mode", "train", "--workdir", "w"]) == \
        "edm2-jax train (w): importing JAX..."
    for argv in (["--mode=eval", "--net=n"], ["--mode", "generate"], ["--helpfull"], ["-h"]):
        assert start_line(argv) is None, argv
