"""`differentiate_with` called from JAX: ``jax.pure_callback`` wrapped in ``custom_vjp`` / ``custom_jvp``.

A call under reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``), or under no
transform, is a ``jax.custom_vjp`` whose backward pass is the inner backend's pullback;
a call whose arguments carry forward-mode tangents (``jax.jvp``, ``jax.jacfwd``) is a
``jax.custom_jvp`` whose tangent is the inner backend's pushforward. JAX allows one of
the two per function, so the choice is made per call from the arguments' tracers.
Each derivative is again such a function, so it can be differentiated once more.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np

from . import _arrays as arrays
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
        zeros = [
            tuple(_to_inner(jax.numpy.zeros(leaf.shape, leaf.dtype), mixed.inner) for leaf in group)
            for group in (diff, data, cache)
        ]
    signature.learn(signature.run(*zeros))


def _jax_avals(avals: Sequence[tuple[tuple[int, ...], str]]) -> list[tuple[tuple[int, ...], str]]:
    import jax

    return [(shape, str(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))) for shape, dtype in avals]


# ------------------------------------------------------------------ forward or reverse


def _forward_mode(leaves: Sequence[Any]) -> bool:
    """Whether the innermost differentiating transform around these leaves is forward mode
    (a ``jax.jvp`` tangent, not a ``jax.grad`` linearization): custom_vjp cannot run there."""
    import jax

    for leaf in leaves:
        value = leaf
        while isinstance(value, jax.core.Tracer):
            kind = type(value).__name__
            if kind == "JVPTracer":
                return True
            if kind == "LinearizeTracer":
                break
            inner = getattr(value, "primal", None)
            if inner is None:
                inner = getattr(value, "val", None)
            value = inner
    return False


class _Function:
    """One function over (diff, data, cache) leaves as JAX sees it, in both modes.

    ``run`` computes every output leaf; ``node`` gives the derivatives of the floating
    ones (``floating`` marks them among the outputs).
    """

    def __init__(self, mixed: _Mixed, run: Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], list[Any]], node: _Node,
                 avals: list[tuple[tuple[int, ...], str]], floating: Sequence[bool]):
        self.mixed = mixed
        self.run = run
        self.node = node
        self.avals = avals
        self.floating = tuple(floating)
        self._vjp: Any = None
        self._jvp: Any = None
        self.lane: Callable[[], Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], Sequence[Any]]] = lambda: run

    def __call__(self, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
        version = self._jvp_version() if _forward_mode((*diff, *data, *cache)) else self._vjp_version()
        return tuple(version(diff, data, cache))

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

    def _vjp_version(self) -> Any:
        if self._vjp is not None:
            return self._vjp
        import jax

        @jax.custom_vjp
        def function(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
            return self._callback(diff, data, cache, self._batched_run())

        def forward(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
            return self(diff, data, cache), (diff, data, cache)

        def backward(residuals: tuple[Any, ...], cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
            diff, data, cache = residuals
            if not diff:  # only Constants and Caches: nothing is differentiated
                return (), tuple(None for _ in data), tuple(None for _ in cache)
            pulled = self.node.derived("pull", _avals_of(diff))
            cts = tuple(ct for ct, floating in zip(cotangents, self.floating) if floating)
            grads = _node_function(self.mixed, pulled)((*diff, *cts), data, cache)
            return tuple(grads), tuple(None for _ in data), tuple(None for _ in cache)

        function.defvjp(forward, backward)
        self._vjp = function
        return function

    def _jvp_version(self) -> Any:
        if self._jvp is not None:
            return self._jvp
        import jax

        @jax.custom_jvp
        def function(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
            return self._callback(diff, data, cache, self._batched_run())

        def rule(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, ...]:
            diff, data, cache = primals
            outputs = self(diff, data, cache)
            if not diff:
                return outputs, tuple(_zero_tangent(y) for y in outputs)
            pushed = self.node.derived("push", _avals_of(diff))
            dys = iter(_node_function(self.mixed, pushed)((*diff, *tangents[0]), data, cache))
            out_tangents = tuple(
                next(dys) if floating else _zero_tangent(y) for y, floating in zip(outputs, self.floating)
            )
            return outputs, out_tangents

        function.defjvp(rule)
        self._jvp = function
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
