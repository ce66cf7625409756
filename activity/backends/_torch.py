"""PyTorch: the autograd tape for gradients and pullbacks, `torch.func` for the rest.

`torch.autograd.grad` on the tape is the fastest reverse mode on small
models; it never touches ``.grad``. Forward mode, batched products and
second order use `torch.func` (`jvp`, `vjp`, `grad`, `vmap`). Inside an outer
`torch.func` transform the tape is unavailable, so reverse mode switches to
`torch.func` there too.

Modules never run themselves: ``f`` gets a *bound view*, a structural copy
whose parameters are the differentiated tensors and whose buffers are fresh
copies made inside the current transform, so BatchNorm statistics, flags and
``.grad`` of the user's module never change.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import sys
from typing import Any, Callable

import attrs

from .. import _arrays as arrays
from .._tree import unflatten
from ._base import NO_CONTEXT, Backend, CompiledCall, Flat, FlatFunction, SignatureChanged


def _torch() -> Any:
    return sys.modules.get("torch") or importlib.import_module("torch")  # imported on first use only


def _inside_functorch() -> bool:
    return _torch()._C._functorch.maybe_current_level() is not None


# ------------------------------------------------------------------ modules


@attrs.frozen(eq=False)
class ModuleDescription:
    """What one walk over a module found (see `describe_module`)."""

    module: Any
    names: list[str]  # trainable parameters, named like named_parameters(), shared ones once
    params: list[Any]
    layout: tuple  # types, parameter and buffer layouts: what a prepared operator checks
    has_buffers: bool
    # For `still_describes`: the parameter, buffer and submodule dicts of every visited
    # module, with the objects each held (empty ones apart), and each tensor's metadata.
    filled: tuple = ()
    empty: tuple = ()
    tensors: tuple = ()

    def still_describes(self, module: Any) -> bool:
        """Whether ``module`` is the module described, unchanged: the same objects in every
        submodule, parameter and buffer slot, each tensor with the same shape, dtype,
        device and ``requires_grad``. Cheaper than a new walk (no names, no layout): it
        runs on every prepared call."""
        if module is not self.module or any(self.empty):
            return False
        for slots, objects in self.filled:
            if len(slots) != len(objects) or not all(map(operator.is_, slots.values(), objects)):
                return False
        for tensor, shape, dtype, device, requires_grad in self.tensors:
            if (
                tensor.requires_grad is not requires_grad
                or tensor.dtype is not dtype
                or tensor.shape != shape
                or tensor.device != device
            ):
                return False
        return True


def describe_module(module: Any) -> ModuleDescription:
    """Walk ``module`` once: its trainable parameters and the layout a prepared operator checks."""
    names: list[str] = []
    params: list[Any] = []
    layout: list[Any] = []
    slot_dicts: list[dict] = []
    tensors: list[tuple] = []
    seen: set[int] = set()

    def visit(m: Any, prefix: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        layout.append(type(m))
        slot_dicts.extend((m._parameters, m._buffers, m._modules))
        for key, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            layout.append((prefix + key, p.shape, p.dtype, p.device, p.requires_grad))
            tensors.append((p, p.shape, p.dtype, p.device, p.requires_grad))
            if p.requires_grad:
                names.append(prefix + key)
                params.append(p)
        for key, b in m._buffers.items():
            if b is not None:
                layout.append((prefix + key, b.shape, b.dtype, b.device))
                tensors.append((b, b.shape, b.dtype, b.device, b.requires_grad))
        for key, child in m._modules.items():
            if child is not None:
                visit(child, prefix + key + ".")

    visit(module, "")
    has_buffers = any(b is not None for slots in slot_dicts[1::3] for b in slots.values())
    filled = tuple((slots, tuple(slots.values())) for slots in slot_dicts if slots)
    empty = tuple(slots for slots in slot_dicts if not slots)
    return ModuleDescription(module, names, params, tuple(layout), has_buffers, filled, empty, tuple(tensors))


def bound_view(module: Any, params: list[Any] | None, convert: Callable[[Any], Any]) -> Any:
    """A copy of ``module``'s structure whose trainable parameters are ``params``.

    ``params`` follow `describe_module`'s order (None: a Constant module, no
    parameter replaced). Every other parameter and buffer is ``convert``-ed (a
    clone for AD, a float64 copy for finite differences). Shared submodules and
    tied parameters stay shared in the view; the original is never written.
    A submodule in which nothing is replaced (no buffers, its own parameters
    passed back, as on the autograd tape) is used as it is, without a copy.
    """
    replacements = iter(params or ())
    replaced: dict[int, Any] = {}
    views: dict[int, Any] = {}

    def tensor_for(t: Any, trainable: bool) -> Any:
        if t is None:
            return None
        new = replaced.get(id(t))
        if new is None:
            new = next(replacements) if trainable else convert(t)
            replaced[id(t)] = new
        return new

    def view(m: Any) -> Any:
        existing = views.get(id(m))
        if existing is not None:
            return existing
        parameters = {
            k: tensor_for(p, params is not None and p is not None and p.requires_grad) for k, p in m._parameters.items()
        }
        buffers = {k: tensor_for(b, False) for k, b in m._buffers.items()}
        modules = {k: (None if c is None else view(c)) for k, c in m._modules.items()}
        unchanged = (
            all(new is old for new, old in zip(parameters.values(), m._parameters.values()))
            and all(new is old for new, old in zip(buffers.values(), m._buffers.values()))
            and all(new is old for new, old in zip(modules.values(), m._modules.values()))
        )
        if unchanged:
            views[id(m)] = m
            return m
        new = object.__new__(type(m))
        state = m.__dict__.copy()
        state.update(_parameters=parameters, _buffers=buffers, _modules=modules)
        if "_flat_weights_names" in state:  # RNNs cache their weights in a list
            state["_flat_weights"] = [parameters.get(w, state.get(w)) for w in state["_flat_weights_names"]]
        object.__setattr__(new, "__dict__", state)  # nn.Module.__setattr__ is slow and would refuse tensors
        views[id(m)] = new
        return new

    return view(module)


def float64_copy(module: ModuleDescription, params: list[Any] | None) -> Any:
    """The module evaluated in float64 on copies (finite differences)."""
    torch = _torch()

    def convert(t: Any) -> Any:
        t = t.detach()
        return t.to(torch.float64, copy=True) if t.dtype.is_floating_point else t.clone()

    return bound_view(module.module, params, convert)


def _clone(t: Any) -> Any:
    return t.clone() if not isinstance(t, _torch().nn.Parameter) else t


# ------------------------------------------------------------------ backend


@attrs.frozen
class AutoTorch(Backend):
    """Differentiate with PyTorch: tape-based `torch.autograd.grad` for gradients and
    pullbacks, `torch.func` for forward mode, batched products and second order.

    >>> import torch
    >>> import activity as ad
    >>> model = torch.nn.Linear(2, 1)
    >>> grads = ad.gradient(lambda m, x: m(x).sum(), ad.Active(model), ad.Constant(torch.ones(3, 2)))
    >>> sorted(grads), grads["bias"]
    (['bias', 'weight'], tensor([3.]))
    """

    framework = "torch"

    # -- leaves ---------------------------------------------------------------

    def as_array(self, leaf: Any) -> Any:
        torch = _torch()
        if isinstance(leaf, torch.Tensor):
            return leaf
        return torch.as_tensor(leaf, dtype=torch.get_default_dtype() if isinstance(leaf, float) else None)

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        torch = _torch()
        if isinstance(leaf, torch.Tensor):
            return leaf if leaf.dtype == dtype else leaf.to(dtype)
        return torch.as_tensor(leaf, dtype=dtype)

    def fresh_cache(self, leaf: Any, like: Any) -> Any:
        # Made here, inside the transform, so f may write into it in place.
        torch = _torch()
        tensor = leaf if isinstance(leaf, torch.Tensor) else torch.as_tensor(leaf)
        if like is not None and like.dtype != tensor.dtype:
            return tensor.detach().to(torch.promote_types(tensor.dtype, like.dtype), copy=True)
        return tensor.detach().clone() if not _inside_functorch() else tensor.clone()

    def describe_module(self, module: Any, previous: ModuleDescription | None = None) -> ModuleDescription:
        if previous is not None and previous.still_describes(module):
            return previous
        return describe_module(module)

    def bind_module(self, module: ModuleDescription, params: list[Any] | None) -> Any:
        own = params is None or all(map(operator.is_, params, module.params))
        if own and not module.has_buffers:
            return module.module  # the tape differentiates the parameters themselves: nothing to copy
        return bound_view(module.module, params, _clone)

    def context(self) -> contextlib.AbstractContextManager:
        torch = _torch()
        return NO_CONTEXT if torch.is_grad_enabled() else torch.enable_grad()

    def compile_call(
        self, plan: Any, values: tuple, seed_kwargs: dict, retrace: Callable | None = None
    ) -> CompiledCall | None:
        # A subclass may change any step; it gets the generic path, which runs each of its hooks.
        if type(self) is not AutoTorch:
            return None
        if plan.operator.name in ("gradient", "value_and_gradient") and not plan.options.get("has_aux"):
            return CompiledCall(_tape_gradient(plan))
        return None

    # -- reverse mode ---------------------------------------------------------

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        torch = _torch()
        if _inside_functorch():
            return _func_vjp(F, xs)

        leaves = tuple(map(_tape_leaf, xs))
        ys, aux = F(leaves)
        connected = [i for i, y in enumerate(ys) if y.requires_grad]
        func_pull: list = []  # torch.func's pull for batched cotangents, made on first use

        def pull(cts: Flat, batched: bool) -> Flat:
            if not connected:
                lead = (arrays.shape(cts[0])[0],) if batched else ()
                return tuple(torch.zeros(lead + tuple(x.shape), dtype=x.dtype, device=x.device) for x in xs)
            if batched:
                # vmap over torch.func's vjp (what torch.func.jacrev does) is much faster than the
                # tape's is_grads_batched, which vmaps over the autograd engine: worth a forward pass.
                if not func_pull:
                    func_pull.append(_func_vjp(F, xs)[2])
                return func_pull[0](cts, True)
            outputs = [ys[i] for i in connected]
            seeds = [cts[i] for i in connected]
            grads = torch.autograd.grad(outputs, leaves, seeds, retain_graph=True, allow_unused=True)
            return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs))

        return tuple(y.detach() for y in ys), aux, pull

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        torch = _torch()
        if _inside_functorch():
            grads, (ys, aux) = torch.func.grad(_scalar_with_aux(F), has_aux=True)(xs)
            return ys, aux, grads
        leaves = tuple(map(_tape_leaf, xs))
        ys, aux = F(leaves)
        return (ys[0].detach(),), aux, _tape_grads(ys[0], leaves, xs)

    def gradient_function(self, F: FlatFunction) -> FlatFunction:
        torch = _torch()

        # Differentiated again by torch.func, so the gradient itself must be torch.func's.
        def G(xs: Flat) -> tuple[Flat, Any]:
            grads, (ys, aux) = torch.func.grad(_scalar_with_aux(F), has_aux=True)(xs)
            return grads, (ys, aux)

        return G

    # -- forward mode ---------------------------------------------------------

    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        torch = _torch()

        def one(tangent: Flat) -> tuple:
            return torch.func.jvp(F, (xs,), (tangent,), has_aux=True)

        if not batched:
            ys, dys, aux = one(ts)
        else:
            ys, dys, aux = torch.func.vmap(one, out_dims=(None, 0, None))(ts)
        return ys, aux, dys


def _func_vjp(F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
    """`torch.func.vjp` of ``F``, pulling single or batched (vmapped) cotangents."""
    torch = _torch()
    ys, pull_one, aux = torch.func.vjp(F, xs, has_aux=True)

    def pull(cts: Flat, batched: bool) -> Flat:
        if batched:
            return torch.func.vmap(lambda ct: pull_one(ct)[0])(cts)
        return pull_one(cts)[0]

    return ys, aux, pull


def _tape_gradient(plan: Any) -> Callable:
    """A prepared gradient straight on the tape, for the prepared signature.

    The same steps as the generic gradient (check and split the arguments,
    rebuild them, run f, `torch.autograd.grad`, arrange the result), without
    the layers that let one pipeline serve every operator and backend: on a
    small model those cost more than the forward and backward passes. Calls
    it does not cover (another signature, grad mode off, inside `torch.func`)
    raise SignatureChanged before f runs and take the generic path.
    """
    torch = _torch()
    problem, f, kinds = plan.problem, plan.f, plan.problem.kinds
    value_wanted = plan.operator.name == "value_and_gradient"

    def gradient(*values: Any, **seed_kwargs: Any) -> Any:
        split = None if seed_kwargs or len(values) != len(kinds) else problem.split(values, kinds)
        if split is None or not torch.is_grad_enabled() or _inside_functorch():
            raise SignatureChanged
        xs, ctx = split
        leaves = tuple(map(_tape_leaf, xs))
        out = problem.call(f, problem.rebuild(leaves, ctx))
        if isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype.is_floating_point:
            y, spec = out, None
        else:  # a float, or a one-leaf pytree: checked like any output (the error names the problem)
            (y,), spec = problem.output_leaves(out, scalar=True)
        result = problem.like_active(_tape_grads(y, leaves, xs))
        if not value_wanted:
            return result
        value = y.detach()
        return (value if spec is None else unflatten(spec, [value]), result)

    return gradient


def _tape_grads(y: Any, leaves: Flat, xs: Flat) -> Flat:
    """The gradient of the scalar ``y`` with respect to the tape ``leaves`` made from ``xs``
    (zeros for a leaf ``y`` does not depend on)."""
    torch = _torch()
    if not y.requires_grad:
        return tuple(torch.zeros_like(x) for x in xs)
    grads = torch.autograd.grad(y, leaves, allow_unused=True)
    if any(g is None for g in grads):
        grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs))
    return grads


def _tape_leaf(x: Any) -> Any:
    """A tensor the tape differentiates: a parameter as it is (like a hand-written
    ``torch.autograd.grad(loss, params)``), anything else as a fresh detached leaf."""
    if x.requires_grad and x.is_leaf:
        return x
    return x.detach().requires_grad_()


def _scalar_with_aux(F: FlatFunction) -> Callable:
    def scalar(xs: Flat) -> tuple[Any, tuple]:
        ys, aux = F(xs)
        return ys[0], (ys, aux)

    return scalar
