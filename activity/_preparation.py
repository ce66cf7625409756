"""`prepare`: do an operator's one-time work once, then call it on new data."""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Generic, ParamSpec, Sequence, TypeVar, overload

from . import _arrays as arrays
from ._annotations import Annotation
from ._direct_call import specialised_call
from ._errors import PreparationMismatchError, caller_stacklevel, drop_jax_note, explain_runtime_check
from ._operators._common import (
    Operator,
    Plan,
    encode_seeds,
    operator_of,
    operator_options,
    refuse_annotated_options,
    unannotated_keyword_message,
)
from ._problem import (
    HAS_AUX,
    Arguments,
    _describe,
    _same_meta,
    kinds_of,
    module_difference,
    parse_call,
    wheres_of,
)
from ._tree import flatten, structure_difference
from .backends import Backend, find_placeholder, placeholders_allowed
from .backends._base import SignatureChanged

MAX_SIGNATURES = 32
"""How many signatures a ``strict=False`` prepared operator keeps, by default (``max_signatures=``)."""

WARN_AFTER = 8
"""A ``strict=False`` prepared operator warns (once) when calls have brought more new signatures than this."""

R = TypeVar("R")  # what the prepared operator returns
P = ParamSpec("P")


class Prepared(Generic[R]):
    """An operator prepared for one call signature. Call it like the operator, without ``f``.

    ``Prepared[R]``: a call returns what the operator returned for the prepared
    arguments (``prepare(gradient, f, Active(x), ...)`` on a ``jax.Array`` is a
    ``Prepared[jax.Array]``).

    Arguments may be raw values (they take the prepared kinds, and an
    ``Active``'s prepared ``where=``) or annotated with the same kinds;
    keyword arguments for ``f`` are passed by name on every call, raw or
    annotated; ``tangent=``/``cotangent=`` are passed per call.
    Made by `prepare`, not constructed directly.

    Attributes:
        operator: the operator's name, e.g. ``"gradient"``.
        backend: the backend it was prepared for.

    Raises:
        PreparationMismatchError: (from a call, with ``strict=True``) the arguments differ
            from the preparation's in kind, structure, shape, dtype, device or static value;
            the message names the argument and what differs.

    >>> import numpy as np
    >>> import activity as ad
    >>> loss = lambda w, x: ((x @ w) ** 2).sum()
    >>> grad = ad.prepare(ad.gradient, loss, ad.Active(np.ones(2)), ad.Constant(np.eye(2)), backend=ad.AutoFiniteDifferences())
    >>> grad.operator, np.round(grad(np.array([1.0, 2.0]), np.eye(2)), 6)
    ('gradient', array([2., 4.]))
    """

    def __init__(
        self,
        plan: Plan,
        f: Callable[..., Any],
        strict: bool,
        options: dict[str, Any],
        seed_kwargs: dict[str, Any],
        values: tuple[Any, ...],
        max_signatures: int = MAX_SIGNATURES,
        device_pending: bool = False,
    ):
        self._plan = plan
        # (signature key, plan), the most recently used last; strict=False keeps `max_signatures`
        self._plans = [((tuple(plan.problem.signature), _raw_seed_key(seed_kwargs, plan.backend)), plan)]
        self._f, self._strict, self._options = f, strict, options
        self._max_signatures = max_signatures
        self._lock = threading.Lock()
        self._local = threading.local()  # strict=False: this thread's call, while the compiled call runs
        self.operator: str = plan.operator.name
        self.backend: Backend = plan.backend
        self._keywords = plan.problem.keywords  # f's keyword arguments, taken by name per call
        self._seed_names = tuple(seed_kwargs)  # the tangent keywords a specialised __call__ takes by name
        self._new_signatures = 0  # plans made after prepare, for the warning
        self._warned = False
        self._compiled_signatures = 1  # signatures traced into the compiled call
        # Prepared from torch meta-device tensors: the first call that matches them fixes the
        # devices, and the operator is prepared for it (on torch that runs nothing).
        self._device_pending = device_pending
        self._set_compiled_call(None if device_pending else self._compile(plan, values, seed_kwargs))

    def __repr__(self) -> str:
        return f"<prepared activity.{self.operator} on {self.backend!r}, strict={self._strict}>"

    def __call__(self, *args: Any, **seed_kwargs: Any) -> R:
        # A strict operator without keywords for f has a `__call__` of its own for the prepared
        # call (see `_specialise`), which hands every other shape of call here.
        return self._reported(self._call, args, seed_kwargs)  # type: ignore[no-any-return]

    def _generic_call(self, args: tuple[Any, ...], seed_kwargs: dict[str, Any]) -> Any:
        """`__call__` for any arguments: what a specialised ``__call__`` (see `_set_compiled_call`)
        hands a call of another shape than the prepared one."""
        return Prepared.__call__(self, *args, **seed_kwargs)

    def _after_miss(self, args: tuple[Any, ...], seed_kwargs: dict[str, Any]) -> Any:
        """The call the compiled call declined: the checked path says what differs (or runs it)."""
        annotated = any(isinstance(arg, Annotation) for arg in args)  # refused by the compiled call
        return self._reported(self._call if annotated else self._checked_call, args, seed_kwargs)

    def _explain(self, error: BaseException) -> None:
        explain_runtime_check(error, f"{self.operator} with backend {self.backend!r}")
        drop_jax_note(error)

    def _call(self, args: tuple[Any, ...], seed_kwargs: dict[str, Any]) -> Any:
        if self._keywords:
            args = self._with_keywords(args, seed_kwargs)
        compiled_call = self._compiled_call
        if compiled_call is not None:
            values: tuple[Any, ...] | None = args
            if any(isinstance(arg, Annotation) for arg in args):
                problem = self._plan.problem
                kinds, values = kinds_of(args, problem.kinds)
                same = kinds == problem.kinds and all(a is b for a, b in zip(wheres_of(args, problem.wheres), problem.wheres))
                values = values if same else None
            if values is not None:
                if not self._strict:
                    self._local.call = (values, seed_kwargs)  # for `_retrace`
                try:
                    return compiled_call(*values, **seed_kwargs)
                except compiled_call.misses:
                    pass  # not the prepared signature: the checked path says what differs, or prepares again
                finally:
                    if not self._strict:
                        self._local.call = None
        return self._checked_call(args, seed_kwargs)

    def _reported(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as error:
            self._explain(error)
            raise

    def _set_compiled_call(self, compiled_call: Any) -> None:
        self._compiled_call = compiled_call
        # a `__call__` written for the prepared call serves strict operators without keywords for f
        direct = compiled_call is not None and self._strict and not self._keywords
        self._specialise(compiled_call if direct else None)

    def _specialise(self, compiled_call: Any) -> None:
        """Give this object a ``__call__`` for the prepared call, or take it away (None): the
        framework's own dispatch where the backend offers one (``compiled_call.native``: its
        misses come back to `_after_miss` with the caller's arguments, and a copy of this
        object hands them to this one, which holds the same plan), else a method written for
        it (`specialised_call`). It lives on a subclass of its own, made on first use, as
        Python looks a call's ``__call__`` up on the type."""
        specialised: Any = None
        native = None if compiled_call is None or compiled_call.native is None else compiled_call.native(
            functools.partial(Prepared._after_miss, self), functools.partial(Prepared._explain, self),
            functools.partial(Prepared.__call__, self),
        )
        if native is not None:
            # JAX's C++ dispatch is the whole call, with no frame of activity's: the prepared
            # call's hook in `native` hands every other call to the generic paths.
            specialised = staticmethod(native)
        elif compiled_call is not None:
            specialised = specialised_call(
                len(self._plan.problem.kinds), self._seed_names, compiled_call.call, compiled_call.misses,
                compiled_call.rebuild, not compiled_call.refuses_annotations,
                Prepared._generic_call, Prepared._after_miss, Prepared._explain,
            )
        owner = type(self).__dict__.get("_specialised_for")
        own = owner is not None and owner() is self  # a copy of this object has its class, not its own
        if specialised is None:
            if own:
                type(self).__call__ = Prepared.__call__  # type: ignore[method-assign]
            return
        if not own:
            cls = type(self).__mro__[1] if owner is not None else type(self)  # not a copy's owner's subclass
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
            self.__class__ = type(cls.__name__, (cls,), {**namespace, "_specialised_for": weakref.ref(self)})
        if native is None:
            specialised.__doc__, specialised.__qualname__ = Prepared.__call__.__doc__, "Prepared.__call__"
            specialised.__signature__ = _generic_signature()  # what `inspect` shows
        else:  # its signature is `eager`'s, the generic call's
            functools.update_wrapper(native, Prepared.__call__, updated=())
            del native.__wrapped__
        type(self).__call__ = specialised  # type: ignore[method-assign]

    def _with_keywords(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The positional arguments followed by the prepared keyword arguments for f, taken out
        of ``kwargs`` by name (what is left are the tangent keywords)."""
        missing = [name for name in self._keywords if name not in kwargs]
        if missing:
            raise TypeError(
                f"prepared activity.{self.operator}: missing the keyword argument(s) "
                f"{', '.join(name + '=' for name in missing)} for f; it was prepared with "
                f"{', '.join(name + '=' for name in self._keywords)}. Pass each by name, raw or annotated."
            )
        return (*args, *(kwargs.pop(name) for name in self._keywords))

    def _checked_call(self, args: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> Any:
        plan = self._plan
        problem = plan.problem
        extra = [name for name, value in seed_kwargs.items() if isinstance(value, Annotation)]
        if extra:
            raise PreparationMismatchError(
                f"prepared activity.{self.operator}: called with the keyword argument(s) "
                f"{', '.join(name + '=' for name in extra)} for f, which it was not prepared with"
                f"{' (prepared with ' + ', '.join(n + '=' for n in self._keywords) + ')' if self._keywords else ''}. "
                f"Prepare again with them."
            )
        if len(args) != len(problem.kinds):
            raise PreparationMismatchError(
                f"prepared activity.{self.operator}: prepared with {problem.n_positional} argument(s) after f, "
                f"called with {len(args) - len(self._keywords)}. Pass the same arguments in the same order."
            )
        kinds, values = kinds_of(args, problem.kinds)
        wheres = wheres_of(args, problem.wheres)
        if self._device_pending or not self._strict:
            self._refuse_placeholders(values, seed_kwargs)
        if self._device_pending and problem.explain_mismatch(values, kinds, wheres) is None:
            plan = self._prepare_for_devices(kinds, values, seed_kwargs, wheres)
            problem = plan.problem
        if not self._strict:
            plan = self._plan_for(kinds, values, seed_kwargs, wheres)
            if kinds == self._plan.problem.kinds and wheres == self._plan.problem.wheres:
                compiled = self._recompile_if_full(plan, values, seed_kwargs)
                if compiled is not None:
                    try:
                        return compiled(*values, **seed_kwargs)
                    except compiled.misses:
                        pass
            return plan.run(values, encode_seeds(plan.operator, plan.problem, seed_kwargs))
        try:
            seeds = encode_seeds(plan.operator, problem, seed_kwargs)
        except (TypeError, ValueError):
            self._refuse_placeholders((), seed_kwargs)  # a placeholder tangent is said to be one
            raise
        split = problem.split(values, kinds, wheres)
        mismatch = None
        if split is None:
            self._refuse_placeholders(values, seed_kwargs)
            mismatch = problem.explain_mismatch(values, kinds, wheres) or "the arguments differ from the prepared ones."
        elif seeds is not None and seeds.key != plan.seed_key:
            mismatch = _seed_mismatch(plan.seed_key, seeds.key, plan.operator.seed)
        if mismatch is not None:
            raise PreparationMismatchError(
                f"prepared activity.{self.operator}: {mismatch} Prepare again for the new arguments, "
                f"or prepare with strict=False to re-prepare automatically."
            )
        return plan.run(values, seeds, split)

    def _compile(self, plan: Plan, values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> Any:
        return plan.backend.compile_call(plan, values, seed_kwargs, None if self._strict else self._retrace)

    def _refuse_placeholders(self, values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> None:
        found = next(
            (
                where
                for where in (
                    *(find_placeholder(value, f"argument {position}") for position, value in enumerate(values)),
                    *(find_placeholder(value, name) for name, value in seed_kwargs.items()),
                )
                if where is not None
            ),
            None,
        )
        if found is not None:
            raise TypeError(
                f"prepared activity.{self.operator}: {found}. Placeholders are for prepare only: call the "
                f"prepared operator with arrays of the prepared shapes and dtypes."
            )

    def _prepare_for_devices(self, kinds: tuple[Any, ...], values: tuple[Any, ...], seed_kwargs: dict[Any, Any], wheres: tuple[Any, ...]) -> Plan:
        """The first call after preparing from meta-device tensors: prepared again for its devices."""
        plan = self._make_plan(kinds, values, seed_kwargs, wheres)
        plan.compile()
        compiled = self._compile(plan, values, seed_kwargs)
        with self._lock:
            if self._device_pending:
                self._plan, self._device_pending = plan, False
                self._plans = [((tuple(plan.problem.signature), _raw_seed_key(seed_kwargs, self.backend)), plan)]
                self._set_compiled_call(compiled)
            return self._plan

    def _retrace(self, values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> Any:
        """The whole call for another signature, traced into the compiled call from that
        signature's plan (``strict=False``), until the compiled call holds `max_signatures`
        (see `_recompile_if_full`). A failed trace would leave JAX's C++ dispatch on its slow
        path for those arguments, so it only fails for a compiled call about to be replaced."""
        kinds, wheres = self._plan.problem.kinds, self._plan.problem.wheres
        key = self._key(kinds, values, seed_kwargs)
        with self._lock:
            if self._compiled_signatures >= self._max_signatures:
                raise SignatureChanged
            self._compiled_signatures += 1
        try:
            plan = self._known_plan(key) or self._new_plan(
                kinds, *self._own_values(values, seed_kwargs, key), key, wheres
            )
            return plan.direct()(values, seed_kwargs)
        except BaseException:
            with self._lock:
                self._compiled_signatures -= 1  # nothing was added to the compiled call
            raise

    def _own_values(self, values: tuple[Any, ...], seed_kwargs: dict[Any, Any], key: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[Any, Any]]:
        """The caller's own values for a plan made while JAX traces: inside `jax.jit` the values
        are JAX's rebuild of them, whose dicts have sorted keys, and a plan's results keep
        the key order of the values it was made from."""
        call: tuple[tuple[Any, ...], dict[Any, Any]] | None = getattr(self._local, "call", None)
        if call is not None and _same_key(self._key(self._plan.problem.kinds, *call), key):
            return call
        return values, seed_kwargs

    def _recompile_if_full(self, plan: Plan, values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> Any:
        """A new compiled call, starting from ``plan``, if the current one is full (or None):
        JAX cannot drop one signature from a jitted function, so the whole one goes, and the
        signatures still in use are traced again into the new one when they next come."""
        with self._lock:
            full = self._compiled_call is not None and self._compiled_signatures >= self._max_signatures
        if not full:
            return None
        compiled = self._compile(plan, values, seed_kwargs)
        if compiled is not None:  # else these values cannot start one (JAX refuses them): keep the full one
            with self._lock:
                self._set_compiled_call(compiled)
                self._compiled_signatures = 1
        return compiled

    def _key(self, kinds: tuple[Any, ...], values: tuple[Any, ...], seed_kwargs: dict[Any, Any], wheres: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """The signature of a call: the arguments' (as `Problem.check` sees them) and the tangents'."""
        return (self._plan.problem.check(values, kinds, wheres), _raw_seed_key(seed_kwargs, self.backend))

    def _known_plan(self, key: tuple[Any, ...]) -> Plan | None:
        with self._lock:
            for index, (known, plan) in enumerate(self._plans):
                if _same_key(known, key):
                    self._plans.append(self._plans.pop(index))  # the most recently used last
                    return plan
        return None

    def _plan_for(self, kinds: tuple[Any, ...], values: tuple[Any, ...], seed_kwargs: dict[Any, Any], wheres: tuple[Any, ...]) -> Plan:
        """The plan for this call's signature (tangents included), prepared on first sight."""
        key = self._key(kinds, values, seed_kwargs, wheres)
        return self._known_plan(key) or self._new_plan(kinds, values, seed_kwargs, key, wheres)

    def _make_plan(self, kinds: tuple[Any, ...], values: tuple[Any, ...], seed_kwargs: dict[Any, Any], wheres: tuple[Any, ...]) -> Plan:
        plan = Plan(
            self._plan.operator, self._f, kinds, values, self.backend, self._options, seed_kwargs, "prepared",
            wheres=wheres, keywords=self._keywords,
        )
        return plan.compile()

    def _new_plan(self, kinds: tuple[Any, ...], values: tuple[Any, ...], seed_kwargs: dict[Any, Any], key: tuple[Any, ...], wheres: tuple[Any, ...]) -> Plan:
        """A plan for a new signature; at most `max_signatures` are kept, the least recently
        used is dropped. Warns once when calls keep bringing new ones."""
        plan = self._make_plan(kinds, values, seed_kwargs, wheres)
        with self._lock:
            previous = self._plans[-1][0] if self._plans else None
            self._plans.append((key, plan))
            del self._plans[: -self._max_signatures]
            self._new_signatures += 1
            warn = self._new_signatures > WARN_AFTER and not self._warned
            self._warned |= warn
        if warn:
            warnings.warn(self._keeps_preparing(previous, key, values), stacklevel=caller_stacklevel())
        return plan

    def _keeps_preparing(self, previous: tuple[Any, ...] | None, key: tuple[Any, ...], values: tuple[Any, ...]) -> str:
        problem = self._plan.problem
        change = _signature_change(previous, key, values, problem) if previous is not None else "a new signature"
        return (
            f"prepared activity.{self.operator} (strict=False) has been prepared again for "
            f"{self._new_signatures} new signatures, each from scratch (on JAX, f is traced and compiled "
            f"again). The last change: {change}. Keep the shapes, dtypes and static values steady (pad or "
            f"bucket batches), or prepare one operator per signature. At most max_signatures="
            f"{self._max_signatures} signatures are kept, the least recently used are dropped."
        )


@functools.cache
def _generic_signature() -> inspect.Signature:
    return inspect.signature(Prepared.__call__)


def _signature_change(old: tuple[Any, ...], new: tuple[Any, ...], values: tuple[Any, ...], problem: Any) -> str:
    """What differs between two signature keys, where, e.g. "argument 1 (Constant) at ['x']:
    shape (3, 4) -> (5, 4)" (the first three differences)."""
    (old_args, old_seeds), (new_args, new_seeds) = old, new
    changes = []
    for position, ((old_kind, old_spec, old_metas, old_mask), (kind, spec, metas, mask)) in enumerate(
        zip(old_args, new_args)
    ):
        name = f"argument {position}" if position < problem.n_positional else problem.label(position)
        label = f"{name} ({kind.capitalize()})"
        if old_kind != kind:
            changes.append(f"{name}: {old_kind.capitalize()} -> {kind.capitalize()}")
        elif old_mask != mask:
            changes.append(f"{label}: another where= mask")
        elif old_spec != spec:
            changes.append(f"{label}: structure changed: {structure_difference(old_spec, spec)}")
        else:
            changes += [
                f"{label} at {leaf_path(problem, values, position, index)}: {_meta_change(before, after)}"
                for index, (before, after) in enumerate(zip(old_metas, metas))
                if not _same_meta(before, after)
            ]
    if old_seeds != new_seeds:
        changes.append(f"the tangent or cotangent keywords: {old_seeds} -> {new_seeds}")
    if not changes:
        return "none found (the arguments compare unequal to themselves)"
    more = f"; and {len(changes) - 3} more" if len(changes) > 3 else ""
    return "; ".join(changes[:3]) + more


def leaf_path(problem: Any, values: tuple[Any, ...], position: int, index: int) -> str:
    """The path of a leaf of the signature, for messages."""
    return problem.leaf_path(position, values[position], index)  # type: ignore[no-any-return]


def _meta_change(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    if before[0] == after[0] and before[0] not in ("static", "module", "placeholder"):
        parts = [
            f"{what} {a} -> {b}"
            for what, a, b in zip(("shape", "dtype", "device"), before[1:], after[1:])
            if a != b
        ]
        return ", ".join(parts)
    if before[0] == after[0] == "module" and before[1] == after[1]:
        return module_difference(before[2], after[2])
    change = f"{_describe(before)} -> {_describe(after)}"
    if after[0] == "static" and type(after[1]) in (int, float, bool, complex):
        change += (
            ". A Python number in a Constant is static, like a jax.jit static argument: each new value is "
            "a new signature. Pass jnp.asarray(value) (or np.asarray) to trace it instead"
        )
    return change


def _raw_seed_key(seed_kwargs: dict[str, Any], backend: Backend) -> tuple[Any, ...]:
    """Which tangent keyword was given, batch size, structure and leaf layouts (as the backend
    checks them, like the arguments' signature)."""
    key = []
    for name in sorted(k for k, v in seed_kwargs.items() if v is not None):
        value = seed_kwargs[name]
        batch = len(value) if name.endswith("s") and isinstance(value, (list, tuple)) else None
        first = value[0] if batch else value
        leaves, spec = flatten(first)
        key.append((name, batch, spec, tuple(_seed_meta(leaf, backend) for leaf in leaves)))
    return tuple(key)


def _seed_meta(leaf: Any, backend: Backend) -> tuple[Any, ...]:
    """A tangent leaf's meta; a JAX placeholder's is that of the arrays it stands for."""
    if arrays.is_jax_placeholder(leaf):
        return ("jax", tuple(leaf.shape), str(sys.modules["jax"].dtypes.canonicalize_dtype(leaf.dtype)), None)
    return backend.array_meta(leaf)


def _same_key(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two signature keys are one signature (static leaves compared as `_same_meta` does)."""
    (args_a, seeds_a), (args_b, seeds_b) = a, b
    if len(args_a) != len(args_b) or seeds_a != seeds_b:
        return False
    for (kind_a, spec_a, metas_a, mask_a), (kind_b, spec_b, metas_b, mask_b) in zip(args_a, args_b):
        if kind_a != kind_b or mask_a != mask_b or spec_a != spec_b or len(metas_a) != len(metas_b):
            return False
        if not all(map(_same_meta, metas_a, metas_b)):
            return False
    return True


def _seed_mismatch(expected: Any, got: Any, seed: str | None) -> str:
    def describe(batch: int | None) -> str:
        return f"{seed}=" if batch is None else f"{seed}s= with {batch} entries"

    (batch_e, spec_e), (batch_g, spec_g) = expected, got
    changed = spec_e is not None and spec_g is not None and spec_e != spec_g
    structure = f"the {seed}'s structure changed: {structure_difference(spec_e, spec_g)}" if changed else ""
    if batch_e == batch_g and structure:
        return f"{structure}."
    return f"prepared for {describe(batch_e)}, called with {describe(batch_g)}" + (f"; {structure}." if structure else ".")


def _placeholder_frameworks(values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> set[str]:
    leaves, _ = flatten((values, seed_kwargs))
    found = {"jax" if arrays.is_jax_placeholder(leaf) else "torch" for leaf in leaves if arrays.is_placeholder(leaf)}
    if any(arrays.is_torch_module(leaf) and _on_meta(leaf) for leaf in leaves):
        found.add("torch")  # a module built on the meta device: its tensors are placeholders too
    return found


def _on_meta(module: Any) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _plan(
    operator: Operator,
    f: Callable[..., Any],
    arguments: Arguments,
    backend: Backend | None,
    options: dict[Any, Any],
    seed_kwargs: dict[Any, Any],
) -> tuple[Plan, bool]:
    """The prepared plan, and whether it was made from torch placeholders (its devices are
    then fixed by the first call). JAX placeholders become tracers of their shape and dtype
    while the plan is made (inside `jax.eval_shape`), so it is the plan of the arrays they
    stand for; nothing is computed from them."""
    kinds, values = arguments.kinds, arguments.values
    placeholders = _placeholder_frameworks(values, seed_kwargs)

    def make(values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> Plan:
        return Plan(
            operator, f, kinds, values, backend, options, seed_kwargs, "prepared",
            wheres=arguments.wheres, keywords=arguments.keywords,
        )

    if not placeholders:
        return make(values, seed_kwargs).compile(), False
    with placeholders_allowed():
        if "jax" not in placeholders:
            return make(values, seed_kwargs).compile(), True
        from .backends._jax import with_abstract_arrays

        made: list[Plan] = []
        with_abstract_arrays(
            lambda values, seed_kwargs: made.append(make(values, seed_kwargs)) or (),  # type: ignore[func-returns-value]
            values, seed_kwargs,
            placeholders_only=True,
        )
        return made[0].compile(), "torch" in placeholders


# The result's type follows from the operator's overloads. mypy cannot yet match the
# operator's keywords through `P.kwargs` when the operator is overloaded: a call with one
# of them (or with strict=, which the operator does not take, or an operator's name) is
# typed by the later overloads, `Prepared[Any]`, instead of being refused.
@overload
def prepare(op: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Prepared[R]: ...
@overload
def prepare(
    op: Callable[..., Any] | str, f: Callable[..., Any], *args: Any, backend: Backend | None = None, strict: bool,
    max_signatures: int | None = None, **op_kwargs: Any,
) -> Prepared[Any]: ...
@overload
def prepare(
    op: str, f: Callable[..., Any], *args: Any, backend: Backend | None = None, strict: bool = True,
    max_signatures: int | None = None, **op_kwargs: Any,
) -> Prepared[Any]: ...
@overload
def prepare(
    op: Callable[..., Any], f: Callable[..., Any], *args: Any, backend: Backend | None, **op_kwargs: Any
) -> Prepared[Any]: ...
@overload
def prepare(op: Callable[..., Any], f: Callable[..., Any], *args: Any, has_aux: bool, **op_kwargs: Any) -> Prepared[Any]: ...
@overload
def prepare(op: Callable[..., Any], f: Callable[..., Any], *args: Any, tangent: Any, **op_kwargs: Any) -> Prepared[Any]: ...
@overload
def prepare(op: Callable[..., Any], f: Callable[..., Any], *args: Any, tangents: Sequence[Any], **op_kwargs: Any) -> Prepared[Any]: ...
@overload
def prepare(op: Callable[..., Any], f: Callable[..., Any], *args: Any, cotangent: Any, **op_kwargs: Any) -> Prepared[Any]: ...
@overload
def prepare(op: Callable[..., Any], f: Callable[..., Any], *args: Any, cotangents: Sequence[Any], **op_kwargs: Any) -> Prepared[Any]: ...
# The first overload passes the operator's own keywords, which mypy cannot match to these.
def prepare(  # type: ignore[misc]
    op: Callable[..., Any] | str,
    f: Callable[..., Any],
    *args: Any,
    backend: Backend | None = None,
    strict: bool = True,
    max_signatures: int | None = None,
    **op_kwargs: Any,
) -> Prepared[Any]:
    """Prepare ``op(f, *args, **op_kwargs)`` once; call the result on new values of the same kinds.

    All one-time work (tracing, compiling, building transformed functions) is
    done here; results are never computed from the preparation values, which
    may be placeholders: ``jax.ShapeDtypeStruct`` or torch tensors on the
    ``meta`` device, at any leaf (of arguments and tangents). With
    ``strict=True`` a change of kind, structure, shape, dtype, device or static
    value raises `PreparationMismatchError`; with ``strict=False`` the operator
    is prepared again for the new signature, keeping at most
    ``max_signatures`` (default `MAX_SIGNATURES`, 32; the least recently used
    is dropped) and warning once when calls keep bringing new ones.

    Non-array leaves of the arguments (a Python number or string in a
    `Constant`, a model's activation function) are static, like ``jax.jit``
    static arguments: a call matches them by type and equality, so a new value
    is a new signature, and an object changed in place between calls (an
    object without ``__eq__`` compares by identity) is not seen by AutoJAX,
    which compiles f with them. Pass values that change as arrays:
    ``Constant(jnp.asarray(scale))`` is traced. AutoJAX warns at prepare of
    static leaves it can tell are mutable.

    Annotated keyword arguments (``scale=Constant(2.0)``) go to ``f`` by name,
    and the prepared operator takes them by name on every call. An
    ``Active(x, where=...)`` mask is part of the signature: raw values take
    the prepared mask; another mask is a mismatch.

    A prepared object may be called from several threads at once: each call
    builds its own state (module views, Cache buffers, tapes) and shares only
    what was compiled, so every thread gets the result for its own arguments.

    Args:
        op: the operator, e.g. `activity.gradient`, or its name (``"gradient"``).
        f: the function, called as ``f(*values)``.
        *args: the preparation arguments, each annotated `Active`, `Constant` or `Cache`
            (values or placeholders of the shapes and dtypes later calls will bring).
        backend: as for the operator; ``None`` infers JAX or torch from the arguments.
        strict: raise `PreparationMismatchError` for a call unlike the preparation
            (``True``), or prepare again for its signature (``False``).
        max_signatures: with ``strict=False``, how many signatures to keep (default 32).
        **op_kwargs: the operator's own keywords: ``has_aux``, and ``tangent``/``tangents``
            or ``cotangent``/``cotangents`` (their values are placeholders too).

    Returns:
        A `Prepared` operator: call it with the raw values of the arguments in the same
        order (no annotations), and the operator's per-call keywords.

    Raises:
        TypeError: ``op`` is not an operator, an argument is not annotated, or a keyword is
            not the operator's.
        UnsupportedError: ``backend`` does not support this operator prepared with these kinds.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> loss = lambda w, x: jnp.sum((w * x) ** 2)
    >>> prep = ad.prepare(ad.gradient, loss, ad.Active(jnp.ones(2)), ad.Constant(jnp.zeros(2)))
    >>> prep(jnp.ones(2), jnp.array([1.0, 2.0]))
    Array([2., 8.], dtype=float32)
    """
    operator = operator_of(op)
    own = _prepare_options(operator)
    refuse_annotated_options(operator, {"backend": backend, "strict": strict, "max_signatures": max_signatures}, "prepare")
    refuse_annotated_options(operator, {k: v for k, v in op_kwargs.items() if k in own}, "prepare")
    f_keywords = {k: op_kwargs.pop(k) for k in list(op_kwargs) if isinstance(op_kwargs[k], Annotation)}
    unknown = [k for k in op_kwargs if k not in own and k != "has_aux"]  # has_aux is refused below, with a reason
    if unknown:
        raise TypeError(unannotated_keyword_message(operator, unknown[0], op_kwargs[unknown[0]], own, "prepare"))
    arguments = parse_call(operator.name, f, args, f_keywords)
    values = arguments.values
    options = {k: op_kwargs.pop(k) for k in list(op_kwargs) if k == "has_aux"}
    if options.get("has_aux") and operator.name not in _HAS_AUX:
        raise TypeError(f"activity.{operator.name} does not take has_aux; it is for {', '.join(sorted(_HAS_AUX))}.")
    if operator.name not in _HAS_AUX:
        options = {}
    limit = _max_signatures(operator.name, strict, max_signatures)
    try:
        plan, device_pending = _plan(operator, f, arguments, backend, options, op_kwargs)
        return Prepared(plan, f, strict, options, op_kwargs, values, limit, device_pending)
    except Exception as error:
        drop_jax_note(error)  # placeholders are traced inside jax.eval_shape
        raise


def _max_signatures(op_name: str, strict: bool, max_signatures: int | None) -> int:
    if max_signatures is None:
        return MAX_SIGNATURES
    if strict:
        raise TypeError(
            f"activity.prepare(activity.{op_name}, ...): max_signatures= bounds the signatures a strict=False "
            f"prepared operator keeps; with strict=True there is only the prepared one. Pass strict=False too."
        )
    if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) or max_signatures < 1:
        raise ValueError(
            f"activity.prepare(activity.{op_name}, ...): max_signatures must be a positive int, got "
            f"{max_signatures!r}."
        )
    return max_signatures


_HAS_AUX = HAS_AUX


def _prepare_options(operator: Operator) -> tuple[str, ...]:
    """The keywords `prepare` takes for ``operator`` besides f's annotated ones."""
    return ("strict", "max_signatures", *operator_options(operator))
