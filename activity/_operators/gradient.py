"""`gradient` and `value_and_gradient`: reverse mode on a scalar output."""

from __future__ import annotations

from typing import Any, Callable

from .._annotations import Annotation
from ..backends import Backend
from ._common import Operator, call, register, start, with_value


def _build(problem, f, backend, seeds, *, value: bool, has_aux: bool = False) -> Callable:
    def pipeline(xs, ctx, extra):
        xs, traced, F = start(problem, f, backend, xs, ctx, has_aux=has_aux, scalar=True)
        ys, aux, grads = backend.value_and_grad(F, xs)
        aux = traced.aux(aux) if has_aux else None
        return with_value(value, traced.output(ys) if value else None, has_aux, aux, problem.like_active(grads))

    return pipeline


def gradient(f: Callable, *args: Annotation, backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation) -> Any:
    """Gradient of a scalar ``f`` with respect to its Active arguments.

    One Active argument: a result of its structure; several: a tuple. A
    ``torch.nn.Module`` gives a dict keyed like ``named_parameters()``. With
    ``has_aux=True`` ``f`` returns ``(output, aux)`` and the result is ``(grad, aux)``.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> loss = lambda params, x: jnp.sum((params["w"] * x + params["b"]) ** 2)
    >>> g = ad.gradient(loss, ad.Active({"w": jnp.array(1.0), "b": jnp.array(0.0)}),
    ...                 ad.Constant(jnp.array([1.0, 2.0])))
    >>> {k: float(v) for k, v in g.items()}
    {'w': 10.0, 'b': 6.0}
    """
    return call(GRADIENT, f, args, backend, {"has_aux": has_aux}, {}, keywords)


def value_and_gradient(
    f: Callable, *args: Annotation, backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation
) -> tuple[Any, Any]:
    """``(value, gradient)``, or ``((value, aux), gradient)`` with ``has_aux=True``.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_gradient(lambda x: jnp.sum(x**2), ad.Active(jnp.array([1.0, 2.0])))
    (Array(5., dtype=float32), Array([2., 4.], dtype=float32))
    """
    return call(VALUE_AND_GRADIENT, f, args, backend, {"has_aux": has_aux}, {}, keywords)


GRADIENT = Operator("gradient", lambda *a, **k: _build(*a, value=False, **k))
VALUE_AND_GRADIENT = Operator("value_and_gradient", lambda *a, **k: _build(*a, value=True, **k))
register(GRADIENT, gradient)
register(VALUE_AND_GRADIENT, value_and_gradient)
