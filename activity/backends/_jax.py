"""JAX: `jax.jvp`, `jax.vjp`, `jax.vmap`, and `jax.jit` for prepared operators."""

from __future__ import annotations

import threading
from typing import Any, Callable

import attrs
import numpy as np

from .. import _arrays as arrays
from .._problem import array_meta, combine, partition
from ._base import Backend, CompiledCall, Flat, FlatFunction, SignatureChanged


def _jax() -> Any:
    import jax

    return jax


@attrs.frozen
class AutoJAX(Backend):
    """Differentiate with JAX transforms; prepared operators are compiled with `jax.jit`.

    Constants are traced arguments of the compiled function, so new data of
    the same shape and dtype never recompiles; non-array leaves are static.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.gradient(lambda w, x: jnp.sum((w * x) ** 2), ad.Active(jnp.ones(2)),
    ...             ad.Constant(jnp.array([1.0, 2.0])), backend=ad.AutoJAX())
    Array([2., 8.], dtype=float32)
    """

    framework = "jax"

    def as_array(self, leaf: Any) -> Any:
        return _jax().numpy.asarray(leaf) if isinstance(leaf, float) else leaf

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        return _jax().numpy.asarray(leaf, dtype=dtype)

    def array_meta(self, leaf: Any) -> tuple:
        # A numpy array is what `jax.jit` makes of it: a JAX array of the canonical dtype
        # (float64 becomes float32 unless x64 is enabled), so it is accepted where a JAX
        # array of that shape and dtype was prepared, as `jax.jit` accepts it.
        if isinstance(leaf, (np.ndarray, np.generic)):
            dtype = _jax().dtypes.canonicalize_dtype(leaf.dtype)
            return ("jax", tuple(leaf.shape), str(dtype), None)
        return array_meta(leaf)

    def fresh_cache(self, leaf: Any, like: Any) -> Any:
        # JAX arrays are immutable: f writes with `.at[...].set(...)` and gets a traced array.
        # A leaf that is not floating (a counter, an index, a mask) keeps its dtype.
        jnp = _jax().numpy
        floating = like is not None and arrays.dtype_kind(leaf) == "f"
        return jnp.asarray(leaf, dtype=jnp.result_type(leaf, like) if floating else None)

    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        jax = _jax()

        def one(tangent: Flat) -> tuple:
            return jax.jvp(F, (xs,), (tangent,), has_aux=True)

        if not batched:
            ys, dys, aux = one(ts)
        else:
            ys, dys, aux = jax.vmap(one, out_axes=(None, 0, None))(ts)
        return ys, aux, dys

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        jax = _jax()
        ys, pull_one, aux = jax.vjp(F, xs, has_aux=True)

        def pull(cts: Flat, batched: bool) -> Flat:
            if batched:
                return jax.vmap(lambda ct: pull_one(ct)[0])(cts)
            return pull_one(cts)[0]

        return ys, aux, pull

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        def scalar(xs_: Flat) -> tuple[Any, tuple]:
            ys, aux = F(xs_)
            return ys[0], (ys, aux)

        (_, (ys, aux)), grads = _jax().value_and_grad(scalar, has_aux=True)(xs)
        return ys, aux, grads

    def compile(self, pipeline: Callable) -> Callable:
        dynamic_only, rebuild = _with_static_output(pipeline)
        jitted = _jax().jit(dynamic_only)

        def run(xs: Flat, ctx: Flat, extra: Flat | None) -> Any:
            return rebuild(jitted(xs, ctx, extra))

        return run

    def compile_call(
        self, plan: Any, values: tuple, seed_kwargs: dict, retrace: Callable | None = None
    ) -> CompiledCall | None:
        # `jax.jit` of the whole call, arguments as the user passes them: JAX
        # flattens them and finds the compiled code in C++, so a prepared call
        # costs what a call of `jax.jit(jax.grad(f))` costs. JAX refuses
        # arguments it cannot take (a torch tensor, a string) with TypeError or
        # ValueError, before anything runs. With `retrace`, a new signature is
        # traced once more into the same jitted function, from its own plan.
        if type(self) is not AutoJAX or not plan.problem.arrays_only:
            return None  # a subclass may change any step: it gets the generic path, which runs its hooks
        call, misses = plan.direct(), (SignatureChanged, TypeError, ValueError)
        jitted = _sealed_jit(call, values, seed_kwargs, retrace)
        if jitted is not None:
            return CompiledCall(jitted, misses)
        if retrace is not None:  # the static part of the output may differ between signatures
            return None
        dynamic_only, rebuild = _with_static_output(call)  # an output JAX cannot return (a string in aux)
        jitted = _sealed_jit(dynamic_only, values, seed_kwargs, None)
        if jitted is None:
            return None
        return CompiledCall(lambda *values, **seed_kwargs: rebuild(jitted(*values, **seed_kwargs)), misses)


def _sealed_jit(call: Callable, values: tuple, seed_kwargs: dict, retrace: Callable | None) -> Callable | None:
    """``jax.jit`` of ``call``, traced, compiled and run once on ``values``, then sealed:
    a later call that would trace again has another signature, and is traced from
    ``retrace`` or, without it, raises SignatureChanged."""
    sealed = False

    def whole(*values: Any, **seed_kwargs: Any) -> Any:
        if not sealed:
            return call(values, seed_kwargs)
        if retrace is None:
            raise SignatureChanged
        return retrace(values, seed_kwargs)

    jitted = _jax().jit(whole)
    try:
        jitted(*values, **seed_kwargs)  # the result is dropped: this run only fills JAX's caches
    except Exception:  # noqa: BLE001 - the checked path runs the call again and reports any error
        return None
    sealed = True
    return jitted


def _with_static_output(function: Callable) -> tuple[Callable, Callable]:
    """``function`` returning only its array leaves, and how to put the rest back.

    JAX functions return arrays only; the static part of the output (structure,
    strings, None) is recorded at trace time, fixed for one prepared signature.
    """
    recorded: dict[str, Any] = {}
    lock = threading.Lock()

    def dynamic_only(*args: Any) -> list:
        dynamic, static = partition(function(*args))
        with lock:
            recorded["static"] = static
        return dynamic

    def rebuild(dynamic: list) -> Any:
        return combine(dynamic, recorded["static"])

    return dynamic_only, rebuild
