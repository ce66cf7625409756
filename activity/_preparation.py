"""`prepare`: do an operator's one-time work once, then call it on new data."""

from __future__ import annotations

import threading
from typing import Any, Callable

from ._annotations import Annotation
from ._errors import PreparationMismatchError
from ._operators._common import Plan, encode_seeds, operator_of
from ._problem import kinds_of, parse_arguments
from ._tree import flatten
from .backends import Backend


class Prepared:
    """An operator prepared for one call signature. Call it like the operator, without ``f``.

    Arguments may be raw values (they take the prepared kinds) or annotated
    with the same kinds; ``tangent=``/``cotangent=`` are passed per call.
    """

    def __init__(
        self,
        plan: Plan,
        f: Callable,
        strict: bool,
        options: dict[str, Any],
        seed_kwargs: dict[str, Any],
        values: tuple,
    ):
        self._plans = [((tuple(plan.problem.signature), _raw_seed_key(seed_kwargs, plan.backend)), plan)]
        self._plan = plan
        self._f, self._strict, self._options = f, strict, options
        self._lock = threading.Lock()
        self.operator = plan.operator.name
        self.backend = plan.backend
        retrace = None if strict else self._run_new_signature
        self._compiled_call = plan.backend.compile_call(plan, values, seed_kwargs, retrace)

    def __repr__(self) -> str:
        return f"<prepared activity.{self.operator} on {self.backend!r}, strict={self._strict}>"

    def __call__(self, *args: Any, **seed_kwargs: Any) -> Any:
        compiled_call = self._compiled_call
        if compiled_call is not None:
            values: tuple | None = args
            for arg in args:  # a loop, not any(...): this path is timed against raw jax.jit calls
                if isinstance(arg, Annotation):
                    kinds, values = kinds_of(args, self._plan.problem.kinds)
                    values = values if kinds == self._plan.problem.kinds else None
                    break
            if values is not None:
                try:
                    return compiled_call.call(*values, **seed_kwargs)
                except compiled_call.misses:
                    pass  # not the prepared signature: the checked path says what differs, or prepares again
        plan = self._plan
        problem = plan.problem
        if len(args) != len(problem.kinds):
            raise PreparationMismatchError(
                f"prepared activity.{self.operator}: prepared with {len(problem.kinds)} argument(s) after f, "
                f"called with {len(args)}. Pass the same arguments in the same order."
            )
        kinds, values = kinds_of(args, problem.kinds)
        if not self._strict:
            plan = self._plan_for(kinds, values, seed_kwargs)
            return plan.run(values, encode_seeds(plan.operator, plan.problem, seed_kwargs))
        seeds = encode_seeds(plan.operator, problem, seed_kwargs)
        split = problem.split(values, kinds)
        mismatch = None
        if split is None:
            mismatch = problem.explain_mismatch(values, kinds) or "the arguments differ from the prepared ones."
        elif seeds is not None and seeds.key != plan.seed_key:
            mismatch = _seed_mismatch(plan.seed_key, seeds.key, plan.operator.seed)
        if mismatch is not None:
            raise PreparationMismatchError(
                f"prepared activity.{self.operator}: {mismatch} Prepare again for the new arguments, "
                f"or prepare with strict=False to re-prepare automatically."
            )
        return plan.run(values, seeds, split)

    def _run_new_signature(self, values: tuple, seed_kwargs: dict) -> Any:
        """The whole call on raw values of a new signature, from its own plan (``strict=False``)."""
        plan = self._plan_for(self._plan.problem.kinds, values, seed_kwargs)
        return plan.direct()(values, seed_kwargs)

    def _plan_for(self, kinds: tuple, values: tuple, seed_kwargs: dict) -> Plan:
        """The plan for this call's signature (tangents included), prepared on first sight."""
        key = (self._plan.problem.check(values, kinds), _raw_seed_key(seed_kwargs, self.backend))
        with self._lock:
            for known, plan in self._plans:
                if _same_key(known, key):
                    return plan
        plan = Plan(
            self._plan.operator, self._f, kinds, values, self.backend, self._options, seed_kwargs, "prepared"
        ).compile()
        with self._lock:
            self._plans.append((key, plan))
        return plan


def _raw_seed_key(seed_kwargs: dict[str, Any], backend: Backend) -> tuple:
    """Which tangent keyword was given, batch size, structure and leaf layouts (as the backend
    checks them, like the arguments' signature)."""
    key = []
    for name in sorted(k for k, v in seed_kwargs.items() if v is not None):
        value = seed_kwargs[name]
        batch = len(value) if name.endswith("s") and isinstance(value, (list, tuple)) else None
        first = value[0] if batch else value
        leaves, spec = flatten(first)
        key.append((name, batch, spec, tuple(backend.array_meta(leaf) for leaf in leaves)))
    return tuple(key)


def _same_key(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a static leaf whose == is not a bool
        return False


def _seed_mismatch(expected: Any, got: Any, seed: str | None) -> str:
    def describe(key: Any) -> str:
        batch, spec = key
        shape = f" of structure {spec}" if spec is not None else ""
        return f"{seed}={seed}{shape}" if batch is None else f"{seed}s= with {batch} entries{shape}"

    return f"prepared for {describe(expected)}, called with {describe(got)}."


def prepare(
    op: Callable | str,
    f: Callable,
    *args: Any,
    backend: Backend | None = None,
    strict: bool = True,
    **op_kwargs: Any,
) -> Prepared:
    """Prepare ``op(f, *args, **op_kwargs)`` once; call the result on new values of the same kinds.

    All one-time work (tracing, compiling, building transformed functions) is
    done here; results are never computed from the preparation values. With
    ``strict=True`` a change of kind, structure, shape, dtype or device raises
    `PreparationMismatchError`; with ``strict=False`` the operator is prepared
    again for the new signature.

    A prepared object may be called from several threads at once: each call
    builds its own state (module views, Cache buffers, tapes) and shares only
    what was compiled, so every thread gets the result for its own arguments.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> loss = lambda w, x: jnp.sum((w * x) ** 2)
    >>> prep = ad.prepare(ad.gradient, loss, ad.Active(jnp.ones(2)), ad.Constant(jnp.zeros(2)))
    >>> prep(jnp.ones(2), jnp.array([1.0, 2.0]))
    Array([2., 8.], dtype=float32)
    """
    operator = operator_of(op)
    kinds, values = parse_arguments(operator.name, f, args)
    options = {k: op_kwargs.pop(k) for k in list(op_kwargs) if k == "has_aux"}
    if options.get("has_aux") and operator.name not in _HAS_AUX:
        raise TypeError(f"activity.{operator.name} does not take has_aux; it is for {', '.join(sorted(_HAS_AUX))}.")
    if operator.name not in _HAS_AUX:
        options = {}
    plan = Plan(operator, f, kinds, values, backend, options, op_kwargs, "prepared").compile()
    return Prepared(plan, f, strict, options, op_kwargs, values)


_HAS_AUX = {"gradient", "value_and_gradient", "jacobian", "value_and_jacobian"}
