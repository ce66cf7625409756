"""A benchmark case: one raw backend call and the `activity` call that should match it."""

from __future__ import annotations

from typing import Any, Callable

import attrs

from activity.testing import assert_tree_allclose

# Families of cases, in the order the report shows them.
PREPARED = "prepared"
UNPREPARED = "unprepared"
SCALING = "scaling"


def _identity(result: Any) -> Any:
    return result


@attrs.frozen
class Case:
    """``raw()`` and ``ours()`` compute the same derivative; the timer runs them alternately.

    ``raw_as_ours`` rearranges the raw result like ours (a tuple of torch
    gradients into a dict keyed by parameter name, ...). It is applied only in
    ``check()``, never in the timed call, so the raw side pays nothing extra.
    ``size`` is the x coordinate of the plot (parameter count for networks,
    input length for functions of a vector); ``size_label`` says what it is.
    ``target`` is the largest acceptable ratio ours / raw, or None.
    """

    framework: str
    operator: str
    family: str
    model: str
    size: int
    size_label: str
    raw: Callable[[], Any]
    ours: Callable[[], Any]
    raw_as_ours: Callable[[Any], Any] = _identity
    target: float | None = None
    rtol: float = 1e-4
    atol: float = 1e-5

    @property
    def name(self) -> str:
        return f"{self.framework} {self.operator} {self.family} {self.model} {self.size_label}"

    def check(self) -> int:
        """Raise AssertionError unless ours equals the raw result; returns the leaves compared."""
        return assert_tree_allclose(self.ours(), self.raw_as_ours(self.raw()), rtol=self.rtol, atol=self.atol)


# The targets for prepared calls: first-order operators should cost what the raw
# compiled call costs; dense jacobians and hessians may pay a little for arranging blocks.
FIRST_ORDER_TARGET = 1.05
DENSE_TARGET = 1.2
