"""`hvp` and `gradient_and_hvp`: Hessian-vector products, forward over reverse."""

from __future__ import annotations

from typing import Any, Callable, overload, Sequence

from .._annotations import Active, Annotation
from .._problem import Problem
from ..backends import Backend
from ._common import call, Operator, per_seed, register, Seeds, start
from ._typing import Data, ModuleGradient, NNXGradient, NNXModuleLike, T, TorchModuleLike


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds, *, with_gradient: bool
) -> Callable[..., Any]:
    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], ts: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx, scalar=True)
        _, grads, _, hvps = backend.value_and_hvp(F, xs, ts, seeds.batch is not None)
        result = per_seed(seeds, lambda b: problem.like_active(hvps if b is None else [h[b] for h in hvps]))
        return (problem.like_active(grads), result) if with_gradient else result

    return pipeline


@overload
def hvp(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Data,
) -> ModuleGradient: ...
@overload
def hvp(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Data,
) -> NNXGradient: ...
@overload
def hvp(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Data,
) -> list[ModuleGradient]: ...
@overload
def hvp(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Data,
) -> list[NNXGradient]: ...
@overload
def hvp(
    f: Callable[..., Any], arg: Active[float], /, *args: Data,
    backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Data,
) -> Any: ...
@overload
def hvp(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Data,
) -> T: ...
@overload
def hvp(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Data,
) -> list[T]: ...
@overload
def hvp(
    f: Callable[..., Any], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Annotation[Any],
) -> Any: ...
def hvp(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation[Any]) -> Any:
    """Hessian-vector product of a scalar ``f`` along ``tangent`` (a list for ``tangents=[...]``).

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        tangent: one tangent, of the structure of the Active argument (a tuple of them for
            several Active arguments).
        tangents: a list of tangents instead, computed in one batched call where the backend can.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        The Hessian-vector product, of the structure of the Active argument; a list for ``tangents=``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: ``f`` does not return a scalar.
        TypeError: neither or both of ``tangent=`` and ``tangents=`` are given.
        ValueError: a tangent's structure or shapes differ from the Active arguments'.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.hvp(lambda x: jnp.sum(x**3), ad.Active(jnp.array([1.0, 2.0])), tangent=jnp.array([1.0, 1.0]))
    Array([ 6., 12.], dtype=float32)
    """
    return call(HVP, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Data,
) -> tuple[ModuleGradient, ModuleGradient]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Data,
) -> tuple[NNXGradient, NNXGradient]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Data,
) -> tuple[ModuleGradient, list[ModuleGradient]]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Data,
) -> tuple[NNXGradient, list[NNXGradient]]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[float], /, *args: Data,
    backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Data,
) -> tuple[Any, Any]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Data,
) -> tuple[T, T]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Data,
) -> tuple[T, list[T]]: ...
@overload
def gradient_and_hvp(
    f: Callable[..., Any], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Annotation[Any],
) -> Any: ...
def gradient_and_hvp(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation[Any]
) -> Any:
    """``(gradient, hvp)``.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        tangent: one tangent, of the structure of the Active argument (a tuple of them for
            several Active arguments).
        tangents: a list of tangents instead, computed in one batched call where the backend can.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        ``(gradient, hvp)``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: ``f`` does not return a scalar.
        TypeError: neither or both of ``tangent=`` and ``tangents=`` are given.
        ValueError: a tangent's structure or shapes differ from the Active arguments'.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

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
