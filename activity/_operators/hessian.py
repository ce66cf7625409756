"""`hessian` and `value_gradient_and_hessian`: forward over reverse, one batched HVP."""

from __future__ import annotations

from typing import Any, Callable

from .. import _arrays as arrays
from .._annotations import Annotation
from ..backends import Backend
from .._arrays import input_basis
from ._common import Operator, blocks, call, register, start


def _build(problem, f, backend, seeds, *, value: bool) -> Callable:
    def pipeline(xs, ctx, extra):
        xs, traced, F = start(problem, f, backend, xs, ctx, scalar=True)
        shapes = [arrays.shape(x) for x in xs]
        sizes = [arrays.size(x) for x in xs]
        ys, grads, _, hvps = backend.value_and_hvp(F, xs, input_basis(xs, backend), True)
        # hvps[j] has shape (N, *shape_j); its rows for leaf i are d2f / dx_i dx_j.
        by_column = [blocks(h, sizes, shapes, s, inner_first=False) for h, s in zip(hvps, shapes)]
        hess = problem.like_active(
            [problem.like_active([column[i] for column in by_column]) for i in range(len(xs))]
        )
        if not value:
            return hess
        return traced.output(ys), problem.like_active(grads), hess

    return pipeline


def hessian(f: Callable, *args: Annotation, backend: Backend | None = None, **keywords: Annotation) -> Any:
    """Hessian of a scalar ``f`` in `jax.hessian`'s layout (input structure twice,
    leaves of shape ``shape_i + shape_j``); a tuple of tuples for several Active arguments.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.hessian(lambda x: x[0] * x[1] ** 2, ad.Active(jnp.array([1.0, 2.0])))
    Array([[0., 4.],
           [4., 2.]], dtype=float32)
    """
    return call(HESSIAN, f, args, backend, {}, {}, keywords)


def value_gradient_and_hessian(f: Callable, *args: Annotation, backend: Backend | None = None, **keywords: Annotation) -> tuple[Any, Any, Any]:
    """``(value, gradient, hessian)``.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> value, grad, hess = ad.value_gradient_and_hessian(lambda x: jnp.sum(x**3), ad.Active(jnp.array([1.0])))
    >>> value, grad, hess
    (Array(1., dtype=float32), Array([3.], dtype=float32), Array([[6.]], dtype=float32))
    """
    return call(VALUE_GRADIENT_AND_HESSIAN, f, args, backend, {}, {}, keywords)


HESSIAN = Operator("hessian", lambda *a: _build(*a, value=False))
VALUE_GRADIENT_AND_HESSIAN = Operator("value_gradient_and_hessian", lambda *a: _build(*a, value=True))
register(HESSIAN, hessian)
register(VALUE_GRADIENT_AND_HESSIAN, value_gradient_and_hessian)
