"""PyTorch: the autograd tape first, `torch.func` where it is faster or needed.

Reverse mode runs on the tape (`torch.autograd.grad`, batched cotangents with
`vmap` over it): one evaluation of ``f``, any operation autograd knows,
random layers drawing once. Forward mode and batched second order use
`torch.func` (`jvp`, `grad`, `vmap`); where torch cannot run a function that
way (no forward-mode rule, a custom `autograd.Function` without
``setup_context``, random operations under `vmap`, batching gaps) the backend
falls back to the tape. Inside an outer `torch.func` transform the tape is
unavailable, so everything runs through `torch.func` there. A call made
inside ``f`` of another AutoTorch call is differentiated by it (`_CALL`): it
records its graph on the outer pass's, and its results stay on it.

Differentiated leaves are never the user's own tensors: fresh ``detach()``
aliases, so only the Active argument's occurrence is differentiated, even
where the same parameter is also a Constant, tied into another module or
captured by ``f``. Modules run as views (see `_torch_modules`), so BatchNorm
statistics, flags and ``.grad`` of the user's module never change; a prepared
call keeps its view and its parameters' aliases between calls and re-points
them (`ReusedView`) instead of building them again. One tangent of forward
mode runs on dual tensors (`torch.autograd.forward_ad`) rather than
`torch.func.jvp`; tape calls whose cotangents activity has checked go to
the autograd engine without `torch.autograd.grad`'s argument handling.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import threading
import warnings
from typing import Any, Callable, ClassVar, Sequence

import attrs

from .. import _arrays as arrays
from .._errors import add_note, caller_stacklevel
from .._imports import optional, require
from .._problem import Traced
from .._tree import LEAF, flatten, unflatten
from ._base import NO_CONTEXT, Backend, CompiledCall, Flat, FlatFunction, SignatureChanged, cut_is_an_error, derived_from
from ._torch_lookups import on_reverse_convention
from ._torch_modules import (
    VERSION,
    ModuleDescription,
    bound_view,
    clear_grads,
    described,
    differentiable_parameter,
    fresh_leaf,
    frozen_copy,
    frozen_parameter,
    grads_left,
    lease_view,
    parameter_alias,
    release_view,
    tensor_guard,
)


def _torch() -> Any:
    return optional("torch", "AutoTorch()")  # imported on first use only


def _inside_functorch() -> bool:
    return _torch()._C._functorch.maybe_current_level() is not None


# Whether the AutoTorch call running in this context keeps its graph: None where no call runs,
# else whether the call is itself differentiated. A call made while another runs (an operator
# inside ``f`` of another: a PINN's derivative in the input, a gradient penalty, MAML's inner
# step) is differentiated by the outer one, so it records its graph on the outer pass's and
# returns results that stay on it, as ``torch.autograd.grad(create_graph=True)`` does; a call
# of ``AutoTorch(create_graph=True)`` keeps it for the user's own later backward. A cut there
# would drop the inner derivative without a word.
_CALL: contextvars.ContextVar[bool | None] = contextvars.ContextVar("activity_torch_call", default=None)
_CALL_GET = _CALL.get
# Whether an AutoTorch call is evaluating f here: a call made now runs inside f of that one.
_EVALUATING: contextvars.ContextVar[bool] = contextvars.ContextVar("activity_torch_evaluating", default=False)
_EVALUATING_GET = _EVALUATING.get


def _keeps_graph() -> bool:
    """Whether this call is differentiated by an outer tape pass (see `_CALL`)."""
    return _CALL_GET() is True


def differentiated_by_an_outer_call() -> bool:
    """Whether an AutoTorch call runs around this point (its f calls the code here): what a
    backend that cannot stay on the tape (finite differences) refuses."""
    return _EVALUATING_GET()


class _Call:
    """The context of one AutoTorch call (`AutoTorch.context`): it keeps its graph where another
    call runs around it or the backend says so, and tells the calls made inside it that they run
    inside one. A fresh object per call: calls nest and run in threads."""

    __slots__ = ("create_graph", "token", "inner")

    def __init__(self, create_graph: bool, inner: contextlib.AbstractContextManager[Any] | None) -> None:
        self.create_graph, self.inner = create_graph, inner

    def __enter__(self) -> None:
        self.token = _CALL.set(self.create_graph or _EVALUATING_GET())
        if self.inner is not None:
            self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.inner is not None:
                self.inner.__exit__(*exc)
        finally:
            _CALL.reset(self.token)


def _evaluating(call: Callable[..., Any], f: Callable[..., Any], args: Any) -> Any:
    """``call(f, args)`` marked as an AutoTorch call's evaluation of f, for the fast paths, which
    take no `_Call` (they serve only calls that are not differentiated, see `_usable`)."""
    token = _EVALUATING.set(True)
    try:
        return call(f, args)
    finally:
        _EVALUATING.reset(token)


# torch's forward-AD levels are process-global: two threads in torch.func.jvp corrupt each other.
_FORWARD_AD = threading.RLock()

_HVP_MODES = ("auto", "forward-over-reverse", "reverse-over-reverse")

# Messages by which torch says a function cannot run under torch.func (not that f is wrong).
_TRANSFORM_LIMITS = (
    "forward ad",
    "forward-mode ad",
    "forward mode ad",
    "vmap",
    "batching rule",
    "batched",
    "setup_context",
    "functorch",
    "torch.func",
    "randomness",
    "data pointer of tensor that doesn't have storage",  # .numpy(), data_ptr() on a transform's wrapper
    "derivative for",  # "derivative for aten::..._backward is not implemented": no double backward
    "zerotensors are immutable",  # forward over reverse writing a gradient torch keeps as a ZeroTensor (mse_loss)
    # an in-place write under no_grad to a tensor f reaches but the transform did not get (weight clipping
    # of a Constant module's parameter, RWKV's rescaling in eval mode): the tape runs it, as a plain call does
    "mutate a captured tensor",
)

_NO_SECOND_ORDER = (
    "activity (AutoTorch): an operation in f has neither a forward-mode rule nor a differentiable backward in "
    "this torch version, so no second-order derivative can be taken through it (a custom autograd.Function "
    "with @once_differentiable and no jvp has neither, too)."
)
_FUSED_ATTENTION = (
    " scaled_dot_product_attention's fused kernels have neither: run f under "
    "torch.nn.attention.sdpa_kernel(SDPBackend.MATH), or build a Hugging Face model with attn_implementation='eager'."
)

_ONE_HVP_PATH = (
    "activity (AutoTorch): hvp_mode={mode!r} takes that path only, and torch cannot run f on it; "
    "AutoTorch() (hvp_mode='auto') falls back to {other} where it fails."
)
# Torch's own message names vmap's flags, which the caller does not hold.
_RANDOM_UNDER_VMAP = (
    "activity (AutoTorch): f draws random numbers (dropout in train mode?) under the vmap over the batch of "
    "tangents: AutoTorch(randomness='same') draws one mask for the whole batch, randomness='different' one per "
    "tangent."
)

# Worded clear of `_TRANSFORM_LIMITS`: no other path can give this second derivative either.
_ONCE_DIFFERENTIABLE = (
    "activity (AutoTorch): f calls a custom autograd.Function whose backward is marked @once_differentiable, "
    "and the gradient flowing into that backward depends on the Active arguments (f is not linear after it), "
    "so torch cannot take a second-order derivative through it: a double backward leaves that backward's "
    "part out, and forward over reverse loses its tangent. Write that backward in differentiable torch "
    "operations, without @once_differentiable, to take hvp, hessian or second_derivative of f."
)


_ACCUMULATED_SECOND_ORDER = (
    "activity (AutoTorch): a backward in f runs a backward pass of its own (torch.autograd.backward inside a "
    "custom autograd.Function's backward, as Hugging Face Reformer's reversible layers in train mode do), "
    "which accumulates its part of the gradient into the parameters' .grad without a graph: torch cannot "
    "take a second-order derivative through it. Take gradient, pullback or value_and_gradient of f; for hvp, "
    "hessian or second_derivative, f must compute that part without such a backward (Reformer: a model whose "
    "layers are not reversible)."
)


def _folded(grads: Flat, leaves: Flat, create_graph: bool = False) -> Flat:
    """``grads`` of the tape ``leaves`` plus what a backward pass f runs inside the backward pass
    accumulated into the leaves' ``.grad``: a custom autograd.Function whose backward recomputes its
    part and calls ``torch.autograd.backward`` (Hugging Face Reformer's reversible layers in train
    mode; the user's training loop, ``loss.backward()``, sums both in ``.grad``). Left out, those
    parameters silently got a zero gradient. The leaves are this call's own, so their ``.grad`` is
    cleared (a reused view's leaves serve the next call). With ``create_graph`` (a first pass of
    second order) such a part has no graph: an error, never a second derivative without it.
    The backward pass must start from leaves without ``.grad`` (`clear_grads`): what a backward
    pass f ran during its forward left there (a first-order MAML step reading ``p.grad``) is no
    part of f's derivative."""
    if not grads_left(leaves):  # the usual case
        return grads
    folded = []
    for g, leaf in zip(grads, leaves):
        extra = leaf.grad
        if extra is None:
            folded.append(g)
            continue
        leaf.grad = None
        if create_graph and not extra.requires_grad:
            for other in leaves:
                other.grad = None
            raise RuntimeError(_ACCUMULATED_SECOND_ORDER)
        folded.append(extra if g is None else g + extra)
    return tuple(folded)


class _CutGradient(RuntimeError):
    """A gradient taken with ``create_graph`` came back without a graph for a leaf: f is linear
    in it (its derivative is zero), or a backward in f is not differentiable itself
    (``@once_differentiable`` where the incoming gradient is a constant): the tape cannot
    tell which, so the other path (forward over reverse) decides."""


class _NoTangent(RuntimeError):
    """Forward mode gave no output of f a tangent: f is cut from its Active arguments (a
    mistake the tape names), or an operation's forward rule drops tangents without a word
    (``scatter_reduce(..., "prod")``, where ``torch.func.jvp`` returns zeros): the tape decides."""

    def __init__(self, op_name: str | None):
        super().__init__("no output of f carries a tangent")
        self.op_name = op_name


def _is_transform_limit(error: BaseException) -> bool:
    return isinstance(error, (_CutGradient, _NoTangent)) or isinstance(error, (RuntimeError, NotImplementedError)) and any(
        text in str(error).lower() for text in _TRANSFORM_LIMITS
    )


def _disconnected(op_name: str | None) -> ValueError:
    where = f"activity.{op_name}" if op_name else "activity"
    return ValueError(
        f"{where} (AutoTorch): f's output does not depend on the Active argument(s) through operations "
        f"torch can differentiate, so torch has no derivative to give. Likely causes inside f: .item(), "
        f".tolist(), .numpy() or torch.tensor(...) on a computed value, .detach(), torch.no_grad(), or "
        f".requires_grad_(False) on an input. An Active tensor that f reaches "
        f"through a Constant module, or captures, is data there (only the Active occurrence is differentiated): "
        f"pass the module itself as Active(module, where=...). Keep the computation in torch tensors; if f "
        f"really does not depend on these arguments, mark them Constant(...)."
    )


def _in_choices(name: str, choices: tuple[Any, ...]) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"AutoTorch({name}={value!r}): choose one of {', '.join(map(repr, choices))}.")

    return check


@attrs.frozen(repr=False)
class AutoTorch(Backend):
    """Differentiate with PyTorch: the autograd tape for reverse mode, `torch.func` for
    forward mode and batched second order, the tape again where `torch.func` cannot run.

    Args:
        hvp_mode: ``"reverse-over-reverse"`` (double backward on the tape),
            ``"forward-over-reverse"`` (`torch.func.jvp` of `torch.func.grad`), or
            ``"auto"``: double backward for one tangent, forward over reverse
            (vectorised with `vmap`) for a batch and Hessians, each falling back
            to the other where torch cannot run it.
        vectorize: ``None`` (auto) vectorises batches with `vmap` and falls back
            to the tape or a loop where torch cannot; ``True`` always vectorises
            (torch's error propagates); ``False`` never does (loops on the tape).
        randomness: `torch.func.vmap`'s ``randomness`` for vectorised batches:
            ``"error"`` (random operations under `vmap` fall back to the tape, which
            draws once for the whole batch), ``"different"`` or ``"same"``.
        create_graph: keep every result on the autograd graph, as
            ``torch.autograd.grad(create_graph=True)`` does, for a backward pass of the
            user's own through it (a gradient penalty in a plain training loop). Without
            it results are plain tensors, except where an outer activity operator or an
            outer ``torch.func`` transform differentiates the call: there they stay on the
            graph whatever this option says, so operators compose.

    Raises:
        ValueError: an option is not one of its choices.
        ModuleNotFoundError: torch is not installed (the message names
            ``pip install "activity-ad[torch]"``).

    >>> import torch
    >>> import activity as ad
    >>> model = torch.nn.Linear(2, 1)
    >>> grads = ad.gradient(lambda m, x: m(x).sum(), ad.Active(model), ad.Constant(torch.ones(3, 2)))
    >>> sorted(grads), grads["bias"]
    (['bias', 'weight'], tensor([3.]))
    """

    hvp_mode: str = attrs.field(default="auto", validator=_in_choices("hvp_mode", _HVP_MODES))
    vectorize: bool | None = attrs.field(default=None, validator=_in_choices("vectorize", (None, True, False)))
    randomness: str = attrs.field(default="error", validator=_in_choices("randomness", ("error", "different", "same")))
    create_graph: bool = attrs.field(default=False, validator=_in_choices("create_graph", (False, True)))
    framework: ClassVar[str | None] = "torch"

    def __attrs_post_init__(self) -> None:
        require("torch", "AutoTorch()")

    def __repr__(self) -> str:
        changed = [f"{a.name}={getattr(self, a.name)!r}" for a in attrs.fields(type(self)) if getattr(self, a.name) != a.default]
        return f"{type(self).__name__}({', '.join(changed)})"

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
        if like is not None and like.dtype != tensor.dtype and tensor.dtype.is_floating_point:
            return tensor.detach().to(torch.promote_types(tensor.dtype, like.dtype), copy=True)
        return tensor.detach().clone() if not _inside_functorch() else tensor.clone()

    def describe_module(self, module: Any, previous: ModuleDescription | None = None) -> ModuleDescription:
        if previous is not None and previous.still_describes(module):
            return previous
        return described(module)

    def bind_module(self, module: ModuleDescription, params: list[Any] | None) -> Any:
        # A Constant module without buffers gets a view too: what f sets on its submodules (a
        # torchmetrics Metric's states and update count, a counter of calls) must not reach the
        # user's module, and a view costs a dict copy per submodule, not a tensor copy.
        # A Constant module's view holds aliases of its parameters that require grad (the same
        # storage and flag), never the user's own: a backward pass f runs inside the backward
        # (Hugging Face Reformer's reversible layers in train mode) accumulated into the user's
        # ``.grad`` otherwise; so does an Active module's view for a parameter ``where=`` leaves out
        # (its differentiated leaves are `fresh_leaf`s, see `_folded`).
        if _keeps_graph():  # (first: the call's own torch.func transforms keep the outer graph too)
            return bound_view(module, params, _attached_for_view)
        if _inside_functorch():
            return bound_view(module, params, _alias_for_view)
        return bound_view(module, params, _constant_for_view)

    # -- execution ------------------------------------------------------------

    def random_state(self) -> Any:
        return None if _inside_functorch() else _rng_state()

    def restore_random_state(self, state: Any) -> None:
        if state is not None:
            _torch().set_rng_state(state)

    def explain_error(self, error: Exception, active: str) -> str | None:
        if isinstance(error, RuntimeError) and "requires grad is being used in an in-place operation" in str(error):
            return (
                f"f changes a differentiated tensor in place (the Active {active}, or a tensor that requires "
                f"grad which f reads from outside its arguments, such as a model's nn.Parameter; torch refused "
                f"the write). Compute out of place or on a copy (x = x.clone()); pass scratch space that f "
                f"writes as Cache(buffer), and data as Constant(x)."
            )
        if isinstance(error, AttributeError) and "is not an nn.Parameter" in str(error):
            return (
                "f asked a module for an nn.Parameter (get_parameter, say). In forward mode and under torch.func "
                "(pushforward, hessian, and hvp where it runs forward over reverse) a module's parameter slots hold "
                "the transform's tensors, as with torch.func.functional_call, and those are not nn.Parameters. Read "
                "the parameter as an attribute (module.get_submodule(path).weight), or use the reverse-mode "
                "operators (gradient, pullback, hvp with AutoTorch(hvp_mode='reverse-over-reverse')), "
                "where f gets nn.Parameters."
            )
        return None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        torch = _torch()
        if torch.is_inference_mode_enabled():  # no tape at all in there: leave it for the call
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            return _Call(self.create_graph, stack)
        return _Call(self.create_graph, None if torch.is_grad_enabled() else torch.enable_grad())

    def wrap_function(self, F: FlatFunction, xs: Flat) -> FlatFunction:
        # An operator f calls runs inside this call: see `_CALL`.
        def evaluated(leaves: Flat) -> tuple[Flat, Any]:
            token = _EVALUATING.set(True)
            try:
                return F(leaves)
            finally:
                _EVALUATING.reset(token)

        evaluated.__dict__.update(F.__dict__)  # what the primitives read of F (its problem, op_name)
        return evaluated

    def convert_inputs(self, xs: Flat, ctx: Flat) -> tuple[Flat, Flat]:
        if _inside_functorch():
            return xs, ctx  # the outer transform differentiates through them
        if _keeps_graph():  # the outer pass differentiates through them (see `_CALL`)
            return tuple(map(_usable_on_the_tape, xs)), tuple(map(_usable_on_the_tape, ctx))
        return tuple(map(_plain, xs)), tuple(map(_plain, ctx))

    def finalize(self, result: Any, problem: Any) -> Any:
        """Results are plain tensors, off every graph, unless an outer transform or an outer
        activity call differentiates the call (or ``create_graph=True``)."""
        if _inside_functorch():
            return result
        torch = _torch()
        owned = _attached_result if _keeps_graph() else _owned
        if isinstance(result, torch.Tensor):
            return owned(result)
        leaves, spec = flatten(result)
        if not any(isinstance(leaf, torch.Tensor) and (leaf.requires_grad or leaf._is_zerotensor()) for leaf in leaves):
            return result
        return unflatten(spec, [owned(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])

    def compile_call(
        self, plan: Any, values: tuple[Any, ...], seed_kwargs: dict[Any, Any], retrace: Callable[..., Any] | None = None
    ) -> CompiledCall | None:
        # A subclass may change any step; it gets the generic path, which runs each of its hooks.
        if type(self) is not AutoTorch:
            return None
        name, single = plan.operator.name, plan.seeds is None or plan.seeds.batch is None
        if self.create_graph:  # the tape paths below return plain results
            return CompiledCall(_checked_pipeline(plan))
        if name in ("gradient", "value_and_gradient") and not plan.options.get("has_aux"):
            run, f = _tape_gradient(plan.problem, name), plan.f
            return CompiledCall(functools.partial(run, f))  # C-level: no frame of ours before `run`
        if name in ("pullback", "value_and_pullback") and single:
            pull, f = _tape_pullback(plan.problem, plan.operator, plan.seed_key), plan.f
            return CompiledCall(functools.partial(pull, f))
        if name in ("hvp", "gradient_and_hvp") and single and plan.backend is self and self.hvp_mode != "forward-over-reverse":
            return CompiledCall(_tape_hvp_call(plan))
        return CompiledCall(_checked_pipeline(plan))

    def reusable_call(self, plan: Any) -> Callable[..., Any] | None:
        # Only signatures of lone tensors and modules: the call holds no static value of the user's.
        name = plan.operator.name
        if type(self) is not AutoTorch or plan.options.get("has_aux") or self.create_graph:
            return None
        if name in ("gradient", "value_and_gradient"):
            run = _tape_gradient(plan.problem, name, fallback=False)
        elif name in ("pullback", "value_and_pullback") and plan.seeds is not None and plan.seeds.batch is None:
            run = _tape_pullback(plan.problem, plan.operator, plan.seed_key, fallback=False)
        else:
            return None
        return run if getattr(run, "split").entries is not None else None

    # -- reverse mode ---------------------------------------------------------

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        if _inside_functorch():
            return _func_vjp(F, xs, self)
        # Inputs on the graph of an outer pass of the tape (forward mode made from this pullback,
        # `_tape_jvp`, inside a derivative of f the tape differentiates again): this pass records
        # its graph on theirs, else the outer pass sees a derivative cut from them, a zero.
        outer = _keeps_graph() or (any(x.requires_grad for x in xs) and _torch().is_grad_enabled())
        leaves = tuple(x.view_as(x) if x.requires_grad else _tape_leaf(x) for x in xs) if outer else tuple(map(_tape_leaf, xs))
        ys, aux = F(leaves)
        connected = [i for i, y in enumerate(ys) if y.requires_grad]
        if not connected:
            if cut_is_an_error(F):
                raise _disconnected(getattr(F, "op_name", None))
            return tuple(y.detach() for y in ys), aux, _zero_pull(xs)
        outputs = [ys[i] for i in connected]
        if not cut_is_an_error(F) and _holds_error_node(outputs):
            # A derivative of f through a backward marked @once_differentiable: this pullback
            # would leave that backward's part out (see `_gradient_with_graph`).
            raise RuntimeError(_ONCE_DIFFERENTIABLE)

        def one(cts: Flat) -> Flat:
            if not outer:
                clear_grads(leaves)
            grads = _torch().autograd.grad(
                outputs, leaves, [cts[i] for i in connected], retain_graph=True, create_graph=outer, allow_unused=True
            )
            if not outer:  # (views of the outer pass's tensors, not leaves: what f accumulates goes to those)
                grads = _folded(grads, leaves)
            return _zeros_for_unused(grads, xs, getattr(F, "op_name", None), cut_is_an_error(F))

        def pull(cts: Flat, batched: bool) -> Flat:
            if not batched:
                return one(cts)
            if outer:  # under vmap a backward marked @once_differentiable loses the mark `_holds_error_node` finds
                return _loop(one, cts)
            return _batched(one, cts, self, getattr(F, "problem", None), tuple(outputs))

        return (ys if outer else tuple(y.detach() for y in ys)), aux, pull

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        torch = _torch()
        if _inside_functorch():
            grads, (ys, aux) = torch.func.grad(_scalar_with_aux(F), has_aux=True)(xs)
            return ys, aux, grads
        keep = _keeps_graph()
        leaves = tuple(map(_tape_leaf, xs))
        ys, aux = F(leaves)
        grads = _tape_grads(ys[0], leaves, xs, getattr(F, "op_name", None), keep)
        return (ys[0] if keep else ys[0].detach(),), aux, grads

    def gradient_function(self, F: FlatFunction) -> FlatFunction:
        torch = _torch()

        # Differentiated again by torch.func, so the gradient itself must be torch.func's.
        def G(xs: Flat) -> tuple[Flat, Any]:
            grads, (ys, aux) = torch.func.grad(_scalar_with_aux(F), has_aux=True)(xs)
            return grads, (ys, aux)

        return derived_from(F, G)

    # -- forward mode ---------------------------------------------------------

    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        if _inside_functorch():
            try:
                return _func_jvp(F, xs, ts, batched, self)
            except _NoTangent as error:  # no tape in here to tell the two causes apart
                raise _disconnected(error.op_name) from None
        # Forward mode hands f views of the Active tensors, which torch lets f write through (the
        # tape refuses an in-place write to a leaf that requires grad, but forward mode has none,
        # and a write under no_grad, nn.Embedding(max_norm=...)'s, passes either way). A problem's
        # first call runs on copies (where they are small enough to double), so such a write
        # leaves the user's tensors untouched; any write is warned of, found by the version
        # counters the copies, or the views of later calls, share with what they view.
        problem: Any = getattr(F, "problem", None)
        first = problem is not None and not problem.forward_writes_checked
        if first and sum(x.numel() * x.element_size() for x in xs) > _MOST_COPIED_BYTES:
            first, problem.forward_writes_checked = False, True
        # (a clone keeps an input that is on an outer pass's graph there, see `vjp`)
        given = tuple(x.clone() if x.requires_grad else x.detach().clone() for x in xs) if first else xs
        versions = tuple(map(VERSION, given))
        result = self._jvp_on_the_tape(F, given, ts, batched)
        if first:
            problem.forward_writes_checked = True
        if tuple(map(VERSION, given)) != versions:
            _warn_written_through(F, first)
        return result

    def _jvp_on_the_tape(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        state = _rng_state()
        try:
            # One tangent through f itself (not a gradient function another transform made):
            # dual tensors, the same forward-mode rules as torch.func.jvp without its wrapping.
            if not batched and hasattr(F, "problem"):
                dual = _dual_jvp(F, xs, ts)
                if dual is not None:
                    return dual
                _torch().set_rng_state(state)  # f runs again, drawing what it drew the first time
            return _func_jvp(F, xs, ts, batched, self)
        except (RuntimeError, NotImplementedError) as error:
            if not isinstance(error, _NoTangent) and (self.vectorize or not _is_transform_limit(error)):
                raise
            _torch().set_rng_state(state)  # the failed attempt drew nothing, as far as the caller can tell
        return _tape_jvp(F, xs, ts, batched, self)

    # -- second order ---------------------------------------------------------

    def value_and_hvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Flat, Any, Flat]:
        mode = self.hvp_mode
        # Inside torch.func only torch.func runs; a subclass may change a primitive, so it gets
        # the generic composition of its primitives (as in `compile_call`).
        if _inside_functorch() or type(self) is not AutoTorch:
            return super().value_and_hvp(F, xs, ts, batched)
        if mode == "auto":
            first, second = (_forward_over_reverse, _tape_hvp) if batched else (_tape_hvp, _forward_over_reverse)
        elif mode == "forward-over-reverse":
            first, second = _forward_over_reverse, None
        else:
            first, second = _tape_hvp, None
        state = _rng_state()
        try:
            return first(self, F, xs, ts, batched)
        except (RuntimeError, NotImplementedError) as error:
            if second is None and _is_transform_limit(error):  # the one path the caller chose
                other = _tape_hvp if first is _forward_over_reverse else _forward_over_reverse
                add_note(error, _ONE_HVP_PATH.format(mode=mode, other=_HVP_PATHS[other]))
                if "randomness" in str(error):
                    add_note(error, _RANDOM_UNDER_VMAP)
            if second is None or not _is_transform_limit(error):
                raise
            _torch().set_rng_state(state)
            first_error = error
        try:
            return second(self, F, xs, ts, batched)
        except (RuntimeError, NotImplementedError) as error:
            if _is_transform_limit(error):  # torch has neither second-order path for an operation in f
                add_note(error, f"({_HVP_PATHS[first]} failed too: {str(first_error).splitlines()[0][:200]})")
                # torch's messages name the operation: the attention advice only where it is attention
                attention = "attention" in f"{error} {first_error}".lower()
                add_note(error, _NO_SECOND_ORDER + (_FUSED_ATTENTION if attention else ""))
            raise


# ------------------------------------------------------------------ primitives


def _plain(leaf: Any) -> Any:
    """A tensor the call may use freely: off the user's graph, not an inference tensor."""
    torch = _torch()
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.is_inference():
        return leaf.clone()  # outside inference mode: a normal tensor autograd can save
    if not leaf.requires_grad:
        return leaf
    # A parameter stays one, for the leaf `_tape_leaf` makes of it (see `fresh_leaf`)
    return torch.nn.Parameter(leaf.detach(), requires_grad=False) if type(leaf) is torch.nn.Parameter else leaf.detach()


def _usable_on_the_tape(leaf: Any) -> Any:
    """`_plain` for a call an outer pass differentiates: the tensor stays on the outer graph."""
    torch = _torch()
    if isinstance(leaf, torch.Tensor) and leaf.is_inference():
        return leaf.clone()
    return leaf


def _attached_for_view(t: Any) -> Any:
    """`_constant_for_view` for a call an outer pass differentiates: a tensor on the outer graph
    (the outer call's leaf, or what f computed from one) stays on it, as itself."""
    return t if t.requires_grad and not t.is_inference() else _copy_for_view(t)


def _attached_result(result: Any) -> Any:
    """`_owned` for a call an outer pass differentiates: the result stays on the graph."""
    return _torch().zeros_like(result) if result._is_zerotensor() else result


def _copy_for_view(t: Any) -> Any:
    """What a view holds for a tensor it does not differentiate: a buffer copy f may update
    (BatchNorm statistics), a frozen parameter's `frozen_copy` (its memory until either is
    written: a write f makes, such as peft's merge, reaches only the copy), any other parameter
    (a library's subclass, a quantized weight) as it is (made usable outside inference mode)."""
    if t.is_inference():
        return t.clone()
    if frozen_parameter(t):
        return frozen_copy(t)
    return t if isinstance(t, _torch().nn.Parameter) else t.clone()


def _alias_for_view(t: Any) -> Any:
    """`_copy_for_view` inside a torch.func transform, where a parameter that requires grad gets
    an alias (its storage, its ``requires_grad``) instead. ``module.to(...)`` in f assigns
    ``.data`` of every parameter the view holds (botorch's acquisition functions call
    ``self.to(device=X.device)`` in their forward): under a transform that put the transform's
    wrapper into the user's own parameter, and a later use of it crashed the process (the hessian
    of an acquisition function with its model a Constant). On a tensor made inside the transform
    torch refuses that write with an error, and an hvp falls back to the double backward."""
    if type(t) is _torch().nn.Parameter and not t.is_inference() and t.requires_grad:
        return _torch().nn.Parameter(t.detach(), requires_grad=True)
    return _copy_for_view(t)


def _constant_for_view(t: Any) -> Any:
    """`_copy_for_view` for a tensor a view does not differentiate (a Constant module's, or one an
    ``Active(model, where=...)`` leaves out): a parameter that requires grad as an alias (see
    `AutoTorch.bind_module`)."""
    return parameter_alias(t) if differentiable_parameter(t) else _copy_for_view(t)


class _DualWatch:
    """Whether a tape operator ran on a dual tensor inside `_dual_jvp`'s f (an AutoTorch
    gradient or pullback called by f: forward over reverse): `_tape_leaf` detaches, which
    drops the tangent, so that forward pass is redone by `torch.func.jvp`."""

    open = 0
    dropped = False


def _tape_leaf(x: Any) -> Any:
    """A fresh tensor the tape differentiates: never the user's own, so no other use of the
    same tensor (a Constant, a tied module, a closure) is differentiated with it. Where an outer
    pass differentiates the call (`_keeps_graph`), a tensor on that pass's graph gets a view of
    itself instead, which stays on it (its derivative reaches the outer pass)."""
    if x.requires_grad and _keeps_graph():
        return x.view_as(x)
    if _DualWatch.open and _torch().autograd.forward_ad.unpack_dual(x).tangent is not None:
        _DualWatch.dropped = True
    if x.is_inference():
        return x.clone().requires_grad_()
    return fresh_leaf(x)


def _rng_state() -> Any:
    return _torch().get_rng_state()


def _zeros_for_unused(grads: tuple[Any, ...], xs: Flat, op_name: str | None, cut_is_error: bool = True) -> Flat:
    """Zeros where a leaf is unused; an error where every leaf is (the output is cut from them),
    unless ``cut_is_error`` is False (a derivative of f, see `derived_from`)."""
    for g in grads:  # the usual case, every leaf used, in one pass
        if g is None:
            break
    else:
        return tuple(grads)
    if cut_is_error and all(g is None for g in grads) and any(arrays.size(x) for x in xs):
        raise _disconnected(op_name)
    if any(g is None for g in grads):
        return tuple(_torch().zeros_like(x) if g is None else g for g, x in zip(grads, xs))
    return tuple(grads)


@attrs.define
class _BatchingVerdict:
    """What `_agrees_with_one` found for a prepared operator's batched backward passes, by the
    set of backward operations they run (batching rules are per operation): a call whose graph
    holds the same operations as a checked one takes that verdict, any other is checked. False:
    one cotangent at a time for those operations."""

    problem: Any  # the prepared operator's problem: a nested call inside f has its own
    agrees: dict[frozenset[type], bool] = attrs.field(factory=dict)


def _graph_operations(outputs: Flat) -> frozenset[type]:
    """The types of the backward nodes the graph of ``outputs`` holds (one walk, each node once)."""
    seen: set[int] = set()
    types: set[type] = set()
    stack = [y.grad_fn for y in outputs if y.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        types.add(type(node))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return frozenset(types)


# The verdict of the prepared call running in this context (`_checked_pipeline`); None: unprepared.
_VERDICT: contextvars.ContextVar[_BatchingVerdict | None] = contextvars.ContextVar("activity_torch_batching", default=None)


def _batched(
    one: Callable[[Flat], Flat], cts: Flat, backend: AutoTorch, problem: Any = None, outputs: Flat = ()
) -> Flat:
    """``one`` over a batch of cotangents: `vmap` over the tape's backward pass (much faster
    than ``is_grads_batched``, which runs torch's older vmap) of ``outputs``, checked by
    `_agrees_with_one` (a prepared operator checks each set of operations once); one
    cotangent at a time where torch cannot batch it or batches it wrong."""
    verdict = _VERDICT.get()
    operations = None
    if verdict is not None and problem is not None and verdict.problem is problem and outputs:
        operations = _graph_operations(outputs)
    known = None if operations is None else verdict.agrees.get(operations)  # type: ignore[union-attr]
    if backend.vectorize is not False and not (known is False and not backend.vectorize):
        try:
            batch: Flat = _torch().func.vmap(one, randomness=backend.randomness)(cts)
        except (RuntimeError, NotImplementedError):
            # Any error of a backward under vmap, not only the ones `_is_transform_limit` knows
            # (a sparse Constant's backward: "expand is unsupported for Sparse tensors"): the
            # loop runs the same backward unbatched, so an error of the backward itself comes back.
            if backend.vectorize:
                raise
            if operations is not None:
                verdict.agrees[operations] = False  # type: ignore[union-attr]  # later calls loop straight away
        else:
            if backend.vectorize or known:
                return batch
            agrees = _agrees_with_one(batch, cts, one)
            if operations is not None:
                verdict.agrees[operations] = agrees  # type: ignore[union-attr]
            return batch if agrees else _loop(one, cts)
    return _loop(one, cts)


def _loop(one: Callable[[Flat], Flat], cts: Flat) -> Flat:
    """``one`` on each entry of a batch, stacked: where a batch cannot (or must not) be vectorised."""
    torch = _torch()
    rows = [one(tuple(c[b] for c in cts)) for b in range(arrays.shape(cts[0])[0])]
    return tuple(torch.stack([row[j] for row in rows]) for j in range(len(rows[0])))


def _agrees_with_one(batch: Flat, cts: Flat, one: Callable[[Flat], Flat]) -> bool:
    """Whether a vectorised pullback is linear in its cotangents as it must be: one unbatched
    pullback of a weighted sum of the cotangents against the same sum of the batch's rows.

    torch's batching rules are not all right (in torch 2.13 ``_cdist_backward`` under vmap
    pulls back the first cotangent for every row), and nothing tells which are wrong before
    they run; this probe costs one more backward pass and catches such a rule.
    """
    torch = _torch()
    size = arrays.shape(cts[0])[0]
    if size < 2:
        return True

    def combine(leaf: Any) -> Any:
        w = _probe_weights(size, leaf.dtype, leaf.device).reshape((size,) + (1,) * (leaf.dim() - 1))
        return (w * leaf).sum(0)

    expected = one(tuple(combine(c) for c in cts))
    combined = [combine(b) for b in batch]
    # Rounding is measured against the whole result: a leaf whose exact derivative is zero
    # (a bias before BatchNorm) still holds rounding noise of the other leaves' size.
    scale = max((2.0 * float(b.abs().sum(0).max()) for b in batch if b.numel()), default=0.0)  # |weights| <= 2
    for got, want in zip(combined, expected):
        if not want.numel() or not want.dtype.is_floating_point:
            continue
        tolerance = 64 * math.sqrt(torch.finfo(want.dtype).eps) * scale
        if float((got - want).abs().max()) > tolerance:
            warnings.warn(
                "activity (AutoTorch): torch's vectorised pullback disagreed with an unbatched one for this f "
                "(a batching rule of an operation in f is wrong in this torch version); the batch was computed "
                "one cotangent at a time instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
    return True


@functools.lru_cache(maxsize=64)
def _probe_weights(size: int, dtype: Any, device: Any) -> Any:
    """The weights of `_agrees_with_one`'s sum: alternating signs, magnitudes from 1 to 2 (made once)."""
    torch = _torch()
    signs = torch.tensor([(-1.0) ** b for b in range(size)], dtype=torch.float64)
    return (torch.linspace(1.0, 2.0, size, dtype=torch.float64) * signs).to(device=device, dtype=dtype)


def _func_vjp(F: FlatFunction, xs: Flat, backend: AutoTorch) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
    """`torch.func.vjp` of ``F`` (inside an outer transform), pulling single or batched cotangents
    (vmapped only with ``vectorize=True``)."""
    torch = _torch()
    ys, pull_one, aux = torch.func.vjp(_checked_reverse(F), xs, has_aux=True)

    def one(cts: Flat) -> Flat:
        return pull_one(cts)[0]  # type: ignore[no-any-return]

    def pull(cts: Flat, batched: bool) -> Flat:
        if not batched:
            return one(cts)
        if backend.vectorize:
            return torch.func.vmap(one, randomness=backend.randomness)(cts)  # type: ignore[no-any-return]
        # One cotangent at a time (the outer transform still vectorises each): torch's batching
        # rules are not all right, and under a transform no value can be inspected to check them.
        return _loop(one, cts)

    return ys, aux, pull


def _zero_pull(xs: Flat) -> Callable[[Flat, bool], Flat]:
    """The pullback of a function whose outputs depend on none of ``xs``: zeros."""
    torch = _torch()

    def pull(cts: Flat, batched: bool) -> Flat:
        batch = (arrays.shape(cts[0])[0],) if batched and cts else ()
        return tuple(torch.zeros((*batch, *x.shape), dtype=x.dtype, device=x.device) for x in xs)

    return pull


def _checked_reverse(F: FlatFunction) -> FlatFunction:
    """``F`` raising where its outputs are cut from the graph (under a torch.func grad level)."""

    if not cut_is_an_error(F):
        return F

    def checked(xs: Flat) -> tuple[Flat, Any]:
        ys, aux = F(xs)
        if ys and not any(y.requires_grad for y in ys) and any(arrays.size(x) for x in xs):
            raise _disconnected(getattr(F, "op_name", None))
        return ys, aux

    return checked


def _checked_forward(F: FlatFunction) -> FlatFunction:
    """``F`` raising where no output carries a tangent (inside torch.func.jvp)."""
    unpack_dual = _torch().autograd.forward_ad.unpack_dual
    if not cut_is_an_error(F):
        return F

    def checked(xs: Flat) -> tuple[Flat, Any]:
        ys, aux = F(xs)
        if ys and all(unpack_dual(y).tangent is None for y in ys) and any(arrays.size(x) for x in xs):
            raise _NoTangent(getattr(F, "op_name", None))
        return ys, aux

    return checked


_MOST_COPIED_BYTES = 1 << 28  # a forward-mode first call copies Active tensors up to 256 MiB in all


def _warn_written_through(F: FlatFunction, on_copies: bool) -> None:
    problem = getattr(F, "problem", None)
    active = "argument" if problem is None else ", ".join(problem.label(i) for i in problem.active_positions)
    where = (
        "this call ran on copies, so yours are unchanged"
        if on_copies
        else "forward mode gives f views of your tensors, so yours was changed, as a plain call would change it"
    )
    warnings.warn(
        f"activity.{getattr(F, 'op_name', None) or 'pushforward'}: f wrote the Active {active} in place (an "
        f"in-place operation, or one under torch.no_grad(): nn.Embedding(max_norm=...) renormalizes the rows "
        f"it looks up so); {where}, and the derivatives are taken at the values f used. Reverse mode refuses "
        f"such a write unless it is under no_grad. Compute out of place or on a copy (x = x.clone()).",
        RuntimeWarning,
        stacklevel=caller_stacklevel(),
    )


def _dual_jvp(F: FlatFunction, xs: Flat, ts: Flat) -> tuple[Flat, Any, Flat] | None:
    """One tangent by forward-mode AD on dual tensors (`torch.autograd.forward_ad`), outside
    every `torch.func` transform: on a small model a third of `torch.func.jvp`'s time, which
    wraps every input and output for its transform levels. Dual tensors are fresh views,
    so only the Active occurrence carries the tangent. None where f ran a tape operator on
    a dual tensor (see `_DualWatch`): its result lost that tangent."""
    torch = _torch()
    forward_ad = torch.autograd.forward_ad
    with _FORWARD_AD, forward_ad.dual_level():
        outer_dropped, _DualWatch.dropped = _DualWatch.dropped, False
        _DualWatch.open += 1
        try:
            # (embedding lookups' tangents as their backward has them)
            ys, aux = on_reverse_convention(F, F)(tuple(map(forward_ad.make_dual, xs, ts)))
        finally:
            _DualWatch.open -= 1
            dropped, _DualWatch.dropped = _DualWatch.dropped, outer_dropped
        if dropped:
            return None
        unpacked = [forward_ad.unpack_dual(y) for y in ys]
        if ys and all(u.tangent is None for u in unpacked) and any(arrays.size(x) for x in xs) and cut_is_an_error(F):
            raise _NoTangent(getattr(F, "op_name", None))
        dys = tuple(
            torch.zeros_like(u.primal) if u.tangent is None else u.tangent if u.tangent.dtype == u.primal.dtype else u.tangent.to(u.primal.dtype)
            for u in unpacked
        )
        primals = tuple(u.primal for u in unpacked)
        if aux is not None:
            leaves, spec = flatten(aux)
            aux = unflatten(spec, [forward_ad.unpack_dual(a).primal if isinstance(a, torch.Tensor) else a for a in leaves])
    return primals, aux, dys


def _func_jvp(F: FlatFunction, xs: Flat, ts: Flat, batched: bool, backend: AutoTorch) -> tuple[Flat, Any, Flat]:
    """`torch.func.jvp`, vmapped over a batch of tangents (serialised: forward-AD levels are global)."""
    torch = _torch()
    G = on_reverse_convention(F, _checked_forward(F))  # embedding lookups' tangents as their backward has them

    def one(tangent: Flat) -> tuple[Any, ...]:
        ys, dys, aux = torch.func.jvp(G, (xs,), (tangent,), has_aux=True)
        # A tangent in its primal's dtype: torch.func promotes `float32 scalar / 2.0` to float64
        # in the tangent (the Python number loses its "wrapped number" status), not in the value.
        return ys, tuple(d if d.dtype == y.dtype else d.to(y.dtype) for d, y in zip(dys, ys)), aux

    with _FORWARD_AD:
        if not batched:
            ys, dys, aux = one(ts)
            return ys, aux, dys
        if ts and arrays.shape(ts[0])[0] == 0:  # no tangent at all (every Active leaf is empty)
            ys, aux = F(xs)
            return ys, aux, tuple(torch.zeros((0, *y.shape), dtype=y.dtype, device=y.device) for y in ys)
        if backend.vectorize is False:
            results = [one(tuple(t[b] for t in ts)) for b in range(arrays.shape(ts[0])[0])]
            ys, _, aux = results[0]
            return ys, aux, tuple(torch.stack([r[1][j] for r in results]) for j in range(len(ys)))
        # out_dims=0 throughout: under an outer vmap the primal outputs are batched too.
        ys, dys, aux = torch.func.vmap(one, randomness=backend.randomness)(ts)
    first: Callable[[Any], Any] = lambda tree: torch.utils._pytree.tree_map(lambda leaf: leaf[0], tree)  # noqa: E731
    return first(ys), first(aux), dys


def _tape_jvp(F: FlatFunction, xs: Flat, ts: Flat, batched: bool, backend: AutoTorch) -> tuple[Flat, Any, Flat]:
    """Forward mode from reverse mode on the tape, for functions torch.func cannot run:
    the Jacobian, one batched pullback of the output basis, applied to the tangents."""
    torch = _torch()
    ys, aux, pull = backend.vjp(F, xs)
    rows = pull(tuple(backend.as_tangent(b, y.dtype) for b, y in zip(arrays.output_basis(ys), ys)), True)
    n_out = sum(arrays.size(y) for y in ys)
    matrix = torch.cat([r.reshape(n_out, -1) for r in rows], dim=1)  # (outputs, inputs)
    tangents = ts if batched else tuple(t[None] for t in ts)
    flat_t = torch.cat([t.reshape(t.shape[0], -1).to(matrix.dtype) for t in tangents], dim=1)
    flat_out = flat_t @ matrix.T  # (batch, outputs)
    dys, start = [], 0
    for y in ys:
        n = arrays.size(y)
        block = flat_out[:, start : start + n].reshape((flat_out.shape[0], *y.shape)).to(y.dtype)
        dys.append(block if batched else block[0])
        start += n
    return ys, aux, tuple(dys)


def _forward_over_reverse(backend: AutoTorch, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Any, ...]:
    grads, (ys, aux), hvps = _func_jvp(backend.gradient_function(F), xs, ts, batched, backend)
    return ys, grads, aux, hvps


def _tape_hvp(backend: AutoTorch, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Any, ...]:
    """Reverse over reverse on the tape: one backward pass with ``create_graph``, then one
    more per tangent (a batch vectorised with `vmap` over it)."""
    torch = _torch()
    keep = _keeps_graph()
    leaves = tuple(map(_tape_leaf, xs))
    ys, aux = F(leaves)
    grads, live = _gradient_with_graph(ys[0], leaves, xs, getattr(F, "op_name", None), backend.hvp_mode != "auto")

    def one(tangent: Flat) -> Flat:
        hvps = (None,) * len(xs)
        if live:  # the graph is kept for the rows of a batch only
            hvps = torch.autograd.grad(
                [grads[i] for i in live], leaves, [tangent[i] for i in live], retain_graph=batched or keep,
                create_graph=keep, allow_unused=True,
            )
        return tuple(map(_materialized, hvps, xs))

    if not batched:
        hvps = one(ts)
    elif keep:  # (as in `vjp`: under vmap the outer pass's graph is not recorded)
        hvps = _loop(one, ts)
    else:
        hvps = _batched(one, ts, backend, getattr(F, "problem", None), tuple(grads[i] for i in live))
    if keep:
        return ys, grads, aux, hvps
    detached = tuple(g.detach() for g in grads)
    return tuple(y.detach() for y in ys), detached, aux, tuple(h.detach() for h in hvps)


class _FastSplit:
    """`Problem.split` with the prepared checks, specialised once at prepare for a signature
    of modules, tensors and pytrees of tensors (the usual ``Active(model), Constant(x)``):
    a module is checked by its description's `still_describes` (no walk), a tensor by its
    type, shape, dtype and device, a pytree by its structure and then each tensor. Any
    difference, or another kind of signature (static or Cache leaves), goes to the generic
    `Problem.split`, which says what differs or describes a changed module again.
    """

    def __init__(self, problem: Any, fallback: bool = True) -> None:
        self.problem = problem
        # Without the fallback, any difference gives None: an unprepared call then makes a new
        # plan, whose checks (which backend, which framework) the generic split does not repeat.
        self.fallback = problem.split if fallback else lambda values, kinds: None
        self.entries: tuple[Any, ...] | None = None
        self.direct = False  # every entry a module or a tensor (`arguments` builds f's arguments itself)
        self.guards: dict[int, Any] = {}  # position -> `tensor_guard` of a Constant tensor (see `arguments`)
        entries = []
        for position, (kind, roles, bare, bare_type) in enumerate(
            zip(problem.kinds, problem.roles, problem.bare, problem.bare_types)
        ):
            metas = problem.signature[position][2]
            if not bare:
                if position in problem.adapted or not all(role in ("diff", "dynamic") for role in roles):
                    return
                if not all(meta[0] == "torch" and meta[3].type != "meta" for meta in metas):
                    return
                entries.append((position, "tree", kind == "active", problem.specs[position], tuple(zip(roles, metas))))
                continue
            if roles[0] not in ("module", "diff", "dynamic"):
                return
            if roles[0] != "module" and (metas[0][0] != "torch" or metas[0][3].type == "meta"):
                return
            entries.append((position, roles[0], kind == "active", bare_type, metas[0]))
        self.entries = tuple(entries)
        self.direct = all(entry[1] != "tree" for entry in entries)

    def __call__(self, values: tuple[Any, ...]) -> tuple[Flat, Flat] | None:
        problem = self.problem
        if self.entries is None:
            return self.fallback(values, problem.kinds)
        xs: list[Any] = []
        ctx: list[Any] = []
        described = problem._described
        tensor_type = _torch().Tensor
        for position, role, active, bare_type, meta in self.entries:
            value = values[position]
            if role == "tree":
                leaves, spec = flatten(value)
                if spec != bare_type:  # the prepared structure
                    return self.fallback(values, problem.kinds)
                for leaf, (leaf_role, leaf_meta) in zip(leaves, meta):
                    if (
                        not isinstance(leaf, tensor_type)
                        or leaf.dtype is not leaf_meta[2]
                        or leaf.shape != leaf_meta[1]
                        or leaf.device != leaf_meta[3]
                    ):
                        return self.fallback(values, problem.kinds)
                    (xs if leaf_role == "diff" else ctx).append(leaf)
                continue
            checked = _checked_bare(position, role, bare_type, meta, value, described)
            if checked is None:
                return self.fallback(values, problem.kinds)
            if role == "module":
                if active:
                    xs += checked.params
                ctx.append(checked)
                continue
            (xs if role == "diff" else ctx).append(value)
        return tuple(xs), tuple(ctx)


    def arguments(self, values: tuple[Any, ...]) -> tuple[list[Any], Flat, Flat, list[Any]] | None:
        """f's arguments for one call on the tape, checked like `__call__`: ``(args, leaves, xs,
        leases)``, the tape leaves made from the differentiated tensors ``xs``; the leased views
        (`lease_view`) go back with `release` once the call is done. None: not this signature.

        An Active module gets a reused view whose leaves alias its parameters (made once, not
        per call); a tensor gets a fresh leaf. Pytrees take `Problem.rebuild`.
        """
        if not self.direct:
            return self._rebuilt(values)
        problem = self.problem
        described = problem._described
        args: list[Any] = []
        leaves: list[Any] = []
        xs: list[Any] = []
        leases: list[Any] = []
        guards = self.guards
        for position, role, active, bare_type, meta in self.entries or ():
            value = values[position]
            if role == "dynamic":
                # A Constant tensor: one C++ guard for what `_checked_bare` and `_plain` read, once a call
                # has made it (it says no to a tensor that requires grad or was made in inference mode).
                guard = guards.get(position)
                if guard is not None and type(value) is bare_type and guard.check(value):
                    args.append(value)
                    continue
                if _checked_bare(position, role, bare_type, meta, value, described) is None:
                    return self._rebuilt(values, leases)
                plain = _plain(value)
                if plain is value and guard is None:
                    guards[position] = tensor_guard([value])
                args.append(plain)
                continue
            checked = _checked_bare(position, role, bare_type, meta, value, described)
            if checked is None:
                return self._rebuilt(values, leases)
            if role == "module":
                description = checked
                if not active:
                    # A view kept between calls, as an Active module's: building one, and the
                    # aliases of its parameters (see `bind_module`), costs more than a small model's call.
                    lease = lease_view(description, _copy_for_view, active=False)
                    leases.append((description, lease))
                    args.append(lease.root)
                    continue
                if description.has_inference:  # its tensors are cloned for the tape: nothing to alias
                    own = tuple(map(_tape_leaf, description.params))
                    args.append(bound_view(description, list(own), _constant_for_view))
                else:
                    lease = lease_view(description, _copy_for_view)
                    leases.append((description, lease))
                    own = lease.leaves
                    args.append(lease.root)
                leaves += own
                xs += description.params
                continue
            if role == "diff":
                if value._backward_hooks:  # the planned path, which names the hooks it does not apply
                    _release(leases)
                    return None
                leaf = _tape_leaf(value)
                leaves.append(leaf)
                xs.append(value)
                args.append(leaf)
        return args, tuple(leaves), tuple(xs), leases

    def _rebuilt(self, values: tuple[Any, ...], leases: list[Any] | None = None) -> tuple[list[Any], Flat, Flat, list[Any]] | None:
        if leases:
            _release(leases)
        # a difference found by `arguments` goes to the generic split; pytrees take `__call__`'s checks
        split = self.fallback(values, self.problem.kinds) if self.direct else self(values)
        if split is None:
            return None
        xs, ctx = split
        leaves = tuple(map(_tape_leaf, xs))
        return self.problem.rebuild(leaves, tuple(map(_plain, ctx))), leaves, xs, []


def _checked_bare(position: int, role: str, bare_type: Any, meta: Any, value: Any, described: dict[Any, Any]) -> Any:
    """One module or tensor argument against the prepared signature: the module's description
    (`still_describes` it), the tensor (same type, dtype, shape, device), or None where it differs."""
    if type(value) is not bare_type:
        return None
    if role == "module":
        description = described[(position, 0)]
        return description if description.still_describes(value) else None
    if value.dtype is not meta[2] or value.shape != meta[1] or value.device != meta[3]:
        return None
    return value


def _release(leases: list[Any]) -> None:
    for description, lease in leases:
        release_view(description, lease)


@functools.cache
def _modes() -> tuple[Callable[[], bool], Callable[[], bool], Callable[[], Any]]:
    torch = _torch()
    return torch.is_grad_enabled, torch.is_inference_mode_enabled, torch._C._functorch.maybe_current_level


def _usable() -> bool:
    """Whether a compiled torch call may run here: the tape on, outside every `torch.func` transform
    and every other AutoTorch call (which differentiates this one: the generic path keeps the graph)."""
    grad_enabled, inference_mode, functorch_level = _modes()
    return grad_enabled() and not inference_mode() and functorch_level() is None and not _EVALUATING_GET()


def _tape_gradient(problem: Any, op_name: str, fallback: bool = True) -> Callable[..., Any]:
    """A gradient straight on the tape, for one signature: ``run(f, *values, **seed_kwargs)``.

    The same steps as the generic gradient (check and split the arguments,
    rebuild them, run f, `torch.autograd.grad`, arrange the result), without
    the layers that let one pipeline serve every operator and backend: on a
    small model those cost more than the forward and backward passes. Calls
    it does not cover (another signature, grad mode off, inside `torch.func`)
    raise SignatureChanged before f runs and take the generic path. It holds
    no ``f``, so an unprepared call may keep it for the next (`reusable_call`).
    """
    torch = _torch()
    n_args = len(problem.kinds)
    split_checked = _FastSplit(problem, fallback)
    arguments = split_checked.arguments
    value_wanted = op_name == "value_and_gradient"
    lone_module = _lone_module(problem)
    tensor_type = torch.Tensor
    engine, ones_like, call = _engine(), torch.ones_like, problem.call
    loss_guard: Any = None  # `tensor_guard` of the first call's loss, where it was the usual one

    def gradient(f: Callable[..., Any], /, *values: Any, **seed_kwargs: Any) -> Any:
        nonlocal loss_guard
        got = None if seed_kwargs or len(values) != n_args or not _usable() else arguments(values)
        if got is None:
            raise SignatureChanged
        args, leaves, xs, leases = got
        del got
        out: Any = None
        try:
            out = _evaluating(call, f, args)
            if loss_guard is not None and loss_guard.check(out):  # a plain 0-d floating tensor on the tape, as before
                y, spec = out, None
                grads = _zeros_for_unused(_engine_grads(engine, (y,), (ones_like(y),), leaves), xs, op_name)
            else:
                y, spec = _scalar_output(problem, out, tensor_type)
                if type(y) is tensor_type and engine is not None and y.requires_grad:
                    # `_tape_grads` inlined for the usual scalar loss (a plain tensor): about 1 us a call
                    if y is out and loss_guard is None:
                        loss_guard = tensor_guard([y])
                    grads = _zeros_for_unused(_engine_grads(engine, (y,), (ones_like(y),), leaves), xs, op_name)
                else:
                    grads = _tape_grads(y, leaves, xs, op_name)
        finally:
            if leases:
                args.clear()  # a leased view goes back only if nothing of ours still holds it
                out = None
                _release(leases)
        result = dict(zip(problem.module_names[lone_module], grads)) if lone_module else problem.like_active(grads)
        if not value_wanted:
            return result
        value = y.detach()
        return (value if spec is None else unflatten(spec, [value]), result)

    gradient.split = split_checked  # type: ignore[attr-defined]
    return gradient


def _scalar_output(problem: Any, out: Any, tensor_type: Any) -> tuple[Any, Any]:
    """f's scalar output and its structure (None: a bare tensor). A float, or a one-leaf pytree,
    is checked like any output (the error names the problem)."""
    if isinstance(out, tensor_type) and out.dim() == 0 and out.dtype.is_floating_point:
        return out, None
    (y,), spec = problem.output_leaves(out, scalar=True)
    return y, spec


def _gradient_with_graph(
    y: Any, leaves: Flat, xs: Flat, op_name: str | None, cut_is_zero: bool, look_for_once_differentiable: bool = True
) -> tuple[Flat, list[int]]:
    """The first pass of reverse over reverse: the gradients of the scalar ``y``, recording their
    own graph, and the leaves whose gradient has one. A gradient without a graph is a zero
    derivative only where ``cut_is_zero`` (``hvp_mode="reverse-over-reverse"``): else it raises
    `_CutGradient`, for forward over reverse to decide. ``look_for_once_differentiable``: walk
    the gradients' graph for a backward that cannot be differentiated (a prepared call looks on
    its first call only: the walk visits every node of the graph)."""
    if not y.requires_grad:
        raise _disconnected(op_name)
    first_pass = _backward((y,), (_torch().ones_like(y),), leaves, create_graph=True)
    grads = _zeros_for_unused(first_pass, xs, op_name)
    # One pass over the gradients (each read is a cache miss after the backward pass): those with a
    # graph, and whether a gradient of a leaf f uses came back without one.
    live: list[int] = []
    cut = False
    for i, g in enumerate(first_pass):
        if g is not None:
            if g.requires_grad:
                live.append(i)
            elif not cut:
                cut = arrays.size(xs[i]) > 0
    if look_for_once_differentiable and live and _holds_error_node([grads[i] for i in live]):
        # A custom backward marked @once_differentiable gave its part of these gradients behind
        # a node that raises only if run, and that torch's second pass never runs: it is cut
        # from the leaves, so the pass would silently leave that part out (a wrong, not a zero,
        # second derivative). Forward over reverse is no way out: there the mark detaches that
        # part, dropping its tangent. Not a transform limit, so no other path is tried.
        raise RuntimeError(_ONCE_DIFFERENTIABLE)
    # A leaf f does not use (no gradient at all: a LoRA adapter that peft's module dropout
    # skipped, an unused pooler) has zero second derivatives whatever f's operations are.
    if not cut_is_zero and cut:
        # torch's own backward formulas record their graph: a gradient without one does not
        # depend on the leaf (f is linear in it), a zero second derivative. A custom Function's
        # backward may not record it (@once_differentiable), so there forward over reverse decides.
        if not all(map(_built_in_node, _graph_operations((y,)))):
            raise _CutGradient("a gradient came back without a graph for a differentiated leaf")
    return grads, live


def _holds_error_node(outputs: Sequence[Any]) -> bool:
    """Whether the graph of ``outputs`` holds the node by which ``@once_differentiable`` marks
    a backward that cannot be differentiated."""
    return getattr(_torch()._C._functions, "Error", None) in _graph_operations(tuple(outputs))


def _owned(result: Any) -> Any:
    """A result tensor as the user gets it: off the graph, and a plain tensor where torch's
    derivative rules gave a ZeroTensor (forward mode through abs or sign), which is immutable."""
    if result._is_zerotensor():
        return _torch().zeros_like(result)
    return result.detach() if result.requires_grad else result


def _materialized(derivative: Any, x: Any) -> Any:
    """A second pass's derivative as a tensor the user owns: zeros where the leaf got none, and
    where torch gives a ZeroTensor (the double backward of sign or abs), which is immutable."""
    if derivative is None or derivative._is_zerotensor():
        return _torch().zeros_like(x)
    return derivative


def _built_in_node(node_type: type) -> bool:
    """Whether a backward node is one of torch's own operations (not a Python or C++ custom Function)."""
    return node_type.__module__ == "builtins" and not node_type.__name__.startswith("CppNode")


def _lone_module(problem: Any) -> tuple[int, int] | None:
    """Where the one Active argument is a module and nothing else is differentiated: the key of
    its names (a result is then ``dict(zip(names, values))``, what `Problem.like_active` makes)."""
    actives = problem.active_positions
    if len(actives) == 1 and problem.bare[actives[0]] and problem.roles[actives[0]][0] == "module":
        return (actives[0], 0)
    return None


def _tape_pullback(problem: Any, operator: Any, seed_key: Any, fallback: bool = True) -> Callable[..., Any]:
    """A pullback of one cotangent straight on the tape (see `_tape_gradient`), for one
    signature: ``run(f, *values, **seed_kwargs)``; one evaluation of f, one backward pass with
    the cotangent, nothing kept. It holds no ``f`` (`reusable_call`)."""
    torch = _torch()
    n_args = len(problem.kinds)
    split_checked = _FastSplit(problem, fallback)
    value_wanted = operator.name == "value_and_pullback"
    op_name = operator.name
    tensor_type = torch.Tensor
    lone_module = _lone_module(problem)
    one_tensor = seed_key == (None, LEAF)  # prepared with one tensor cotangent
    engine = _engine()
    from .._operators._common import Seeds, encode_seeds  # the operators import the backends
    from .._operators.pullback import checked_cotangents

    # `tensor_guard`s of the first call's cotangent and output where they took the usual path
    # below (one tensor out, a cotangent of its shape and dtype): what later calls compare with.
    guards: list[Any] = []

    def pullback(f: Callable[..., Any], /, *values: Any, **seed_kwargs: Any) -> Any:
        if len(values) != n_args or not _usable():
            raise SignatureChanged
        cotangent: Any = seed_kwargs.get("cotangent")
        guarded = bool(guards) and len(seed_kwargs) == 1 and type(cotangent) is tensor_type and guards[0].check(cotangent)
        if guarded:
            cts_given: Flat = (cotangent,)
            seeds = None
        elif one_tensor and len(seed_kwargs) == 1 and type(cotangent) is tensor_type and cotangent.dtype.is_floating_point:
            cts_given = (cotangent,)  # what `encode_seeds` makes of one tensor, without a walk
            seeds = None
        else:
            seeds = _encoded_seeds(encode_seeds, operator, problem, seed_kwargs)
            if seeds.key != seed_key:
                raise SignatureChanged
            cts_given = seeds.leaves
        got = split_checked.arguments(values)
        if got is None:
            raise SignatureChanged
        args, leaves, xs, leases = got
        del got
        out: Any = None
        traced = None
        grads: Flat | None = None
        try:
            out = _evaluating(problem.call, f, args)
            if (guarded and guards[1].check(out)) or (
                seeds is None
                and type(out) is tensor_type
                and out.requires_grad
                and out.dtype is cotangent.dtype
                and out.shape == cotangent.shape
            ):  # one tensor out, a cotangent of its shape and dtype: what the checks below pass as it is
                ys, cts, connected = (out,), cts_given, [0]
                if not guards:
                    made = [tensor_guard([cotangent]), tensor_guard([out])]
                    if None not in made:
                        guards[:] = made
                if engine is not None:
                    grads = _zeros_for_unused(_engine_grads(engine, ys, cts, leaves), xs, op_name)
            else:
                if seeds is None:
                    seeds = Seeds(cts_given, None, LEAF)
                traced = Traced()
                ys, traced.out_spec = problem.output_leaves(out, False)
                cts = checked_cotangents(problem, traced, seeds, cts_given, ys)
                connected = [i for i, y in enumerate(ys) if y.requires_grad]
                if not connected:
                    raise _disconnected(op_name)
            if grads is None:
                grads = _zeros_for_unused(_backward(tuple(ys[i] for i in connected), tuple(cts[i] for i in connected), leaves), xs, op_name)
        finally:
            if leases:
                args.clear()  # as in `_tape_gradient`
                out = None
                _release(leases)
        result = dict(zip(problem.module_names[lone_module], grads)) if lone_module else problem.like_active(grads)
        if not value_wanted:
            return result
        values_out = [y.detach() for y in ys]
        return (values_out[0] if traced is None else traced.output(values_out)), result

    pullback.split = split_checked  # type: ignore[attr-defined]
    return pullback


def _checked_pipeline(plan: Any, backend: AutoTorch | None = None) -> Callable[..., Any]:
    """Any other prepared operator: its pipeline, after the prepared checks of `_FastSplit`
    (what the prepared object's checked path does, without its general dispatch); with
    ``backend``, the pipeline of the same operator built on that backend."""
    problem, n_args, operator = plan.problem, len(plan.problem.kinds), plan.operator
    split_checked = _FastSplit(problem)
    seed_key, pipeline = plan.seed_key, plan.pipeline
    if backend is not None:
        pipeline = operator.build(problem, plan.f, backend, plan.seeds, **plan.options)
    else:
        backend = plan.backend
    finalize = backend.finalize
    torch = _torch()
    from .._operators._common import encode_seeds  # the operators import the backends

    tangent_seeds = _tangent_checker(problem, operator)
    verdict = _BatchingVerdict(problem)

    def call(*values: Any, **seed_kwargs: Any) -> Any:
        split = None if len(values) != n_args or torch.is_inference_mode_enabled() else split_checked(values)
        if split is None:
            raise SignatureChanged
        seeds = None
        if tangent_seeds is not None and len(seed_kwargs) == 1 and seed_kwargs.get("tangent") is not None:
            seeds = tangent_seeds(seed_kwargs["tangent"])
        if seeds is None:
            seeds = _encoded_seeds(encode_seeds, operator, problem, seed_kwargs)
        if (None if seeds is None else seeds.key) != seed_key:
            raise SignatureChanged
        token = _VERDICT.set(verdict)
        try:
            with backend.context():
                return finalize(pipeline(*split, None if seeds is None else seeds.leaves), problem)
        finally:
            _VERDICT.reset(token)

    return call


def _tangent_checker(problem: Any, operator: Any) -> Callable[[Any], Any] | None:
    """For one Active tensor, pytree of tensors or module: ``check(tangent)``, the `Seeds` that
    `encode_seeds` makes of a ``tangent=`` of the prepared structure, shapes, dtypes and devices,
    checked leaf by leaf without its generic walk; None for anything else (which takes
    `encode_seeds`, and its error if it is wrong)."""
    from .._operators._common import Seeds  # the operators import the backends

    if operator.seed != "tangent" or len(problem.active_positions) != 1:
        return None
    position = problem.active_positions[0]
    roles = problem.roles[position]
    tensor_type = _torch().Tensor
    layouts = tuple(zip(problem.diff_shapes, problem.diff_dtypes))
    # After a tangent has passed the checks leaf by leaf: one C++ guard of its leaves' types,
    # dtypes, devices, shapes and layouts, for the next (another layout is checked leaf by leaf).
    guard: list[Any] = []

    def _guard_from(leaves: Any) -> None:
        if not guard:
            made = tensor_guard(list(leaves))
            if made is not None:
                guard.append(made)

    if problem.bare[position] and roles[0] == "module":
        description = problem._described[(position, 0)]
        names = tuple(problem.module_names[(position, 0)])
        if problem.module_unselected.get((position, 0)):
            return None  # a tangent may name unselected parameters too: the generic check
        devices = tuple(p.device for p in description.params)

        def module_tangent(tangent: Any) -> Any:
            if type(tangent) is not dict or len(tangent) != len(names):
                return None
            leaves: tuple[Any, ...] = tuple(map(tangent.get, names))
            if not (guard and guard[0].check(*leaves)):
                for leaf, (shape, dtype), device in zip(leaves, layouts, devices):
                    if type(leaf) is not tensor_type or leaf.dtype is not dtype or leaf.shape != shape or leaf.device != device:
                        return None
                _guard_from(leaves)
            return Seeds(leaves, None, None)

        return module_tangent
    if position in problem.adapted or not all(role == "diff" for role in roles):
        return None
    spec = problem.specs[position]

    def tree_tangent(tangent: Any) -> Any:
        leaves, got = flatten(tangent)
        if got != spec or len(leaves) != len(layouts):
            return None
        if not (guard and guard[0].check(*leaves)):
            for leaf, (shape, dtype) in zip(leaves, layouts):
                if not isinstance(leaf, tensor_type) or leaf.dtype is not dtype or leaf.shape != shape:
                    return None
            _guard_from(leaves)
        return Seeds(tuple(leaves), None, None)

    return tree_tangent


def _tape_hvp_call(plan: Any) -> Callable[..., Any]:
    """A prepared Hessian-vector product of one tangent, reverse over reverse on the tape (see
    `_tape_gradient`): one evaluation of f, a backward pass that records its own graph, and
    its pullback of the tangent. Where torch has no double backward for an operation in f,
    forward over reverse (`torch.func`), as the generic path does."""
    torch = _torch()
    problem, f, n_args, operator, backend = plan.problem, plan.f, len(plan.problem.kinds), plan.operator, plan.backend
    split_checked = _FastSplit(problem)
    with_gradient = operator.name == "gradient_and_hvp"
    op_name, seed_key = operator.name, plan.seed_key
    tensor_type = torch.Tensor
    tangent_seeds = _tangent_checker(problem, operator)
    lone_module = _lone_module(problem)
    fallback = _checked_pipeline(plan) if backend.hvp_mode == "auto" else None
    cut_is_zero = fallback is None  # explicit reverse-over-reverse (see `_gradient_with_graph`)
    forward_over_reverse: list[Callable[..., Any]] = []  # where the tape's gradients came back cut
    # Whether a call has found no @once_differentiable backward in f's gradient: the same f takes
    # the same operations call after call (as `forward_over_reverse` assumes), and the walk that
    # finds one costs about a microsecond per graph node, a fifth of a small model's call.
    checked_once = False
    # `tensor_guard` of a call's products where each was a plain tensor (no leaf without one, no
    # immutable ZeroTensor, see `_materialized`): later calls check them in one C++ call.
    products_guard: Any = None
    from .._operators._common import encode_seeds  # the operators import the backends

    def hvp(*values: Any, **seed_kwargs: Any) -> Any:
        nonlocal checked_once, products_guard
        if len(values) != n_args or not _usable():
            raise SignatureChanged
        if forward_over_reverse:
            return forward_over_reverse[0](*values, **seed_kwargs)
        seeds = None
        if tangent_seeds is not None and len(seed_kwargs) == 1 and seed_kwargs.get("tangent") is not None:
            seeds = tangent_seeds(seed_kwargs["tangent"])
        exact = seeds is not None  # `tangent_seeds` passes only leaves of the parameters' dtypes
        if seeds is None:
            seeds = _encoded_seeds(encode_seeds, operator, problem, seed_kwargs)
        if seeds.key != seed_key:
            raise SignatureChanged
        got = split_checked.arguments(values)
        if got is None:
            raise SignatureChanged
        args, leaves, xs, leases = got
        del got
        out: Any = None
        state = _rng_state() if fallback is not None else None
        try:
            out = _evaluating(problem.call, f, args)
            grads, live = _gradient_with_graph(
                _scalar_output(problem, out, tensor_type)[0], leaves, xs, op_name, cut_is_zero, not checked_once
            )
            checked_once = True
            hvps: Flat = (None,) * len(xs)
            if live:
                tangents = seeds.leaves
                ts = tuple(tangents[i] for i in live) if exact else tuple(backend.as_tangent(tangents[i], grads[i].dtype) for i in live)
                hvps = _backward(tuple(grads[i] for i in live), ts, leaves)
        except (RuntimeError, NotImplementedError) as error:
            if fallback is None and _is_transform_limit(error):  # as in `AutoTorch.value_and_hvp`
                add_note(error, _ONE_HVP_PATH.format(mode=backend.hvp_mode, other=_HVP_PATHS[_forward_over_reverse]))
            if fallback is None or not _is_transform_limit(error):
                raise
            torch.set_rng_state(state)
            result = fallback(*values, **seed_kwargs)
            if isinstance(error, _CutGradient):
                # Forward over reverse could run f; the same f takes the same operations call after
                # call, so the later calls take it straight away.
                forward_over_reverse.append(_checked_pipeline(plan, attrs.evolve(backend, hvp_mode="forward-over-reverse")))
            return result
        finally:
            if leases:
                args.clear()  # as in `_tape_gradient`
                out = None
                _release(leases)
        if products_guard is None or not products_guard.check(*hvps):
            materialized = tuple(map(_materialized, hvps, xs))
            if products_guard is None and all(m is h for m, h in zip(materialized, hvps)):
                products_guard = tensor_guard(list(hvps))
            hvps = materialized
        result = dict(zip(problem.module_names[lone_module], hvps)) if lone_module else problem.like_active(hvps)
        if not with_gradient:
            return result
        return problem.like_active(tuple(g.detach() for g in grads)), result

    return hvp


def _encoded_seeds(encode_seeds: Callable[..., Any], operator: Any, problem: Any, seed_kwargs: dict[str, Any]) -> Any:
    """`encode_seeds`; a mistake in them is for the prepared object's checked path to explain."""
    try:
        return encode_seeds(operator, problem, seed_kwargs)
    except (TypeError, ValueError):
        raise SignatureChanged from None


def _tape_grads(y: Any, leaves: Flat, xs: Flat, op_name: str | None, create_graph: bool = False) -> Flat:
    """The gradient of the scalar ``y`` with respect to the tape ``leaves`` made from ``xs``
    (zeros for a leaf ``y`` does not depend on; an error if it depends on none)."""
    if not y.requires_grad:
        raise _disconnected(op_name)
    torch = _torch()
    return _zeros_for_unused(_backward((y,), (torch.ones_like(y),), leaves, create_graph=create_graph), xs, op_name)


def _backward(outputs: Flat, cotangents: Flat, leaves: Flat, create_graph: bool = False, retain_graph: bool = False) -> Flat:
    """``torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)`` for cotangents the
    caller has checked (same shapes and dtypes as the outputs), and leaves it made itself.

    Plain tensors go straight to the autograd engine, as `torch.autograd.grad` does after its
    argument handling: on a small model that handling costs as much as a tenth of the call.
    A tensor subclass (its ``__torch_function__`` may change the call) takes the public call.
    """
    torch = _torch()
    engine = _engine()
    tensor = torch.Tensor
    own = all(leaf.is_leaf for leaf in leaves)  # views on an outer pass's graph (`_tape_leaf`) hold no .grad
    if own:
        clear_grads(leaves)
    if engine is not None and (type(outputs[0]) is tensor if len(outputs) == 1 else all(type(y) is tensor for y in outputs)):
        grads = engine.run_backward(outputs, cotangents, retain_graph or create_graph, create_graph, leaves, True, False)
    else:
        grads = torch.autograd.grad(
            outputs, leaves, cotangents, retain_graph=retain_graph or create_graph, create_graph=create_graph, allow_unused=True
        )
    return _folded(tuple(grads), leaves, create_graph) if own else tuple(grads)


def _engine_grads(engine: Any, outputs: Flat, cotangents: Flat, leaves: Flat) -> Flat:
    """The first-order backward pass of a tape call straight on the autograd ``engine``: from
    leaves without ``.grad``, and with what a backward pass of f's own put there folded in
    (`_folded`), as `_backward` does for every other call."""
    clear_grads(leaves)
    return _folded(engine.run_backward(outputs, cotangents, False, False, leaves, True, False), leaves)


@functools.cache
def _engine() -> Any:
    """torch's autograd engine, where this torch version exposes it as `torch.autograd.grad` uses it."""
    engine = getattr(_torch().autograd.Variable, "_execution_engine", None)
    return engine if callable(getattr(engine, "run_backward", None)) else None


def _scalar_with_aux(F: FlatFunction) -> Callable[..., Any]:
    def scalar(xs: Flat) -> tuple[Any, tuple[Any, ...]]:
        ys, aux = _checked_reverse(F)(xs)
        return ys[0], (ys, aux)

    return scalar


def float64_copy(module: ModuleDescription, params: list[Any] | None) -> Any:
    """The module evaluated in float64 on copies (finite differences)."""
    torch = _torch()

    def convert(t: Any) -> Any:
        t = t.detach()
        return t.to(torch.float64, copy=True) if t.dtype.is_floating_point else t.clone()

    return bound_view(module, params, convert)


_HVP_PATHS = {_tape_hvp: "double backward", _forward_over_reverse: "forward over reverse"}  # for messages
