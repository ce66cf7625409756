"""The small protocol every backend implements.

The generic operators need two differentiation primitives, `jvp` and `vjp`,
over flat tuples of arrays. Everything else here has a default a backend may
override with a native fast path (`value_and_grad`, `hvp`), plus the hooks
that say how a leaf becomes an array, how a Cache buffer is made inside the
transform, and how a prepared pipeline is compiled.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Sequence

import attrs

from .. import _arrays as arrays
from .._operators._names import OPERATORS
from .._problem import array_meta

# F(xs) -> (output leaves, dynamic aux). `pull(cts, batched)` -> gradients like xs.
Flat = tuple[Any, ...]
FlatFunction = Callable[[Flat], "tuple[Flat, Any]"]

NO_CONTEXT = contextlib.nullcontext()  # reusable; entered on every call, so made once

_BACKEND_FOR = {"jax": "AutoJAX()", "torch": "AutoTorch()"}
_DISPLAY = {"jax": "JAX", "torch": "torch"}
KINDS = ("active", "constant", "cache")
MODES = ("unprepared", "prepared")


@attrs.frozen
class Backend:
    """Base class of the backends: JAX, PyTorch, finite differences, `SecondOrder`."""

    framework: ClassVar[str | None] = None  # array framework this backend differentiates natively
    # Whether f gets a copy of every array on every evaluation (`fresh_input`): a backend that
    # evaluates f many times on the same values cannot let one evaluation change the next.
    copies_inputs: ClassVar[bool] = False

    # -- what it supports ------------------------------------------------------

    def supports(self, operator: str, kind: str, mode: str = "unprepared") -> bool:
        """Whether this backend runs ``operator`` with an argument of ``kind`` in ``mode``."""
        return operator in OPERATORS and kind in KINDS and mode in MODES

    def capabilities(self) -> dict[tuple[str, str, str], bool]:
        """The support table: (operator, kind, mode) -> supported."""
        return {(o, k, m): self.supports(o, k, m) for o in OPERATORS for k in KINDS for m in MODES}

    def check_framework(self, op_name: str, framework: str | None, where: str) -> None:
        """Raise if this backend cannot differentiate arrays of ``framework``."""
        if self.framework is None or framework not in _BACKEND_FOR or framework == self.framework:
            return
        from .._errors import UnsupportedError

        raise UnsupportedError(
            f"activity.{op_name}: {self!r} cannot differentiate the {_DISPLAY[framework]} value at {where}. "
            f"Use backend={_BACKEND_FOR[framework]}, or convert the values to {_DISPLAY[self.framework]} arrays."
        )

    # -- leaves -------------------------------------------------------------

    def as_array(self, leaf: Any) -> Any:
        """A differentiated leaf as an array of this backend (Python floats become 0-d arrays)."""
        return leaf

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        """A user's tangent leaf, in the dtype of the value it perturbs."""
        return leaf

    def array_meta(self, leaf: Any) -> tuple[Any, ...]:
        """What a prepared operator checks of a leaf (framework, shape, dtype, device)."""
        return array_meta(leaf)

    def fresh_cache(self, leaf: Any, like: Any) -> Any:
        """The buffer ``f`` gets for a Cache leaf, made inside the current transform, with a
        dtype that holds both its own values and those of ``like`` (a differentiated leaf)."""
        return leaf

    def fresh_input(self, leaf: Any) -> Any:
        """A copy of an array ``f`` is given (see ``copies_inputs``); other leaves as they are."""
        return leaf

    def cast_result(self, value: Any, dtype: Any) -> Any:
        """A derivative for a leaf of ``dtype`` (finite differences compute in float64)."""
        return value

    def describe_module(self, module: Any, previous: Any = None) -> Any:
        """One walk over a module: an object with ``.names`` and ``.params`` (the trainable
        parameters), ``.layout`` (what a prepared operator checks); passed to `bind_module`.
        ``previous`` (an earlier description) is returned if it still describes ``module``."""
        from .._errors import UnsupportedError

        raise UnsupportedError(f"{self!r} does not take torch.nn.Module arguments; use AutoTorch().")

    def bind_module(self, module: Any, params: list[Any] | None) -> Any:
        """The module ``f`` sees, from `describe_module`'s description: ``params`` in place of
        its trainable parameters (None: a Constant module), buffers copied."""
        return module

    # -- execution ------------------------------------------------------------

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around every call (grad mode, precision)."""
        return NO_CONTEXT

    def explain_error(self, error: Exception, active: str) -> str | None:
        """What to tell the user about ``error``, raised by ``f`` on this backend, beyond its own
        message (None: nothing); ``active`` names the Active arguments, e.g. "argument 0"."""
        return None

    def forward_only(self, error: Exception) -> bool:
        """Whether ``error``, raised where ``f`` was linearised for reverse mode, says that ``f``
        holds an operation with a forward-mode rule only (so forward mode may still answer)."""
        return False

    def random_state(self) -> Any:
        """The global random state ``f`` may draw from (None if the backend has none to keep)."""
        return None

    def restore_random_state(self, state: Any) -> None:
        """Rewind to `random_state`'s ``state``: an operator evaluating ``f`` a second time
        replays the same random numbers, so both evaluations are one function."""

    def convert_inputs(self, xs: Flat, ctx: Flat) -> tuple[Flat, Flat]:
        """Called at the start of every pipeline run (finite differences work in float64)."""
        return xs, ctx

    def finalize(self, result: Any, problem: Any) -> Any:
        """Called on every operator result before it is returned."""
        return result

    def wrap_function(self, F: FlatFunction, xs: Flat) -> FlatFunction:
        """``F`` as the primitives will call it (finite differences compile it once on JAX inputs)."""
        return F

    def compile(self, pipeline: Callable[..., Any]) -> Callable[..., Any]:
        """Turn a pipeline into its prepared form (JIT, where the backend has one)."""
        return pipeline

    def compile_call(
        self, plan: Any, values: tuple[Any, ...], seed_kwargs: dict[Any, Any], retrace: Callable[..., Any] | None = None
    ) -> "CompiledCall | None":
        """A prepared call specialised end to end for ``plan``'s signature, or None.

        ``plan.direct()`` is the whole operator as one function of the user's
        own arguments (split, checks and pipeline), for a backend that compiles
        it; ``values`` and ``seed_kwargs`` are the preparation's arguments. The
        result is called as ``call(*values, **seed_kwargs)`` with raw values;
        where it cannot take a call, it raises one of its ``misses`` before
        running ``f``, and the prepared operator takes its checked path, which
        says what differs or prepares again. ``retrace(values, seed_kwargs)``,
        given for ``strict=False``, computes the result for a new signature
        from its own plan (a compiling backend may trace it, once per signature).
        """
        return None


    def reusable_call(self, plan: Any) -> Callable[..., Any] | None:
        """For unprepared calls: ``run(f, *values, **seed_kwargs)`` computing ``plan``'s operator for
        any later call of the same signature, or None. It raises `SignatureChanged` before
        running ``f`` on a call of another signature (a new plan is then made). It must not
        keep ``f`` or any value of the call alive, and must check the signature as cheaply as
        it can: it replaces building a plan on every unprepared call."""
        return None

    # -- differentiation primitives -------------------------------------------

    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        """``(ys, aux, dys)``: ``F`` and its derivative along ``ts`` (a leading batch axis if batched)."""
        raise NotImplementedError

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        """``(ys, aux, pull)``: ``F`` and a function pulling cotangents back to ``xs``."""
        raise NotImplementedError

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        """``(ys, aux, grads)`` for a scalar ``F``."""
        ys, aux, pull = self.vjp(F, xs)
        return ys, aux, pull((arrays.ones_like(ys[0]),), False)

    def gradient_function(self, F: FlatFunction) -> FlatFunction:
        """``G(xs) -> (grads, (ys, aux))``: the gradient as a function an outer backend can differentiate."""

        def G(xs: Flat) -> tuple[Flat, Any]:
            ys, aux, grads = self.value_and_grad(F, xs)
            return grads, (ys, aux)

        return derived_from(F, G)

    def derivative_function(self, F: FlatFunction, ts: Flat) -> FlatFunction:
        """``D(xs) -> (dys, (ys, aux))``: derivatives along the batch ``ts``, differentiable by an outer backend."""

        def D(xs: Flat) -> tuple[Flat, Any]:
            ys, aux, dys = self.jvp(F, xs, ts, True)
            return dys, (ys, aux)

        return derived_from(F, D)

    # Second-order operators differentiate an inner first-order function with an
    # outer backend; `SecondOrder` sets the two, every other backend is both.
    @property
    def outer(self) -> "Backend":
        return self

    @property
    def inner(self) -> "Backend":
        return self

    def value_and_hvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Flat, Any, Flat]:
        """``(ys, grads, aux, hvps)``: forward over reverse."""
        grads, (ys, aux), hvps = self.outer.jvp(self.inner.gradient_function(F), xs, ts, batched)
        return ys, grads, aux, hvps

    def value_and_second_jvp(self, F: FlatFunction, xs: Flat, ts: Flat) -> tuple[Flat, Flat, Any, Flat]:
        """``(ys, dys, aux, d2ys)`` along the batch ``ts``; ``d2ys`` has two leading batch axes."""
        dys, (ys, aux), d2ys = self.outer.jvp(self.inner.derivative_function(F, ts), xs, ts, True)
        return ys, dys, aux, d2ys


def stack_batch(items: Sequence[Flat]) -> Flat:
    """Stack a list of flat tuples leaf by leaf along a new leading axis."""
    return tuple(arrays.stack([item[j] for item in items]) for j in range(len(items[0])))


def derived_from(F: FlatFunction, derivative: FlatFunction) -> FlatFunction:
    """``derivative``, a derivative of ``F`` (its gradient, say) that an outer backend
    differentiates again, marked as such: an output of it that depends on no input is a zero
    second derivative (f linear in that input), not f's output cut from its inputs."""
    derivative.derived = True  # type: ignore[attr-defined]
    derivative.op_name = getattr(F, "op_name", None)  # type: ignore[attr-defined]
    derivative.source = F  # type: ignore[attr-defined]  # for messages about the call it came from
    return derivative


def cut_is_an_error(F: FlatFunction) -> bool:
    """Whether ``F``'s outputs depending on none of its inputs is the user's mistake (f's output
    cut from its Active arguments), not a zero derivative (see `derived_from`)."""
    return not getattr(F, "derived", False)


class SignatureChanged(Exception):
    """A compiled call met arguments it was not compiled for (see `Backend.compile_call`)."""


@attrs.frozen
class CompiledCall:
    """A prepared call specialised by a backend, and the exceptions by which it declines one.

    With ``rebuild``, the call returns the result's leaves, and ``rebuild(leaves)`` is the
    result (the prepared object calls it, saving a frame per call). ``refuses_annotations``:
    an annotated argument (``Constant(x)``) is one of its misses (`jax.jit` refuses it as no
    JAX type), so the prepared object does not look for one before the call. ``native``,
    where the framework's own dispatch can serve the prepared call with no Python frame,
    makes that callable from the prepared object's paths for every other call
    (`native_call` in ``_jax_dispatch``)."""

    call: Callable[..., Any]
    misses: tuple[type[BaseException], ...] = (SignatureChanged,)
    rebuild: Callable[[Any], Any] | None = None
    refuses_annotations: bool = False
    native: Callable[[Callable[..., Any], Callable[..., Any], Callable[..., Any]], Any] | None = None

    def __call__(self, *values: Any, **seed_kwargs: Any) -> Any:
        out = self.call(*values, **seed_kwargs)
        return out if self.rebuild is None else self.rebuild(out)
