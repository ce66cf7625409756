"""A testing kit you can trust: it fails where it should.

- The expected-failure manifest (``broken=``, ``skip=``) of `test_differentiation`
  and of the pytest plugin: a skipped case is not run, a broken case that fails
  does not fail the run, one that passes does, a stale key is an error.
- ``python -m activity.testing --bench`` runs end to end (pytrees with names,
  Equinox modules, torch default scenarios) without rerunning the catalogue.
- A command line that would check nothing exits 2 and says why; a framework or
  catalogue that cannot run is named with the command that installs it.
- The numpy default scenarios carry analytic results: finite differences 10 %
  wrong fail on every one of them, even as their own reference.
- Misusing the plugin is a collection error that says what to do.
- Reports: another framework's scenario is n/a, test ids are plain, a failure
  prints a few lines.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap

import attrs
import numpy as np
import pytest

import activity as ad
from activity.testing import Case, Scenario, UsageError, default_scenarios, parametrize, test_differentiation
from activity.testing import __main__ as cli
from activity.testing._plugin import plan
from activity.testing._runner import backend_name

pytest_plugins = ["pytester"]

NUMPY_DEFAULT = default_scenarios("numpy")


def square(x):
    return (x**2).sum()


def sine(x):
    return np.sin(x)


def small_scenarios() -> list[Scenario]:
    return [
        Scenario("gradient", square, [ad.Active(np.array([1.0, 2.0]))], name="square", result=np.array([2.0, 4.0])),
        Scenario("jacobian", sine, [ad.Active(np.array([0.5]))], name="sine", result=np.array([[np.cos(0.5)]])),
    ]


@attrs.frozen
class OnePercentOff(ad.AutoFiniteDifferences):
    """Finite differences whose every derivative is 1 % too large."""

    def jvp(self, F, xs, ts, batched):
        ys, aux, dys = super().jvp(F, xs, ts, batched)
        return ys, aux, tuple(1.01 * d for d in dys)


@attrs.frozen
class Counting(ad.AutoFiniteDifferences):
    """Finite differences that record the scenarios' functions they are asked to differentiate."""

    calls: list = attrs.field(factory=list, eq=False)

    def jvp(self, F, xs, ts, batched):
        self.calls.append(1)
        return super().jvp(F, xs, ts, batched)


def run(args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, **kw)


# ============================================================================ 9. the expected-failure manifest


def test_skip_is_not_run_and_reported_with_its_reason():
    backend = Counting()
    report = test_differentiation([backend], small_scenarios()[:1], skip={("Counting", "square"): "too slow today"},
                                  raise_on_failure=False)
    assert backend.calls == []  # not run at all
    (outcome,) = report.outcomes
    assert (outcome.status, outcome.reason) == ("skipped", "too slow today")
    text = str(report)
    assert "| square   | skipped" in text
    assert "skipped: Counting on square: too slow today" in text
    assert text.splitlines()[-1] == "0 passed, 0 failed, 0 unsupported, 1 skipped"
    assert report.counts() == {"pass": 0, "FAIL": 0, "unsupported": 0, "skipped": 1}


def test_a_broken_case_that_fails_is_expected_and_does_not_fail_the_run():
    report = test_differentiation([OnePercentOff(), ad.AutoFiniteDifferences()], small_scenarios(),
                                  broken={"OnePercentOff": "derivatives 1% off (issue #1)"})
    assert report.failures == []
    statuses = {(o.backend, o.scenario): o.status for o in report.outcomes}
    assert statuses == {
        ("OnePercentOff", "square"): "broken", ("OnePercentOff", "sine"): "broken",
        ("AutoFiniteDifferences", "square"): "pass", ("AutoFiniteDifferences", "sine"): "pass",
    }
    broken = [o for o in report.outcomes if o.status == "broken"]
    assert all("wrong result" in o.message and o.reason == "derivatives 1% off (issue #1)" for o in broken)
    text = str(report)
    assert "broken (expected): OnePercentOff on square: derivatives 1% off (issue #1)" in text
    assert text.splitlines()[-1] == "2 passed, 0 failed, 0 unsupported, 2 broken (expected)"


def test_a_broken_case_that_passes_is_an_unexpected_pass_and_fails_the_run():
    with pytest.raises(AssertionError) as info:
        test_differentiation([ad.AutoFiniteDifferences()], small_scenarios(), broken={"square": "thought broken"})
    message = str(info.value)
    assert "1 failure(s)" in message
    assert "AutoFiniteDifferences on square: UNEXPECTED PASS" in message and "remove it from broken=" in message
    assert "| square   | UNEXPECTED PASS" in message
    report = test_differentiation([ad.AutoFiniteDifferences()], small_scenarios(), broken={"square": "thought broken"},
                                  raise_on_failure=False)
    assert [(o.scenario, o.status) for o in report.failures] == [("square", "UNEXPECTED PASS")]
    assert report.counts()["UNEXPECTED PASS"] == 1


@pytest.mark.parametrize(
    "manifest, names",
    [
        ({("AutoTorch", "square"): "r"}, ["('AutoTorch', 'square')", "'AutoTorch' is neither a backend nor a scenario"]),
        ({"squre": "r"}, ["'squre'", "did you mean ['square']"]),
        ({("AutoFiniteDifferences", "cosine"): "r"}, ["'cosine' is neither"]),
        ({"AutoJAX": "r"}, ["'AutoJAX'", "matches only cases that are n/a"]),
    ],
    ids=["unknown-backend", "misspelt-scenario", "unknown-scenario", "only-not-applicable"],
)
@pytest.mark.parametrize("which", ["broken", "skip"])
def test_a_key_that_matches_no_case_is_an_error_naming_it(manifest, names, which):
    backend = Counting()
    with pytest.raises(UsageError) as info:
        test_differentiation([backend, ad.AutoJAX()], small_scenarios(), **{which: manifest})
    message = str(info.value)
    assert message.startswith(f"{which}= key ")
    for name in names:
        assert name in message, message
    assert "stale manifest" in message
    assert backend.calls == []  # raised before anything ran


def test_manifest_key_forms_and_precedence():
    scenarios = small_scenarios()
    fd = ad.AutoFiniteDifferences(step=0.05)
    assert backend_name(fd) == "AutoFiniteDifferences(step=0.05)"
    for key in ("AutoFiniteDifferences", "AutoFiniteDifferences(step=0.05)", ("AutoFiniteDifferences", "sine"), "sine"):
        report = test_differentiation([fd], scenarios, skip={key: "why"}, raise_on_failure=False)
        assert {o.scenario for o in report.outcomes if o.status == "skipped"} == (
            {"sine"} if "sine" in key else {"square", "sine"}
        ), key
    # skip wins over broken; a (backend, scenario) key wins over a name alone
    report = test_differentiation(
        [OnePercentOff()], scenarios,
        broken={"OnePercentOff": "all off", ("OnePercentOff", "sine"): "sine off"}, skip={"square": "skipped"},
    )
    assert {(o.scenario, o.status, o.reason) for o in report.outcomes} == {
        ("square", "skipped", "skipped"), ("sine", "broken", "sine off"),
    }


@pytest.mark.parametrize(
    "manifest, text",
    [
        (["AutoTorch"], "must be a mapping"),
        ({("AutoTorch",): "r"}, "a key is a (backend name, scenario name) pair"),
        ({"square": ""}, "non-empty string"),
        ({"square": None}, "non-empty string"),
    ],
)
def test_malformed_manifests_are_errors(manifest, text):
    with pytest.raises(UsageError, match=re.escape(text)):
        test_differentiation([ad.AutoFiniteDifferences()], small_scenarios(), broken=manifest)


PLUGIN_SUITE = """
import numpy as np
import pytest
import activity as ad
from activity.testing import Scenario

SCENARIOS = [
    Scenario("gradient", lambda x: (x**2).sum(), [ad.Active(np.array([1.0, 2.0]))], name="square"),
    Scenario("jacobian", lambda x: np.sin(x), [ad.Active(np.array([0.5]))], name="sine"),
]

class Wrong(ad.AutoFiniteDifferences):
    def finalize(self, result, problem):
        return result * 1.01

@pytest.mark.differentiation(backends=[Wrong(), ad.AutoFiniteDifferences()], scenarios=SCENARIOS,
                             broken={"Wrong": "off by 1%"}, skip={("AutoFiniteDifferences", "sine"): "not today"})
def test_manifest(activity_case):
    activity_case.check()

@pytest.mark.differentiation(backends=[ad.AutoFiniteDifferences()], scenarios=SCENARIOS[:1],
                             broken={"square": "believed broken"})
def test_fixed(activity_case):
    activity_case.check()
"""


def test_plugin_manifest_skip_broken_and_unexpected_pass(pytester):
    pytester.makepyfile(test_user=PLUGIN_SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=2)
    out = result.stdout.str()
    assert "SKIPPED [1] test_user.py" in out and "not today" in out
    assert "XFAIL test_user.py::test_manifest[Wrong-gradient-square] - broken: off by 1%" in out
    assert "XFAIL test_user.py::test_manifest[Wrong-jacobian-sine]" in out
    assert "FAILED test_user.py::test_fixed[AutoFiniteDifferences-gradient-square]" in out
    assert "[XPASS(strict)] broken: believed broken (if it passes, it is fixed: remove it from broken=)" in out


def test_plugin_stale_manifest_key_is_a_collection_error(pytester):
    pytester.makepyfile(test_user=PLUGIN_SUITE.replace('skip={("AutoFiniteDifferences", "sine")', 'skip={("AutoFiniteDifferences", "cosine")'))
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    out = result.stdout.str()
    assert "test_manifest: skip= key ('AutoFiniteDifferences', 'cosine') matches no case that runs" in out
    assert "Traceback" not in out and "_runner.py" not in out


# ============================================================================ 10. --bench


BENCH_ROW = r"\| {name} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|"


def test_bench_end_to_end_on_jax_pytrees_with_names_and_torch_default_scenarios():
    # pytree_to_scalar's params hold a name ("layer") and a Python int: the raw jitted baseline used to crash on them
    result = run(["-m", "activity.testing", "--bench", "--framework", "jax,torch", "--scenarios", "default",
                  "--select", "gradient-pytree,gradient-vector_with_aux", "--repeat", "2"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for framework in ("jax", "torch"):
        for name in ("gradient-pytree_to_scalar", "gradient-vector_with_aux"):
            assert re.search(BENCH_ROW.format(name=f"{framework}/{name}"), result.stdout), result.stdout
    # timing only: the catalogue is not run (no progress lines, no matrix)
    assert "[  1/" not in result.stdout and "Compatibility matrix" not in result.stdout
    assert "error" not in result.stdout


def test_bench_times_torch_modules_and_equinox_modules_with_non_array_leaves():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import torch

    mlp = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.PRNGKey(0))  # functions among its leaves
    x = jnp.ones((5, 3))
    layer = torch.nn.Linear(3, 2)
    scenarios = [
        Scenario("gradient", lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2), [ad.Active(mlp), ad.Constant(x)], name="jax/mlp"),
        Scenario("gradient", lambda m, x: (m(x) ** 2).sum(), [ad.Active(layer), ad.Constant(torch.ones(5, 3))], name="torch/linear"),
        Scenario("hessian", lambda x: (x**3).sum(), [ad.Active(torch.ones(2))], name="torch/not_a_gradient"),
    ]
    out = io.StringIO()
    assert cli.bench(scenarios, repeat=1, out=out) == (2, 0)
    text = out.getvalue()
    assert re.search(BENCH_ROW.format(name="jax/mlp"), text) and re.search(BENCH_ROW.format(name="torch/linear"), text), text
    assert "not_a_gradient" not in text


def test_bench_reports_a_scenario_it_cannot_time_and_fails():
    import torch

    def raises(x):
        raise RuntimeError("f is broken")

    out = io.StringIO()
    assert cli.bench([Scenario("gradient", raises, [ad.Active(torch.ones(2))], name="torch/raises")], 1, out) == (0, 1)
    assert "| torch/raises | error: RuntimeError: f is broken" in out.getvalue()


def test_bench_with_nothing_to_time_exits_2(capsys):
    assert cli.main(["--bench", "--framework", "numpy", "--scenarios", "default", "--select", "hvp-"]) == 2
    assert "nothing to time" in capsys.readouterr().err


# ============================================================================ 11. a run that checks nothing


@pytest.mark.parametrize(
    "args, text",
    [
        (["--scenarios", "bogus"], "'bogus' is not one of default, nn"),
        (["--framework", "tensorflow"], "'tensorflow' is not one of numpy, jax, torch"),
        (["--framework", "numpy", "--select", "nothingmatches"], "--select 'nothingmatches' matches no scenario"),
        (["--framework", "numpy", "--scenarios", "nn"], "numpy has no nn catalogue"),
    ],
    ids=["unknown-catalogue", "unknown-framework", "select-matches-nothing", "numpy-nn"],
)
def test_command_line_that_checks_nothing_exits_2_with_a_message(args, text):
    result = run(["-m", "activity.testing", *args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert text in result.stderr, result.stderr
    assert "0 passed" not in result.stdout


def test_command_line_all_unsupported_exits_2(monkeypatch, capsys):
    @attrs.frozen
    class Nothing(ad.AutoFiniteDifferences):
        def supports(self, operator, kind, mode="unprepared"):
            return False

    monkeypatch.setattr(cli, "_backends", lambda framework: [Nothing()])
    assert cli.main(["--framework", "numpy", "--scenarios", "default", "--select", "hvp-"]) == 2
    captured = capsys.readouterr()
    assert "nothing was checked" in captured.err and "unsupported" in captured.out


BLOCK = "import sys; sys.modules['equinox'] = None; from activity.testing.__main__ import main; sys.exit(main({args}))"


def test_missing_equinox_names_the_skipped_catalogue_and_the_install_command():
    result = run(["-c", BLOCK.format(args=["--framework", "jax", "--select", "hvp-vector"])])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped the jax nn catalogue: equinox is not installed" in result.stdout
    assert 'install it with `pip install "activity-ad[testing]"`' in result.stdout
    assert "| jax/hvp-vector_to_scalar" in result.stdout and "2 passed" in result.stdout
    # asking for the nn catalogue alone then checks nothing: an error, with the same reason
    result = run(["-c", BLOCK.format(args=["--framework", "jax", "--scenarios", "nn"])])
    assert result.returncode == 2
    assert "nothing to check" in result.stderr and 'pip install "activity-ad[testing]"' in result.stderr


HIDE_TORCH = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
from activity.testing.__main__ import main
sys.exit(main(ARGS))
"""


def test_missing_framework_is_named_with_the_install_command():
    result = run(["-c", HIDE_TORCH.replace("ARGS", repr(["--scenarios", "default", "--select", "hvp-vector"]))])
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'skipped torch: not installed; install it with `pip install "activity-ad[torch]"`' in result.stdout
    assert "| numpy/hvp-vector_to_scalar" in result.stdout and "| jax/hvp-vector_to_scalar" in result.stdout
    result = run(["-c", HIDE_TORCH.replace("ARGS", repr(["--framework", "torch"]))])
    assert result.returncode == 2
    assert 'torch is not installed; install it with `pip install "activity-ad[torch]"`' in result.stderr


def test_test_differentiation_that_checks_nothing_fails():
    with pytest.raises(AssertionError, match="checked nothing: no case ran \\(2 n/a\\).*AutoJAX takes jax"):
        test_differentiation([ad.AutoJAX()], small_scenarios())
    with pytest.raises(AssertionError, match="checked nothing"):
        test_differentiation([ad.AutoFiniteDifferences()], [])
    with pytest.raises(AssertionError, match="checked nothing"):
        test_differentiation([ad.AutoFiniteDifferences()], small_scenarios(), skip={"AutoFiniteDifferences": "all"})
    report = test_differentiation([ad.AutoJAX()], small_scenarios(), raise_on_failure=False)
    assert report.checked == 0


# ============================================================================ 12. analytic expected results


@attrs.frozen
class TenPercentOff(ad.AutoFiniteDifferences):
    """Finite differences 10 % wrong in every derivative (values untouched)."""

    def jvp(self, F, xs, ts, batched):
        ys, aux, dys = super().jvp(F, xs, ts, batched)
        return ys, aux, tuple(1.1 * d for d in dys)


@pytest.fixture(scope="module")
def ten_percent_off_runs():
    outcomes: list = []
    # the wrong backend is its own reference: only the scenarios' own results can catch it
    with pytest.raises(AssertionError):
        test_differentiation([TenPercentOff()], NUMPY_DEFAULT, reference=TenPercentOff(), progress=outcomes.append)
    return {o.scenario: o for o in outcomes}


@pytest.mark.parametrize("name", [s.name for s in NUMPY_DEFAULT])
def test_ten_percent_wrong_finite_differences_fail_every_numpy_default_scenario(ten_percent_off_runs, name):
    outcome = ten_percent_off_runs[name]
    assert outcome.status == "FAIL" and "wrong result" in outcome.message, outcome


def test_patched_finite_differences_fail_as_the_default_reference_too(monkeypatch):
    """The issue's experiment: AutoFiniteDifferences itself patched 10 % wrong used to pass against itself."""
    original = ad.AutoFiniteDifferences.jvp

    def ten_percent_off(self, F, xs, ts, batched):
        ys, aux, dys = original(self, F, xs, ts, batched)
        return ys, aux, tuple(1.1 * d for d in dys)

    monkeypatch.setattr(ad.AutoFiniteDifferences, "jvp", ten_percent_off)
    scenarios = default_scenarios("numpy")  # fresh: no cached reference
    report = test_differentiation([ad.AutoFiniteDifferences()], scenarios, raise_on_failure=False)
    assert [o.status for o in report.outcomes] == ["FAIL"] * len(scenarios)


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_every_default_scenario_carries_its_expected_result(framework):
    scenarios = default_scenarios(framework)
    assert all(s.result is not None for s in scenarios)


def test_analytic_results_agree_with_float64_finite_differences():
    from activity.testing import assert_tree_allclose

    for s in NUMPY_DEFAULT:
        reference = attrs.evolve(s, result=None).expected()
        assert_tree_allclose(s.result, reference, rtol=1e-6, atol=1e-9)


# ============================================================================ 13. plugin misuse is an error


MISUSE = {
    "no-activity_case": (
        "@pytest.mark.differentiation(backends=[ad.AutoFiniteDifferences()], scenarios=SCENARIOS)\ndef test_x():\n    pass",
        ["test_x is marked @pytest.mark.differentiation but takes no `activity_case` argument",
         "def test_x(activity_case): activity_case.check()"],
    ),
    "misspelt-keyword": (
        "@pytest.mark.differentiation(backend=[ad.AutoFiniteDifferences()], scenarios=SCENARIOS)\n"
        "def test_x(activity_case):\n    activity_case.check()",
        ["has no keyword backend= (did you mean backends=?)",
         "the keywords are backends, scenarios, reference, prepared, rtol, atol, broken, skip"],
    ),
    "missing-scenarios": (
        "@pytest.mark.differentiation(backends=[ad.AutoFiniteDifferences()])\ndef test_x(activity_case):\n    activity_case.check()",
        ["needs scenarios="],
    ),
    "filter-matches-nothing": (
        "@pytest.mark.differentiation(backends=[ad.AutoFiniteDifferences()], "
        "scenarios=lambda: [s for s in SCENARIOS if 'lstm' in s.name])\ndef test_x(activity_case):\n    activity_case.check()",
        ["scenarios= is empty (a filter that matches nothing?)"],
    ),
    "wrong-framework": (
        "@pytest.mark.differentiation(backends=[ad.AutoFiniteDifferences(), ad.AutoJAX()], scenarios=SCENARIOS)\n"
        "def test_x(activity_case):\n    activity_case.check()",
        ["AutoJAX runs none of the 1 scenario(s): they are numpy scenarios and AutoJAX takes jax ones",
         "default_scenarios('jax')"],
    ),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_plugin_misuse_is_a_collection_error_naming_the_fix(pytester, case):
    body, texts = MISUSE[case]
    pytester.makepyfile(test_user=(
        "import numpy as np\nimport pytest\nimport activity as ad\nfrom activity.testing import Scenario\n\n"
        "SCENARIOS = [Scenario('gradient', lambda x: (x**2).sum(), [ad.Active(np.ones(2))], name='square')]\n\n"
        f"{body}\n"
    ))
    result = pytester.runpytest("-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, out
    assert "ERROR collecting test_user.py" in out
    for text in texts:
        assert text in out, out
    assert "Traceback" not in out and "During handling" not in out


def test_plan_and_parametrize_refuse_what_checks_nothing():
    @attrs.frozen
    class FirstOrderOnly(ad.AutoFiniteDifferences):
        def supports(self, operator, kind, mode="unprepared"):
            return "hess" not in operator

    hessians = [s for s in NUMPY_DEFAULT if s.op == "hessian"]
    with pytest.raises(UsageError, match="FirstOrderOnly supports none of the 3 scenario"):
        plan([FirstOrderOnly()], hessians)
    with pytest.raises(UsageError, match="backends= is empty"):
        parametrize([], hessians)
    with pytest.raises(UsageError, match="not a Scenario"):
        plan([ad.AutoFiniteDifferences()], [np.ones(2)])
    # unsupported pairs among supported ones are skipped with the reason, not silently dropped
    planned = plan([FirstOrderOnly()], hessians + NUMPY_DEFAULT[:1])
    assert [p.action for p in planned] == ["unsupported"] * 3 + ["run"]
    assert planned[0].reason == "unsupported: FirstOrderOnly does not support hessian on ('active',)"


# ============================================================================ 14. reports


def test_another_frameworks_scenario_is_not_applicable_and_not_counted():
    report = test_differentiation([ad.AutoFiniteDifferences(), ad.AutoJAX()], small_scenarios())
    assert {o.status for o in report.outcomes if o.backend == "AutoJAX"} == {"n/a"}
    assert report.counts() == {"pass": 2, "FAIL": 0, "unsupported": 0}
    rows = [line for line in str(report).splitlines() if line.startswith("| s")][1:]  # after the header
    assert rows == [
        "| square   | pass                  | n/a         |",
        "| sine     | pass                  | n/a         |",
    ]
    assert str(report).splitlines()[-1] == "2 passed, 0 failed, 0 unsupported"


@pytest.mark.parametrize(
    "backend, name, expected",
    [
        (ad.AutoFiniteDifferences(step=0.05), "square", "AutoFiniteDifferences-step_0.05-gradient-square"),
        (ad.SecondOrder(ad.AutoTorch(), ad.AutoJAX()), "square", "SecondOrder-AutoTorch-AutoJAX-gradient-square"),
        (ad.AutoFiniteDifferences(), "my case (v=2), big", "AutoFiniteDifferences-gradient-my_case-v_2-big"),
        (ad.AutoFiniteDifferences(), None, "AutoFiniteDifferences-gradient-lambda"),
    ],
)
def test_case_ids_have_no_spaces_equals_or_parentheses(backend, name, expected):
    scenario = Scenario("gradient", lambda x: (x**2).sum(), [ad.Active(np.ones(2))], name=name)
    case_id = Case(backend, scenario).id
    assert case_id == expected
    assert not set(case_id) & set(" =()[]<>,'\"")


FAILING_SUITE = """
import numpy as np
import pytest
import activity as ad
from activity.testing import Scenario

class Wrong(ad.AutoFiniteDifferences):
    def finalize(self, result, problem):
        return result * 1.01

@pytest.mark.differentiation(backends=[Wrong(step=0.05)], scenarios=[
    Scenario("gradient", lambda x: (x**2).sum(), [ad.Active(np.array([1.0, 2.0]))], name="square")])
def test_wrong(activity_case):
    activity_case.check()
"""


def test_a_failure_prints_a_few_useful_lines(pytester):
    pytester.makepyfile(test_user=FAILING_SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "test_wrong[Wrong-step_0.05-gradient-square]" in line)
    end = next(i for i, line in enumerate(lines) if "short test summary" in line)
    failure = lines[start:end]
    assert len(failure) <= 15, "\n".join(failure)
    text = "\n".join(failure)
    assert "activity_case = Case(Wrong(step=0.05) on square)" in text
    assert "E       AssertionError: Wrong(step=0.05) on square:" in text
    assert "max rel error 0.01" in text and "got 4.04" in text  # numbers plainly, not np.float64(...)
    assert "np.float64" not in text
    assert "_runner.py" not in text and "_plugin.py" not in text  # the kit's frames are hidden
