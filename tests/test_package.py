"""Package-level promises: lazy framework imports, the examples run, the public names exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _forkserver import ForkServer

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


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Every example run as ``python examples/<name>``, in its own process (forked from one that has
    imported the frameworks), one per core at a time; tests wait for their own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the checkout under test, not an installed copy
    server = ForkServer({name: ([ROOT / "examples" / name], ROOT) for name in EXAMPLES}, tmp_path_factory.mktemp("examples"), env)
    yield server
    server.close()


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs(script, example_runs):
    code, stdout, stderr = example_runs.result(script)
    assert code == 0, stderr
    assert stdout.strip()


def test_public_names():
    import activity as ad

    for name in ad.__all__:
        assert hasattr(ad, name), name
        if callable(getattr(ad, name)) and not name[0].isupper():
            assert getattr(ad, name).__doc__, f"{name} has no docstring"


MISSING = {
    "AutoJAX()": ("jax", "import activity as ad; ad.AutoJAX()", 'pip install "activity-ad[jax]"'),
    "AutoTorch()": ("torch", "import activity as ad; ad.AutoTorch()", 'pip install "activity-ad[torch]"'),
    "activity.testing's jax scenarios": (
        "jax", "from activity.testing import default_scenarios; default_scenarios('jax')", 'pip install "activity-ad[jax]"'
    ),
    'nn_scenarios("jax")': (
        "equinox", "from activity.testing import nn_scenarios; nn_scenarios('jax')", 'pip install "activity-ad[testing]"'
    ),
}


@pytest.mark.parametrize("needed_by", sorted(MISSING))
def test_a_missing_framework_names_the_extra_that_installs_it(needed_by):
    module, code, install = MISSING[needed_by]
    # None in sys.modules is how Python marks a module as not importable: as if it were not installed.
    script = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "try:\n"
        f"    {code}\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error.name, '|', error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"ModuleNotFoundError {module} | "), out
    assert f"{needed_by}: {module} is not installed; install it with {install}" in out, out


def test_the_version_is_one_in_pyproject_and_the_package():
    import re

    import activity

    (version,) = re.findall(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version == activity.__version__


@pytest.mark.parametrize("missing, shown", [("torch", "JAX:"), ("jax", "PyTorch:")])
def test_quickstart_runs_with_one_framework(missing, shown):
    # A finder that refuses the module, as an environment without it would; a None in sys.modules
    # would not do here: the library reads sys.modules["torch"] wherever it is listed.
    script = (
        "import runpy, sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] == {missing!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        f"runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout and f'{missing} is not installed: its example is skipped (pip install ".[{missing}]"' in result.stdout


def test_sdist_carries_what_its_tests_read_and_passes_twine_check(tmp_path):
    # From a copy without build leftovers: setuptools would reuse a stale *.egg-info/SOURCES.txt.
    # Built without isolation: the build backend (setuptools>=77) is already installed, nothing is downloaded.
    import shutil

    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "*.egg-info", "__pycache__", "build", "dist", "site", ".pytest_cache", ".hypothesis"
    ))
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(source)],
        capture_output=True, text=True, check=True,
    )
    (sdist,) = tmp_path.glob("activity_ad-*.tar.gz")
    import tarfile

    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = {"LICENSE", "CHANGELOG.md", "README.md", "Makefile", "mkdocs.yml", "pytest_activity.py", "tests/conftest.py"}
    for folder, pattern in [("tests", "*.py"), ("docs", "*.md"), ("docs", "*.py"), ("docs", "*.css"),
                            ("docs", "*.png"), ("benchmarks", "*.py"), ("examples", "*.py"), ("activity", "*.py")]:
        needed |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob(pattern) if "__pycache__" not in p.parts}
    assert sorted(needed - names) == []
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_makefiles_exact_torch_satisfies_the_torch_extra():
    # `make test` installs its exact CPU torch first; the extra must accept it, or pip would
    # replace it by another build (a CUDA one, downloaded) when it installs the extras.
    import re

    from packaging.requirements import Requirement

    pinned = re.search(r'"torch==([\w.+]+)"', (ROOT / "Makefile").read_text()).group(1)
    extra = re.search(r'^torch = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    (torch,) = [Requirement(r) for r in re.findall(r'"([^"]+)"', extra) if Requirement(r).name == "torch"]
    assert "==" not in str(torch.specifier), f"the [torch] extra pins {torch}: state a range"
    assert torch.specifier.contains(pinned), (pinned, str(torch.specifier))
