"""`differentiate_with` called from JAX: ``jax.pure_callback`` in a ``custom_jvp`` with a linear map.

The call is a ``jax.custom_jvp`` around a ``jax.pure_callback`` of g. Its tangent is
``linear_p``, a JAX primitive of this module for "the inner pushforward at this point,
linear in the tangent": forward mode (``jax.jvp``, ``jax.jacfwd``) evaluates it, so the
inner backend's pushforward runs; reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``)
transposes it into the inner pullback, which is all that runs. The same function serves
both, so nothing depends on which transform JAX is running: under ``jax.jit`` the
arguments do not tell. ``linear_p`` also batches (``jax.vmap``) and differentiates again
(second order) through the derivative's own derivative.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np

from . import _arrays as arrays
from ._errors import UnsupportedError
from ._mixing import _Mixed, _Node, _Parsed, _Signature, _to_inner, _to_numpy

_errors = threading.local()  # the exception g raised inside a callback, re-raised in its place


def call(mixed: _Mixed, parsed: _Parsed) -> Any:
    import jax

    signature = mixed.signature(parsed, lambda: _Signature(mixed, parsed))
    diff, data, cache = tuple(parsed.diff), tuple(parsed.data), tuple(parsed.cache)
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in (*diff, *data, *cache))
    if not traced:  # no transform is watching: run g once, learn its layout on the way
        inner = _regroup((*diff, *data, *cache), (len(diff), len(data), len(cache)), mixed.inner)
        outputs = signature.run_value(*inner)
        if signature.node is None:
            signature.learn(outputs)
        out_leaves, aux_leaves = signature.split(outputs)
        arrays = [jax.numpy.asarray(_to_numpy(leaf, *aval)) for leaf, aval in
                  zip((*out_leaves, *aux_leaves), _jax_avals(signature.out_avals + signature.aux_avals))]
        return _assemble(signature, arrays)
    if signature.node is None:
        _probe(signature, diff, data, cache)
    leaves = _primal(signature)(diff, data, cache)
    return _assemble(signature, list(leaves))


def _assemble(signature: _Signature, leaves: list[Any]) -> Any:
    from ._tree import unflatten

    n_out = len(signature.out_avals)
    out = unflatten(signature.out_spec, leaves[:n_out])
    if not signature.mixed.has_aux:
        return out
    return out, unflatten(signature.aux_spec, leaves[n_out:])


def _probe(signature: _Signature, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> None:
    """Learn g's output layout while JAX traces (no values yet): g runs once on zeros."""
    import jax

    mixed = signature.mixed
    with jax.ensure_compile_time_eval():  # concrete zeros, not values traced into the caller's program
        zeros = [jax.numpy.zeros(leaf.shape, leaf.dtype) for group in (diff, data, cache) for leaf in group]
    # as every call's arguments: converted, and the Caches copies g may write into
    signature.learn(signature.run(*_regroup(zeros, (len(diff), len(data), len(cache)), mixed.inner)))


def _jax_avals(avals: Sequence[tuple[tuple[int, ...], str]]) -> list[tuple[tuple[int, ...], str]]:
    import jax

    return [(shape, str(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))) for shape, dtype in avals]


class _Function:
    """One function over (diff, data, cache) leaves as JAX sees it.

    ``run`` computes every output leaf in g's framework; `_callback` is the
    ``jax.pure_callback`` that calls it; ``node`` gives the derivatives of the floating
    outputs (``floating`` marks them among the outputs). Called, it is a ``jax.custom_jvp``
    whose tangent is `linear_p` (a linear map JAX can both evaluate and transpose).
    """

    def __init__(self, mixed: _Mixed, run: Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], list[Any]], node: _Node,
                 avals: list[tuple[tuple[int, ...], str]], floating: Sequence[bool]):
        self.mixed = mixed
        self.run = run
        self.node = node
        self.avals = avals
        self.floating = tuple(floating)
        self._custom: Any = None
        self.lane: Callable[[], Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], Sequence[Any]]] = lambda: run

    def __call__(self, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(self._differentiable()(diff, data, cache))

    def _callback(self, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...],
                  batched: Callable[..., list[Any]] | None) -> tuple[Any, ...]:
        import jax

        shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.avals]  # type: ignore[no-untyped-call]
        sizes = (len(diff), len(data), len(cache))
        base = [tuple(np.shape(leaf)) for leaf in (*diff, *data, *cache)]
        mixed = self.mixed
        # Everything that depends only on the signature is settled here, at trace time: how each
        # argument crosses into g's framework, how each result comes back (and is checked), and
        # the prepared inner operator (looked up once, on the first call).
        importers = [_importer(mixed.inner, str(leaf.dtype), copy=k >= sizes[0] + sizes[1])
                     for k, leaf in enumerate((*diff, *data, *cache))]
        exporters = [_exporter(mixed.inner, shape, dtype) for shape, dtype in self.avals]
        run = self.lane()
        a, b = sizes[0], sizes[0] + sizes[1]
        rank = len(base[0]) if base else 0

        def host(*flat: Any) -> list[Any]:
            try:
                # under jax.vmap a derivative gets every argument with leading batch axes
                if batched is not None and flat[0].ndim != rank:
                    return batched(flat, base, sizes)
                inner = [imported(leaf) for imported, leaf in zip(importers, flat)]
                results = run(tuple(inner[:a]), tuple(inner[a:b]), tuple(inner[b:]))
                return [exported(leaf) for exported, leaf in zip(exporters, results)]
            except Exception as error:
                _errors.error = mixed.noted(error)
                raise

        # The primal runs once per batch element under jax.vmap ("sequential": g is not assumed
        # to broadcast); a derivative gets the whole batch ("expand_dims") and makes one call.
        vmap_method = "sequential" if batched is None else "expand_dims"
        return tuple(_reraising(lambda: jax.pure_callback(host, shapes, *diff, *data, *cache,
                                                          vmap_method=vmap_method)))

    def _differentiable(self) -> Any:
        """The callback as a ``jax.custom_jvp``: its tangent is the inner pushforward as a
        `linear_p`, which reverse mode transposes into the inner pullback. One function for
        both modes, so nothing depends on which transform JAX is running (under ``jax.jit``
        the arguments do not tell)."""
        if self._custom is not None:
            return self._custom
        import jax

        @jax.custom_jvp
        def function(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
            return self._callback(diff, data, cache, self._batched_run())

        def rule(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, ...]:
            diff, data, cache = primals
            outputs = function(diff, data, cache)
            if not diff:  # only Constants and Caches: nothing is differentiated
                return outputs, tuple(_zero_tangent(y) for y in outputs)
            lin = _LinearMap.of(self.mixed, self.node, "push", _avals_of(diff), (len(diff), len(data), len(cache)))
            dys = iter(linear_p.bind(*diff, *data, *cache, *tangents[0], linear_map=lin))
            out_tangents = tuple(
                next(dys) if floating else _zero_tangent(y) for y, floating in zip(outputs, self.floating)
            )
            return outputs, out_tangents

        function.defjvp(rule)
        self._custom = function
        return function

    def _batched_run(self) -> Callable[..., list[Any]] | None:
        """How a derivative node runs on a batch (under ``jax.vmap``): one call with
        ``tangents=[...]`` / ``cotangents=[...]`` when only the seeds are batched."""
        if self.node.how is None:
            return None
        return lambda flat, base, sizes: _run_batch(self, flat, base, sizes)


def _zero_tangent(y: Any) -> Any:
    """The tangent of an output that is not differentiated (aux, integer outputs)."""
    import jax

    if arrays.is_floating_dtype(str(y.dtype)) or np.dtype(y.dtype).kind == "c":
        return jax.numpy.zeros_like(y)
    return np.zeros(y.shape, jax.dtypes.float0)


def _avals_of(leaves: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


# ------------------------------------------------------------------ a linear map JAX can run both ways


class _LinearMap:
    """The pushforward or the pullback of a node at a point: linear in its seeds.

    ``linear_p.bind(*point, *data, *cache, *seeds, linear_map=m)`` evaluates it (forward
    mode: the inner pushforward), transposes into the other one (reverse mode: the inner
    pullback), differentiates again through the derivative's own derivative (second
    order), and batches: ``layers`` records the ``jax.vmap``s around it, innermost first,
    as (in_axes, size); evaluating it then vmaps the callback, whose ``expand_dims``
    method makes one inner call for a batch of seeds. Made once per node, direction and
    layout (`of`), so equal maps keep JAX's compilation caches warm.
    """

    def __init__(self, mixed: _Mixed, parent: _Node, how: str, point_avals: tuple[Any, ...],
                 sizes: tuple[int, int, int], layers: tuple[tuple[tuple[int | None, ...], int], ...]):
        self.mixed, self.parent, self.how = mixed, parent, how
        self.point_avals = point_avals  # the parent's diff leaves, unbatched
        self.sizes = sizes  # point, data and cache leaves (the residuals), before the seeds
        self.layers = layers
        self.node = parent.derived(how, point_avals)  # raises UnsupportedError past the orders provided

    def __repr__(self) -> str:
        return f"<{self.node.label} of {self.mixed!r}>"

    @staticmethod
    def of(mixed: _Mixed, parent: _Node, how: str, point_avals: tuple[Any, ...], sizes: tuple[int, int, int],
           layers: tuple[tuple[tuple[int | None, ...], int], ...] = ()) -> "_LinearMap":
        maps: dict[tuple[Any, ...], _LinearMap] = parent.__dict__.setdefault("linear_maps", {})
        key = (how, point_avals, sizes, layers)
        found = maps.get(key)
        if found is None:
            found = maps.setdefault(key, _LinearMap(mixed, parent, how, point_avals, sizes, layers))
        return found

    @property
    def n_residuals(self) -> int:
        return sum(self.sizes)

    def seed_avals(self) -> tuple[Any, ...]:
        """Tangents of the point (a pushforward) or cotangents of the parent's outputs (a pullback)."""
        return self.point_avals if self.how == "push" else tuple(self.parent.out_avals)

    def out_avals(self) -> list[tuple[tuple[int, ...], str]]:
        batch = tuple(size for _, size in reversed(self.layers))
        return [(batch + tuple(shape), dtype) for shape, dtype in _jax_avals(self.node.out_avals)]

    def evaluate(self, args: Sequence[Any]) -> list[Any]:
        import jax

        run: Callable[..., Any] = self._evaluate_one
        for in_axes, _ in self.layers:
            run = jax.vmap(run, in_axes=in_axes)
        return list(run(*args))

    def _evaluate_one(self, *args: Any) -> list[Any]:
        n_point, n_data, _ = self.sizes
        k = self.n_residuals
        point, data, cache, seeds = args[:n_point], args[n_point:n_point + n_data], args[n_point + n_data:k], args[k:]
        function = _node_function(self.mixed, self.node)
        return list(function._callback((*point, *seeds), tuple(data), tuple(cache), function._batched_run()))

    def transposed(self) -> "_LinearMap":
        """The other derivative (pullback for pushforward and back), linear in this one's
        output cotangents; every output of a batched map is batched at axis 0."""
        k, n_out = self.n_residuals, len(self.node.out_avals)
        layers = tuple((in_axes[:k] + (0,) * n_out, size) for in_axes, size in self.layers)
        return _LinearMap.of(self.mixed, self.parent, "pull" if self.how == "push" else "push",
                             self.point_avals, self.sizes, layers)

    def differentiated(self) -> "_LinearMap":
        """This map's own pushforward: its point is (point, seeds), its seeds their tangents
        (batched like them)."""
        n_point, n_data, n_cache = self.sizes
        k = self.n_residuals
        point_avals = (*self.point_avals, *self.seed_avals())
        layers = []
        for in_axes, size in self.layers:
            moving = (*in_axes[:n_point], *in_axes[k:])
            layers.append(((*moving, *in_axes[n_point:k], *moving), size))
        return _LinearMap.of(self.mixed, self.node, "push", point_avals, (len(point_avals), n_data, n_cache),
                             tuple(layers))

    def batched(self, in_axes: tuple[int | None, ...], size: int) -> "_LinearMap":
        return _LinearMap.of(self.mixed, self.parent, self.how, self.point_avals, self.sizes,
                             self.layers + ((in_axes, size),))


def _make_linear_primitive() -> Any:
    import jax
    from jax.extend import core as extend_core
    from jax.interpreters import ad as jax_ad, batching as jax_batching, mlir as jax_mlir

    ad: Any = jax_ad  # JAX's rule tables and helpers carry no type hints
    batching: Any = jax_batching
    mlir: Any = jax_mlir
    primitive: Any = extend_core.Primitive("activity_linear_map")
    primitive.multiple_results = True

    def evaluate(*args: Any, linear_map: _LinearMap) -> list[Any]:
        return linear_map.evaluate(args)

    def abstract(*args: Any, linear_map: _LinearMap) -> list[Any]:
        return [jax.core.ShapedArray(shape, np.dtype(dtype)) for shape, dtype in linear_map.out_avals()]

    def transpose(cotangents: Sequence[Any], *args: Any, linear_map: _LinearMap) -> list[Any]:
        k = linear_map.n_residuals
        residuals, seeds = args[:k], args[k:]
        if any(ad.is_undefined_primal(r) for r in residuals):
            raise UnsupportedError(
                f"activity.differentiate_with: JAX asked to transpose {linear_map!r} with respect to the point "
                f"it is taken at; it is linear in its seeds only."
            )
        cts = [ad.instantiate_zeros(ct) for ct in cotangents]
        back = primitive.bind(*residuals, *cts, linear_map=linear_map.transposed())
        # a seed JAX knows (the zeros a jvp rule instantiates) is not transposed: no cotangent for it
        return [None] * k + [ct if ad.is_undefined_primal(s) else None for s, ct in zip(seeds, back)]

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], *, linear_map: _LinearMap) -> tuple[list[Any], list[Any]]:
        out = primitive.bind(*primals, linear_map=linear_map)
        n_point, _, _ = linear_map.sizes
        k = linear_map.n_residuals
        moving = [*tangents[:n_point], *tangents[k:]]  # Constants and Caches are not differentiated
        if all(type(t) is ad.Zero for t in moving):
            return out, [ad.Zero(jax.typeof(y).to_tangent_aval()) for y in out]
        point = [*primals[:n_point], *primals[k:]]
        dys = primitive.bind(*point, *primals[n_point:k], *[ad.instantiate_zeros(t) for t in moving],
                             linear_map=linear_map.differentiated())
        return out, list(dys)

    def batch(args: Sequence[Any], dims: Sequence[Any], *, linear_map: _LinearMap) -> tuple[list[Any], list[int]]:
        k = linear_map.n_residuals
        size = next(np.shape(a)[d] for a, d in zip(args, dims) if d is not None)
        moved = [a if d is None or d == 0 else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        # seeds are batched, every one: the transpose then gives each seed's cotangent per element
        moved[k:] = [jax.numpy.broadcast_to(a, (size, *np.shape(a))) if d is None else a
                     for a, d in zip(moved[k:], dims[k:])]
        in_axes = tuple(None if d is None else 0 for d in dims[:k]) + (0,) * (len(args) - k)
        outputs = primitive.bind(*moved, linear_map=linear_map.batched(in_axes, size))
        return list(outputs), [0] * len(outputs)

    primitive.def_impl(evaluate)
    primitive.def_abstract_eval(abstract)
    ad.primitive_jvps[primitive] = jvp
    ad.primitive_transposes[primitive] = transpose
    batching.primitive_batchers[primitive] = batch
    mlir.register_lowering(primitive, mlir.lower_fun(evaluate, multiple_results=True))
    return primitive


def _regroup(flat: Sequence[Any], sizes: tuple[int, int, int], framework: str) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    a, b, _ = sizes
    if framework == "torch":  # the floating leaves, the hot path: straight through DLPack
        import torch

        inner = [torch.utils.dlpack.from_dlpack(leaf) if isinstance(leaf, _jax_array()) else _to_inner(leaf, framework)
                 for leaf in flat[:a]]
        inner += [_to_inner(leaf, framework) for leaf in flat[a:]]
    else:
        inner = [_to_inner(leaf, framework) for leaf in flat]
    # g may write into a Cache: into a copy, never into a buffer JAX owns (and may share)
    inner[a + b:] = [leaf.clone() if hasattr(leaf, "clone") else np.array(leaf) for leaf in inner[a + b:]]
    return tuple(inner[:a]), tuple(inner[a:a + b]), tuple(inner[a + b:])


def _jax_array() -> type:
    import jax

    return jax.Array


def _importer(framework: str, dtype: str, copy: bool) -> Callable[[Any], Any]:
    """How one callback argument (a ``jax.Array``) becomes g's: DLPack into torch for every
    dtype DLPack carries; a Cache is copied (g may write into it, never into JAX's buffer)."""
    if framework == "torch" and dtype != "bool" and not copy:
        import torch

        from_dlpack = torch.utils.dlpack.from_dlpack
        shared = _jax_array()

        def imported(leaf: Any) -> Any:
            return from_dlpack(leaf) if isinstance(leaf, shared) else _to_inner(leaf, framework)

        return imported
    if copy:
        return lambda leaf: _scratch(_to_inner(leaf, framework))
    return lambda leaf: _to_inner(leaf, framework)


def _scratch(leaf: Any) -> Any:
    return leaf.clone() if hasattr(leaf, "clone") else np.array(leaf)


def _exporter(framework: str, shape: tuple[int, ...], dtype: str) -> Callable[[Any], np.ndarray]:
    """How one result of g goes back to JAX as the announced shape and dtype: a result that
    already is (a CPU torch tensor or numpy array of that dtype and shape) is handed over as
    is; anything else takes `_to_numpy`, which converts or says what differs."""
    if framework == "torch":
        import torch

        expected = getattr(torch, dtype, None)
        size = torch.Size(shape)
        tensor = torch.Tensor

        def exported(leaf: Any) -> np.ndarray:
            if type(leaf) is tensor and leaf.dtype is expected and leaf.shape == size and not leaf.requires_grad:
                try:
                    return leaf.numpy()
                except (RuntimeError, TypeError):  # not on the CPU, or no numpy dtype: converted
                    pass
            return _to_numpy(leaf, shape, dtype)

        return exported
    try:
        numpy_dtype: Any = np.dtype(dtype)
    except TypeError:  # a dtype numpy does not name (bfloat16 without ml_dtypes): always converted
        numpy_dtype = None

    def exported_array(leaf: Any) -> np.ndarray:
        if type(leaf) is np.ndarray and leaf.dtype == numpy_dtype and leaf.shape == shape:
            return leaf
        return _to_numpy(leaf, shape, dtype)

    return exported_array


def _reraising(run: Callable[[], Any]) -> Any:
    """``run()``; an exception g raised in a callback comes back as itself (JAX wraps it
    in a runtime error) where the callback ran eagerly; under ``jax.jit`` JAX's error
    carries its traceback and note."""
    import jax

    _errors.error = None
    try:
        return run()
    except jax.errors.JaxRuntimeError as wrapped:
        original = getattr(_errors, "error", None)
        _errors.error = None
        if original is not None:
            raise original from wrapped
        raise


def _primal(signature: _Signature) -> _Function:
    function = getattr(signature, "jax_function", None)
    if function is None:
        avals = _jax_avals(signature.out_avals + signature.aux_avals)
        floating = signature.out_float + (False,) * len(signature.aux_avals)

        def run(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> list[Any]:
            out_leaves, aux_leaves = signature.split(signature.run_value(diff, data, cache))
            return [*out_leaves, *aux_leaves]

        assert signature.node is not None
        function = _Function(signature.mixed, run, signature.node, avals, floating)
        signature.jax_function = function  # type: ignore[attr-defined]
    return function


def _node_function(mixed: _Mixed, node: _Node) -> _Function:
    function = getattr(node, "jax_function", None)
    if function is None:
        avals = _jax_avals(node.out_avals)
        function = _Function(mixed, lambda d, c, s: list(node.fn(d, c, s)), node, avals, [True] * len(avals))
        function.lane = node.lane
        node.jax_function = function  # type: ignore[attr-defined]
    return function


def _run_batch(function: _Function, flat: Sequence[Any], base: list[Any], sizes: tuple[int, int, int]) -> list[Any]:
    """A derivative node on batched leaves (``vmap_method="expand_dims"`` gives unbatched
    leaves a leading 1): one inner call with a list of seeds when only the seeds vary,
    else one call per batch element."""
    node = function.node
    leads = [tuple(np.shape(x)[: np.ndim(x) - len(b)]) for x, b in zip(flat, base)]
    width = max(len(lead) for lead in leads)
    leads = [(1,) * (width - len(lead)) + lead for lead in leads]
    common = tuple(np.broadcast_shapes(*leads))
    n = int(np.prod(common))
    inner = function.mixed.inner
    n_base = node.n_base
    seed_slots = range(n_base, sizes[0])
    only_seeds = all(int(np.prod(lead)) == 1 for i, lead in enumerate(leads) if i not in seed_slots)

    def element(x: Any, b: tuple[Any, ...], lead: tuple[Any, ...], i: int) -> Any:
        x = np.broadcast_to(np.asarray(x).reshape((1,) * (width + len(b) - np.ndim(x)) + np.shape(x)), common + b)
        return x.reshape((n, *b))[i]

    if only_seeds and n > 1:
        groups = _regroup([np.asarray(x).reshape(b) if k not in seed_slots else x
                           for k, (x, b) in enumerate(zip(flat, base))], sizes, inner)
        diff, data, cache = groups
        seeds = [tuple(_to_inner(element(flat[k], base[k], leads[k], i), inner) for k in seed_slots)
                 for i in range(n)]
        op, keyword = ("pushforward", "tangents") if node.how == "push" else ("pullback", "cotangents")
        assert node.parent is not None
        results = node.parent.call(op, diff[:n_base], data, cache, **{keyword: seeds})
        per_element = [[_to_numpy(leaf, *aval) for leaf, aval in zip(result, function.avals)] for result in results]
    else:
        per_element = []
        for i in range(n):
            groups = _regroup([element(x, b, lead, i) for x, b, lead in zip(flat, base, leads)], sizes, inner)
            per_element.append([_to_numpy(leaf, *aval) for leaf, aval in zip(function.run(*groups), function.avals)])
    return [np.stack([row[j] for row in per_element]).reshape(common + tuple(aval[0]))
            for j, aval in enumerate(function.avals)]


linear_p = _make_linear_primitive()
"""The primitive of `_LinearMap` (this module imports JAX only when a call from JAX needs it)."""
