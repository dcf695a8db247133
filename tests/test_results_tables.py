"""One source per figure: the tables and marked values of README.md, docs/*.md and
benchmarks/README.md are what docs/make_tables.py writes from docs/results.json, every
entry there names its command and commit, and the quick start's teacher has one fd_cls
in README.md, docs/ and configs/: the `teacher` entry's, written only where it is marked.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tables", REPO / "docs" / "make_tables.py")
make_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tables)


def test_every_entry_names_its_command_and_commit():
    entries = make_tables.load()
    assert {"teacher", "floor", "mcd-4", "dmd-2", "dmd-gan-1", "scm-2"} <= set(entries)
    for name, e in entries.items():
        assert e["command"].startswith("python "), name
        assert e["values"] and all(isinstance(v, str) for v in e["values"].values()), name


def test_the_docs_tables_are_the_results_files():
    assert not make_tables.differences(), (
        "tables or values differ from docs/results.json; run python docs/make_tables.py")


def test_a_changed_figure_changes_every_table_that_quotes_it():
    entries = make_tables.load()
    entries["teacher"]["values"]["fd_cls"] = "9.8765"
    changed = make_tables.differences(entries)
    assert {"README.md", "docs/distillation.md", "docs/evaluation.md",
            "docs/scm.md"} <= set(changed), changed


def test_each_table_has_a_home_and_the_readme_its_headline():
    text = "\n".join(p.read_text() for p in make_tables.doc_files())
    used = set(re.findall(r"<!-- table:([\w-]+) -->", text))
    assert used == set(make_tables.TABLES), used
    readme = (REPO / "README.md").read_text()
    assert "<!-- table:readme-headline -->" in readme
    first = (REPO / "docs" / "distillation.md").read_text().split("\n|", 1)[0]
    assert first.rstrip().endswith("<!-- table:distill-chooser -->"), "the chooser comes first"


def test_the_teachers_fd_cls_is_one_figure_written_from_the_results_file():
    """Outside the marks, neither the teacher's fd_cls nor any other reading of it
    (3 significant digits of one: 5.18, 5.24, 5.25; the classifier of the measuring machine
    read 5.2458 before the weights shipped) is in README.md, docs/ or configs/, and that
    figure is the shipped classifier's."""
    teacher = make_tables.load()["teacher"]
    assert teacher["classifier"] == "shipped"
    fd = teacher["values"]["fd_cls"]
    others = {fd, "5.25", "5.18", "5.24", "5.2455", "5.2458", "5.246"}
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "configs").glob("*.py"))]
    found = []
    for p in files:
        text = make_tables.VALUE.sub("", make_tables.TABLE.sub("", p.read_text()))
        for line in text.splitlines():
            if "teacher" in line.lower() and any(re.search(rf"(?<![\d.]){re.escape(o)}(?!\d)", line)
                                                 for o in others):
                found.append(f"{p.relative_to(REPO)}: {line.strip()[:120]}")
    assert not found, "the teacher's fd_cls outside a results mark:\n" + "\n".join(found)


def test_every_value_mark_is_one_the_script_writes():
    """A `<!--v ENTRY.KEY-->` mark the script's pattern does not read (a key with a dot, a
    missing close) would keep whatever text it holds: each mark opened is one it writes."""
    for p in make_tables.doc_files():
        text = p.read_text()
        assert text.count("<!--v ") == len(make_tables.VALUE.findall(text)), p
    with pytest.raises(ValueError, match="value mark"):
        make_tables.render("a <!--v teacher.fd_cls-->5<!--/v--> and <!--v teacher.fd cls-->",
                           make_tables.load())
