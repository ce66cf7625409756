"""The package's annotations: mypy --strict is clean, pyright finds every public type, and a
user's fully typed script gets precise types from activity (and its mistakes caught)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER_SCRIPT = ROOT / "tests" / "typing_user_script.py"

# Each line ending in "# error: ..." is a mistake the annotations must catch; no other line may
# be reported. Checked in pyright's default mode: strict mode also flags jax's own signatures.
USER_MISTAKES = '''\
import jax
import jax.numpy as jnp

import activity as ad
from activity import Active, Constant
from activity.testing import Scenario


def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.sum(x @ params["w"])


def cube_sum(v: jax.Array) -> jax.Array:
    return jnp.sum(v**3)


params = {"w": jnp.asarray([1.0, 2.0])}
x = jnp.asarray([[1.0, 0.0], [0.0, 1.0]])
wrong: jax.Array = ad.gradient(loss, Active(params), Constant(x))  # error: the gradient is a dict like params
Scenario("gradient", loss, [params, Constant(x)])  # error: an argument without annotation
ad.prepare(ad.hvp, cube_sum, Active(params["w"]), tangnet=params["w"])  # error: a misspelt keyword
Active(1.0).value.upper()  # error: the value keeps its type
ad.gradient(loss, Active(params), Constant(x), backend="jax")  # error: a backend is a Backend
'''


def _mypy(*targets: str) -> subprocess.CompletedProcess[str]:
    # Run from the repository root, so `activity` is this checkout's; the cache (.mypy_cache)
    # makes a run after the first take a second or two.
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--no-error-summary", *targets],
        cwd=ROOT, capture_output=True, text=True,
    )


def _pyright(*args: str) -> subprocess.CompletedProcess[str]:
    # pyright resolves imports through the interpreter's sys.path: PYTHONPATH puts this checkout first.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, *args],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )


def test_package_is_clean_under_mypy_strict():
    result = _mypy("activity")
    assert result.returncode == 0, result.stdout + result.stderr


def test_pyright_knows_every_public_type():
    result = _pyright("--verifytypes", "activity", "--ignoreexternal", "--outputjson")
    completeness = json.loads(result.stdout)["typeCompleteness"]
    assert Path(completeness["packageRootDirectory"]) == ROOT / "activity", completeness["packageRootDirectory"]
    assert completeness["pyTypedPath"], "activity/py.typed is missing"
    unknown = [
        f"{symbol['name']}: {[d['message'] for d in symbol['diagnostics']]}"
        for symbol in completeness["symbols"]
        if not symbol["isTypeKnown"]
    ]
    assert completeness["completenessScore"] >= 0.95, "\n".join(unknown)


def test_user_script_type_checks_strictly():
    """The documented calls, typed as a strict user types them: no error, no unknown type from
    activity, and the result types pinned by the script's assert_type lines."""
    mypy = _mypy(str(USER_SCRIPT.relative_to(ROOT)))
    assert mypy.returncode == 0, mypy.stdout + mypy.stderr
    pyright = _pyright("--outputjson", str(USER_SCRIPT))  # strict: the script's first line asks for it
    report = json.loads(pyright.stdout)
    assert report["summary"]["errorCount"] == 0, [
        f"{d['range']['start']['line'] + 1}: {d['message']}" for d in report["generalDiagnostics"]
    ]


def test_user_mistakes_are_caught(tmp_path):
    """A checker that reports nothing on the script above might not be checking it: each
    deliberate mistake here is reported on its own line, and nothing else is."""
    script = tmp_path / "mistakes.py"
    script.write_text(USER_MISTAKES)
    expected = {number for number, line in enumerate(USER_MISTAKES.splitlines(), 1) if "# error:" in line}

    mypy = _mypy(str(script))
    # by file name: mypy's cache may name an unchanged module by the path it was first checked at
    mypy_lines = {int(m[1]) for m in re.finditer(rf"^\S*{re.escape(script.name)}:(\d+): error", mypy.stdout, re.M)}
    assert mypy_lines == expected, mypy.stdout

    pyright = json.loads(_pyright("--outputjson", str(script)).stdout)
    pyright_lines = {d["range"]["start"]["line"] + 1 for d in pyright["generalDiagnostics"] if d["severity"] == "error"}
    assert pyright_lines == expected, [d["message"] for d in pyright["generalDiagnostics"]]



def test_checkers_find_the_installed_package_outside_the_repository(tmp_path):
    """A user's project elsewhere type-checks against the installed activity: mypy and pyright
    find the package the interpreter imports. A meta-path import hook (setuptools' default
    editable install) is invisible to them; a path entry (``editable_mode=compat``) is not."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # the install alone
    imported = subprocess.run([sys.executable, "-c", "import activity"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert imported.returncode == 0, f"activity is not installed in {sys.executable}: {imported.stderr}"
    script = tmp_path / "user.py"
    script.write_text(
        "from typing_extensions import assert_type\n"
        "import activity as ad\n"
        "assert_type(ad.Active(1.0).value, float)\n"
    )
    # The repository's cache: an editable install's files are this checkout's, so it is warm.
    mypy = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--no-error-summary",
         "--cache-dir", str(ROOT / ".mypy_cache"), script.name],
        cwd=tmp_path, capture_output=True, text=True, env=env,
    )
    assert mypy.returncode == 0, mypy.stdout + mypy.stderr
    pyright = subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, "--outputjson", script.name],
        cwd=tmp_path, capture_output=True, text=True, env=env,
    )
    report = json.loads(pyright.stdout)
    assert report["summary"]["errorCount"] == 0, [d["message"] for d in report["generalDiagnostics"]]
