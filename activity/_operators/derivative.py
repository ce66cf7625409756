"""`derivative` and `value_and_derivative`: d output / d scalar input, in forward mode."""

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
        ys, _, dys = backend.jvp(F, xs, input_basis(xs, backend), True)
        derivative = problem.like_active([traced.output([dy[k] for dy in dys]) for k in range(n)])
        return (traced.output(ys), derivative) if value else derivative

    return pipeline


def derivative(f: Callable, *args: Annotation, backend: Backend | None = None, **keywords: Annotation) -> Any:
    """Derivative of ``f``'s output with respect to scalar Active arguments.

    The output may be any array or pytree; the result has its structure. With
    several Active scalars, a tuple of partial derivatives.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.derivative(lambda t: jnp.array([t, t**2]), ad.Active(3.0), backend=ad.AutoJAX())
    Array([1., 6.], dtype=float32)
    """
    return call(DERIVATIVE, f, args, backend, {}, {}, keywords)


def value_and_derivative(f: Callable, *args: Annotation, backend: Backend | None = None, **keywords: Annotation) -> tuple[Any, Any]:
    """``(f(*values), derivative)``; see `derivative`.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_derivative(lambda t: t**3, ad.Active(2.0), backend=ad.AutoJAX())
    (Array(8., dtype=float32, weak_type=True), Array(12., dtype=float32, weak_type=True))
    """
    return call(VALUE_AND_DERIVATIVE, f, args, backend, {}, {}, keywords)


DERIVATIVE = Operator("derivative", lambda *a: _build(*a, value=False), scalar_input=True)
VALUE_AND_DERIVATIVE = Operator("value_and_derivative", lambda *a: _build(*a, value=True), scalar_input=True)
register(DERIVATIVE, derivative)
register(VALUE_AND_DERIVATIVE, value_and_derivative)
