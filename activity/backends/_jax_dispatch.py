"""A prepared JAX call dispatched by JAX's C++ ``jit`` dispatch with no Python frame of ours.

A strict prepared call is one ``jax.jit`` call, whose C++ dispatch checks the arguments'
structure, shapes and dtypes and runs the compiled code. Any Python around it (the
prepared object's ``__call__`` frame, its look for annotated arguments, the rebuild of a
dict in the argument's key order) costs a few microseconds, which is 5 to 15 % of a
small model's call. Here the prepared object's ``__call__`` is a ``PjitFunction`` of its
own, made as ``jax.jit`` makes one, with two differences:

- its cache-miss handler is activity's: a call the compiled code does not serve (annotated
  arguments, another signature, a torch tensor) reaches it with the caller's own
  arguments, and it runs the prepared object's checked path, which explains the mismatch
  or computes the result, as the Python ``__call__`` did;
- the result's structure, which JAX's dispatch builds in C++ after each call, is activity's:
  a dict keeps the argument's key order (JAX's own pytrees sort the keys) because the
  structure handed to the dispatch is built from the result with its keys in that order.

Both use JAX internals (``PjitFunction._cache_miss``, ``jaxlib``'s ``pjit``, the fast-path
data's ``out_pytree_def``): where any of them is missing or not as expected, `native_call`
gives None and the prepared object keeps its Python ``__call__``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from .._annotations import Annotation


class _NotLiteral(Exception):
    """A result holding a container that a literal treedef cannot rebuild."""


def literal_treedef(out: Any) -> tuple[Any, list[Any]] | None:
    """The JAX treedef that rebuilds ``out`` as it is, dict keys in ``out``'s order, and its
    arrays in that treedef's order; None where ``out`` holds anything but dicts, lists,
    tuples, None and JAX arrays (or this JAX cannot make such a treedef)."""
    import jax  # only called on JAX results

    registry = jax.tree_util.default_registry
    leaf: Any = jax.tree_util.tree_structure(0)  # its method makes any node
    none = jax.tree_util.tree_structure(None)
    arrays: list[Any] = []

    def node(value: Any) -> Any:
        kind = type(value)
        if kind is dict:
            return leaf.from_node_data_and_children(registry, (dict, list(value)), [node(child) for child in value.values()])
        if kind is list or kind is tuple:
            return leaf.from_node_data_and_children(registry, (kind, None), [node(child) for child in value])
        if value is None:
            return none
        if isinstance(value, jax.Array):
            arrays.append(value)
            return leaf
        raise _NotLiteral

    try:
        treedef = node(out)
    except (_NotLiteral, AttributeError, TypeError):
        return None
    return treedef, arrays


def calls_back(lowered: Any) -> bool:
    """Whether the lowered program calls back into Python (a ``custom_call`` to one of JAX's
    callback targets), wherever the call is: a check such as ``equinox.error_if`` (lineax's
    singular operator) may raise while the compiled code runs, and only the prepared
    object's Python path explains its error. The jaxpr does not always show such a call:
    an Equinox primitive adds it when it is lowered."""
    return re.search(r"custom_call @\w*callback", lowered.as_text()) is not None


# One C++ cache for every prepared object's dispatch: its entries are per function, as
# `jax.jit`'s are, and go with it.
_CACHE: list[Any] = []


def native_call(
    jitted: Any, out_treedef: Any, misses: tuple[type[BaseException], ...]
) -> Callable[[Callable[..., Any], Callable[..., Any], Callable[..., Any]], Any] | None:
    """A maker of the C++-dispatched call for ``jitted`` (a ``jax.jit`` function already
    compiled for the prepared arguments), or None where this JAX lacks what it needs.

    ``out_treedef``: the treedef that rebuilds the result from the flat tuple ``jitted``
    returns (None: ``jitted`` returns the result as it is). ``misses``: the exceptions by
    which ``jitted`` declines arguments. The maker takes ``fallback(args, kwargs)``, the
    prepared object's checked path for a call the compiled code declines,
    ``report(error)``, which explains an error of the compiled call, and ``eager(*args,
    **kwargs)``, the prepared object's generic call, which JAX calls in its place under
    ``jax.disable_jit``."""
    try:
        from jax._src import tree_util
        from jax._src.interpreters import pxla
        from jax._src.lib import _jax as jaxlib  # type: ignore[attr-defined]

        make_pjit, registry, shard_arg = jaxlib.pjit, tree_util.dispatch_registry, pxla.cc_shard_arg
        cache_key = pxla.JitGlobalCppCacheKeys()
        jax_miss = jitted._cache_miss
        if not _CACHE:
            _CACHE.append(jaxlib.PjitFunctionCache(capacity=4096))
    except (ImportError, AttributeError, TypeError):
        return None
    cache = _CACHE[0]
    rebuild = None if out_treedef is None else out_treedef.unflatten

    def make(fallback: Callable[..., Any], report: Callable[..., Any], eager: Callable[..., Any]) -> Any:
        def cache_miss(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(arg, Annotation) for arg in args):  # no JAX type: the checked path strips them
                return fallback(args, kwargs), None, False
            try:
                out, fastpath, *rest = jax_miss(*args, **kwargs)
            except misses:
                out = fastpath = _DECLINED
            except Exception as error:
                report(error)
                raise
            if out is _DECLINED:  # outside the handler: the checked path's error is not chained to JAX's
                return fallback(args, kwargs), None, False
            if rebuild is not None:
                out = rebuild(out)
                # JAX's fast path rebuilds the flat tuple it was given: handed activity's treedef,
                # it rebuilds the result, or (not a tuple of as many arrays) it is not cached.
                if fastpath is not None:
                    given = getattr(fastpath, "out_pytree_def", None)
                    same = hasattr(fastpath, "_replace") and getattr(given, "num_leaves", None) == out_treedef.num_leaves
                    fastpath = fastpath._replace(out_pytree_def=out_treedef) if same else None
            return (out, fastpath, *rest)

        try:
            return make_pjit(
                getattr(jitted, "__name__", "prepared"), eager, cache_miss, (), (), cache_key, registry, shard_arg, cache
            )
        except TypeError:  # another jaxlib's signature
            return None

    return make


_DECLINED: Any = object()
