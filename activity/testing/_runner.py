"""`test_differentiation`: every backend on every scenario, checked against a reference."""

from __future__ import annotations

import difflib
import re
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs

from .._errors import UnsupportedError, short_repr
from .._problem import describe_type
from ._compare import assert_tree_allclose, rounding_atol
from ._intact import Snapshot
from ._scenario import Scenario

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5

PASS, FAIL, UNSUPPORTED = "pass", "FAIL", "unsupported"
NOT_APPLICABLE = "n/a"  # the scenario is in another framework than the backend's: not counted
SKIPPED = "skipped"  # listed in skip=: not run
BROKEN = "broken"  # listed in broken= and failed, as expected
UNEXPECTED_PASS = "UNEXPECTED PASS"  # listed in broken= but passed: fails the run
UNRELIABLE = "reference unreliable"  # the reference cannot decide: not counted as the backend's failure
FAILING = (FAIL, UNEXPECTED_PASS)
CHECKED = (PASS, FAIL, BROKEN, UNEXPECTED_PASS, UNRELIABLE)  # the outcomes of cases that really ran


class UsageError(ValueError):
    """The testing kit was used in a way that would check nothing, or not what was meant."""


class ReferenceUnreliable(AssertionError):
    """A backend disagreed with a reference that says it cannot be trusted for this scenario."""


@attrs.frozen
class Outcome:
    """One backend on one scenario (unprepared and prepared).

    ``status`` is ``"pass"``, ``"FAIL"``, ``"unsupported"``, ``"n/a"`` (the
    scenario is in another framework), ``"skipped"`` (listed in ``skip=``),
    ``"broken"`` (listed in ``broken=`` and failed) or ``"UNEXPECTED PASS"``
    (listed in ``broken=`` but passed). ``message`` is what went wrong,
    ``reason`` the manifest's reason.
    """

    backend: str
    scenario: str
    status: str
    message: str = ""
    seconds: float = 0.0
    reason: str = ""


def _default_of(field: Any) -> Any:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return attrs.NOTHING if default.takes_self else default.factory()
    return default


def backend_name(backend: Any) -> str:
    """The class name, with the settings that differ from the defaults: ``AutoFiniteDifferences(step=0.05)``.

    Backends inside a backend are named the same way: ``SecondOrder(AutoTorch, AutoJAX)``.
    """
    cls = type(backend)
    if not attrs.has(cls):
        try:
            default = bool(backend == cls())
        except Exception:  # noqa: BLE001 - needs arguments
            default = False
        return cls.__name__ if default else repr(backend)
    parts = []
    for field in attrs.fields(cls):
        if not field.init:
            continue
        value, default = getattr(backend, field.name), _default_of(field)
        if default is not attrs.NOTHING:
            try:
                if bool(value == default):
                    continue
            except Exception:  # noqa: BLE001 - not comparable: shown
                pass
        shown = backend_name(value) if hasattr(value, "supports") and hasattr(value, "framework") else repr(value)
        parts.append(shown if default is attrs.NOTHING else f"{field.name}={shown}")
    return f"{cls.__name__}({', '.join(parts)})" if parts else cls.__name__


def safe_id(text: str) -> str:
    """``text`` as a pytest id: no spaces, ``=``, quotes or brackets (``AutoFiniteDifferences-step_0.05``)."""
    text = re.sub(r"\s*[(\[{,]\s*", "-", text)
    text = re.sub(r"\s*=\s*", "_", text)
    text = re.sub(r"[^\w.+\-]+", "_", text)
    text = re.sub(r"[-_]*-[-_]*", "-", re.sub(r"_+", "_", text))
    return text.strip("-_") or "case"


def applies(backend: Any, scenario: Scenario) -> bool:
    """Whether ``scenario`` is in the framework ``backend`` works on (False: "n/a", not "unsupported")."""
    framework = backend.framework
    return framework is None or framework == scenario.framework


def supported(backend: Any, scenario: Scenario) -> bool:
    """Whether ``backend`` declares support for ``scenario``'s operator on its argument kinds."""
    return all(backend.supports(scenario.op, kind, mode) for kind in scenario.kinds for mode in ("unprepared", "prepared"))


def runs_on(backend: Any, scenario: Scenario) -> bool:
    """Whether ``backend`` declares support for ``scenario`` (operator, kinds, framework)."""
    return applies(backend, scenario) and supported(backend, scenario)


def status_before_running(backend: Any, scenario: Scenario) -> str | None:
    """``"n/a"`` or ``"unsupported"`` when the case is not run at all, None when it is."""
    if not applies(backend, scenario):
        return NOT_APPLICABLE
    if not supported(backend, scenario):
        return UNSUPPORTED
    return None


# -- the expected-failure manifest ------------------------------------------------------------------


def _key_text(key: Any) -> str:
    return repr(key)


class Manifest:
    """``broken=`` and ``skip=``: reasons keyed by ``(backend, scenario)``, a backend or a scenario name.

    A backend is named as the report names it (`backend_name`) or by its class
    name; a string key is a backend name or a scenario name. Every key must
    match at least one case that runs (a stale manifest is an error), and the
    most specific key wins: ``(backend, scenario)`` over a name alone.
    """

    def __init__(self, backends: Sequence[Any], scenarios: Sequence[Scenario], *, broken: Any = None, skip: Any = None):
        self.entries: dict[str, dict[Any, str]] = {"broken": self._validated("broken", broken), "skip": self._validated("skip", skip)}
        self.names = {id(b): {backend_name(b), type(b).__name__} for b in backends}
        if not (self.entries["broken"] or self.entries["skip"]):
            return
        everything = [(b, s) for s in scenarios for b in backends]
        runnable = [(b, s) for b, s in everything if status_before_running(b, s) is None]
        for which, entries in self.entries.items():
            for key in entries:
                if not any(self._matches(key, b, s) for b, s in runnable):
                    raise UsageError(self._stale(which, key, backends, scenarios, everything))

    @staticmethod
    def _validated(which: str, entries: Any) -> dict[Any, Any]:
        if entries is None:
            return {}
        if not isinstance(entries, Mapping):
            raise UsageError(
                f"{which}= must be a mapping from (backend, scenario), a backend name or a scenario name to a "
                f"reason, e.g. {{('AutoTorch', 'gradient-lstm'): 'issue #12'}}; got {describe_type(entries)}."
            )
        for key, reason in entries.items():
            pair = isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)
            if not (pair or isinstance(key, str)):
                raise UsageError(
                    f"{which}= key {_key_text(key)}: a key is a (backend name, scenario name) pair, a backend name "
                    f"or a scenario name, e.g. ('AutoTorch', 'gradient-lstm') or 'AutoJAX'."
                )
            if not isinstance(reason, str) or not reason.strip():
                raise UsageError(f"{which}= key {_key_text(key)}: give the reason as a non-empty string, got {reason!r}.")
        return dict(entries)

    def _matches(self, key: Any, backend: Any, scenario: Scenario) -> bool:
        names = self.names[id(backend)]
        if isinstance(key, tuple):
            return key[0] in names and key[1] == scenario.name
        return key in names or key == scenario.name

    def reason(self, which: str, backend: Any, scenario: Scenario) -> str | None:
        """The reason ``which`` ("broken" or "skip") gives for this case, or None."""
        found = [key for key in self.entries[which] if self._matches(key, backend, scenario)]
        if not found:
            return None
        found.sort(key=lambda key: not isinstance(key, tuple))  # (backend, scenario) first
        return self.entries[which][found[0]]

    def _stale(self, which: str, key: Any, backends: Sequence[Any], scenarios: Sequence[Scenario], everything: list[Any]) -> str:
        backend_names = sorted({n for b in backends for n in self.names[id(b)]})
        scenario_names = [s.name for s in scenarios]
        text = f"{which}= key {_key_text(key)} matches no case that runs"
        matched = [(b, s) for b, s in everything if self._matches(key, b, s)]
        if matched:
            statuses = sorted({status_before_running(b, s) for b, s in matched})  # type: ignore[type-var]
            text += f" (it matches only cases that are {' or '.join(statuses)})"  # type: ignore[arg-type]
        else:
            parts = list(key) if isinstance(key, tuple) else [key]
            hints = []
            for part in parts:
                close = difflib.get_close_matches(part, backend_names + scenario_names, n=3, cutoff=0.6)
                if part not in backend_names and part not in scenario_names:
                    hints.append(f"{part!r} is neither a backend nor a scenario" + (f" (did you mean {close}?)" if close else ""))
            if hints:
                text += ": " + "; ".join(hints)
        shown = ", ".join(scenario_names[:6]) + (", ..." if len(scenario_names) > 6 else "")
        return (
            f"{text}. Backends: {', '.join(backend_names)}; scenarios: {shown}. "
            f"Remove the key from {which}= or correct it: a stale manifest must not pass silently."
        )


# -- running ----------------------------------------------------------------------------------------


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

    Args:
        backend: the backend to check.
        scenario: the `Scenario` to run.
        reference: as in `test_differentiation`.
        prepared: as in `test_differentiation`.
        rtol: as in `test_differentiation`.
        atol: as in `test_differentiation`.

    Raises:
        AssertionError: a wrong result, a changed argument or global RNG, an error of the
            operator, or a reference that failed; one message lists every problem.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, check_scenario
    >>> s = Scenario("gradient", lambda x: (x**3).sum(), [ad.Active(np.ones(2))], result=np.array([3.0, 3.0]))
    >>> check_scenario(ad.AutoFiniteDifferences(), s)
    """
    __tracebackhide__ = True  # pytest shows the user's line and this message, not the kit's frames
    rtol = scenario.rtol if scenario.rtol is not None else (DEFAULT_RTOL if rtol is None else rtol)
    # The default atol is "from the dtypes" (Scenario's docs): a result computed in bfloat16 or
    # float16 is allowed its rounding, as `check` allows it (it was held to 1e-5 and every
    # operator on a half-precision model failed against the float64 reference); a tolerance the
    # scenario or the caller sets is used as given.
    from_dtypes = scenario.atol is None and atol is None
    atol = scenario.atol if scenario.atol is not None else (DEFAULT_ATOL if atol is None else atol)
    try:
        expected = scenario.expected(reference)
    except Exception as error:  # noqa: BLE001 - reported, with the scenario's name
        raise AssertionError(f"the reference failed on {scenario.name}: {type(error).__name__}: {error}") from error
    problems = []
    for mode in (False, True) if prepared else (False,):
        label = "prepared" if mode else "unprepared"
        snapshot = Snapshot(scenario.every_arg + (scenario.prep_args or ()) + tuple((scenario.prep_kwargs or {}).values()))
        try:
            actual = scenario.run(backend, prepared=mode)
        except UnsupportedError:
            raise
        except Exception as error:  # noqa: BLE001 - every failure is collected
            problems.append(f"{label}: raised {type(error).__name__}: {str(error)[:500]}")
            continue
        try:
            tolerance = max(atol, rounding_atol(actual, expected)) if from_dtypes else atol
            assert_tree_allclose(actual, expected, rtol=rtol, atol=tolerance)
        except AssertionError as error:
            problems.append(f"{label}: wrong result: {error}")
        problems += [f"{label}: {change}" for change in snapshot.changes()]
    if problems:
        message = f"{backend_name(backend)} on {scenario.name}:\n  " + "\n  ".join(problems)
        cause = scenario.reference_unreliable(reference)
        if cause is not None and all("wrong result" in p for p in problems):
            raise ReferenceUnreliable(f"reference unreliable on {scenario.name}: {cause}.\n{message}") from None
        raise AssertionError(message) from None


class Report:
    """The outcomes of `test_differentiation`; ``str(report)`` is a scenario x backend table.

    Cells: ``pass``, ``FAIL``, ``unsupported``, ``n/a`` (another framework's
    scenario: not counted), ``skipped``, ``broken`` (an expected failure) and
    ``UNEXPECTED PASS``; ``-`` where the pair was not run at all.
    """

    backends: list[str]
    scenarios: list[str]
    outcomes: list[Outcome]

    def __init__(self, backends: Sequence[str], scenarios: Sequence[str], outcomes: list[Outcome]):
        self.backends, self.scenarios, self.outcomes = list(backends), list(scenarios), outcomes

    @property
    def failures(self) -> list[Outcome]:
        """Failed cases, and broken ones that passed."""
        return [o for o in self.outcomes if o.status in FAILING]

    @property
    def checked(self) -> int:
        """How many cases really ran (passed, failed or broken): zero means the run checked nothing."""
        return sum(o.status in CHECKED for o in self.outcomes)

    def counts(self) -> dict[str, int]:
        """``{"pass": .., "FAIL": .., "unsupported": ..}``, plus ``"broken"``, ``"skipped"`` and
        ``"UNEXPECTED PASS"`` where there are any; "n/a" is not counted."""
        counts = {PASS: 0, FAIL: 0, UNSUPPORTED: 0}
        for o in self.outcomes:
            if o.status != NOT_APPLICABLE:
                counts[o.status] = counts.get(o.status, 0) + 1
        return counts

    def summary(self) -> str:
        counts = self.counts()
        text = f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[UNSUPPORTED]} unsupported"
        for status, label in (
            (BROKEN, "broken (expected)"),
            (SKIPPED, "skipped"),
            (UNEXPECTED_PASS, "unexpected pass(es)"),
            (UNRELIABLE, "not decided (reference unreliable)"),
        ):
            if counts.get(status):
                text += f", {counts[status]} {label}"
        return text

    def notes(self) -> list[str]:
        """One line per case of the manifest: skipped, broken (expected) or an unexpected pass, with its reason."""
        labels = {SKIPPED: "skipped", BROKEN: "broken (expected)", UNEXPECTED_PASS: "UNEXPECTED PASS"}
        return [f"{labels[o.status]}: {o.backend} on {o.scenario}: {o.reason}" for o in self.outcomes if o.status in labels]

    def table(self) -> str:
        cell = {(o.scenario, o.backend): o.status for o in self.outcomes}
        width = max([len("scenario")] + [len(s) for s in self.scenarios])
        longest = max([len(o.status) for o in self.outcomes] + [len(UNSUPPORTED)])
        columns = [max(len(b), longest) for b in self.backends]
        lines = [
            "| " + "scenario".ljust(width) + " | " + " | ".join(b.ljust(c) for b, c in zip(self.backends, columns)) + " |",
            "| " + "-" * width + " | " + " | ".join("-" * c for c in columns) + " |",
        ]
        for s in self.scenarios:
            cells = [cell.get((s, b), "-").ljust(c) for b, c in zip(self.backends, columns)]  # - : not run
            lines.append("| " + s.ljust(width) + " | " + " | ".join(cells) + " |")
        notes = self.notes()
        if notes:
            lines += [""] + notes
        lines.append(f"\n{self.summary()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _as_list(backends: Any) -> list[Any]:
    return list(backends) if isinstance(backends, (list, tuple)) else [backends]


def as_scenarios(scenarios: Any) -> list[Scenario]:
    """``scenarios`` as a list: one `Scenario` alone is a list of one, as one backend is."""
    if isinstance(scenarios, Scenario):
        return [scenarios]
    if isinstance(scenarios, (str, bytes)) or not isinstance(scenarios, Iterable):
        raise UsageError(
            f"scenarios must be a Scenario or a list of them (e.g. default_scenarios('jax')), got "
            f"{describe_type(scenarios)} {short_repr(scenarios)}."
        )
    found: list[Scenario] = list(scenarios)
    for scenario in found:
        if not isinstance(scenario, Scenario):
            raise UsageError(f"scenarios holds {describe_type(scenario)}, not a Scenario: {short_repr(scenario, 80)}.")
    return found


def test_differentiation(
    backends: Any | Iterable[Any],
    scenarios: Scenario | Iterable[Scenario],
    *,
    reference: Any = None,
    prepared: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    broken: Mapping[Any, str] | None = None,
    skip: Mapping[Any, str] | None = None,
    progress: Callable[[Outcome], None] | None = None,
    raise_on_failure: bool = True,
) -> Report:
    """Run every backend on every scenario it supports, unprepared and prepared.

    Results are compared with each scenario's expected result; every call must
    leave its arguments and the global RNGs as they were. Combinations a
    backend does not support are listed as unsupported, another framework's
    scenarios as n/a; neither is run.

    Args:
        backends: a list of backends, or one alone.
        scenarios: a list of `Scenario`, or one alone
            (``test_differentiation(ad.AutoJAX(), scenario)``).
        reference: where a scenario has no ``result=``, the backend that computes its
            expected result; ``None``: float64 finite differences.
        prepared: also run each case prepared: prepared on the scenario's ``prep_args`` and
            called on them, then called on its arguments, whose result is compared (a
            prepared operator that kept its first values or result fails).
        rtol: relative tolerance where the scenario sets none; ``None``: 1e-4.
        atol: absolute tolerance where the scenario sets none; ``None``: 1e-5.
        broken: the expected failures, a mapping from a key to its reason: the key a
            ``(backend, scenario)`` pair, a backend name (as the report names it, or its
            class name) or a scenario name. A broken case that fails is reported ``broken``
            and does not fail the run; one that passes is an ``UNEXPECTED PASS`` and does.
        skip: cases not run, keyed as ``broken``.
        progress: called with each `Outcome` as it is decided.
        raise_on_failure: ``False`` returns the `Report` whatever it holds.

    Returns:
        The `Report`: a backend by scenario table (``str()``) and every `Outcome`.

    Raises:
        AssertionError: some case failed, or no case ran at all; one error collects every
            failure, and its message includes the table.
        UsageError: (a ``ValueError``) a ``broken=`` or ``skip=`` key matches no case that
            runs; raised before anything runs.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import default_scenarios, test_differentiation
    >>> report = test_differentiation([ad.AutoFiniteDifferences(step=0.05)], default_scenarios("numpy")[:3])
    >>> report.counts()
    {'pass': 3, 'FAIL': 0, 'unsupported': 0}
    """
    __tracebackhide__ = True
    backends = _as_list(backends)
    scenarios = as_scenarios(scenarios)
    manifest = Manifest(backends, scenarios, broken=broken, skip=skip)
    names = [backend_name(b) for b in backends]
    outcomes = []
    for scenario in scenarios:
        for backend, name in zip(backends, names):
            start = time.perf_counter()
            outcome = _run_case(backend, name, scenario, manifest, reference=reference, prepared=prepared, rtol=rtol, atol=atol)
            outcome = attrs.evolve(outcome, seconds=time.perf_counter() - start)
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
    report = Report(names, [s.name for s in scenarios], outcomes)
    if raise_on_failure and report.failures:
        details = "\n\n".join(o.message for o in report.failures)
        raise AssertionError(f"{len(report.failures)} failure(s):\n\n{details}\n\n{report.table()}")
    if raise_on_failure and not report.checked:
        raise AssertionError(nothing_checked(report, backends, scenarios))
    return report


test_differentiation.__test__ = False  # type: ignore[attr-defined]


def _run_case(backend: Any, name: str, scenario: Scenario, manifest: Manifest, **options: Any) -> Outcome:
    before = status_before_running(backend, scenario)
    if before is not None:
        return Outcome(name, scenario.name, before)
    skip_reason = manifest.reason("skip", backend, scenario)
    if skip_reason is not None:
        return Outcome(name, scenario.name, SKIPPED, reason=skip_reason)
    broken_reason = manifest.reason("broken", backend, scenario)
    try:
        check_scenario(backend, scenario, **options)
    except UnsupportedError as error:
        return Outcome(name, scenario.name, UNSUPPORTED, str(error))
    except ReferenceUnreliable as error:
        return Outcome(name, scenario.name, UNRELIABLE, str(error))
    except AssertionError as error:
        if broken_reason is not None:
            return Outcome(name, scenario.name, BROKEN, str(error), reason=broken_reason)
        return Outcome(name, scenario.name, FAIL, str(error))
    if broken_reason is not None:
        message = (
            f"{name} on {scenario.name}: UNEXPECTED PASS: broken= lists it as broken ({broken_reason}), but it "
            f"passed; remove it from broken= (it is fixed)."
        )
        return Outcome(name, scenario.name, UNEXPECTED_PASS, message, reason=broken_reason)
    return Outcome(name, scenario.name, PASS)


def nothing_checked(report: Report, backends: Sequence[Any], scenarios: Sequence[Scenario]) -> str:
    """Why a run checked nothing, and what to do."""
    if not backends or not scenarios:
        return f"test_differentiation checked nothing: it was given {len(backends)} backend(s) and {len(scenarios)} scenario(s)."
    counts: dict[str, int] = {}
    for o in report.outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    why = ", ".join(f"{n} {status}" for status, n in counts.items())
    frameworks = sorted({s.framework for s in scenarios})
    takes = ", ".join(f"{backend_name(b)} takes {b.framework or 'any framework'}" for b in backends)
    return (
        f"test_differentiation checked nothing: no case ran ({why}). The scenarios are in {', '.join(frameworks)}; "
        f"{takes}. Give each backend scenarios of its framework (e.g. default_scenarios('torch') for AutoTorch) "
        f"and operators it supports, or shorten skip=."
    )
