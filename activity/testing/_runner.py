"""`test_differentiation`: every backend on every scenario, checked against a reference."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import attrs

from .._errors import UnsupportedError
from ._compare import assert_tree_allclose
from ._intact import Snapshot
from ._scenario import Scenario

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5

PASS, FAIL, UNSUPPORTED = "pass", "FAIL", "unsupported"


@attrs.frozen
class Outcome:
    """One backend on one scenario (unprepared and prepared)."""

    backend: str
    scenario: str
    status: str
    message: str = ""
    seconds: float = 0.0


def backend_name(backend: Any) -> str:
    """The class name for a backend with default settings, its repr otherwise."""
    try:
        default = backend == type(backend)()
    except TypeError:  # needs arguments (SecondOrder)
        default = False
    return type(backend).__name__ if default else repr(backend)


def runs_on(backend: Any, scenario: Scenario) -> bool:
    """Whether ``backend`` declares support for ``scenario`` (operator, kinds, framework)."""
    framework = backend.framework
    if framework is not None and framework != scenario.framework:
        return False
    return all(backend.supports(scenario.op, kind, mode) for kind in scenario.kinds for mode in ("unprepared", "prepared"))


def check_scenario(
    backend: Any,
    scenario: Scenario,
    *,
    reference: Any = None,
    prepared: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Run one scenario on one backend (unprepared, then prepared); raise AssertionError on any problem.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, check_scenario
    >>> s = Scenario("gradient", lambda x: (x**3).sum(), [ad.Active(np.ones(2))], result=np.array([3.0, 3.0]))
    >>> check_scenario(ad.AutoFiniteDifferences(), s)
    """
    rtol = scenario.rtol if scenario.rtol is not None else (DEFAULT_RTOL if rtol is None else rtol)
    atol = scenario.atol if scenario.atol is not None else (DEFAULT_ATOL if atol is None else atol)
    try:
        expected = scenario.expected(reference)
    except Exception as error:  # noqa: BLE001 - reported, with the scenario's name
        raise AssertionError(f"the reference failed on {scenario.name}: {type(error).__name__}: {error}") from error
    problems = []
    for mode in (False, True) if prepared else (False,):
        label = "prepared" if mode else "unprepared"
        snapshot = Snapshot(scenario.args + (scenario.prep_args or ()))
        try:
            actual = scenario.run(backend, prepared=mode)
        except UnsupportedError:
            raise
        except Exception as error:  # noqa: BLE001 - every failure is collected
            problems.append(f"{label}: raised {type(error).__name__}: {str(error)[:500]}")
            continue
        try:
            assert_tree_allclose(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as error:
            problems.append(f"{label}: wrong result: {error}")
        problems += [f"{label}: {change}" for change in snapshot.changes()]
    if problems:
        raise AssertionError(f"{backend_name(backend)} on {scenario.name}:\n  " + "\n  ".join(problems))


class Report:
    """The outcomes of `test_differentiation`; ``str(report)`` is a scenario x backend table."""

    def __init__(self, backends: Sequence[str], scenarios: Sequence[str], outcomes: list[Outcome]):
        self.backends, self.scenarios, self.outcomes = list(backends), list(scenarios), outcomes

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == FAIL]

    def counts(self) -> dict[str, int]:
        counts = {PASS: 0, FAIL: 0, UNSUPPORTED: 0}
        for o in self.outcomes:
            counts[o.status] += 1
        return counts

    def table(self) -> str:
        cell = {(o.scenario, o.backend): o.status for o in self.outcomes}
        width = max([len("scenario")] + [len(s) for s in self.scenarios])
        columns = [max(len(b), len(UNSUPPORTED)) for b in self.backends]
        lines = [
            "| " + "scenario".ljust(width) + " | " + " | ".join(b.ljust(c) for b, c in zip(self.backends, columns)) + " |",
            "| " + "-" * width + " | " + " | ".join("-" * c for c in columns) + " |",
        ]
        for s in self.scenarios:
            cells = [cell.get((s, b), "-").ljust(c) for b, c in zip(self.backends, columns)]  # - : not run
            lines.append("| " + s.ljust(width) + " | " + " | ".join(cells) + " |")
        counts = self.counts()
        lines.append(f"\n{counts[PASS]} passed, {counts[FAIL]} failed, {counts[UNSUPPORTED]} unsupported")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def test_differentiation(
    backends: Any | Iterable[Any],
    scenarios: Iterable[Scenario],
    *,
    reference: Any = None,
    prepared: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    progress: Callable[[Outcome], None] | None = None,
    raise_on_failure: bool = True,
) -> Report:
    """Run every backend on every scenario it supports, unprepared and prepared.

    Results are compared with each scenario's expected result (from
    ``reference``, finite differences by default); every call must leave its
    arguments and the global RNGs as they were. Combinations a backend does not
    support are listed as unsupported, not run. All failures are collected into
    one ``AssertionError`` (its message includes the table); otherwise, or with
    ``raise_on_failure=False``, the `Report` is returned. ``progress`` is called
    with each `Outcome` as it is decided.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import default_scenarios, test_differentiation
    >>> report = test_differentiation([ad.AutoFiniteDifferences(step=0.05)], default_scenarios("numpy")[:3])
    >>> report.counts()
    {'pass': 3, 'FAIL': 0, 'unsupported': 0}
    """
    backends = list(backends) if isinstance(backends, (list, tuple)) else [backends]
    scenarios = list(scenarios)
    outcomes = []
    for scenario in scenarios:
        for backend in backends:
            name = backend_name(backend)
            start = time.perf_counter()
            if not runs_on(backend, scenario):
                outcome = Outcome(name, scenario.name, UNSUPPORTED)
            else:
                try:
                    check_scenario(backend, scenario, reference=reference, prepared=prepared, rtol=rtol, atol=atol)
                    outcome = Outcome(name, scenario.name, PASS)
                except UnsupportedError as error:
                    outcome = Outcome(name, scenario.name, UNSUPPORTED, str(error))
                except AssertionError as error:
                    outcome = Outcome(name, scenario.name, FAIL, str(error))
            outcome = attrs.evolve(outcome, seconds=time.perf_counter() - start)
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
    report = Report([backend_name(b) for b in backends], [s.name for s in scenarios], outcomes)
    if report.failures and raise_on_failure:
        details = "\n\n".join(o.message for o in report.failures)
        raise AssertionError(f"{len(report.failures)} failure(s):\n\n{details}\n\n{report.table()}")
    return report


test_differentiation.__test__ = False  # type: ignore[attr-defined]
