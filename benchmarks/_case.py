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
    The ``name`` includes ``raw_name``: one operator may be timed against two raw calls.
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
    raw_name: str | None = None  # what the raw call is, where the family's usual raw call is not it

    @property
    def name(self) -> str:
        against = f" vs {self.raw_name}" if self.raw_name else ""
        return f"{self.framework} {self.operator} {self.family} {self.model} {self.size_label}{against}"

    def check(self) -> int:
        """Raise AssertionError unless ours equals the raw result; returns the leaves compared."""
        return assert_tree_allclose(self.ours(), self.raw_as_ours(self.raw()), rtol=self.rtol, atol=self.atol)


# The targets for prepared calls: every JAX operator, first or second order, and
# torch's first-order ones should cost what the raw compiled call costs.
FIRST_ORDER_TARGET = 1.05
# torch, from the performance issue: a width-8 MLP step is short enough (about 80 us) that
# a few microseconds of checks are 5 %, so it may cost 1.10; the torch Jacobian must stay
# within 1.10 of torch.func.jacrev and the Hessian no slower than torch.func.hessian; an
# unprepared gradient (a new check of every argument) within 1.30.
SMALL_STEP_TARGET = 1.10
TORCH_JACOBIAN_TARGET = 1.10
TORCH_HESSIAN_TARGET = 1.0
UNPREPARED_TARGET = 1.30
# A Hessian-vector product should cost no more than the faster of the two hand-written ones
# (forward over reverse, double backward): each is a case of its own with this target.
HVP_TARGET = 1.0
# Equinox modules prepared as Active(module) against eqx.filter_jit(eqx.filter_grad(loss)).
EQUINOX_TARGET = 1.02
