"""Package-level promises: lazy framework imports, the examples run, the public names exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_activity_imports_neither_jax_nor_torch():
    code = "import sys, activity; print('jax' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_finite_differences_work_with_numpy_only():
    code = (
        "import sys, numpy as np, activity as ad\n"
        "g = ad.gradient(lambda x: np.sum(np.sin(x)), ad.Active(np.array([0.0, 1.0])),"
        " backend=ad.AutoFiniteDifferences())\n"
        "assert np.allclose(g, np.cos([0.0, 1.0]), rtol=1e-10), g\n"
        "print('jax' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_runs(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the checkout under test, not an installed copy
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_public_names():
    import activity as ad

    for name in ad.__all__:
        assert hasattr(ad, name), name
        if callable(getattr(ad, name)) and not name[0].isupper():
            assert getattr(ad, name).__doc__, f"{name} has no docstring"
