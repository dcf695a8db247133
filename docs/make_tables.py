"""Write the docs' tables and quoted figures from docs/results.json, the one source of
every figure the README and the guides quote.

    python docs/make_tables.py           # rewrite the marked tables and values in place
    python docs/make_tables.py --check   # exit 1, naming each one that differs

Two kinds of marks in README.md, docs/*.md and benchmarks/README.md:

- a table: `<!-- table:NAME -->` ... `<!-- /table -->`, its lines written by `TABLES[NAME]`;
- a value in prose or in a hand-written table: `<!--v ENTRY.FIELD-->5.181<!--/v-->`,
  the text between the marks being `values[FIELD]` of `ENTRY`.

A figure measured again is one edit of results.json and one run of this script.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results.json"
NO = "—"   # a cell never measured

TABLE = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
VALUE = re.compile(r"(<!--v ([\w-]+)\.([\w.-]+)-->)(.*?)(<!--/v-->)")


def load(path: Path = RESULTS) -> dict[str, dict]:
    """The entries of results.json, each checked to hold values, a command and a commit."""
    entries = json.loads(path.read_text())["entries"]
    for name, e in entries.items():
        missing = {"what", "values", "command", "commit"} - set(e)
        if missing or not re.fullmatch(r"[0-9a-f]{7,40}", e["commit"]):
            raise ValueError(f"{path.name}: entry {name!r} lacks {sorted(missing) or 'a commit'}")
    return entries


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def readme_headline(r: dict) -> list[str]:
    """README.md's results: parity, speed, quality, few-step, each with where it is measured."""
    v = {k: e["values"] for k, e in r.items()}
    teacher = v["teacher"]
    return [
        _row(["result", "figure", "measured in"]),
        _row(["---"] * 3),
        _row(["parity with the release (its outputs on random weights)",
              f"forward pass within {v['parity-forward']['max_rel']} relative (float32); "
              f"post-hoc EMA coefficients within {v['parity-phema']['max_abs']}",
              "[`tests/test_convert.py`](tests/test_convert.py), "
              "[`tests/test_phema.py`](tests/test_phema.py)"]),
        _row(["speed against the release, 2 CPU cores",
              f"training {v['speed-cpu']['train']}, sampling {v['speed-cpu']['sample']}",
              "[`benchmarks/README.md`](benchmarks/README.md#against-the-release-on-cpu)"]),
        _row(["speed against the release, one H200 (img64-s, bfloat16 against its fp16)",
              f"training {v['speed-h200']['train']}, sampling {v['speed-h200']['sample']}",
              "[`benchmarks/README.md`](benchmarks/README.md#gpu)"]),
        _row([f"quality: the quick start's run ({v['quickstart-train']['kimg']} kimg, "
              f"{v['quickstart-train']['wall']} on 2 CPU cores), 2,000 images",
              f"fd_cls {teacher['fd_cls']}, recall {teacher['recall_cls']}, "
              f"FID-2000 {teacher['fid2000']} (floor: {v['floor']['fd_cls']}, "
              f"{v['floor']['recall_cls']}, {v['floor']['fid2000']})",
              "[`docs/evaluation.md`](docs/evaluation.md#classifier-metrics-for-small-data)"]),
        _row(["few-step students of that run (fd_cls, recall)",
              f"1 step (DMD with the GAN head): {v['dmd-gan-1']['fd_cls']}, "
              f"{v['dmd-gan-1']['recall_cls']}; 2 steps (DMD): {v['dmd-2']['fd_cls']}, "
              f"{v['dmd-2']['recall_cls']}; 4 steps (DMD): {v['dmd-4']['fd_cls']}, "
              f"{v['dmd-4']['recall_cls']}; 2 steps (sCM, sCD): {v['scm-2']['fd_cls']}, "
              f"{v['scm-2']['recall_cls']}; of the autoguided teacher: "
              f"{v['scm-ag-2']['fd_cls']}, {v['scm-ag-2']['recall_cls']}",
              "[`docs/distillation.md`](docs/distillation.md)"]),
    ]


def quality(r: dict) -> list[str]:
    """The quick start's run, unguided and autoguided, and the floor in every `_cls`
    metric and FID-2000 (the shipped classifier)."""
    rows = [_row(["images", "fd_cls", "kid_cls", "precision_cls", "recall_cls", "FID-2000"]),
            _row(["---"] * 6)]
    g = r["teacher-autoguided"]["values"]
    for label, v, suffix in (
            ("generated (64 kimg run)", r["teacher"]["values"], ""),
            ("the same, autoguided by its 16-kimg snapshot, w = 1.5", g, "_w1.5"),
            ("the same, autoguided by its 16-kimg snapshot, w = 2", g, "_w2"),
            ("floor: 2,000 test images vs the train split", r["floor"]["values"], "")):
        rows.append(_row([label] + [v[k + suffix] for k in ("fd_cls", "kid_cls",
                                                            "precision_cls", "recall_cls",
                                                            "fid2000")]))
    return rows


CHOOSER = (("MCD (`configs/distill.py`)", "mcd"), ("DMD (`:dmd`)", "dmd"),
           ("DMD with the GAN head (`:dmd-gan`)", "dmd-gan"),
           ("sCD (`:scm`, [docs/scm.md](scm.md))", "scm"),
           ("sCD of the autoguided teacher (`:scm`, `distill.guide`)", "scm-ag"),
           ("sCT (`:sct`, [docs/scm.md](scm.md))", "sct"))


CLASSIFIERS = {"shipped": "shipped", None: "its machine's"}


def distill_chooser(r: dict) -> list[str]:
    """docs/distillation.md's first table: each method at 1, 2 and 4 steps, with the
    classifier its `_cls` figures come from (an entry's `classifier`: 'shipped', the
    package's; none, the one trained on the machine that measured it, with the row's
    ratio to the teacher's fd_cls in that classifier), and the teacher (shipped)."""
    rows = [_row(["method", "steps", "fd_cls", "recall", "FID-2000", "classifier",
                  "training (2 CPU cores)", "step cost (EDM2 step = 1)"]), _row(["---"] * 8)]
    for label, key in CHOOSER:
        for k in (1, 2, 4):
            e = r.get(f"{key}-{k}")
            if e is None:
                continue
            v, c = e["values"], e.get("classifier")
            # A row read with another classifier compares with the teacher by its
            # ratio to the teacher's fd_cls in that classifier (`fd_cls_to_teacher`).
            where = CLASSIFIERS[c] if c == "shipped" else (
                f"{CLASSIFIERS[c]} ({v['fd_cls_to_teacher']} the teacher's fd_cls there)")
            rows.append(_row([label, str(k)] + [v.get(f, NO) for f in (
                "fd_cls", "recall_cls", "fid2000")] + [where] + [
                    v.get(f, NO) for f in ("training", "step_cost")]))
    q, t = r["quickstart-train"]["values"], r["teacher"]["values"]
    rows.append(_row(["the teacher, Heun 32 steps", t["evaluations"], t["fd_cls"],
                      t["recall_cls"], t["fid2000"], CLASSIFIERS["shipped"],
                      f"{q['kimg']} kimg, {q['wall']}", "1.00"]))
    return rows


TABLES = {"readme-headline": readme_headline, "quality": quality,
          "distill-chooser": distill_chooser}


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            REPO / "benchmarks" / "README.md"]


def render(text: str, r: dict) -> str:
    """`text` with every marked table and value written from `r`. Raises ValueError on a
    value mark `VALUE` cannot read (its text would never be checked), KeyError on a mark
    naming no table or entry."""
    unread = text.count("<!--v ") - len(VALUE.findall(text))
    if unread:
        raise ValueError(f"{unread} value mark(s) not of the form "
                         f"<!--v ENTRY.KEY-->...<!--/v--> on one line")
    def table(m):
        if m.group(2) not in TABLES:
            raise KeyError(f"no table {m.group(2)!r}; tables: {sorted(TABLES)}")
        return m.group(1) + "\n".join(TABLES[m.group(2)](r)) + "\n" + m.group(4)

    def value(m):
        return m.group(1) + r[m.group(2)]["values"][m.group(3)] + m.group(5)

    return VALUE.sub(value, TABLE.sub(table, text))


def differences(r: dict | None = None) -> list[str]:
    """The files whose marked tables or values differ from results.json."""
    r = load() if r is None else r
    return [str(p.relative_to(REPO)) for p in doc_files()
            if render(p.read_text(), r) != p.read_text()]


def main(argv: list[str]) -> int:
    r = load()
    if "--check" in argv:
        bad = differences(r)
        for path in bad:
            print(f"{path}: a table or value differs from docs/results.json "
                  f"(python docs/make_tables.py writes it)")
        return 1 if bad else 0
    for p in doc_files():
        new = render(p.read_text(), r)
        if new != p.read_text():
            p.write_text(new)
            print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
