"""`Scenario`: one operator applied to one function at given annotated arguments."""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Iterable, Sequence

import attrs
import numpy as np

from .. import _arrays as arrays
from .._annotations import Annotation
from .._operators._common import operator_of
from .._problem import describe_type
from .._tree import flatten, leaf_paths
from ._compare import run_reference


def _refuse_non_finite(result: Any, name: str | None, reference: Any) -> None:
    """A reference that is not finite checks nothing: an error, never "expected inf"."""
    leaves = flatten(result)[0]
    paths = None
    for index, leaf in enumerate(leaves):
        if arrays.is_array(leaf) and arrays.dtype_kind(leaf) == "f" and not np.all(np.isfinite(_host(leaf))):
            paths = paths or leaf_paths(result)
            raise ValueError(
                f"the reference {reference!r} gave a value that is not finite at {paths[index] or 'the root'} of "
                f"{name}: f is not differentiable there (or overflows). Choose other inputs, or give the "
                f"scenario an expected result=."
            )


def _reads_what_it_writes(scenario: "Scenario") -> str | None:
    """Why finite differences cannot give torch's derivative of a stateful ``f``, or None.

    A module whose buffers ``f`` updates and reads again (``spectral_norm``'s power
    iteration in train mode) defines a derivative that holds that state constant;
    finite differences differentiate through it. Two calls of ``f`` on one copy of the
    arguments, with the same random numbers, tell: they differ only if ``f`` reads
    what it wrote. (BatchNorm in train mode writes statistics it does not read.)
    """
    torch: Any = sys.modules.get("torch")
    values = (tuple(a.value for a in scenario.args), {k: a.value for k, a in scenario.kwargs.items()})
    stateful = torch is not None and any(
        isinstance(leaf, torch.nn.Module) and any(True for _ in leaf.buffers()) for leaf in flatten(values)[0]
    )
    if not stateful:
        return None
    copies = copy.deepcopy(values)
    with torch.random.fork_rng(devices=[]):
        start = torch.get_rng_state()
        first = _output(scenario, copies)
        torch.set_rng_state(start)
        second = _output(scenario, copies)
    from ._compare import assert_tree_allclose

    try:
        assert_tree_allclose(second, first, rtol=1e-6, atol=1e-9)
    except AssertionError:
        return (
            "f updates state it reads again (module buffers such as spectral_norm's power-iteration vectors in "
            "train mode), and torch's derivative holds that state constant, which finite differences cannot; "
            "check the module in eval mode, or pass reference=<an AD backend>"
        )
    return None


def _output(scenario: "Scenario", values: tuple[Any, ...]) -> Any:
    positional, keywords = values
    out = scenario.f(*positional, **keywords)
    return out[0] if scenario.options.get("has_aux") else out


def _host(leaf: Any) -> Any:
    return leaf.detach().cpu().numpy() if arrays.is_torch(leaf) else np.asarray(leaf)


def _operator_function(op: Any) -> Callable[..., Any]:
    import activity

    return getattr(activity, operator_of(op).name)  # type: ignore[no-any-return]


def _operator_name(op: Callable[..., Any] | str) -> str:
    return operator_of(op).name


# Typed converters: with `converter=tuple` type checkers derive the parameter's type from
# tuple's overloaded constructor, and refuse a list of annotations.
def _arguments(args: Iterable[Annotation[Any]]) -> tuple[Annotation[Any], ...]:
    return tuple(args)


def _optional_arguments(args: Iterable[Annotation[Any]] | None) -> tuple[Annotation[Any], ...] | None:
    return None if args is None else tuple(args)


@attrs.define(eq=False, repr=False)
class Scenario:
    """One test case: ``op(f, *args)``, its expected result and tolerances.

    ``op`` is an operator function or its name; ``args`` are annotated; ``result``
    is the expected result (computed once by the reference backend when None);
    ``tangent`` is the tangent or cotangent the operator needs (``tangents`` a
    batch of them); ``prep_args`` are other values of the same kinds to
    prepare with, so a prepared operator that reuses its preparation values
    fails; ``options`` are extra operator keywords such as ``has_aux``;
    ``kwargs`` are annotated keyword arguments for ``f`` (``prep_kwargs`` their
    values to prepare with, when ``prep_args`` are given).

    Args:
        op: the operator, e.g. `activity.gradient`, or its name (``"gradient"``).
        f: the function, called as ``f(*values)``.
        args: the annotated arguments (`Active`, `Constant`, `Cache`), a tuple or list.
        result: the expected result; ``None`` computes it once with the reference
            (`AutoFiniteDifferences`).
        tangent: the tangent (or cotangent) of operators that take one.
        tangents: a batch of them instead.
        prep_args: other values of the same kinds to prepare with.
        name: the scenario's name in reports and test ids (default ``op-f.__name__``).
        rtol: relative tolerance of the comparison (default: from the dtypes).
        atol: absolute tolerance of the comparison (default: from the dtypes).
        options: extra operator keywords, such as ``{"has_aux": True}``.
        kwargs: annotated keyword arguments for ``f`` (``{"scale": Constant(2.0)}``), passed by name.
        prep_kwargs: other values of the same kinds for the keyword arguments, to prepare with.
        derived_from: set by the transforms (``(scenario, function)``); not for direct use.

    Raises:
        TypeError: an argument is not annotated, or an operator that takes a tangent got
            neither or both of ``tangent=`` and ``tangents=``.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario
    >>> s = Scenario("gradient", lambda x: (x**2).sum(), (ad.Active(np.array([1.0, 2.0])),), name="square")
    >>> s.name, s.run(ad.AutoFiniteDifferences())
    ('square', array([2., 4.]))
    """

    op: str = attrs.field(converter=_operator_name)
    f: Callable[..., Any]
    args: tuple[Annotation[Any], ...] = attrs.field(converter=_arguments)
    result: Any = attrs.field(default=None, kw_only=True)
    tangent: Any = attrs.field(default=None, kw_only=True)
    tangents: Sequence[Any] | None = attrs.field(default=None, kw_only=True)
    prep_args: tuple[Annotation[Any], ...] | None = attrs.field(default=None, kw_only=True, converter=_optional_arguments)
    name: str = attrs.field(default=None, kw_only=True)  # None: named in __attrs_post_init__
    rtol: float | None = attrs.field(default=None, kw_only=True)
    atol: float | None = attrs.field(default=None, kw_only=True)
    options: dict[Any, Any] = attrs.field(factory=dict, kw_only=True)
    kwargs: dict[str, Any] = attrs.field(factory=dict, kw_only=True, converter=dict)
    prep_kwargs: dict[str, Any] | None = attrs.field(default=None, kw_only=True, converter=attrs.converters.optional(dict))
    # (scenario, function): the expected result is function(scenario's expected result); set by transforms
    derived_from: tuple[Scenario, Callable[[Any], Any]] | None = attrs.field(default=None, kw_only=True)
    _expected: dict[Any, Any] = attrs.field(factory=dict, init=False)
    _unreliable: dict[str, str] = attrs.field(factory=dict, init=False)  # reference repr -> why its result is unreliable

    def __attrs_post_init__(self) -> None:
        for position, arg in enumerate(self.args):
            if not isinstance(arg, Annotation):
                raise TypeError(
                    f"Scenario {self.name!r}: argument {position} is unannotated: {describe_type(arg)}; "
                    f"wrap it as Active(...), Constant(...) or Cache(...)."
                )
        for name, arg in {**self.kwargs, **(self.prep_kwargs or {})}.items():
            if not isinstance(arg, Annotation):
                raise TypeError(
                    f"Scenario {self.name!r}: the keyword argument {name}= is an unannotated {type(arg).__name__}; "
                    f"wrap it as Active(...), Constant(...) or Cache(...)."
                )
        if self.name is None:
            self.name = f"{self.op}-{getattr(self.f, '__name__', 'f')}"
        seed = operator_of(self.op).seed
        if seed is not None and (self.tangent is None) == (self.tangents is None):
            raise TypeError(f"Scenario {self.name!r}: {self.op} needs exactly one of tangent= or tangents=.")

    def __repr__(self) -> str:
        kinds = [f"{type(a).__name__}({type(a.value).__name__})" for a in self.args]
        kinds += [f"{name}={type(a).__name__}({type(a.value).__name__})" for name, a in self.kwargs.items()]
        return f"Scenario({self.name!r}, {self.op}({', '.join(kinds)}))"

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(a.kind for a in (*self.args, *self.kwargs.values()))

    @property
    def every_arg(self) -> tuple[Any, ...]:
        """The positional and then the keyword arguments (as the result orders the Actives)."""
        return (*self.args, *self.kwargs.values())

    @property
    def framework(self) -> str:
        """``"torch"``, ``"jax"`` or ``"numpy"``: the framework of the arguments' arrays."""
        found: set[str | None] = set()
        for arg in self.every_arg:
            leaves, _ = flatten(arg.value)
            found.update(arrays.framework(leaf) for leaf in leaves)
        for name in ("torch", "jax"):
            if name in found:
                return name
        return "numpy"

    def seed_kwargs(self) -> dict[str, Any]:
        seed = operator_of(self.op).seed
        if seed is None:
            return {}
        return {seed: self.tangent} if self.tangents is None else {seed + "s": list(self.tangents)}

    def run(self, backend: Any, prepared: bool = False) -> Any:
        """The operator's result on ``backend``.

        Prepared: prepare on ``prep_args``, call once on them, then return the
        call on ``args``, so a prepared operator that reuses the values it was
        prepared with, or its first result, gives a wrong answer.
        """
        import activity

        op = _operator_function(self.op)
        seeds = self.seed_kwargs()
        if not prepared:
            return op(self.f, *self.args, backend=backend, **self.options, **seeds, **self.kwargs)
        prep_args = self.prep_args or self.args
        prep_kwargs = self.kwargs if self.prep_args is None or self.prep_kwargs is None else self.prep_kwargs
        prep = activity.prepare(op, self.f, *prep_args, backend=backend, **self.options, **seeds, **prep_kwargs)
        if self.prep_args is not None:
            prep(*self.prep_args, **seeds, **prep_kwargs)
        return prep(*self.args, **seeds, **self.kwargs)

    def expected(self, reference: Any = None) -> Any:
        """``result``, or the reference backend's result (computed once, on copies)."""
        if self.result is not None:
            return self.result
        if self.derived_from is not None:
            source, transform = self.derived_from
            return transform(source.expected(reference))
        import activity

        reference = reference or activity.AutoFiniteDifferences()
        key = repr(reference)
        if key not in self._expected:
            result, reason = run_reference(lambda: self.run(reference))
            if reason is not None:
                self._unreliable.setdefault(key, reason)
            _refuse_non_finite(result, self.name, reference)
            if key not in self._unreliable and isinstance(reference, activity.AutoFiniteDifferences):
                cause = _reads_what_it_writes(self)
                if cause is not None:
                    self._unreliable[key] = cause
            self._expected[key] = result
        return self._expected[key]

    def reference_unreliable(self, reference: Any = None) -> str | None:
        """Why the reference's result for this scenario cannot be trusted, or None (see `expected`)."""
        if self.result is not None:
            return None
        if self.derived_from is not None:
            return self.derived_from[0].reference_unreliable(reference)
        import activity

        return self._unreliable.get(repr(reference or activity.AutoFiniteDifferences()))

    def derive(self, transform: Callable[[Any], Any] = lambda result: result, **changes: Any) -> "Scenario":
        """A new scenario whose expected result is ``transform`` of this one's (no new reference run)."""
        result = None if self.result is None else transform(self.result)
        return attrs.evolve(self, result=result, derived_from=None if result is not None else (self, transform), **changes)

