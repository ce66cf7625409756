"""`differentiate_with` called from PyTorch: a ``torch.autograd.Function`` per function.

``backward`` is the inner backend's pullback and ``jvp`` (forward-mode AD, ``torch.func.jvp``)
its pushforward, each itself applied through the same ``Function``, so
``create_graph=True`` differentiates them again (second order). ``vmap`` runs the
primal once per batch element and a derivative whose point is not batched in one
inner call with ``cotangents=[...]`` / ``tangents=[...]``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import _arrays as arrays
from ._mixing import _shape_changed, _Mixed, _Node, _Parsed, _Signature, _to_inner

_FUNCTION: Any = None


def call(mixed: _Mixed, parsed: _Parsed) -> Any:
    from ._tree import unflatten

    signature = mixed.signature(parsed, lambda: _Signature(mixed, parsed))
    diff, data, cache = tuple(parsed.diff), tuple(parsed.data), tuple(parsed.cache)
    function = _primal(signature)
    leaves = function(diff, data, cache)
    n_out = len(signature.out_avals)
    out = unflatten(signature.out_spec, list(leaves[:n_out]))
    if not mixed.has_aux:
        return out
    return out, unflatten(signature.aux_spec, list(leaves[n_out:]))


def _inner_groups(mixed: _Mixed, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    return (
        tuple(_to_inner(leaf, mixed.inner) for leaf in diff),
        tuple(_to_inner(leaf, mixed.inner) for leaf in data),
        tuple(_to_inner(leaf, mixed.inner) for leaf in cache),
    )


def _to_torch(leaf: Any, shape: tuple[int, ...], dtype: str, device: Any) -> Any:
    """An inner result as a torch tensor of the announced dtype (DLPack: no copy from JAX on CPU)."""
    import torch

    if arrays.is_jax(leaf):
        tensor = torch.utils.dlpack.from_dlpack(leaf)
    elif isinstance(leaf, torch.Tensor):
        tensor = leaf.detach()
    else:
        array = np.asarray(leaf)
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    tensor = tensor.to(device=device, dtype=getattr(torch, dtype))
    if tuple(tensor.shape) != shape:  # never broadcast: that would return numbers for a shape g did not give
        raise ValueError(_shape_changed(tuple(tensor.shape), shape))
    return tensor


class _TorchFunction:
    """One function over (diff, data, cache) tensors as torch sees it.

    ``run`` computes every output leaf in the inner framework; ``node`` gives the
    derivatives of the floating ones (``floating`` marks them among the outputs).
    """

    def __init__(self, mixed: _Mixed, run: Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], list[Any]], node: _Node,
                 avals: Sequence[tuple[tuple[int, ...], str]], floating: Sequence[bool]):
        self.mixed = mixed
        self.run = run
        self.node = node
        self.avals = tuple(avals)
        self.floating = tuple(floating)

    def __call__(self, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(_autograd_function().apply(self, (len(diff), len(data), len(cache)), *diff, *data, *cache))

    def evaluate(self, leaves: Sequence[Any], sizes: tuple[int, int, int]) -> tuple[Any, ...]:
        device = next((leaf.device for leaf in leaves), None)
        a, b, _ = sizes
        groups = _inner_groups(self.mixed, tuple(leaves[:a]), tuple(leaves[a:a + b]), tuple(leaves[a + b:]))
        results = self.run(*groups)
        return tuple(_to_torch(leaf, *aval, device) for leaf, aval in zip(results, self.avals))

    def derivative(self, how: str, diff: tuple[Any, ...]) -> "_TorchFunction":
        node = self.node.derived(how, tuple((tuple(d.shape), str(d.dtype).removeprefix("torch.")) for d in diff))
        return _node_function(self.mixed, node)


def _autograd_function() -> Any:
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch

    class DifferentiateWith(torch.autograd.Function):
        """g of another framework inside torch autograd (see `activity.differentiate_with`)."""

        @staticmethod
        def forward(function: _TorchFunction, sizes: tuple[int, int, int], *leaves: Any) -> tuple[Any, ...]:
            return function.evaluate(leaves, sizes)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            function, sizes, *leaves = inputs
            ctx.function, ctx.sizes = function, sizes
            ctx.save_for_backward(*leaves)
            ctx.save_for_forward(*leaves)
            fixed = [y for y, floating in zip(output, function.floating) if not floating]
            if fixed:
                ctx.mark_non_differentiable(*fixed)

        @staticmethod
        def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
            function: _TorchFunction = ctx.function
            leaves = ctx.saved_tensors
            n_diff, n_data, n_cache = ctx.sizes
            diff = tuple(leaves[:n_diff])
            cts = tuple(
                torch.zeros(aval[0], dtype=getattr(torch, aval[1]), device=_device(leaves)) if ct is None else ct
                for ct, aval, floating in zip(cotangents, function.avals, function.floating)
                if floating
            )
            if n_diff == 0:
                return (None, None, *(None,) * len(leaves))
            pulled = function.derivative("pull", diff)
            grads = pulled((*diff, *cts), tuple(leaves[n_diff:n_diff + n_data]), tuple(leaves[n_diff + n_data:]))
            return (None, None, *grads, *(None,) * (n_data + n_cache))

        @staticmethod
        def jvp(ctx: Any, _function: Any, _sizes: Any, *tangents: Any) -> Any:
            function: _TorchFunction = ctx.function
            leaves = ctx.saved_tensors
            n_diff, n_data, _ = ctx.sizes
            diff = tuple(leaves[:n_diff])
            tdiff = tuple(torch.zeros_like(d) if t is None else t for d, t in zip(diff, tangents[:n_diff]))
            pushed = function.derivative("push", diff)
            dys = iter(pushed((*diff, *tdiff), tuple(leaves[n_diff:n_diff + n_data]), tuple(leaves[n_diff + n_data:])))
            out = tuple(next(dys) if floating else None for floating in function.floating)
            return out

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], function: _TorchFunction, sizes: tuple[int, int, int], *leaves: Any) -> Any:
            return _vmap(info, in_dims[2:], function, sizes, leaves)

    _FUNCTION = DifferentiateWith
    return _FUNCTION


def _device(leaves: Sequence[Any]) -> Any:
    return leaves[0].device if leaves else None


def _vmap(info: Any, in_dims: Sequence[int | None], function: _TorchFunction, sizes: tuple[int, int, int],
          leaves: Sequence[Any]) -> tuple[Any, ...]:
    """``torch.func.vmap`` over the function: a derivative with only its seeds batched is one
    inner call with a list of seeds; anything else runs once per batch element."""
    import torch

    n = info.batch_size
    node = function.node
    n_diff = sizes[0]
    seeds = set(range(node.n_base, n_diff)) if node.how is not None else set()
    batched = {i for i, dim in enumerate(in_dims) if dim is not None}
    moved = [leaf.movedim(dim, 0) if dim is not None else leaf for leaf, dim in zip(leaves, in_dims)]
    if node.how is not None and batched and batched <= seeds and not any(map(_transformed, moved)):
        parent = node.parent
        assert parent is not None
        a, b, _ = sizes
        base = [_to_inner(leaf, function.mixed.inner) for leaf in moved]
        seed_list = [tuple(base[k][i] if k in batched else base[k] for k in range(node.n_base, n_diff))
                     for i in range(n)]
        op, keyword = ("pushforward", "tangents") if node.how == "push" else ("pullback", "cotangents")
        results = parent.call(op, tuple(base[:node.n_base]), tuple(base[a:a + b]), tuple(base[a + b:]),
                              **{keyword: seed_list})
        device = _device(leaves)
        rows = [[_to_torch(leaf, *aval, device) for leaf, aval in zip(result, function.avals)] for result in results]
    else:  # through the Function again, so transforms outside this vmap see each call
        a, b, _ = sizes
        rows = []
        for i in range(n):
            element = [leaf[i] if k in batched else leaf for k, leaf in enumerate(moved)]
            rows.append(list(function(tuple(element[:a]), tuple(element[a:a + b]), tuple(element[a + b:]))))
    outputs = tuple(torch.stack([row[j] for row in rows]) for j in range(len(function.avals)))
    return outputs, (0,) * len(outputs)


_UNKNOWN = _Node(lambda diff, data, cache: (), (), 0, None, "g")  # type: ignore[arg-type]
"""The node of a g whose output layout is not known yet."""


def _transformed(leaf: Any) -> bool:
    """Whether a tensor is still wrapped by a torch.func transform outside this vmap (a jvp
    dual, an outer vmap's batch): its values are not readable from here."""
    import torch

    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(leaf)) if check is not None else True


class _PrimalFunction(_TorchFunction):
    """g itself: its output layout is learnt by the first call's ``forward`` (which sees
    plain tensors even under torch.func transforms)."""

    def __init__(self, signature: _Signature):
        self.signature = signature
        learnt = signature.node is not None
        super().__init__(signature.mixed, self._run, signature.node or _UNKNOWN, (), ())
        if learnt:
            self._adopt()

    def _run(self, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> list[Any]:
        signature = self.signature
        outputs = signature.run(diff, data, cache)
        if signature.node is None:
            signature.learn(outputs)
        if self.node is _UNKNOWN:
            self._adopt()
        out_leaves, aux_leaves = signature.split(outputs)
        return [*out_leaves, *aux_leaves]

    def _adopt(self) -> None:
        signature = self.signature
        assert signature.node is not None
        self.avals = signature.out_avals + signature.aux_avals
        self.floating = signature.out_float + (False,) * len(signature.aux_avals)
        self.node = signature.node


def _primal(signature: _Signature) -> _TorchFunction:
    function = getattr(signature, "torch_function", None)
    if function is None:
        function = _PrimalFunction(signature)
        signature.torch_function = function  # type: ignore[attr-defined]
    return function


def _node_function(mixed: _Mixed, node: _Node) -> _TorchFunction:
    function = getattr(node, "torch_function", None)
    if function is None:
        function = _TorchFunction(mixed, lambda d, c, s: list(node.fn(d, c, s)), node, node.out_avals,
                                  [True] * len(node.out_avals))
        node.torch_function = function  # type: ignore[attr-defined]
    return function
