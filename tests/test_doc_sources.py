"""What the documents state is held by something a test keeps true.

- docs/reliability.md: every guarantee names the test that holds it, and every test it
  names exists.
- README.md: every figure of a section (a measured value, a ratio, a time) is stated in
  a document that the section links to, the one place it comes from, so that a figure
  measured again is changed there and the README cannot keep an older one. Figures in a
  table or value written from docs/results.json (`<!-- table:... -->`, `<!--v ...-->`) come
  from that file, which tests/test_results_tables.py holds to.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------
# docs/reliability.md


def _bullets(text: str, section: str) -> list[str]:
    """The top-level bullets of `## section` of a markdown text, each as one string."""
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.split(r"\n(?=- )", body) if b.strip().startswith("- ")]


def test_every_guarantee_names_a_test_that_exists():
    text = (REPO / "docs" / "reliability.md").read_text()
    guarantees = ("Resuming and stopping", "Integrity of what is written",
                  "One writer, clear errors")
    for section in guarantees:
        for bullet in _bullets(text, section):
            assert re.search(r"tests/test_\w+\.py", bullet), (section, bullet[:200])
    named, current = [], None
    for token in re.findall(r"`([^`]+)`", text):
        m = re.fullmatch(r"(tests/test_\w+\.py)(?:::(\w+))?|::(\w+)", token)
        if not m:
            continue
        current = m.group(1) or current
        if m.group(2) or m.group(3):
            named.append((current, m.group(2) or m.group(3)))
    assert len(named) >= 30, named
    for path, test in named:
        source = (REPO / path).read_text()
        assert re.search(rf"^(async )?def {test}\(", source, re.M), f"{path}::{test}"


# ---------------------------------------------------------------------------------------
# README.md's figures

# A figure: a number with decimals or thousands separators, a ratio (1.02x), a percentage,
# a time (6 min 8 s, 45 s, 26 days) or a rate (img/s); not a version, a flag's value or
# a paper's section number (removed first, with inline code and link targets).
_FIGURE = re.compile(
    r"(?<![\w.\-/=+])-?\d+(?:,\d{3})+(?:\.\d+)?"
    r"|(?<![\w./=+])-?\d+\.\d+(?:x\b)?"
    r"|(?<![\w./=+])\d+(?:x\b| ?%| min \d+ s| s\b| img/s| days\b)")
_NOT_FIGURES = (r"`[^`]*`", r"\]\([^)]*\)", r"\((?:Sec|Eq|Algorithm|Fig)\.?[^)]*\)",
                r"<[^>]*>")


_FROM_RESULTS = (r"<!-- table:[\w-]+ -->.*?<!-- /table -->", r"<!--v [\w.-]+-->.*?<!--/v-->")


def _sections(readme: str) -> list[tuple[str, str]]:
    """`(heading, text)` of each `##`/`###` section of README.md, code blocks and what is
    written from docs/results.json removed."""
    text = re.sub(r"```.*?```", "\n", readme, flags=re.S)
    for pattern in _FROM_RESULTS:
        text = re.sub(pattern, "\n", text, flags=re.S)
    parts = re.split(r"\n(?=#{2,3} )", text)
    return [(p.splitlines()[0], p) for p in parts]


def readme_figures() -> list[tuple[str, str, list[Path]]]:
    """`(heading, figure, sources)` of every figure of README.md, `sources` the files the
    section links to."""
    out = []
    for heading, text in _sections((REPO / "README.md").read_text()):
        sources = [REPO / link for link in re.findall(r"\]\(([^)#\s]+)", text)
                   if (REPO / link).is_file() and link.endswith((".md", ".py"))]
        body = text
        for pattern in _NOT_FIGURES:
            body = re.sub(pattern, " ", body)
        for figure in _FIGURE.findall(body):
            out.append((heading, figure.strip(), sources))
    return out


def test_every_figure_of_the_readme_is_stated_where_the_section_links():
    figures = readme_figures()
    assert len(figures) >= 5, len(figures)  # the rest are docs/results.json's
    def stated(figure: str, source: Path) -> bool:  # as a whole number, not inside one
        return re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d])", source.read_text())

    missing = [(heading, figure, [str(s.relative_to(REPO)) for s in sources])
               for heading, figure, sources in figures
               if not any(stated(figure, s) for s in sources)]
    assert not missing, "\n".join(f"{h}: {f} is in none of {s}" for h, f, s in missing)
