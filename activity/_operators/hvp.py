"""`hvp` and `gradient_and_hvp`: Hessian-vector products, forward over reverse."""

from __future__ import annotations

from typing import Any, Callable

from .._annotations import Annotation
from ..backends import Backend
from ._common import Operator, call, per_seed, register, start


def _build(problem, f, backend, seeds, *, with_gradient: bool) -> Callable:
    def pipeline(xs, ctx, ts):
        xs, traced, F = start(problem, f, backend, xs, ctx, scalar=True)
        _, grads, _, hvps = backend.value_and_hvp(F, xs, ts, seeds.batch is not None)
        result = per_seed(seeds, lambda b: problem.like_active(hvps if b is None else [h[b] for h in hvps]))
        return (problem.like_active(grads), result) if with_gradient else result

    return pipeline


def hvp(f: Callable, *args: Annotation, backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation) -> Any:
    """Hessian-vector product of a scalar ``f`` along ``tangent`` (a list for ``tangents=[...]``).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.hvp(lambda x: jnp.sum(x**3), ad.Active(jnp.array([1.0, 2.0])), tangent=jnp.array([1.0, 1.0]))
    Array([ 6., 12.], dtype=float32)
    """
    return call(HVP, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


def gradient_and_hvp(
    f: Callable, *args: Annotation, backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation
) -> tuple[Any, Any]:
    """``(gradient, hvp)``.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.gradient_and_hvp(lambda x: jnp.sum(x**3), ad.Active(jnp.array([2.0])), tangent=jnp.array([1.0]))
    (Array([12.], dtype=float32), Array([12.], dtype=float32))
    """
    return call(GRADIENT_AND_HVP, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


HVP = Operator("hvp", lambda *a: _build(*a, with_gradient=False), seed="tangent")
GRADIENT_AND_HVP = Operator("gradient_and_hvp", lambda *a: _build(*a, with_gradient=True), seed="tangent")
register(HVP, hvp)
register(GRADIENT_AND_HVP, gradient_and_hvp)
