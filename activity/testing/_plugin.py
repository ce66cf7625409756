"""What the pytest plugin (`pytest_activity`) builds: one case per supported backend x scenario."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs

from ._runner import backend_name, check_scenario, runs_on
from ._scenario import Scenario


@attrs.frozen
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
        name = self.scenario.name
        label = name if name.startswith(self.scenario.op) else f"{self.scenario.op}-{name}"
        return f"{backend_name(self.backend)}-{label}"

    def check(self) -> None:
        check_scenario(
            self.backend, self.scenario, reference=self.reference, prepared=self.prepared, rtol=self.rtol, atol=self.atol
        )


def cases(
    backends: Any | Iterable[Any],
    scenarios: Iterable[Scenario] | Callable[[], Iterable[Scenario]],
    *,
    reference: Any = None,
    prepared: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[list[Case], list[str]]:
    """The cases for every backend x scenario the backend supports, and their test ids."""
    backends = list(backends) if isinstance(backends, (list, tuple)) else [backends]
    scenarios = list(scenarios() if callable(scenarios) else scenarios)
    found = [
        Case(b, s, reference, prepared, rtol, atol) for s in scenarios for b in backends if runs_on(b, s)
    ]
    return found, [c.id for c in found]


def parametrize(backends: Any, scenarios: Any, **kwargs: Any) -> Any:
    """``pytest.mark.parametrize("activity_case", ...)`` without the marker, for explicit use.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, parametrize
    >>> mark = parametrize([ad.AutoFiniteDifferences()], [Scenario("gradient", np.sum, [ad.Active(np.ones(2))])])
    >>> mark.args[0], mark.kwargs["ids"]
    ('activity_case', ['AutoFiniteDifferences-gradient-sum'])
    """
    import pytest

    params, ids = cases(backends, scenarios, **kwargs)
    return pytest.mark.parametrize("activity_case", params, ids=ids)
