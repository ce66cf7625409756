"""`pullback` and `value_and_pullback`: vector-Jacobian products (reverse mode)."""

from __future__ import annotations

from typing import Any, Callable, overload, Sequence

from .. import _arrays as arrays
from .._tree import leaf_paths, structure_difference
from .._annotations import Active, Annotation
from .._problem import Problem, Traced
from ..backends import Backend
from ._common import batch_hint, call, Operator, per_seed, register, Seeds, start
from ._typing import Data, ModuleGradient, NNXGradient, NNXModuleLike, R, T, TorchModuleLike


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds, *, value: bool
) -> Callable[..., Any]:
    batched = seeds.batch is not None

    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], cts: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, _, pull = backend.vjp(F, xs)
        cts = checked_cotangents(problem, traced, seeds, cts, ys)
        grads = pull(cts, batched)
        result = per_seed(seeds, lambda b: problem.like_active(grads if b is None else [g[b] for g in grads]))
        return (traced.output(ys), result) if value else result

    return pipeline


def checked_cotangents(problem: Any, traced: Any, seeds: Any, cts: tuple[Any, ...], ys: tuple[Any, ...]) -> tuple[Any, ...]:
    what = "cotangent" if seeds.batch is None else "cotangents[i]"
    if seeds.spec != traced.out_spec:
        raise ValueError(
            f"activity.{problem.op_name}: {what} must have the structure of f's output: "
            f"{structure_difference(traced.out_spec, seeds.spec)}."
            + (batch_hint("cotangent", seeds.spec.num_children) if seeds.batch is None and seeds.spec.type is list else "")
        )
    lead = () if seeds.batch is None else (seeds.batch,)
    for index, (ct, y) in enumerate(zip(cts, ys)):
        if arrays.shape(ct) != lead + arrays.shape(y):
            path = leaf_paths(traced.output(list(range(len(ys)))))[index]
            raise ValueError(
                f"activity.{problem.op_name}: {what}{path} has shape {arrays.shape(ct)[len(lead):]}, "
                f"but f's output there has shape {arrays.shape(y)}. Pass a cotangent shaped like f's output."
            )
    return tuple(problem.backend.as_tangent(ct, y.dtype) for ct, y in zip(cts, ys))


@overload
def pullback(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: Any, cotangents: None = None,
    **keywords: Data,
) -> ModuleGradient: ...
@overload
def pullback(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: Any, cotangents: None = None,
    **keywords: Data,
) -> NNXGradient: ...
@overload
def pullback(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: None = None, cotangents: Sequence[Any],
    **keywords: Data,
) -> list[ModuleGradient]: ...
@overload
def pullback(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: None = None, cotangents: Sequence[Any],
    **keywords: Data,
) -> list[NNXGradient]: ...
@overload
def pullback(
    f: Callable[..., Any], arg: Active[float], /, *args: Data,
    backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None,
    **keywords: Data,
) -> Any: ...
@overload
def pullback(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, cotangent: Any, cotangents: None = None,
    **keywords: Data,
) -> T: ...
@overload
def pullback(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, cotangent: None = None, cotangents: Sequence[Any],
    **keywords: Data,
) -> list[T]: ...
@overload
def pullback(
    f: Callable[..., Any], /, *args: Annotation[Any],
    backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None,
    **keywords: Annotation[Any],
) -> Any: ...
def pullback(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None,
    **keywords: Annotation[Any],
) -> Any:
    """The cotangent pulled back to the Active arguments (a VJP), or a list for ``cotangents=[...]``.

    A cotangent has the structure of ``f``'s output; the result has the
    structure of the Active argument(s).

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        cotangent: one cotangent, of the structure of ``f``'s output.
        cotangents: a list of cotangents instead, computed in one batched call where the backend can.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        The pulled-back cotangent, of the structure of the Active argument (a tuple for several);
        a list of them for ``cotangents=``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        TypeError: neither or both of ``cotangent=`` and ``cotangents=`` are given.
        ValueError: a cotangent's structure or shapes differ from ``f``'s output.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.pullback(lambda x: x**2, ad.Active(jnp.array([1.0, 2.0])), cotangent=jnp.array([1.0, 1.0]))
    Array([2., 4.], dtype=float32)
    """
    return call(PULLBACK, f, args, backend, {}, {"cotangent": cotangent, "cotangents": cotangents}, keywords)


@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: Any, cotangents: None = None,
    **keywords: Data,
) -> tuple[R, ModuleGradient]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: Any, cotangents: None = None,
    **keywords: Data,
) -> tuple[R, NNXGradient]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: None = None, cotangents: Sequence[Any],
    **keywords: Data,
) -> tuple[R, list[ModuleGradient]]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, cotangent: None = None, cotangents: Sequence[Any],
    **keywords: Data,
) -> tuple[R, list[NNXGradient]]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[float], /, *args: Data,
    backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None,
    **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, cotangent: Any, cotangents: None = None,
    **keywords: Data,
) -> tuple[R, T]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, cotangent: None = None, cotangents: Sequence[Any],
    **keywords: Data,
) -> tuple[R, list[T]]: ...
@overload
def value_and_pullback(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None,
    **keywords: Annotation[Any],
) -> tuple[R, Any]: ...
def value_and_pullback(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None, **keywords: Annotation[Any]
) -> Any:
    """``(value, pullback)``.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        cotangent: one cotangent, of the structure of ``f``'s output.
        cotangents: a list of cotangents instead, computed in one batched call where the backend can.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        ``(value, pullback)``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        TypeError: neither or both of ``cotangent=`` and ``cotangents=`` are given.
        ValueError: a cotangent's structure or shapes differ from ``f``'s output.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_pullback(lambda x: 2 * x, ad.Active(jnp.array(1.0)), cotangent=jnp.array(3.0))
    (Array(2., dtype=float32, weak_type=True), Array(6., dtype=float32))
    """
    return call(VALUE_AND_PULLBACK, f, args, backend, {}, {"cotangent": cotangent, "cotangents": cotangents}, keywords)


PULLBACK = Operator("pullback", lambda *a: _build(*a, value=False), seed="cotangent")
VALUE_AND_PULLBACK = Operator("value_and_pullback", lambda *a: _build(*a, value=True), seed="cotangent")
register(PULLBACK, pullback)
register(VALUE_AND_PULLBACK, value_and_pullback)
