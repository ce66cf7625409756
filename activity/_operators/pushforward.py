"""`pushforward` and `value_and_pushforward`: Jacobian-vector products (forward mode)."""

from __future__ import annotations

from typing import Any, Callable

from .._annotations import Annotation
from ..backends import Backend
from ._common import Operator, call, per_seed, register, start


def _build(problem, f, backend, seeds, *, value: bool) -> Callable:
    def pipeline(xs, ctx, ts):
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, _, dys = backend.jvp(F, xs, ts, seeds.batch is not None)
        tangent_out = per_seed(seeds, lambda b: traced.output(dys if b is None else [d[b] for d in dys]))
        return (traced.output(ys), tangent_out) if value else tangent_out

    return pipeline


def pushforward(
    f: Callable, *args: Annotation, backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation
) -> Any:
    """The output tangent of ``f`` along ``tangent`` (a JVP), or a list for ``tangents=[...]``.

    A tangent has the structure of the Active argument (a tuple of them when
    there are several); a batch is computed in one vectorised call where the
    backend can.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.pushforward(lambda x: x**2, ad.Active(jnp.array([1.0, 2.0])), tangent=jnp.array([1.0, 0.0]))
    Array([2., 0.], dtype=float32)
    """
    return call(PUSHFORWARD, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


def value_and_pushforward(
    f: Callable, *args: Annotation, backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation
) -> tuple[Any, Any]:
    """``(value, pushforward)``.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_pushforward(jnp.sin, ad.Active(jnp.array(0.0)), tangents=[jnp.array(2.0)])
    (Array(0., dtype=float32, weak_type=True), [Array(2., dtype=float32, weak_type=True)])
    """
    return call(VALUE_AND_PUSHFORWARD, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


PUSHFORWARD = Operator("pushforward", lambda *a: _build(*a, value=False), seed="tangent")
VALUE_AND_PUSHFORWARD = Operator("value_and_pushforward", lambda *a: _build(*a, value=True), seed="tangent")
register(PUSHFORWARD, pushforward)
register(VALUE_AND_PUSHFORWARD, value_and_pushforward)
