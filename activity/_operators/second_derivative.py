"""`second_derivative` and `value_derivative_and_second_derivative`: forward over forward."""

from __future__ import annotations

from typing import Any, Callable

from .._annotations import Annotation
from ..backends import Backend
from .._arrays import input_basis
from ._common import Operator, call, register, start


def _build(problem, f, backend, seeds, *, value: bool) -> Callable:
    n = len(problem.diff_shapes)

    def pipeline(xs, ctx, extra):
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, dys, _, d2ys = backend.value_and_second_jvp(F, xs, input_basis(xs, backend))

        def at(leaves, *index):
            return traced.output([leaf[index] for leaf in leaves])

        second = problem.like_active(
            [problem.like_active([at(d2ys, k, l) for l in range(n)]) for k in range(n)]
        )
        if not value:
            return second
        return traced.output(ys), problem.like_active([at(dys, k) for k in range(n)]), second

    return pipeline


def second_derivative(f: Callable, *args: Annotation, backend: Backend | None = None, **keywords: Annotation) -> Any:
    """Second derivative of ``f``'s output with respect to scalar Active arguments.

    With several Active scalars, a tuple of tuples (``[i][j]`` is d2/dxi dxj).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.second_derivative(lambda t: t**3, ad.Active(2.0), backend=ad.AutoJAX())
    Array(12., dtype=float32, weak_type=True)
    """
    return call(SECOND_DERIVATIVE, f, args, backend, {}, {}, keywords)


def value_derivative_and_second_derivative(
    f: Callable, *args: Annotation, backend: Backend | None = None, **keywords: Annotation
) -> tuple[Any, Any, Any]:
    """``(value, derivative, second_derivative)``.

    >>> import activity as ad
    >>> ad.value_derivative_and_second_derivative(lambda t: t**3, ad.Active(2.0), backend=ad.AutoJAX())
    (Array(8., dtype=float32, weak_type=True), Array(12., dtype=float32, weak_type=True), Array(12., dtype=float32, weak_type=True))
    """
    return call(VALUE_DERIVATIVE_AND_SECOND_DERIVATIVE, f, args, backend, {}, {}, keywords)


SECOND_DERIVATIVE = Operator("second_derivative", lambda *a: _build(*a, value=False), scalar_input=True)
VALUE_DERIVATIVE_AND_SECOND_DERIVATIVE = Operator(
    "value_derivative_and_second_derivative", lambda *a: _build(*a, value=True), scalar_input=True
)
register(SECOND_DERIVATIVE, second_derivative)
register(VALUE_DERIVATIVE_AND_SECOND_DERIVATIVE, value_derivative_and_second_derivative)
