"""`hessian` and `value_gradient_and_hessian`: forward over reverse, one batched HVP."""

from __future__ import annotations

from typing import Any, Callable, overload

from .. import _arrays as arrays
from .._annotations import Active, Annotation
from .._problem import Problem
from ..backends import Backend
from .._arrays import input_basis
from ._common import blocks, call, Operator, register, Seeds, start
from ._typing import AR, AT, ArrayLike, Data, ModuleGradient, NNXGradient, NNXModuleLike, R, T, TorchModuleLike


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds | None, *, value: bool
) -> Callable[..., Any]:
    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], extra: Any) -> Any:
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


@overload
def hessian(
    f: Callable[..., Any], arg: Active[TorchModuleLike | NNXModuleLike], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> Any: ...
@overload
def hessian(
    f: Callable[..., AR], arg: Active[ArrayLike | float], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> AR: ...
@overload
def hessian(
    f: Callable[..., Any], arg1: Active[TorchModuleLike | NNXModuleLike], arg2: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> Any: ...
@overload
def hessian(
    f: Callable[..., Any], arg1: Active[Any], arg2: Active[TorchModuleLike | NNXModuleLike], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> Any: ...
@overload
def hessian(
    f: Callable[..., AR], arg1: Active[ArrayLike | float], arg2: Active[ArrayLike | float], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[tuple[AR, AR], tuple[AR, AR]]: ...
@overload
def hessian(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]
) -> Any: ...
def hessian(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]) -> Any:
    """Hessian of a scalar ``f`` in `jax.hessian`'s layout (input structure twice,
    leaves of shape ``shape_i + shape_j``); a tuple of tuples for several Active arguments.

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
        The Hessian: the Active argument's structure twice, leaves of shape ``shape_i + shape_j``;
        a tuple of tuples for several Active arguments.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: ``f`` does not return a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.hessian(lambda x: x[0] * x[1] ** 2, ad.Active(jnp.array([1.0, 2.0])))
    Array([[0., 4.],
           [4., 2.]], dtype=float32)
    """
    return call(HESSIAN, f, args, backend, {}, {}, keywords)


@overload
def value_gradient_and_hessian(
    f: Callable[..., R], arg: Active[TorchModuleLike], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, ModuleGradient, Any]: ...
@overload
def value_gradient_and_hessian(
    f: Callable[..., R], arg: Active[NNXModuleLike], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, NNXGradient, Any]: ...
@overload
def value_gradient_and_hessian(
    f: Callable[..., AR], arg: Active[float], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[AR, Any, AR]: ...
@overload
def value_gradient_and_hessian(
    f: Callable[..., AR], arg: Active[AT], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[AR, AT, AR]: ...
@overload
def value_gradient_and_hessian(
    f: Callable[..., R], arg: Active[float], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, Any, Any]: ...
@overload
def value_gradient_and_hessian(
    f: Callable[..., R], arg: Active[T], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, T, Any]: ...
@overload
def value_gradient_and_hessian(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None,
    **keywords: Annotation[Any],
) -> tuple[R, Any, Any]: ...
def value_gradient_and_hessian(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]) -> Any:
    """``(value, gradient, hessian)``.

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
        ``(value, gradient, hessian)``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: ``f`` does not return a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

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
