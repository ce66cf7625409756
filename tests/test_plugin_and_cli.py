"""The pytest plugin (entry point) and the command line of the testing kit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import attrs
import numpy as np

import activity as ad
from activity.testing import __main__ as cli


def run(args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd)


def test_loading_the_plugin_imports_neither_activity_nor_frameworks():
    code = "import sys, pytest_activity; print(sorted(m for m in ('activity', 'jax', 'torch', 'numpy') if m in sys.modules))"
    result = run(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_pytest_loads_the_plugin_through_its_entry_point():
    code = (
        "import importlib.metadata as m; "
        "print([e.value for e in m.entry_points(group='pytest11') if e.name == 'activity'])"
    )
    assert run(["-c", code]).stdout.strip() == "['pytest_activity']"


USER_SUITE = """
import numpy as np
import pytest
import activity as ad
from activity.testing import Scenario

SCENARIOS = [
    Scenario("gradient", lambda x: (x**2).sum(), [ad.Active(np.array([1.0, 2.0]))], name="square"),
    Scenario("jacobian", lambda x: np.sin(x), [ad.Active(np.array([0.5]))], name="sine"),
]

@pytest.mark.differentiation(backends=[ad.AutoFiniteDifferences()], scenarios=SCENARIOS)
def test_backends(activity_case):
    activity_case.check()

class Wrong(ad.AutoFiniteDifferences):
    def finalize(self, result, problem):
        return result * 1.01

@pytest.mark.differentiation(backends=[Wrong()], scenarios=lambda: SCENARIOS[:1])
def test_wrong(activity_case):
    activity_case.check()
"""


def test_marker_parametrizes_with_readable_ids_and_catches_a_wrong_backend(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_SUITE))
    collected = run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path)
    ids = [line.split("::")[-1] for line in collected.stdout.splitlines() if "::" in line]
    # (a backend of another framework is an error: tests/test_testing_kit_trust.py)
    assert ids == [
        "test_backends[AutoFiniteDifferences-gradient-square]",
        "test_backends[AutoFiniteDifferences-jacobian-sine]",
        "test_wrong[Wrong-gradient-square]",
    ], collected.stdout + collected.stderr
    result = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path)
    assert "1 failed, 2 passed" in result.stdout, result.stdout
    assert "Wrong on square" in result.stdout and "wrong result" in result.stdout


def test_command_line_prints_the_matrix_and_succeeds():
    result = run(["-m", "activity.testing", "--framework", "numpy", "--scenarios", "default", "--select", "gradient-"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Compatibility matrix" in result.stdout
    assert "| numpy/gradient-vector_to_scalar" in result.stdout
    assert "0 failed" in result.stdout
    assert "[  1/" in result.stdout  # progress while it runs


@attrs.frozen
class OffByOnePercent(ad.AutoFiniteDifferences):
    def finalize(self, result, problem):
        return result * 1.01 if isinstance(result, np.ndarray) else result


def test_command_line_exit_status_is_one_on_failures(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_backends", lambda framework: [OffByOnePercent()])
    status = cli.main(["--framework", "numpy", "--scenarios", "default", "--select", "jacobian-vector"])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL" in out and "OffByOnePercent" in out
