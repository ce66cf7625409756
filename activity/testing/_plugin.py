"""What the pytest plugin (`pytest_activity`) builds: one case per backend x scenario, with readable ids."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable, Mapping

import attrs

from ._runner import (
    Manifest,
    UsageError,
    backend_name,
    check_scenario,
    safe_id,
    status_before_running,
    UNSUPPORTED,
    _as_list,
    as_scenarios,
)
from ._scenario import Scenario

KEYWORDS = ("backends", "scenarios", "reference", "prepared", "rtol", "atol", "broken", "skip")


@attrs.frozen(repr=False)
class Case:
    """One backend on one scenario; ``check()`` runs it (unprepared and prepared) and asserts."""

    backend: Any
    scenario: Scenario
    reference: Any = None
    prepared: bool = True
    rtol: float | None = None
    atol: float | None = None

    @property
    def id(self) -> str:
        """``Backend-operator-scenario``, with no spaces, ``=`` or brackets: ``AutoTorch-gradient-lstm``."""
        name = self.scenario.name
        label = name if name.startswith(self.scenario.op) else f"{self.scenario.op}-{name}"
        return f"{safe_id(backend_name(self.backend))}-{safe_id(label)}"

    def __repr__(self) -> str:
        return f"Case({backend_name(self.backend)} on {self.scenario.name})"

    def check(self) -> None:
        __tracebackhide__ = True  # a failure shows the test's line and the kit's message, not the kit's frames
        check_scenario(
            self.backend, self.scenario, reference=self.reference, prepared=self.prepared, rtol=self.rtol, atol=self.atol
        )


@attrs.frozen
class Planned:
    """A case and what the plugin does with it: ``"run"``, ``"skip"`` (skip=, with its reason),
    ``"unsupported"`` (skipped too) or ``"broken"`` (expected to fail)."""

    case: Case
    action: str = "run"
    reason: str = ""


def plan(
    backends: Any | Iterable[Any],
    scenarios: Iterable[Scenario] | Callable[[], Iterable[Scenario]],
    *,
    reference: Any = None,
    prepared: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    broken: Mapping[Any, str] | None = None,
    skip: Mapping[Any, str] | None = None,
) -> list[Planned]:
    """Every backend x scenario of the same framework, with what to do with it.

    Another framework's scenarios get no case (n/a); unsupported ones are
    skipped with the reason. Raises `UsageError` where the result would check
    less than asked: no backend or no scenario, a backend that gets no case at
    all, a manifest key that matches no case.
    """
    backends = _as_list(backends)
    scenarios = as_scenarios(scenarios() if callable(scenarios) and not isinstance(scenarios, Scenario) else scenarios)
    if not backends:
        raise UsageError("backends= is empty: give the backends to test, e.g. backends=[ad.AutoTorch()].")
    if not scenarios:
        raise UsageError(
            "scenarios= is empty (a filter that matches nothing?): give the scenarios to run, "
            "e.g. scenarios=lambda: default_scenarios('torch')."
        )
    manifest = Manifest(backends, scenarios, broken=broken, skip=skip)
    planned = []
    for backend in backends:
        mine = []
        for scenario in scenarios:
            case = Case(backend, scenario, reference, prepared, rtol, atol)
            before = status_before_running(backend, scenario)
            if before == UNSUPPORTED:
                mine.append(Planned(case, "unsupported", f"unsupported: {backend_name(backend)} does not support {scenario.op} on {scenario.kinds}"))
            elif before is None:
                skip_reason = manifest.reason("skip", backend, scenario)
                broken_reason = manifest.reason("broken", backend, scenario)
                if skip_reason is not None:
                    mine.append(Planned(case, "skip", skip_reason))
                elif broken_reason is not None:
                    mine.append(Planned(case, "broken", broken_reason))
                else:
                    mine.append(Planned(case))
        if not any(p.action != "unsupported" for p in mine):
            raise UsageError(_no_case(backend, scenarios, bool(mine)))
        planned += mine
    order = {id(s): i for i, s in enumerate(scenarios)}
    planned.sort(key=lambda p: order[id(p.case.scenario)])  # scenario-major, like the report
    return planned


def _no_case(backend: Any, scenarios: list[Scenario], any_supported: bool) -> str:
    name = backend_name(backend)
    frameworks = sorted({s.framework for s in scenarios})
    if not any_supported:
        return (
            f"{name} runs none of the {len(scenarios)} scenario(s): they are {'/'.join(frameworks)} scenarios and "
            f"{name} takes {backend.framework} ones. Give it scenarios of its framework "
            f"(e.g. default_scenarios({backend.framework!r})) or remove it from backends=."
        )
    ops = sorted({s.op for s in scenarios})
    return (
        f"{name} supports none of the {len(scenarios)} scenario(s) (operators {', '.join(ops)}): "
        f"give it scenarios of operators it supports, or remove it from backends=."
    )


def cases(backends: Any, scenarios: Any, **kwargs: Any) -> tuple[list[Case], list[str]]:
    """The cases that run (not skipped), and their test ids."""
    found = [p.case for p in plan(backends, scenarios, **kwargs) if p.action in ("run", "broken")]
    return found, [c.id for c in found]


def pytest_params(backends: Any, scenarios: Any, **kwargs: Any) -> tuple[list[Any], list[str]]:
    """``pytest.param`` per case: skipped ones marked skip, broken ones xfail(strict), so an unexpected pass fails."""
    import pytest

    params, ids = [], []
    for p in plan(backends, scenarios, **kwargs):
        marks: tuple[Any, ...] = ()
        if p.action in ("skip", "unsupported"):
            marks = (pytest.mark.skip(reason=p.reason),)
        elif p.action == "broken":
            marks = (pytest.mark.xfail(reason=f"broken: {p.reason} (if it passes, it is fixed: remove it from broken=)", strict=True),)
        params.append(pytest.param(p.case, marks=marks, id=p.case.id))
        ids.append(p.case.id)
    return params, ids


def marker_arguments(args: tuple[Any, ...], kwargs: dict[Any, Any], test: str) -> dict[Any, Any]:
    """The ``differentiation`` marker's arguments as keywords; a misspelt or missing one is a `UsageError`."""
    if len(args) > 2:
        raise UsageError(
            f"{test}: @pytest.mark.differentiation takes (backends, scenarios) positionally and the rest by keyword "
            f"({', '.join(KEYWORDS[2:])}); got {len(args)} positional arguments."
        )
    given = dict(zip(KEYWORDS, args))
    for key, value in kwargs.items():
        if key not in KEYWORDS:
            close = difflib.get_close_matches(key, KEYWORDS, n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            raise UsageError(
                f"{test}: @pytest.mark.differentiation has no keyword {key}={hint}; "
                f"the keywords are {', '.join(KEYWORDS)}."
            )
        if key in given:
            raise UsageError(f"{test}: @pytest.mark.differentiation got {key} both positionally and by keyword.")
        given[key] = value
    missing = [k for k in ("backends", "scenarios") if k not in given]
    if missing:
        raise UsageError(
            f"{test}: @pytest.mark.differentiation needs {' and '.join(k + '=' for k in missing)}, e.g. "
            f"@pytest.mark.differentiation(backends=[ad.AutoTorch()], scenarios=lambda: default_scenarios('torch'))."
        )
    return given


def parametrize(backends: Any, scenarios: Any, **kwargs: Any) -> Any:
    """``pytest.mark.parametrize("activity_case", ...)`` without the marker, for explicit use.

    Args:
        backends: a list of backends, or one alone.
        scenarios: a list of `Scenario`, or one alone.
        **kwargs: the marker's keywords, as in `test_differentiation`: ``reference``,
            ``prepared``, ``rtol``, ``atol``, ``broken``, ``skip``.

    Returns:
        A ``pytest.mark.parametrize`` of ``activity_case``, one case per backend and
        scenario, with readable ids.

    Raises:
        UsageError: where the marker would be a collection error (an unknown keyword, a
            ``broken=`` key that matches nothing).

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, parametrize
    >>> mark = parametrize([ad.AutoFiniteDifferences()], [Scenario("gradient", np.sum, [ad.Active(np.ones(2))])])
    >>> mark.args[0], mark.kwargs["ids"]
    ('activity_case', ['AutoFiniteDifferences-gradient-sum'])
    """
    import pytest

    params, ids = pytest_params(backends, scenarios, **kwargs)
    return pytest.mark.parametrize("activity_case", params, ids=ids)
