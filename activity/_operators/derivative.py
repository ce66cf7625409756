"""`derivative` and `value_and_derivative`: d output / d scalar input, in forward mode."""

from __future__ import annotations

from typing import Any, Callable, overload

from .._annotations import Active, Annotation
from .._problem import Problem
from ..backends import Backend
from .._arrays import input_basis
from ._common import call, Operator, register, Seeds, start
from ._typing import Data, R


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds | None, *, value: bool
) -> Callable[..., Any]:
    n = len(problem.diff_shapes)

    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], extra: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, _, dys = backend.jvp(F, xs, input_basis(xs, backend), True)
        derivative = problem.like_active([traced.output([dy[k] for dy in dys]) for k in range(n)])
        return (traced.output(ys), derivative) if value else derivative

    return pipeline


@overload
def derivative(
    f: Callable[..., R], arg: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> R: ...
@overload
def derivative(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, R]: ...
@overload
def derivative(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], arg3: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, R, R]: ...
@overload
def derivative(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None,
    **keywords: Annotation[Any],
) -> Any: ...
def derivative(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]) -> Any:
    """Derivative of ``f``'s output with respect to scalar Active arguments.

    The output may be any array or pytree; the result has its structure. With
    several Active scalars, a tuple of partial derivatives.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        The derivative, of the structure of ``f``'s output; a tuple of them for several Active
        arguments.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: an Active argument is not a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.derivative(lambda t: jnp.array([t, t**2]), ad.Active(3.0), backend=ad.AutoJAX())
    Array([1., 6.], dtype=float32)
    """
    return call(DERIVATIVE, f, args, backend, {}, {}, keywords)


@overload
def value_and_derivative(
    f: Callable[..., R], arg: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, R]: ...
@overload
def value_and_derivative(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, tuple[R, R]]: ...
@overload
def value_and_derivative(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], arg3: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, tuple[R, R, R]]: ...
@overload
def value_and_derivative(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None,
    **keywords: Annotation[Any],
) -> tuple[R, Any]: ...
def value_and_derivative(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]) -> Any:
    """``(f(*values), derivative)``; see `derivative`.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        ``(value, derivative)``: ``f``'s output and `derivative`'s result.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: an Active argument is not a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

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
