"""Where the tests' reference data lives: `tests/data/` (origins and licences in
`tests/data/README.md`).

Golden-parity tests get their files through `golden(...)`, which fails the test (never
skips it) when a file is missing: a clone without the data must not pass silently.
"""
from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"
EDM2_REF = DATA / "edm2_ref"      # outputs of the authors' release on random weights
INCEPTION = DATA / "inception"    # jax-fid's FID Inception fixture


def golden(path: Path | str) -> Path:
    """`path` (absolute, or relative to `tests/data/`) if it exists, else fail the
    calling test with the file's name."""
    path = DATA / path
    if not path.is_file():
        pytest.fail(f"test data {path} is missing: it is part of the repository "
                    f"(tests/data/README.md); restore it with `git checkout -- tests/data`",
                    pytrace=False)
    return path
