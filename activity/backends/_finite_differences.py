"""Finite differences: the reference backend.

Central differences along each tangent, with the step chosen by Ridders'
Richardson extrapolation, evaluated in float64 in the inputs' own framework.
No AD system is involved, so it works on any Python function; it is slow
(one Jacobian column per input entry for reverse-mode operators).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import math
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, ClassVar

import attrs
import numpy as np

from .. import _arrays as arrays
from .._errors import UnsupportedError, caller_stacklevel
from ._base import Backend, Flat, FlatFunction


def _to_float64(leaf: Any) -> Any:
    if arrays.dtype_kind(leaf) != "f":
        return leaf
    if arrays.is_torch(leaf):
        return leaf.detach().to(sys.modules["torch"].float64)
    if arrays.is_jax(leaf):
        return sys.modules["jax"].numpy.asarray(leaf, dtype="float64")
    return np.asarray(leaf, dtype=np.float64)


def _max_abs(leaves: Flat) -> float:
    """Largest magnitude over all leaves; inf when any entry is nan (so it never looks small)."""
    largest = max((float(abs(leaf).max()) for leaf in leaves if arrays.size(leaf)), default=0.0)
    return math.inf if math.isnan(largest) else largest


def _positive(name: str, hint: str) -> Callable[..., Any]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"AutoFiniteDifferences({name}={value!r}): must be a finite number > 0 ({hint}).")

    return check


def _greater_than_one(instance: Any, attribute: Any, value: Any) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 1):
        raise ValueError(
            f"AutoFiniteDifferences(shrink={value!r}): must be a finite number > 1 (each step is the previous "
            f"one divided by it), e.g. 1.4."
        )


def _count(name: str, least: int, why: str) -> Callable[..., Any]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"AutoFiniteDifferences({name}={value!r}): must be an integer >= {least} ({why}).")

    return check


class ReferenceUnreliableWarning(RuntimeWarning):
    """The float64 finite differences cannot be trusted for this ``f``; ``reason`` says why,
    as the testing kit reports it (the reference unreliable, not the backend it checks wrong)."""

    reason: ClassVar[str] = "the finite-difference reference cannot be trusted for this f"


class ReferencePrecisionWarning(ReferenceUnreliableWarning):
    """``f`` returned floats of lower precision than the float64 finite differences evaluate in."""

    reason = (
        "f computes in lower precision than the float64 reference (a .float() call, a float32 "
        "parameter or constant inside f), so the finite differences carry its rounding error; "
        "keep f in float64 for the reference, or pass reference=<an AD backend>"
    )


class ReferenceRandomnessWarning(ReferenceUnreliableWarning):
    """``f`` draws random numbers that JAX's float64 mode changes: the reference differentiates other draws."""

    reason = (
        "f draws random numbers at JAX's default dtype, which the reference's float64 mode makes "
        "float64, so its draws (a dropout mask, say) differ from those the backend under test sees; "
        "give the draws an explicit dtype (jax.random.uniform(key, shape, dtype=jnp.float32) < p "
        "for a mask), or pass reference=<an AD backend>"
    )


class ReferenceNondeterminismWarning(ReferenceUnreliableWarning):
    """``f`` returned different values for the same inputs: its differences are partly noise."""

    reason = (
        "f returns different values on the same inputs (random numbers from a generator of its own, "
        "a clock, a nondeterministic kernel), so its finite differences measure that noise; make f "
        "deterministic for the check (seed the generator inside f), or pass reference=<an AD backend>"
    )


class ReferenceKinkWarning(ReferenceUnreliableWarning):
    """``f``'s slopes on either side of the point differ at every step: a kink at the point (or
    closer to it than the smallest step), or values noisier than their precision (an inner
    finite difference, an iterative solver stopping at a tolerance), so no step's estimate settled
    within the testing kit's default tolerances."""

    reason = (
        "f is not differentiable at this point, or has a kink closer to it than the reference's "
        "smallest step (a ReLU or abs at 0, tied maxima, a clip at its bound), or its values are "
        "noisy at that scale: the finite differences average the slopes on either side, where an "
        "AD backend picks one by its own convention; move the point off the kink, or pass "
        "reference=<an AD backend>"
    )


class ReferenceQuantizedWarning(ReferenceUnreliableWarning):
    """``f`` did not move at all over a step at which its estimated slope says it must: it is
    piecewise constant at a scale above its precision (it rounds, floors or buckets)."""

    reason = (
        "f is piecewise constant at a scale coarser than its precision (it rounds, floors or "
        "buckets its input or an intermediate, such as round(x, decimals=3)), so its derivative is "
        "zero almost everywhere while the finite differences measure the slope of the staircase; "
        "differentiate f without the rounding, or pass reference=<an AD backend>"
    )




def _refuse_an_outer_tape(xs: Flat, ctx: Flat) -> None:
    """Finite differences give plain numbers: inside f of an AutoTorch operator that
    differentiates through them, the outer derivative would silently lose this call's part."""
    from ._torch import differentiated_by_an_outer_call

    torch = sys.modules["torch"]
    tensors = [leaf for leaf in (*xs, *ctx) if isinstance(leaf, torch.Tensor)]
    tensors += [p for leaf in ctx for p in getattr(leaf, "params", ()) if isinstance(p, torch.Tensor)]
    if any(t.requires_grad for t in tensors) and differentiated_by_an_outer_call():
        raise UnsupportedError(
            "activity: AutoFiniteDifferences is called inside f of an AutoTorch operator that differentiates "
            "through this call, but finite differences give plain numbers that torch cannot differentiate: the "
            "outer derivative would lose this call's part. Use backend=AutoTorch() (or backend=None) for the "
            "inner call, or take the outer derivative with AutoFiniteDifferences too."
        )


@attrs.frozen
class AutoFiniteDifferences(Backend):
    """Central finite differences with a Richardson-extrapolated step, in float64.

    Ridders' method evaluates central differences at ``step``, ``step / shrink``,
    ``step / shrink**2``, ... (at most ``max_steps`` steps) and extrapolates them to
    zero step. When the error estimate stays large (or ``f`` raises, or leaves its
    domain, at a step) it starts again ten times smaller, up to ``retries`` times.

    Args:
        step: the largest step tried; the default 0.01 is small enough not to straddle the
            kinks of ReLU and max-pooling models at usual scales.
        shrink: the factor (> 1) between one step and the next.
        max_steps: the most steps of one extrapolation (at least 2).
        retries: the most starts, each ten times smaller than the one before (at least 1).

    Raises:
        ValueError: a parameter is out of its range (the message says which and why).

    >>> import numpy as np
    >>> import activity as ad
    >>> np.round(ad.derivative(np.sin, ad.Active(0.0), backend=ad.AutoFiniteDifferences()), 12)
    np.float64(1.0)
    """

    step: float = attrs.field(default=0.01, validator=_positive("step", "the largest step tried, e.g. 0.01"))
    shrink: float = attrs.field(default=1.4, validator=_greater_than_one)
    max_steps: int = attrs.field(default=10, validator=_count("max_steps", 2, "Ridders' method needs two steps"))
    retries: int = attrs.field(default=4, validator=_count("retries", 1, "one start at least"))
    framework: ClassVar[str | None] = None  # works on numpy, JAX and torch values
    copies_inputs = True  # f is evaluated many times on the same values: none may change the next

    def fresh_input(self, leaf: Any) -> Any:
        if arrays.is_torch(leaf):
            return leaf.clone()
        if isinstance(leaf, np.ndarray):
            return leaf.copy()
        return leaf  # JAX arrays are immutable; other leaves are not arrays

    def as_array(self, leaf: Any) -> Any:
        return np.asarray(leaf, dtype=np.float64) if isinstance(leaf, float) else leaf

    def cast_result(self, value: Any, dtype: Any) -> Any:
        return _cast(value, dtype) if arrays.is_array(value) else value

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        # Converted to float64 inside the primitives, where the float64 context is active.
        return leaf if arrays.is_array(leaf) else np.asarray(leaf, dtype=np.float64)

    def fresh_cache(self, leaf: Any, like: Any) -> Any:
        # A copy, so every evaluation starts from the same state; floating leaves in float64,
        # the others (counters, indices, masks) in their own dtype.
        floating = arrays.dtype_kind(leaf) == "f"
        if arrays.is_torch(leaf):
            return leaf.detach().to(sys.modules["torch"].float64, copy=True) if floating else leaf.detach().clone()
        if arrays.is_jax(leaf):
            return sys.modules["jax"].numpy.array(leaf, dtype="float64" if floating else None)
        return np.array(leaf, dtype=np.float64 if floating else None)

    def describe_module(self, module: Any, previous: Any = None) -> Any:
        from ._torch import AutoTorch

        return AutoTorch().describe_module(module, previous)

    def bind_module(self, module: Any, params: list[Any] | None) -> Any:
        from ._torch import float64_copy

        return float64_copy(module, params)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        if "jax" not in sys.modules:
            return contextlib.nullcontext()
        jax = sys.modules["jax"]
        # jax.enable_x64 is the newer spelling; older jax (0.7 included) has only jax.experimental.enable_x64.
        enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else importlib.import_module("jax.experimental").enable_x64
        return _float64_jax(jax, enable_x64)

    def convert_inputs(self, xs: Flat, ctx: Flat) -> tuple[Flat, Flat]:
        if any(arrays.dtype_kind(x) == "c" for x in xs):  # (the problem refuses complex leaves; a module's slip through)
            raise UnsupportedError(
                "activity: AutoFiniteDifferences cannot differentiate a complex parameter of an Active torch "
                "module: it steps real values only (complex differentiation is not supported). Freeze it "
                "(requires_grad_(False)), or hold it as two real parameters, its real and imaginary parts."
            )
        if "torch" in sys.modules:
            _refuse_an_outer_tape(xs, ctx)
        _PLACEMENT.set(_one_device(xs))
        return tuple(_to_float64(x) for x in xs), tuple(_to_float64(c) for c in ctx)

    def explain_error(self, error: Exception, active: str) -> str | None:
        # f sees float64 arrays here, where the caller's own call passes float32: a dtype check in
        # f (jaxtyping's Float32[...]) or an array f makes in float32 and mixes in may refuse them.
        if not any(word in str(error) for word in _FLOAT64_WORDS):
            return None
        return (
            "AutoFiniteDifferences evaluates f in float64 (its floating Active, Constant and Cache arrays are "
            "converted, so that the differences are accurate), and f refused a float64 value: a dtype check in f "
            "(jaxtyping's Float32[...], an assert on x.dtype) or an array f makes in float32 and mixes in (torch's "
            "'double != float'). Let f follow its inputs' dtype (jaxtyping's Float[...], "
            "torch.ones(3, dtype=x.dtype)), or pass such arrays as Constant arguments; activity.testing.check "
            "also takes reference=<an AD backend>."
        )

    def finalize(self, result: Any, problem: Any) -> Any:
        """Results in the inputs' framework, and in their dtype where all Active leaves share one;
        JAX results on the one device the Active JAX arrays are committed to (the differences
        are taken in numpy, whose arrays JAX would put on its default device)."""
        from .._problem import combine, partition

        dtypes = {str(d) for d in problem.diff_dtypes}
        target = problem.diff_dtypes[0] if len(dtypes) == 1 else None
        to_jax = "jax" in problem.diff_frameworks
        if not to_jax and (target is None or dtypes == {"float64"} or dtypes == {"torch.float64"}):
            return result
        dynamic, static = partition(result)
        if to_jax:
            jnp = sys.modules["jax"].numpy
            device = _PLACEMENT.get()
            dynamic = [
                jnp.asarray(leaf, device=device) if isinstance(leaf, (np.ndarray, np.generic)) else leaf for leaf in dynamic
            ]
        if target is not None:
            dynamic = [_cast(leaf, target) for leaf in dynamic]
        return combine(dynamic, static)

    def wrap_function(self, F: FlatFunction, xs: Flat) -> FlatFunction:
        if not any(arrays.is_jax(x) for x in xs):
            return _same_draws(F)
        # Hundreds of evaluations of one function: compile it once (unless it cannot be traced),
        # and do the difference arithmetic in numpy, where small operations are cheap.
        jax = sys.modules["jax"]
        compiled = _compiled_for(F)
        state = {"traceable": True}

        def evaluate(xs_: Flat) -> tuple[Flat, Any]:
            ys = None
            if state["traceable"]:
                try:
                    ys, aux = compiled.jitted(xs_, F.ctx)  # type: ignore[attr-defined]
                except (jax.errors.JAXTypeError, TypeError):
                    state["traceable"] = False
                else:
                    F.traced.out_spec, F.traced.aux_static = compiled.traced.out_spec, compiled.traced.aux_static  # type: ignore[attr-defined]
            if ys is None:
                ys, aux = F(tuple(jax.numpy.asarray(x) for x in xs_))
            if evaluate.low_precision is None:  # type: ignore[attr-defined]
                evaluate.low_precision = _low_precision(ys)  # type: ignore[attr-defined]
                if state["traceable"] and compiled.widened_draws is None:
                    compiled.widened_draws = _draws_widened_random_bits(jax, compiled.jitted, xs_, F.ctx)  # type: ignore[attr-defined]
                evaluate.widened_draws = bool(compiled.widened_draws)  # type: ignore[attr-defined]
            return tuple(np.asarray(y, dtype=np.float64) for y in ys), aux

        evaluate.on_host = True  # type: ignore[attr-defined]
        evaluate.op_name = getattr(F, "op_name", None)  # type: ignore[attr-defined]
        # f's own output dtypes, before they become float64 on the host, and whether the float64
        # mode changes its random draws (for `_warn_if_unreliable`)
        evaluate.low_precision = None  # type: ignore[attr-defined]
        evaluate.widened_draws = False  # type: ignore[attr-defined]
        return evaluate

    # -- primitives ------------------------------------------------------------

    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        # A gradient is a difference per input direction, a Hessian a difference of gradients:
        # what makes the reference unreliable is said once per operator call, not per direction.
        token = _WARNED.set(set()) if _WARNED.get() is None else None
        try:
            return self._loop_jvp(F, xs, ts) if batched else self._one_jvp(F, xs, ts)
        finally:
            if token is not None:
                _WARNED.reset(token)

    def _one_jvp(self, F: FlatFunction, xs: Flat, ts: Flat) -> tuple[Flat, Any, Flat]:
        xs, ts = _for(F, xs), _for(F, ts)
        ys, aux = F(xs)
        low = _warn_if_unreliable(F, ys, xs)
        # Where F is itself a finite-difference derivative (the inner gradient of a Hessian), its
        # outputs are known only to about that derivative's error estimate (an estimate, not a
        # bound: a few times it), far coarser than float64.
        inner_error: float = 4 * getattr(F, "error", 0.0)
        # Where f rounds to a lower precision, steps below about eps**(1/3) of it give differences
        # of rounding noise (the central difference's best step): a run of steps stops there.
        smallest = _coarsest_rounding(low) ** (1 / 3)
        ts = tuple(_to_float64(t) for t in ts)
        scale = _max_abs(ts)
        if scale == 0.0:
            return ys, aux, tuple(arrays.zeros_like(_to_float64(y)) for y in ys)
        direction = tuple(t / scale for t in ts)
        # Two evaluations closer than the outputs' precision compare equal: a difference at step h
        # is known to no better than this over h, however well the steps agree with each other.
        resolution = max(_resolution(ys, low), inner_error)

        raised: list[BaseException] = []
        ys64 = tuple(_to_float64(y) for y in ys)
        # Half the jump between the one-sided slopes at each step of the current start (for
        # `_kinked`): it shrinks with the step where f is smooth, and stays where f has a kink.
        bends: list[tuple[float, Flat]] = []
        # Each step and where f gave bitwise the same value on both sides (see `_quantized`).
        flats: list[tuple[float, Flat]] = []

        def central(h: float) -> Flat:
            # A trial step may leave f's domain (nan, or f raising, as binary_cross_entropy does
            # outside [0, 1]): that step's estimate is nan, and the extrapolation avoids it.
            try:
                with np.errstate(all="ignore"):
                    plus, _ = F(tuple(x + h * t for x, t in zip(xs, direction)))
                    minus, _ = F(tuple(x - h * t for x, t in zip(xs, direction)))
            except Exception as error:  # noqa: BLE001 - re-raised below if every step fails
                raised.append(error)
                return tuple(arrays.zeros_like(_to_float64(y)) * math.nan for y in ys)
            plus, minus = tuple(_to_float64(p) for p in plus), tuple(_to_float64(m) for m in minus)
            flats.append((h, tuple(p == m for p, m in zip(plus, minus))))
            with np.errstate(all="ignore"):  # inf - inf where an output is infinite: nan, as it should
                bends.append((h, tuple((p - 2 * y + m) / (2 * h) for p, y, m in zip(plus, ys64, minus))))
                return tuple((p - m) / (2 * h) for p, m in zip(plus, minus))

        # A first step too large for the function's scale or domain (log near 0) shows as a large
        # error estimate or nan: start again ten times smaller, keep the best estimate.
        best: Flat | None
        best, best_error, best_bends, step = None, math.inf, [], self.step
        for _ in range(self.retries):
            bends.clear()
            # A retry below the smallest step (the steps above it did not settle: f varies on a
            # smaller scale, or leaves its domain, log near 0) runs its course; the rounding
            # floor, not a wall, then weighs its steps.
            estimate, error, rounded = self._ridders(central, step, resolution, smallest if step >= smallest else 0.0)
            if best is None or error < best_error:
                best, best_error, best_bends = estimate, error, list(bends)
            # Converged, or limited by the outputs' rounding, which smaller steps only make larger
            # (at steps too small to move f at all, every difference is 0 and would look converged).
            if math.isfinite(error) and (error <= 1e-11 * _max_abs(estimate) or rounded):
                break
            step /= 10
        if raised and not math.isfinite(best_error):
            raise raised[-1]  # no step stayed inside f's domain: f's own error, as it raised it
        # A jump that persists over the steps of the best start is a kink at the point, or kinks
        # at a distance below the smallest step: a step a hundred times smaller tells them apart
        # (two evaluations, only where the first test says kink; not below f's own precision).
        kinked = False
        if len(best_bends) > 1 and _kinked(best_bends[0], best_bends[-1], best, resolution):  # type: ignore[arg-type]
            confirm = best_bends[-1][0] / 100
            if confirm >= smallest:
                known = len(bends)
                central(confirm)
                kinked = len(bends) > known and _kinked(best_bends[-1], bends[-1], best, resolution)  # type: ignore[arg-type]
        # A staircase (f rounding coarser than its dtype) looks smooth at the steps above its
        # quanta, where the extrapolation converges: one step far below them, still well above
        # the outputs' and inputs' precision, finds f standing still (two evaluations).
        slope = _max_abs(best)  # type: ignore[arg-type]
        # No start settled within half the testing kit's default tolerances (rtol 1e-4, atol
        # 1e-5): f's values are noisier at these steps than the estimate needs (an inner finite
        # difference of a large f, an iterative solver), or it varies on a smaller scale.
        kinked = kinked or best_error > 5e-6 + 5e-5 * slope
        if not kinked and slope > 0 and flats:
            probe = max(smallest, 5e4 * resolution / slope, 1e-8 * max(1.0, _max_abs(xs)))
            if probe < min(h for h, _ in flats):
                central(probe)
        if kinked:
            _warn_unreliable(F, ReferenceKinkWarning)
        elif _quantized(flats, best, resolution):  # type: ignore[arg-type]
            _warn_unreliable(F, ReferenceQuantizedWarning)
        errors = _REACHED_ERRORS.get()
        if errors is not None:
            errors.append(best_error * scale)
        return ys, aux, tuple(e * scale for e in best)  # type: ignore[union-attr]

    def gradient_function(self, F: FlatFunction) -> FlatFunction:
        return _noting_error(super().gradient_function(F))

    def derivative_function(self, F: FlatFunction, ts: Flat) -> FlatFunction:
        return _noting_error(super().derivative_function(F, ts))

    def _loop_jvp(self, F: FlatFunction, xs: Flat, ts: Flat) -> tuple[Flat, Any, Flat]:
        """A batch of tangents, one after the other (no vmap for arbitrary functions)."""
        batch = arrays.shape(ts[0])[0]
        if batch == 0:  # no tangent (every Active leaf is empty): the value, and empty derivatives
            ys, aux = F(_for(F, xs))
            return ys, aux, tuple(arrays.zeros_like(_to_float64(y))[None][:0] for y in ys)
        columns = []
        for b in range(batch):
            ys, aux, dys = self._one_jvp(F, xs, tuple(t[b] for t in ts))
            columns.append(dys)
        return ys, aux, tuple(arrays.stack([c[j] for c in columns]) for j in range(len(ys)))

    def _ridders(
        self, central: Callable[[float], Flat], step: float, resolution: float = 0.0, smallest: float = 0.0
    ) -> tuple[Flat, float, bool]:
        """Richardson-extrapolate ``central(h)`` to ``h -> 0`` (Ridders' method), with steps no
        smaller than ``smallest``: the estimate, its error, and whether that error is the rounding
        floor ``resolution / h`` (f's outputs are known to ``resolution``) rather than the
        disagreement between steps."""
        factor = self.shrink**2
        previous_row = [central(step)]
        best, best_error, rounded = previous_row[0], math.inf, False
        h = step
        for _ in range(1, self.max_steps):
            h /= self.shrink
            if h < smallest or resolution / h > best_error:
                break  # (every estimate at a smaller step is known to no better than resolution / h)
            row = [central(h)]
            weight = factor
            floor = resolution / h
            for j in range(1, len(previous_row) + 1):
                row.append(tuple((a * weight - b) / (weight - 1) for a, b in zip(row[j - 1], previous_row[j - 1])))
                weight *= factor
                spread = max(
                    _max_abs(tuple(a - b for a, b in zip(row[j], row[j - 1]))),
                    _max_abs(tuple(a - b for a, b in zip(row[j], previous_row[j - 1]))),
                )
                error = max(spread, floor)
                if error <= best_error:
                    best, best_error, rounded = row[j], error, floor >= spread
            if _max_abs(tuple(a - b for a, b in zip(row[-1], previous_row[-1]))) >= 2 * best_error:
                break  # higher orders are dominated by rounding: stop
            previous_row = row
        return best, best_error, rounded

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        xs = _for(F, xs)
        ys, aux = F(xs)
        jacobian: list[Any] = []  # (sum of output sizes, sum of input sizes), built on first pull

        def pull(cts: Flat, batched: bool) -> Flat:
            if not jacobian:
                jacobian.append(self._jacobian_matrix(F, xs))
            cts64 = tuple(_to_float64(c) for c in _for(F, cts))
            if not batched:
                cts64 = tuple(c[None] for c in cts64)
            rows = _weighted_rows(arrays.concat_flat(list(cts64)), jacobian[0])
            grads = [
                arrays.reshape(block, (arrays.shape(rows)[0], *arrays.shape(x)))
                for block, x in zip(arrays.split_columns(rows, [arrays.size(x) for x in xs]), xs)
            ]
            return tuple(grads) if batched else tuple(g[0] for g in grads)

        return ys, aux, pull

    def _jacobian_matrix(self, F: FlatFunction, xs: Flat) -> Any:
        _, _, columns = self.jvp(F, xs, arrays.input_basis(xs, self), True)
        return arrays.moveaxes_front_to_back(arrays.concat_flat(list(columns)), 1)


@attrs.define
class _Compiled:
    """``F`` of one problem, jitted once as a function of its leaves and its context, and what
    its trace revealed (the output structure), for the calls that hit JAX's cache."""

    jitted: Any = None
    traced: Any = None
    widened_draws: bool | None = None  # see `_draws_widened_random_bits`


_COMPILED: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()


# How a dtype check or a mixed-dtype operation names the float64 that f got (JAX, torch, numpy)
_FLOAT64_WORDS = ("float64", "f64[", "Double", "double")

# The device the Active JAX arrays of the current call are committed to (None: JAX's default).
_PLACEMENT: contextvars.ContextVar[Any] = contextvars.ContextVar("_PLACEMENT", default=None)


def _one_device(xs: Flat) -> Any:
    """Where the results go: the one device every Active JAX array is committed to
    (``jax.device_put(x, device)``), or, for arrays sharded alike over a mesh, that mesh,
    replicated (results have shapes of their own, which the inputs' layout may not fit);
    None (JAX's default device) for uncommitted arrays, other frameworks, or mixed placements."""
    placed = {x.sharding for x in xs if arrays.is_jax(x) and getattr(x, "committed", False)}
    if len(placed) != 1:
        return None
    sharding = next(iter(placed))
    if len(sharding.device_set) == 1:
        return next(iter(sharding.device_set))
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return None
    jax = sys.modules["jax"]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


_CALLER = threading.local()  # the caller's own jax_enable_x64, while the reference runs in float64


@contextlib.contextmanager
def _float64_jax(jax: Any, enable_x64: Callable[[bool], Any]) -> Any:
    outermost = getattr(_CALLER, "x64", None) is None
    if outermost:
        _CALLER.x64 = bool(jax.config.jax_enable_x64)
    try:
        with enable_x64(True):
            yield
    finally:
        if outermost:
            _CALLER.x64 = None


def _draws_widened_random_bits(jax: Any, jitted: Any, *args: Any) -> bool:
    """Whether ``jitted(*args)``, traced in float64 mode, draws 64-bit random numbers where the
    caller, outside that mode, would draw 32-bit ones (JAX's default-dtype draws)."""
    if getattr(_CALLER, "x64", None) is not False:
        return False  # the caller runs in float64 too: the same draws

    def widened(jaxpr: Any) -> bool:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "random_bits" and eqn.params.get("bit_width") == 64:
                return True
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns") and widened(inner):
                        return True
        return False

    try:
        return widened(jax.make_jaxpr(jitted)(*args).jaxpr)
    except Exception:  # noqa: BLE001 - f could not be traced again: nothing to tell
        return False


def _compiled_for(F: Any) -> _Compiled:
    """The compiled ``F`` of its problem: made on the first call, reused by every later call of a
    prepared operator (an unprepared call has a problem of its own, and compiles once)."""
    from .._problem import Traced

    by_key = _COMPILED.setdefault(F.problem, {})
    entry = by_key.get(F.key)
    if entry is None:
        entry = _Compiled()
        # The problem held weakly: an entry that referred to its own key would never be dropped.
        problem, (f, flags) = weakref.ref(F.problem), F.key

        def whole(xs: Flat, ctx: Flat) -> tuple[Flat, Any]:
            traced = Traced()
            ys, aux = problem().function(f, ctx, traced, **dict(flags))(xs)  # type: ignore[union-attr]
            entry.traced = traced
            return ys, aux

        entry.jitted = sys.modules["jax"].jit(whole)
        by_key[F.key] = entry
    return entry


# The rounding unit of each floating dtype below float64, by name (numpy has no bfloat16)
_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _coarsest_rounding(dtype_names: list[str]) -> float:
    """The largest rounding unit among ``dtype_names`` (numpy's or torch's names; 0.0 for none)."""
    return max((_EPS.get(name.removeprefix("torch."), 2.0**-23) for name in dtype_names), default=0.0)


def _low_precision(ys: Flat) -> list[str]:
    """The floating dtypes below float64 among ``ys``."""
    return sorted({str(y.dtype) for y in ys if arrays.dtype_kind(y) == "f" and _bits(y) < 64})


def _warn_if_unreliable(F: FlatFunction, ys: Flat, xs: Flat) -> list[str]:
    """Differences of float32 values cannot give a float64 derivative: say so (the testing kit
    reports the reference unreliable instead of blaming the backend it checks). A function
    evaluated on the host returns float64 arrays: it recorded f's own dtypes. Returns them.
    Also says so where the float64 mode changed f's random draws, and where f, evaluated again
    at ``xs``, returns other values than ``ys``."""
    low: list[str] | None = getattr(F, "low_precision", None)
    if low is None:
        low = _low_precision(ys)
    if low:
        _warn_unreliable(F, ReferencePrecisionWarning, f"f returned {', '.join(low)} values although its inputs were float64: ")
    if getattr(F, "widened_draws", False):
        _warn_unreliable(F, ReferenceRandomnessWarning)
    elif _varies(F, xs, ys):
        _warn_unreliable(F, ReferenceNondeterminismWarning)
    return low


def _warn_unreliable(F: FlatFunction, category: type[ReferenceUnreliableWarning], found: str = "") -> None:
    """Warn that the reference cannot be trusted for ``F``, in the words the testing kit reports
    (``category.reason``), after what was ``found``; once per category in a `jvp` call."""
    warned = _WARNED.get()
    if warned is not None:
        if category in warned:
            return
        warned.add(category)
    warnings.warn(
        f"activity.{getattr(F, 'op_name', None) or 'finite differences'} (AutoFiniteDifferences): {found}{category.reason}.",
        category,
        stacklevel=caller_stacklevel(),
    )


def _resolution(ys: Flat, low: list[str]) -> float:
    """How far apart two evaluations of f must be to differ in its floating outputs: each output's
    machine epsilon times its largest magnitude (0 when none is finite: no floor to apply).
    ``low``: f's own dtypes below float64, where its outputs were made float64 on the host."""
    coarsest = _coarsest_rounding(low)
    widest = 0.0
    for y in ys:
        if arrays.dtype_kind(y) != "f" or not arrays.size(y):
            continue
        size = _max_abs((y,))
        if math.isfinite(size):
            widest = max(widest, max(_epsilon(y), coarsest) * size)
    return widest


def _epsilon(y: Any) -> float:
    if arrays.is_torch(y):
        return float(sys.modules["torch"].finfo(y.dtype).eps)
    try:
        return float(np.finfo(np.dtype(y.dtype)).eps)
    except (TypeError, ValueError):  # ml_dtypes' bfloat16, float8: numpy does not know their precision
        return 2.0 ** -(_MANTISSA_BITS.get(_bits(y), 2))


_MANTISSA_BITS = {16: 7, 32: 23, 64: 52}  # the narrowest of each width (bfloat16 among the 16-bit ones)


def _bits(y: Any) -> int:
    if arrays.is_torch(y):
        return y.element_size() * 8  # type: ignore[no-any-return]
    return np.dtype(y.dtype).itemsize * 8  # type: ignore[no-any-return]


def _for(F: Any, leaves: Flat) -> Flat:
    """``leaves`` as ``F`` takes them: numpy for a function evaluated on the host."""
    if getattr(F, "on_host", False):
        return tuple(np.asarray(leaf, dtype=np.float64) if arrays.dtype_kind(leaf) == "f" else np.asarray(leaf) for leaf in leaves)
    return leaves


# The error estimates of the extrapolations a `_noting_error` derivative ran (None outside one).
_REACHED_ERRORS: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("_REACHED_ERRORS", default=None)
# The warnings said in the outermost `jvp` call under way (None outside one).
_WARNED: contextvars.ContextVar[set[type[Warning]] | None] = contextvars.ContextVar("_WARNED", default=None)


def _noting_error(derivative: FlatFunction) -> FlatFunction:
    """``derivative`` (a finite-difference gradient or Jacobian product of f) recording on itself,
    as ``error``, the largest error estimate of its last evaluation: an outer finite difference of
    it treats that as its outputs' precision, so it stops where the inner derivative's own error,
    not float64 rounding, limits it (instead of trying ever smaller steps that only amplify it)."""

    def noted(xs: Flat) -> tuple[Flat, Any]:
        token = _REACHED_ERRORS.set([])
        try:
            result = derivative(xs)
            noted.error = max(_REACHED_ERRORS.get() or [0.0])  # type: ignore[attr-defined]
        finally:
            _REACHED_ERRORS.reset(token)
        return result

    noted.error = 0.0  # type: ignore[attr-defined]
    noted.__dict__.update({k: v for k, v in vars(derivative).items() if k != "error"})
    return noted


def _same_draws(F: FlatFunction) -> FlatFunction:
    """``F`` drawing the same random numbers at every evaluation: each starts from the global
    torch and numpy random states the call found (as AutoTorch does when it runs f again), so
    the differences are those of one function, and the caller's states end as after one call of f."""
    torch = sys.modules.get("torch")
    torch_state = torch.get_rng_state() if torch is not None else None
    numpy_state = np.random.get_state()
    numpy_unchanged = _unchanged_numpy_draws(numpy_state)

    def evaluate(xs_: Flat) -> tuple[Flat, Any]:
        if torch is not None:
            torch.set_rng_state(torch_state)
        if not numpy_unchanged():
            np.random.set_state(numpy_state)
        return F(xs_)

    evaluate.op_name = getattr(F, "op_name", None)  # type: ignore[attr-defined]
    return evaluate


def _unchanged_numpy_draws(state: Any) -> Callable[[], bool]:
    """A test of whether numpy's global random state is still ``state`` (a `np.random.get_state`),
    far cheaper than setting it again (36 us, most of an evaluation of a small f): a comparison of
    its Mersenne Twister words and position. Where that cannot tell (another generator, a cached
    Gaussian that a draw takes without moving the words), it answers no, and the state is set."""
    generator = getattr(np.random.mtrand, "_rand", None)
    bits: Any = getattr(generator, "_bit_generator", None)
    if type(bits).__name__ != "MT19937" or state[0] != "MT19937" or state[3] != 0:
        return lambda: False
    import ctypes  # (here: `import activity` loads no more than it needs)

    address = bits.ctypes.state_address
    words = ctypes.sizeof(ctypes.c_uint32) * len(state[1]) + ctypes.sizeof(ctypes.c_int)  # key[624], pos
    snapshot = ctypes.string_at(address, words)
    if snapshot != np.asarray(state[1], dtype=np.uint32).tobytes() + int(state[2]).to_bytes(4, sys.byteorder, signed=True):
        return lambda: False  # not the layout expected: always set the state
    return lambda: ctypes.string_at(address, words) == snapshot


def _varies(F: FlatFunction, xs: Flat, ys: Flat) -> bool:
    """Whether a second evaluation of ``F`` at ``xs`` differs from its first, ``ys`` (a NaN
    where the first had one is no difference). Asked once per operator call: the answer is kept on ``F``."""
    known: bool | None = getattr(F, "varies", None)
    if known is None:
        again, _ = F(xs)
        known = any(
            arrays.dtype_kind(y) == "f"
            and not bool(np.array_equal(np.asarray(_to_float64(y)), np.asarray(_to_float64(z)), equal_nan=True))
            for y, z in zip(ys, again)
        )
        with contextlib.suppress(AttributeError, TypeError):  # a bound method or builtin keeps no attributes
            F.varies = known  # type: ignore[attr-defined]
    return known


def _quantized(flats: list[tuple[float, Flat]], estimate: Flat, resolution: float) -> bool:
    """Whether at some step h f gave bitwise the same value at x + h and x - h where the estimated
    slope says it changes there by far more than its precision (``|slope| 2h > 100 resolution``)
    and more than the testing kit's tolerances could miss. A smooth f with that slope moves over
    such a step; a staircase (rounding coarser than the dtype) stands still between its jumps."""
    for h, same_sides in flats:
        for same, value in zip(same_sides, estimate):
            if arrays.dtype_kind(value) != "f" or not arrays.size(value):
                continue
            with np.errstate(all="ignore"):
                moves = abs(value) * 2 * h > 100 * resolution + 2 * h * (5e-6 + 5e-5 * abs(value))
                if bool((same & moves).any()):
                    return True
    return False


def _kinked(wider: tuple[float, Flat], narrower: tuple[float, Flat], estimate: Flat, resolution: float) -> bool:
    """Whether f's slopes on either side of the point differ as much at the narrower step as at
    the wider: each is a step h and half the jump between those slopes there,
    ``(f(x+h) - 2 f(x) + f(x-h)) / 2h``. Where f is smooth it is ``f'' h / 2`` and shrinks with h;
    at a kink it stays the same, and is how far the estimate is from either one-sided slope. Jumps
    below half the testing kit's default tolerances (rtol 1e-4, atol 1e-5), which cannot make a
    comparison fail, and those within the outputs' rounding (``resolution / h``), do not count."""
    (wide_step, at_wide), (narrow_step, at_narrow) = wider, narrower
    # Between 1 (a kink) and narrow / wide (smooth): the geometric middle separates them.
    kept = math.sqrt(narrow_step / wide_step)
    for wide, narrow, value in zip(at_wide, at_narrow, estimate):
        if arrays.dtype_kind(narrow) != "f" or not arrays.size(narrow):
            continue
        with np.errstate(all="ignore"):
            significant = abs(narrow) > 5e-6 + 5e-5 * abs(value) + 20 * resolution / narrow_step
            if bool((significant & (abs(narrow) > kept * abs(wide))).any()):
                return True
    return False


def _weighted_rows(cotangents: Any, jacobian: Any) -> Any:
    """``cotangents @ jacobian``, where a row of the Jacobian that is not finite (an output that is
    infinite, such as a masked log-softmax's -inf) spoils only the products that weigh it: one with
    a zero weight on it is the other rows' sum, as each output's own derivative is."""
    xp = arrays.namespace(jacobian)
    finite = xp.isfinite(jacobian)
    if bool(finite.all()):
        return cotangents @ jacobian
    rows = cotangents @ xp.where(finite, jacobian, xp.zeros_like(jacobian))
    spoiled = (cotangents != 0) * 1.0 @ (~finite * 1.0) > 0  # a nonzero weight on a non-finite entry
    return xp.where(spoiled, rows * math.nan, rows)


def _all_finite(leaf: Any) -> Any:
    return arrays.namespace(leaf).isfinite(leaf).all()


def _cast(leaf: Any, dtype: Any) -> Any:
    if arrays.dtype_kind(leaf) != "f":
        return leaf
    if arrays.is_torch(leaf):
        return leaf.to(dtype)
    if "torch" in sys.modules and isinstance(dtype, sys.modules["torch"].dtype):  # e.g. f returned a float
        return sys.modules["torch"].as_tensor(np.asarray(leaf), dtype=dtype)
    return leaf.astype(dtype)


__all__ = [
    "AutoFiniteDifferences",
    "ReferenceKinkWarning",
    "ReferenceNondeterminismWarning",
    "ReferencePrecisionWarning",
    "ReferenceQuantizedWarning",
    "ReferenceRandomnessWarning",
    "ReferenceUnreliableWarning",
]
