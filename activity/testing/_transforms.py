"""Scenario transforms: the same expected result, reached another way.

Each takes a `Scenario` (or a list of them) and returns new scenario(s) whose
expected result is the original's, so one reference run serves them all.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from .. import _arrays as arrays
from .._annotations import Cache, Constant
from .._operators._common import operator_of
from .._tree import flatten, unflatten
from ._frameworks import Framework
from ._scenario import Scenario


def _each(transform: Callable[[Scenario], Scenario]) -> Callable[..., Any]:
    def apply(scenarios: Scenario | list[Scenario]) -> Scenario | list[Scenario]:
        if isinstance(scenarios, Scenario):
            return transform(scenarios)
        return [transform(s) for s in scenarios]

    apply.__name__ = transform.__name__
    apply.__doc__ = transform.__doc__
    return apply


def _map_output(out: Any, has_aux: bool, fn: Callable[[Any], Any]) -> Any:
    if has_aux:
        value, aux = out
        return _map_output(value, False, fn), aux
    leaves, spec = flatten(out)
    return unflatten(spec, [fn(leaf) for leaf in leaves])


@_each
def constantify(scenario: Scenario) -> Scenario:
    """Add a ``Constant`` factor ``c = 1`` to the output (prepared with ``c = 2``, so a
    prepared operator that keeps its preparation values is caught).

    Args:
        scenario: the scenario to transform (not changed).

    Returns:
        A new scenario named ``<name>+constant``, with the same expected result.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, constantify
    >>> s = constantify(Scenario("gradient", lambda x: (x**2).sum(), [ad.Active(np.ones(2))]))
    >>> [a.kind for a in s.args], s.name
    (['active', 'constant'], 'gradient-<lambda>+constant')
    """
    fw = Framework(scenario.framework)
    f, has_aux = scenario.f, scenario.options.get("has_aux", False)

    def with_constant(*args: Any, **keywords: Any) -> Any:
        *values, factor = args
        return _map_output(f(*values, **keywords), has_aux, lambda y: y * factor)

    prep = None if scenario.prep_args is None else (*scenario.prep_args, Constant(fw.array(2.0)))
    return scenario.derive(
        f=with_constant,
        args=(*scenario.args, Constant(fw.array(1.0))),
        prep_args=prep,
        name=scenario.name + "+constant",
    )


def _write(buffer: Any, value: Any) -> Any:
    """Write ``value`` into ``buffer`` the framework's way; return what reading it back gives."""
    if arrays.is_torch(buffer):
        buffer.copy_(value)
        return buffer
    if arrays.is_jax(buffer):
        return buffer.at[...].set(value)
    buffer[...] = value
    return buffer


def _zeros_like_output(scenario: Scenario) -> Any:
    # train-mode layers must not touch the originals
    values, keywords = copy.deepcopy(([a.value for a in scenario.args], {k: a.value for k, a in scenario.kwargs.items()}))
    if scenario.framework == "torch":
        import torch

        with torch.no_grad():
            out = scenario.f(*values, **keywords)
    else:
        out = scenario.f(*values, **keywords)
    if scenario.options.get("has_aux", False):
        out = out[0]
    leaves, spec = flatten(out)
    return unflatten(spec, [arrays.zeros_like(leaf) for leaf in leaves])


@_each
def cachify(scenario: Scenario) -> Scenario:
    """Route the output through a ``Cache``: ``f`` writes it into scratch buffers (in place for
    numpy and torch, with ``.at[].set`` for JAX) and returns what it reads back.

    Args:
        scenario: the scenario to transform (not changed).

    Returns:
        A new scenario named ``<name>+cache``, with the same expected result.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, cachify
    >>> s = cachify(Scenario("gradient", lambda x: (x**2).sum(), [ad.Active(np.ones(2))]))
    >>> s.args[-1].kind, s.run(ad.AutoFiniteDifferences())
    ('cache', array([2., 2.]))
    """
    f, has_aux = scenario.f, scenario.options.get("has_aux", False)
    buffers = _zeros_like_output(scenario)

    def through_cache(*args: Any, **keywords: Any) -> Any:
        *values, cache = args
        out = f(*values, **keywords)
        value, aux = out if has_aux else (out, None)
        leaves, spec = flatten(value)
        written = [_write(buf, leaf) for buf, leaf in zip(flatten(cache)[0], leaves)]
        result = unflatten(spec, written)
        return (result, aux) if has_aux else result

    prep = None if scenario.prep_args is None else (*scenario.prep_args, Cache(copy.deepcopy(buffers)))
    return scenario.derive(
        f=through_cache, args=(*scenario.args, Cache(buffers)), prep_args=prep, name=scenario.name + "+cache"
    )


@_each
def closurify(scenario: Scenario) -> Scenario:
    """Move the ``Constant`` arguments into a closure: the old style of writing tests.

    The closure captures the scenario's constants (keyword ones too), so its
    results must equal the annotated form's; migrating a closure-based suite
    is the reverse step.

    Args:
        scenario: the scenario to transform (not changed).

    Returns:
        A new scenario named ``<name>+closure``, with the same expected result.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, closurify
    >>> s = Scenario("gradient", lambda w, x: (w * x).sum(), [ad.Active(np.ones(2)), ad.Constant(np.arange(2.0))])
    >>> closed = closurify(s)
    >>> len(closed.args), closed.run(ad.AutoFiniteDifferences())
    (1, array([0., 1.]))
    """
    constants = {i: a.value for i, a in enumerate(scenario.args) if a.kind == "constant"}
    keyword_constants = {name: a.value for name, a in scenario.kwargs.items() if a.kind == "constant"}
    if not constants and not keyword_constants:
        return scenario.derive(name=scenario.name + "+closure")
    f, total = scenario.f, len(scenario.args)

    def closure(*values: Any, **keywords: Any) -> Any:
        it = iter(values)
        return f(*(constants[i] if i in constants else next(it) for i in range(total)), **keywords, **keyword_constants)

    def keep(args: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        return None if args is None else tuple(a for a in args if a.kind != "constant")

    def keep_named(kw: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if kw is None else {k: a for k, a in kw.items() if a.kind != "constant"}
    return scenario.derive(
        f=closure,
        args=keep(scenario.args),
        prep_args=keep(scenario.prep_args),
        kwargs=keep_named(scenario.kwargs),
        prep_kwargs=keep_named(scenario.prep_kwargs),
        name=f"{scenario.name}+closure",
    )


def _scaled(tree: Any, factor: float) -> Any:
    leaves, spec = flatten(tree)
    return unflatten(spec, [leaf * factor if arrays.is_array(leaf) else leaf for leaf in leaves])


_SEEDED_VALUE_FIRST = {"value_and_pushforward", "value_and_pullback", "gradient_and_hvp"}


@_each
def batchify(scenario: Scenario) -> Scenario:
    """Turn a single tangent (or cotangent) into the batch ``[t, 2 t]``; the expected result
    becomes ``[r, 2 r]`` by linearity. Scenarios without a tangent are returned unchanged.

    Args:
        scenario: the scenario to transform (not changed).

    Returns:
        A new scenario named ``<name>+batch``, or ``scenario`` itself where it has no tangent.

    >>> import numpy as np
    >>> import activity as ad
    >>> from activity.testing import Scenario, batchify
    >>> s = batchify(Scenario("pushforward", lambda x: 3 * x, [ad.Active(np.ones(2))], tangent=np.ones(2)))
    >>> s.run(ad.AutoFiniteDifferences())
    [array([3., 3.]), array([6., 6.])]
    """
    if operator_of(scenario.op).seed is None or scenario.tangent is None:
        return scenario

    def expected(result: Any) -> Any:
        if scenario.op in _SEEDED_VALUE_FIRST:
            head, single = result
            return head, [single, _scaled(single, 2.0)]
        return [result, _scaled(result, 2.0)]

    tangent = scenario.tangent
    return scenario.derive(expected, tangent=None, tangents=[tangent, _scaled(tangent, 2.0)], name=scenario.name + "+batch")
