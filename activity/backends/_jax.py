"""JAX: `jax.jvp`, `jax.vjp`, `jax.vmap`, and `jax.jit` for prepared operators."""

from __future__ import annotations

import enum
import functools
import operator
import sys
import threading
import types
import warnings
from typing import Any, Callable, ClassVar

import attrs
import numpy as np
import optree

from .. import _arrays as arrays
from .._problem import STATIC, array_meta, combine, partition
from .._errors import add_note, caller_stacklevel
from .._imports import optional, require
from .._tree import NAMESPACE, captured_values, flatten, rebuilder, unflatten
from ._base import Backend, CompiledCall, Flat, FlatFunction, SignatureChanged
from ._jax_dispatch import calls_back, literal_treedef, native_call


def _jax() -> Any:
    return optional("jax", "AutoJAX()")


@attrs.frozen
class AutoJAX(Backend):
    """Differentiate with JAX transforms; prepared operators are compiled with `jax.jit`.

    Constants are traced arguments of the compiled function, so new data of
    the same shape and dtype never recompiles; non-array leaves are static.

    Raises:
        ModuleNotFoundError: JAX is not installed (the message names
            ``pip install "activity-ad[jax]"``).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.gradient(lambda w, x: jnp.sum((w * x) ** 2), ad.Active(jnp.ones(2)),
    ...             ad.Constant(jnp.array([1.0, 2.0])), backend=ad.AutoJAX())
    Array([2., 8.], dtype=float32)
    """

    framework: ClassVar[str | None] = "jax"

    def __attrs_post_init__(self) -> None:
        require("jax", "AutoJAX()")

    def as_array(self, leaf: Any) -> Any:
        return _jax().numpy.asarray(leaf) if isinstance(leaf, float) else leaf

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        return _jax().numpy.asarray(leaf, dtype=dtype)

    def array_meta(self, leaf: Any) -> tuple[Any, ...]:
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

        def one(tangent: Flat) -> tuple[Any, ...]:
            return jax.jvp(F, (xs,), (tangent,), has_aux=True)  # type: ignore[no-any-return]

        try:
            if not batched:
                ys, dys, aux = one(ts)
            else:
                ys, dys, aux = jax.vmap(one, out_axes=(None, 0, None))(ts)
        except TypeError as error:
            _explain_forward_custom_vjp(error)
            raise
        return ys, aux, dys

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        jax = _jax()
        try:
            ys, pull_one, aux = jax.vjp(F, xs, has_aux=True)
        except ValueError as error:
            _explain_reverse_loop(error, F)
            raise

        def pull_as_given(cts: Flat, batched: bool) -> Flat:
            if batched:
                return jax.vmap(lambda ct: pull_one(ct)[0])(cts)  # type: ignore[no-any-return]
            return pull_one(cts)[0]  # type: ignore[no-any-return]

        def pull(cts: Flat, batched: bool) -> Flat:
            try:
                try:
                    return pull_as_given(cts, batched)
                except ValueError as error:
                    if _CT_TYPE not in str(error):
                        raise
                    # f's outputs are sharded over an explicit mesh (jax.set_mesh), which JAX wants
                    # the cotangents to carry: activity's basis and the user's cotangents are laid
                    # out as the outputs, as jax.jacrev lays out its basis.
                    resharded = _sharded_like(cts, ys, batched)
                    if resharded is None:
                        raise
                    return pull_as_given(resharded, batched)
            except ValueError as error:
                _explain_reverse_loop(error, F)
                raise

        return ys, aux, pull

    def forward_only(self, error: Exception) -> bool:
        return isinstance(error, ValueError) and _NO_TRANSPOSE in str(error)

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        def scalar(xs_: Flat) -> tuple[Any, tuple[Any, ...]]:
            ys, aux = F(xs_)
            return ys[0], (ys, aux)

        try:
            (_, (ys, aux)), grads = _jax().value_and_grad(scalar, has_aux=True)(xs)
        except ValueError as error:
            _explain_reverse_loop(error, F)
            raise
        return ys, aux, grads

    def compile(self, pipeline: Callable[..., Any]) -> Callable[..., Any]:
        # One jit of the whole pipeline, which `compile_call` traces and compiles ahead where
        # calls take the generic path; its result leaves JAX in activity's own structure.
        jitted = _jax().jit(_with_static_output(pipeline, {}))

        def run(xs: Flat, ctx: Flat, extra: Flat | None) -> Any:
            try:
                return _rebuilt(jitted(xs, ctx, extra))
            except TypeError as error:  # under jit, JAX may refuse the jvp after `AutoJAX.jvp` returned
                _explain_forward_custom_vjp(error)
                raise

        run.jitted = jitted  # type: ignore[attr-defined]  # for `_compile_ahead`
        return run

    def compile_call(
        self, plan: Any, values: tuple[Any, ...], seed_kwargs: dict[Any, Any], retrace: Callable[..., Any] | None = None
    ) -> CompiledCall | None:
        # `jax.jit` of the whole call, arguments as the user passes them: JAX
        # flattens them and finds the compiled code in C++, so a prepared call
        # costs what a call of `jax.jit(jax.grad(f))` costs. JAX refuses
        # arguments it cannot take (a torch tensor, a string) with TypeError or
        # ValueError, before anything runs. With `retrace`, a new signature is
        # traced once more into the same jitted function, from its own plan.
        # ``values`` may be placeholders: then it is compiled without running.
        _warn_of_stale_statics(plan, values)
        if type(self) is AutoJAX and not plan.problem.arrays_only:
            compiled = _jit_with_statics(plan, values, seed_kwargs, retrace)
            if compiled is not None:
                return compiled
        if type(self) is not AutoJAX or not plan.problem.arrays_only:
            # A non-array leaf (a model's activation function, a Python number) cannot be a
            # `jax.jit` argument, and a subclass may change any step: these calls take the
            # generic path, which splits the arguments and runs the jitted pipeline (and a
            # subclass's hooks). It is compiled now, so that the first call does not trace.
            _compile_ahead(plan, values, seed_kwargs)
            return None
        sealed = _sealed_jit(plan, values, seed_kwargs, retrace)
        if sealed is None:
            return None
        jitted, output = sealed
        # Without a call back into Python (whose error the Python path explains), a strict
        # call is dispatched by JAX's C++ dispatch alone (`native_call`).
        native = retrace is None and not output["calls_back"]
        treedef = output.get("treedef")
        if treedef is not None:  # the result's arrays leave as a tuple, which this treedef rebuilds
            return CompiledCall(
                jitted, _MISSES, treedef.unflatten, refuses_annotations=True,
                native=native_call(jitted, treedef, _MISSES) if native else None,
            )
        if output.get("structure") is not None:  # as a tuple too, rebuilt by activity
            return CompiledCall(jitted, _MISSES, rebuilder(output["structure"]), refuses_annotations=True)
        if retrace is None and not output["rebuilt"]:  # one signature, whose result JAX returns as built
            return CompiledCall(jitted, _MISSES, refuses_annotations=True, native=native_call(jitted, None, _MISSES) if native else None)

        def call(*values: Any, **seed_kwargs: Any) -> Any:
            return _rebuilt(jitted(*values, **seed_kwargs))

        call.jitted = jitted  # type: ignore[attr-defined]  # for inspection, as `compile`'s
        return CompiledCall(call, _MISSES, refuses_annotations=True)


_MISSES = (SignatureChanged, TypeError, ValueError)


def _sealed_jit(
    plan: Any, values: tuple[Any, ...], seed_kwargs: dict[Any, Any], retrace: Callable[..., Any] | None
) -> tuple[Any, dict[str, Any]] | None:
    """``jax.jit`` of the whole call (`Plan.direct`), traced and compiled for ``values``
    (never run), then sealed: a later trace is for other arguments, traced from ``retrace``
    or, without it, only if they have the prepared signature as activity sees it (say, a
    weakly typed array where a plain one was prepared); else it raises SignatureChanged and
    the call takes the checked path. Returns the jitted function and what
    `_with_static_output` learnt of its result, or None if it cannot be traced."""
    call, same_signature = plan.direct(), _same_signature(plan)
    sealed = False

    def whole(*values: Any, **seed_kwargs: Any) -> Any:
        if not sealed:
            return call(values, seed_kwargs)
        if retrace is not None:
            return retrace(values, seed_kwargs)
        if not same_signature(values, seed_kwargs):
            raise SignatureChanged
        return call(values, seed_kwargs)

    output: dict[str, Any] = {}
    jitted = _jax().jit(_with_static_output(whole, output, fixed_structure=retrace is None))
    try:
        # Traced and compiled, not run (the values may be placeholders); calls share JAX's
        # caches with `lower`, so the first call neither traces nor compiles.
        lowered = jitted.lower(*values, **seed_kwargs)
        lowered.compile()
    except Exception:  # noqa: BLE001 - the checked path runs the call again and reports any error
        return None
    output["calls_back"] = calls_back(lowered)
    sealed = True
    return jitted, output


def _jit_with_statics(
    plan: Any, values: tuple[Any, ...], seed_kwargs: dict[str, Any], retrace: Callable[..., Any] | None
) -> CompiledCall | None:
    """The whole call jitted over the array leaves of arguments that also hold static leaves
    (an Equinox module's activation function, a Python number), as ``eqx.filter_jit`` does:
    per call, JAX's own flatten of each argument, its structure and static leaves compared
    with the prepared ones, the rest passed to `jax.jit`. None where JAX's flatten does not
    give the leaves activity's does, in the same order (the generic path then runs)."""
    from .._problem import _same_meta

    jax, problem = _jax(), plan.problem
    # strict=False: a new static value is a new plan on the checked path, which keeps its
    # plans most recently used first; calls served here would not count as uses.
    if retrace is not None or problem.adapted or "module" in {role for roles in problem.roles for role in roles}:
        return None
    layouts = []
    for position, value in enumerate(values):
        leaves, treedef = jax.tree_util.tree_flatten(value)
        ours, _ = flatten(value)
        roles = problem.roles[position]
        if len(leaves) != len(ours) or len(leaves) != len(roles) or not all(map(operator.is_, leaves, ours)):
            return None
        statics = tuple((i, ("static", static)) for i, (role, static) in enumerate(zip(roles, problem.statics[position])) if role == STATIC)
        layouts.append((treedef, statics, tuple(i for i, role in enumerate(roles) if role != STATIC)))
    layouts_ = tuple(layouts)
    call_direct, same_signature = plan.direct(), _same_signature(plan)
    sealed = False

    def rebuilt_values(dynamic: tuple[Any, ...]) -> tuple[Any, ...]:
        rebuilt = []
        for (treedef, statics, dynamic_index), leaves in zip(layouts_, dynamic):
            filled: list[Any] = [None] * (len(statics) + len(dynamic_index))
            for i, (_, static) in statics:
                filled[i] = static
            for i, leaf in zip(dynamic_index, leaves):
                filled[i] = leaf
            rebuilt.append(treedef.unflatten(filled))
        return tuple(rebuilt)

    def whole(dynamic: tuple[Any, ...], seed_kwargs: dict[str, Any]) -> Any:
        values = rebuilt_values(dynamic)
        if not sealed:
            return call_direct(values, seed_kwargs)
        if not same_signature(values, seed_kwargs):
            raise SignatureChanged
        return call_direct(values, seed_kwargs)

    def dynamic_leaves(values: tuple[Any, ...]) -> tuple[Any, ...]:
        if len(values) != len(layouts_):
            raise SignatureChanged
        dynamic = []
        for value, (treedef, statics, dynamic_index) in zip(values, layouts_):
            leaves, got = jax.tree_util.tree_flatten(value)
            if got != treedef:
                raise SignatureChanged
            for i, expected in statics:
                if not _same_meta(expected, ("static", leaves[i])):
                    raise SignatureChanged
            dynamic.append([leaves[i] for i in dynamic_index])
        return tuple(dynamic)

    jitted = jax.jit(_with_static_output(whole, {}))
    try:
        jitted.lower(dynamic_leaves(values), seed_kwargs).compile()
    except Exception:  # noqa: BLE001 - the generic path runs the call and reports any error
        return None
    sealed = True

    def call(*values: Any, **seed_kwargs: Any) -> Any:
        return _rebuilt(jitted(dynamic_leaves(values), seed_kwargs))

    call.jitted = jitted  # type: ignore[attr-defined]  # for inspection, as `compile`'s
    return CompiledCall(call, _MISSES, refuses_annotations=True)


_CT_TYPE = "unexpected JAX type (e.g. shape/dtype) for argument to VJP function"


def _sharded_like(cts: Flat, ys: Flat, batched: bool) -> Flat | None:
    """``cts`` resharded as the outputs ``ys`` are (a batch axis first, unsharded), or None
    where this JAX cannot (no ``jax.sharding.reshard``)."""
    jax = _jax()
    reshard, typeof = getattr(jax.sharding, "reshard", None), getattr(jax, "typeof", None)
    if reshard is None or typeof is None:
        return None
    PartitionSpec = jax.sharding.PartitionSpec

    def like(ct: Any, y: Any) -> Any:
        spec = typeof(y).sharding.spec
        return reshard(ct, PartitionSpec(None, *spec) if batched else spec)

    return tuple(map(like, cts, ys))


def _same_signature(plan: Any) -> Callable[[tuple[Any, ...], dict[Any, Any]], bool]:
    from .._operators._common import encode_seeds  # the operators import the backends

    problem = plan.problem

    def same(values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> bool:
        if len(values) != len(problem.kinds) or problem.split(values, problem.kinds) is None:
            return False
        seeds = encode_seeds(plan.operator, problem, seed_kwargs)
        return seeds is None or seeds.key == plan.seed_key

    return same


def _with_static_output(function: Callable[..., Any], output: dict[str, Any], fixed_structure: bool = False) -> Callable[..., Any]:
    """``function``, its result made such that `jax.jit` gives it back exactly as built.

    JAX rebuilds a jitted function's result with its own pytrees, which sort dict keys
    and return arrays only; activity's results keep the input's key order and may hold
    strings or None in aux. Where the two differ, the result leaves JAX as an `_Output`
    (`_rebuilt` turns it back into the result): its arrays are the outputs, and the rest
    (activity's structure and non-array leaves) is the node's static data, which JAX
    keeps per compiled signature. ``output["rebuilt"]`` says whether the first trace's
    result needed this.

    With ``fixed_structure`` (every trace is for the prepared signature, so f's result has
    one structure), a result of arrays leaves as the tuple of its arrays, which JAX builds
    in C++, and a trace whose result has another structure raises SignatureChanged. The
    structure that rebuilds it is ``output["treedef"]``, a JAX treedef whose dicts keep
    their keys' order, where the result holds only dicts, lists, tuples and None (see
    `literal_treedef`); else ``output["structure"]``, activity's.
    """
    _register_output()

    def returnable(*args: Any, **kwargs: Any) -> Any:
        out = function(*args, **kwargs)
        keeps = _jax_keeps(out)
        output.setdefault("rebuilt", not keeps)
        if fixed_structure:
            literal = None if keeps else literal_treedef(out)
            treedef = output.setdefault("treedef", None if literal is None else literal[0])
            if treedef is not None:
                if literal is None or literal[0] != treedef:
                    raise SignatureChanged
                return tuple(literal[1])
            leaves, structure = flatten(out)
            arrays = all(map(_is_jax_array, leaves))
            known = output.setdefault("structure", structure if arrays and not keeps else None)
            if known is not None:
                if not arrays or structure != known:
                    raise SignatureChanged
                return tuple(leaves)
        if keeps:
            return out
        dynamic, static = partition(out)
        return _Output(_Static(static), dynamic)

    return returnable


def _rebuilt(out: Any) -> Any:
    if type(out) is _Output:
        return out.static.rebuild(out.dynamic)
    return out


class _Output:
    """A result on its way out of `jax.jit` (see `_with_static_output`). JAX's unflatten
    of it must give an `_Output` again: JAX's dispatch flattens what the first call
    returned to learn the structure that later calls take."""

    __slots__ = ("dynamic", "static")

    def __init__(self, static: _Static, dynamic: Any):  # the order of JAX's unflatten
        self.static = static
        self.dynamic = dynamic


class _Static:
    """The static part of a result, as JAX node data: hashed and compared by identity, as
    it may hold unhashable leaves (and one trace's output never equals another's)."""

    __slots__ = ("value", "rebuild")

    def __init__(self, value: tuple[Any, ...]):
        self.value = value  # `partition`'s static part: (structure, which leaves are arrays, the others)
        # `rebuild(arrays)`: the result, from the arrays of an `_Output`
        if all(value[1]):  # a structure of arrays: nothing to put back but them
            self.rebuild: Callable[[Any], Any] = rebuilder(value[0])
        else:
            self.rebuild = functools.partial(combine, static=value)


_output_lock = threading.Lock()
_output_registered = False


def _register_output() -> None:
    global _output_registered
    with _output_lock:
        if not _output_registered:
            _jax().tree_util.register_pytree_node(_Output, lambda out: (out.dynamic, out.static), _Output)
            _output_registered = True


def _is_jax_array(value: Any) -> bool:
    return isinstance(value, _jax().Array)


def _jax_keeps(out: Any) -> bool:
    """Whether JAX's pytrees give ``out`` back as it is: every leaf an array, and the same
    containers, dict keys in the same order. Run at trace time only."""
    jax = _jax()
    if isinstance(out, jax.Array):
        return True
    flatten(out)  # activity learns any new node type before `_same_layout` walks with it
    leaves, treedef = jax.tree_util.tree_flatten(out)
    if not all(isinstance(leaf, jax.Array) for leaf in leaves):
        return False
    if _holds_static_array(treedef):  # JAX's comparisons of this structure raise: activity's compare
        return False
    try:
        rebuilt = treedef.unflatten(leaves)
    except Exception:  # noqa: BLE001 - a namedtuple whose __new__ refuses the None at a non-floating leaf
        return False
    return _same_layout(out, rebuilt)


def _holds_static_array(treedef: Any) -> bool:
    """Whether a node's static data holds an array (an Equinox ``eqx.field(static=True)`` array)."""

    def holds(data: Any) -> bool:
        if isinstance(data, (tuple, list)):
            return any(map(holds, data))
        return hasattr(data, "shape") and hasattr(data, "dtype")

    node = treedef.node_data()
    return node is not None and (holds(node[1]) or any(map(_holds_static_array, treedef.children())))


def _same_layout(built: Any, rebuilt: Any) -> bool:
    if type(built) is not type(rebuilt) or (isinstance(built, dict) and list(built) != list(rebuilt)):
        return False
    children, spec = optree.tree_flatten(built, is_leaf=lambda node: node is not built, namespace=NAMESPACE)
    if spec.is_leaf():
        return True
    others, _ = optree.tree_flatten(rebuilt, is_leaf=lambda node: node is not rebuilt, namespace=NAMESPACE)
    return len(children) == len(others) and all(map(_same_layout, children, others))


def with_abstract_arrays(fn: Callable[..., Any], *trees: Any, placeholders_only: bool = False) -> Any:
    """``fn(*trees)`` evaluated abstractly (`jax.eval_shape`): each JAX placeholder leaf of
    ``trees`` (and, unless ``placeholders_only``, each numpy or JAX array) becomes a tracer
    of its shape and dtype, other leaves are passed as they are; ``fn``'s result comes back
    as ShapeDtypeStructs. Nothing is computed from the arrays."""
    leaves, spec = flatten(trees)
    where = [
        index
        for index, leaf in enumerate(leaves)
        if arrays.is_jax_placeholder(leaf) or (not placeholders_only and arrays.framework(leaf) in ("numpy", "jax"))
    ]

    def on_tracers(abstract: list[Any]) -> Any:
        filled = list(leaves)
        for index, leaf in zip(where, abstract):
            filled[index] = leaf
        return fn(*unflatten(spec, filled))

    return _jax().eval_shape(on_tracers, [leaves[index] for index in where])


def _compile_ahead(plan: Any, values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> None:
    """Trace and compile ``plan``'s jitted pipeline for the signature of ``values`` (arrays
    or placeholders) without running it, so that the first call finds it compiled."""
    jitted = getattr(plan.pipeline, "jitted", None)
    if jitted is None:
        return
    from .._operators._common import encode_seeds  # the operators import the backends

    problem, operator = plan.problem, plan.operator

    def inputs(values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> tuple[Any, ...]:
        seeds = encode_seeds(operator, problem, seed_kwargs)
        xs, ctx = problem.split(values)
        return xs, ctx, None if seeds is None else seeds.leaves

    try:
        jitted.lower(*with_abstract_arrays(inputs, values, seed_kwargs)).compile()
    except Exception:  # noqa: BLE001 - f cannot be traced, say: the first call raises where it is clear
        pass


_REVERSE_LOOP = "Reverse-mode differentiation does not work for lax.while_loop"


_REVERSE_NOTE = "(raised by JAX when activity."


_NO_TRANSPOSE = "Linearization failed to produce known values for all output primals"


def _explain_reverse_loop(error: ValueError, F: FlatFunction) -> None:
    """Say, on JAX's refusal to differentiate a loop of unknown length in reverse mode, which
    operators work and why a prepared call may refuse what an unprepared one took: JAX raises
    it after f has run, so f's own note is not on it."""
    notes, problem = getattr(error, "__notes__", []), getattr(F, "problem", None)
    source = getattr(F, "source", None)  # F is f's gradient, differentiated again (reverse over reverse)
    if source is not None:
        problem = getattr(source, "problem", None)
    if problem is None or any(str(n).startswith(_REVERSE_NOTE) for n in notes):
        return
    if _NO_TRANSPOSE in str(error) and source is None:
        # An operation JAX can linearise but not transpose: a Pallas kernel, a custom_vmap function.
        add_note(
            error,
            f"{_REVERSE_NOTE}{problem.op_name} on {problem.backend!r} differentiated f in reverse mode) An "
            f"operation in f has a forward-mode rule but none for reverse mode (a pallas_call kernel, a "
            f"jax.custom_batching.custom_vmap function). Forward mode differentiates it: activity.pushforward, "
            f"activity.derivative, or activity.jacobian of an f with more outputs than inputs. For reverse mode "
            f"(gradient, pullback, hvp), give that operation a jax.custom_vjp rule.",
        )
        return
    if _REVERSE_LOOP not in str(error):
        return
    if source is not None:
        # The first reverse pass went through, so the loop is in f's derivative: a jax.custom_vjp
        # rule's backward pass (diffrax's adjoints) that JAX cannot differentiate in reverse again.
        add_note(
            error,
            f"{_REVERSE_NOTE}{problem.op_name} on {problem.backend!r} differentiated f's gradient in reverse mode) "
            f"The loop is in f's derivative (the backward pass of a jax.custom_vjp rule, as in diffrax's "
            f"adjoints), which JAX cannot differentiate in reverse mode. Where f has a form JAX "
            f"differentiates in forward mode, the default backend's hvp and hessian (forward over "
            f"reverse) take it: for a diffrax.diffeqsolve, adjoint=diffrax.DirectAdjoint().",
        )
        return
    add_note(
        error,
        f"{_REVERSE_NOTE}{problem.op_name} on {problem.backend!r} differentiated f in reverse mode) Forward "
        f"mode differentiates such a loop: activity.pushforward, activity.derivative, or activity.jacobian of "
        f"an f with more outputs than inputs. A prepared call traces array Constants (jnp.array(n) too): a "
        f"trip count passed as a Python int, Constant(n), is static, and fori_loop is then a scan reverse "
        f"mode can differentiate.",
    )


_FORWARD_CUSTOM_VJP = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


_FORWARD_NOTE = "(JAX differentiates a jax.custom_vjp function in reverse mode only"


def _explain_forward_custom_vjp(error: TypeError) -> None:
    """Say, on JAX's refusal of forward mode through a ``jax.custom_vjp`` function (odeint's
    adjoint, a user's own rule), which operators differentiate f in reverse mode instead, and
    which backend does so for hvp and hessian (their default is forward over reverse)."""
    if _FORWARD_CUSTOM_VJP not in str(error) or any(str(n).startswith(_FORWARD_NOTE) for n in getattr(error, "__notes__", [])):
        return
    add_note(
        error,
        f"{_FORWARD_NOTE}, e.g. jax.experimental.ode.odeint.) activity.gradient and activity.pullback "
        f"differentiate f in reverse mode; activity.jacobian does too when f has no more outputs than inputs "
        f"(otherwise pullback with cotangents=[one per output entry]). For activity.hvp and activity.hessian pass "
        f'backend=activity.SecondOrder(activity.AutoJAX(), activity.AutoJAX(), mode="reverse-over-reverse"). '
        # Reverse over reverse fails inside diffrax's reverse-only adjoints too (a while loop,
        # a filter_custom_vjp), so there the way out is the solver's own forward-capable option.
        f"A diffrax.diffeqsolve differentiates in reverse mode only, once, with its default adjoint "
        f"(RecursiveCheckpointAdjoint) or BacksolveAdjoint: pass adjoint=diffrax.DirectAdjoint() for "
        f"forward mode and second derivatives, or adjoint=diffrax.ForwardMode() for forward mode.",
    )


# ------------------------------------------------------------------ static leaves


def _warn_of_stale_statics(plan: Any, values: tuple[Any, ...]) -> None:
    """Warn, once at prepare, of each static leaf whose changes the compiled call cannot see."""
    problem = plan.problem
    for position, (roles, statics) in enumerate(zip(problem.roles, problem.statics)):
        for index, (role, leaf) in enumerate(zip(roles, statics)):
            reason = _stale_reason(leaf) if role == STATIC else None
            if reason is not None:
                from .._preparation import leaf_path  # the preparation imports the backends

                path = leaf_path(problem, values, position, index)
                warnings.warn(
                    f"activity.prepare(activity.{plan.operator.name}, ...): {problem.label(position)} "
                    f"({problem.kinds[position].capitalize()}) at {path} is {reason}",
                    stacklevel=caller_stacklevel(),
                )


_STATIC_RULE = (
    "AutoJAX compiles f with each non-array leaf as a static value (like a jax.jit static argument), "
    "which a call matches by type and equality"
)


def _stale_reason(leaf: Any) -> str | None:
    """Why AutoJAX would not see a change to the static ``leaf``, or None. Only what is cheap
    to tell and certain: functions, classes, enums, numbers, strings, dtypes and value types
    (``__eq__`` with ``__hash__``) cannot change unseen, so they are never reported."""
    if isinstance(leaf, (type, types.ModuleType, enum.Enum)):
        return None
    layer = sys.modules.get("keras.src.layers.layer")
    if layer is not None and isinstance(leaf, layer.Layer):
        return (
            f"a Keras {type(leaf).__name__} held where activity does not split it into its variables' values "
            f"(inside a Flax NNX module, or with Keras running on another backend than JAX). jax.jit compiles "
            f"the values its variables hold when it traces f, so a change of its weights between calls is not "
            f"seen. Pass the Keras model (on Keras's JAX backend) in an argument of its own, Constant(model) or "
            f"Active(model): its variables' values are then the call's inputs."
        )
    if isinstance(leaf, types.MethodType):  # `model.apply`: what it reads is its object's state
        owner = leaf.__self__
        if not _holds_arrays(owner) or not _mutable(owner):
            return None
        return f"a method of {_changes_in_place(owner)}"
    if callable(leaf) and (isinstance(leaf, (types.FunctionType, functools.partial)) or not _holds_arrays(leaf)):
        # a function, or a function-like object (jax.jit's, a custom_jvp such as jax.nn.relu)
        if not _captures_writable_numpy(leaf):
            return None
        return (
            "a function that reads a numpy array from its closure. jax.jit copies that array into the "
            "compiled code when it traces f, so writing into it between calls is not seen. Pass the array "
            "as an argument (Constant(array)), or make it read-only (array.flags.writeable = False) if it "
            "never changes."
        )
    cls = type(leaf)
    if isinstance(leaf, (set, bytearray)):
        mutable = True
    else:
        try:
            state = vars(leaf)
        except TypeError:  # no attributes to set: numbers, strings, dtypes
            return None
        if not state:  # a marker object (Equinox's SharedNode): f cannot have read anything from it
            return None
        mutable = _mutable(leaf)
    if not mutable:
        return None
    return _changes_in_place(leaf)


def _mutable(value: Any) -> bool:
    """Whether a call may match ``value`` to itself though it changed: unhashable, or equal only to itself."""
    cls = type(value)
    return cls.__hash__ is None or cls.__eq__ is object.__eq__  # type: ignore[comparison-overlap]


def _holds_arrays(value: Any) -> bool:
    """Whether ``value``'s attributes hold an array, directly or in a list, tuple or dict (a callable
    object such as ``Scaler(w)``, whose ``__call__`` reads ``self.w``)."""
    try:
        state = vars(value)
    except TypeError:
        return False
    for attribute in state.values():
        items = attribute.values() if isinstance(attribute, dict) else attribute if isinstance(attribute, (list, tuple)) else (attribute,)
        if any(arrays.is_array(item) for item in items):
            return True
    return False


def _changes_in_place(value: Any) -> str:
    cls = type(value)
    identity = ", for this class identity" if cls.__eq__ is object.__eq__ else ""  # type: ignore[comparison-overlap]
    return (
        f"a {cls.__name__}, which can change in place. {_STATIC_RULE}{identity}: the same object always "
        f"matches itself, so changing it between calls is not seen. Pass what changes as arrays (e.g. "
        f"Constant(jnp.asarray(value)), or a dataclass of arrays), or pass a new object each time, of a "
        f"class with __eq__ and __hash__."
    )


def _captures_writable_numpy(function: Any) -> bool:
    return any(isinstance(value, np.ndarray) and value.flags.writeable for value in captured_values(function))
