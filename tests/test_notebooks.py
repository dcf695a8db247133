"""The Colab notebooks in colabs/ run top to bottom on their tiny settings
(EDM2_JAX_NOTEBOOK_TINY=1), executed by nbclient in a fresh IPython kernel: a failing
cell fails the test. Marked `slow` (7 min for all four on 2 shared CPU cores) and
`notebook`; `.ci/run` runs them with `python -m pytest -q -m notebook`. With
EDM2_JAX_NOTEBOOK_OUT=DIR the executed notebooks (with their outputs) are written there."""
import json
import os
import time
from pathlib import Path

import pytest

COLABS = Path(__file__).resolve().parent.parent / "colabs"
NOTEBOOKS = ["quickstart.ipynb", "released_weights.ipynb", "training_dynamics.ipynb",
             "toy_2d.ipynb"]


def test_every_notebook_is_listed_and_committed_without_outputs():
    assert sorted(p.name for p in COLABS.glob("*.ipynb")) == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        book = json.loads((COLABS / name).read_text())
        code = [c for c in book["cells"] if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), name
        first = "".join(code[0]["source"])
        assert "pip" in first and 'find_spec("edm2_jax") is None' in first, name  # install cell
        assert "EDM2_JAX_NOTEBOOK_TINY" in "".join(code[1]["source"]), name       # tiny switch


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]' installs nbclient")
    if name == "released_weights.ipynb":
        pytest.importorskip("torch", reason="reading release pickles needs torch (.ci/run installs it)")
    monkeypatch.setenv("EDM2_JAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))       # the notebooks' work directories
    book = nbformat.read(COLABS / name, as_version=4)
    client = nbclient.NotebookClient(book, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(COLABS)}})
    t = time.perf_counter()
    client.execute()      # raises CellExecutionError naming the cell and its traceback
    print(f"{name}: {time.perf_counter() - t:.1f} s")
    if os.environ.get("EDM2_JAX_NOTEBOOK_OUT"):       # keep the executed notebook to look at
        os.makedirs(os.environ["EDM2_JAX_NOTEBOOK_OUT"], exist_ok=True)
        nbformat.write(book, os.path.join(os.environ["EDM2_JAX_NOTEBOOK_OUT"], name))
    images = sum("image/png" in o.get("data", {}) for c in book.cells
                 if c.cell_type == "code" for o in c.outputs)
    assert images >= 1, f"{name} showed no plot"
