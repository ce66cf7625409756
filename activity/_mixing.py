"""`differentiate_with(g, backend)`: call a function of one framework from code another differentiates.

``g`` runs in its own framework (torch, numpy/SciPy, JAX); its derivatives come
from ``backend`` through the library's own operators (`pullback`, `pushforward`),
prepared once per signature. The caller's framework sees one function:

- in JAX, a ``jax.custom_jvp`` around a ``jax.pure_callback``, whose tangent is a linear
  map JAX evaluates in forward mode (the inner pushforward) and transposes in reverse
  mode (the inner pullback);
- in PyTorch, a ``torch.autograd.Function`` (``backward``, ``jvp`` and ``vmap``).

Each derivative is itself such a function of its inputs (the pullback of ``g`` is a
function of the point and the cotangent), so the caller's framework can
differentiate it again: that is how second order works.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from . import _arrays as arrays
from ._annotations import Active, Annotation, Cache, Constant
from ._errors import UnsupportedError, add_note
from ._tree import flatten, structure_difference, unflatten

MAX_ORDER = 2
"""The highest order of derivative `differentiate_with` provides (a Hessian through ``h``)."""

MAX_SIGNATURES = 32
"""How many argument signatures one ``h`` keeps (the least recently used dropped), and how many
prepared inner operators each of its derivative nodes keeps (the oldest dropped: the lookup on
every call takes no lock, so it does not reorder)."""

_KINDS = ("active", "constant", "cache")
_WRAPPERS: dict[str, type[Annotation[Any]]] = {"active": Active, "constant": Constant, "cache": Cache}


# ------------------------------------------------------------------ inner functions


class _Node:
    """A function of the inner framework over flat leaves, ``fn(diff, data, cache) -> outputs``.

    ``diff`` are the differentiated (floating) leaves, ``data`` the Constant array leaves
    and ``cache`` the Cache leaves; outputs are the floating output leaves. `pushed` and
    `pulled` are its derivatives as nodes of the same kind, whose ``diff`` is
    ``diff + tangents`` and ``diff + cotangents``.
    """

    def __init__(
        self,
        fn: Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]],
        out_avals: tuple[tuple[tuple[int, ...], str], ...],
        order: int,
        owner: "_Mixed",
        label: str,
    ):
        self.fn = fn
        self.out_avals = out_avals
        self.order = order
        self.owner = owner
        self.label = label
        self.how: str | None = None  # for a derivative: "push" or "pull" of `parent`,
        self.parent: _Node | None = None  # whose first `n_base` diff leaves are the point
        self.n_base = 0
        self._prepared: OrderedDict[tuple[Any, ...], _Bound] = OrderedDict()
        self._derived: dict[str, _Node] = {}
        self._lock = threading.Lock()

    def derived(self, how: str, diff_avals: tuple[Any, ...]) -> "_Node":
        """The pushforward (``how="push"``) or pullback (``"pull"``) of this node, as a node."""
        with self._lock:
            node = self._derived.get(how)
        if node is not None:
            return node
        order = self.order + 1
        backend = self.owner.backend
        if order > MAX_ORDER:
            raise UnsupportedError(
                f"activity.differentiate_with({self.owner.name}, {backend!r}): derivatives of order {order} "
                f"are not supported; differentiate_with provides first and second derivatives only "
                f"(the outer transform asked for the {_ordinal(order)} derivative of g)."
            )
        if how == "pull" and self.order >= 1 and _framework_of(backend) == "torch":
            raise UnsupportedError(
                f"activity.differentiate_with({self.owner.name}, {backend!r}): second-order "
                f"{'reverse-over-reverse' if self.how == 'pull' else 'reverse-over-forward'} (a pullback of the "
                f"{self.label}) is not supported on AutoTorch, whose derivatives are not differentiable again "
                f"in reverse mode from outside torch. Differentiate the first derivative in forward mode "
                f"instead: jax.hessian (forward-over-reverse), jax.jacfwd(jax.grad(...)) or jax.jacfwd(jax.jacfwd(...))."
            )
        n_diff = len(diff_avals)
        if how == "push":

            def fn(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
                pushed: tuple[Any, ...] = self.call("pushforward", diff[:n_diff], data, cache, tangent=tuple(diff[n_diff:]))
                return pushed

            node = _Node(fn, self.out_avals, order, self.owner, f"pushforward of {self.label}")
        else:

            def fn(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
                pulled: tuple[Any, ...] = self.call("pullback", diff[:n_diff], data, cache, cotangent=tuple(diff[n_diff:]))
                return pulled

            node = _Node(fn, diff_avals, order, self.owner, f"pullback of {self.label}")
        node.how, node.parent, node.n_base = how, self, n_diff
        with self._lock:
            return self._derived.setdefault(how, node)

    def lane(self) -> Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]:
        """`fn` for calls that all have one signature (a callback JAX traced for fixed shapes):
        the prepared inner operator is looked up on the first call only."""
        parent = self.parent
        if parent is None:
            return self.fn
        n_base = self.n_base
        op_name, seed_name = ("pushforward", "tangent") if self.how == "push" else ("pullback", "cotangent")
        found: list[_Bound] = []

        def run(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
            if not found:
                found.append(parent.bound(op_name, seed_name, diff[:n_base], data, cache, tuple(diff[n_base:])))
            result: tuple[Any, ...] = found[0](diff[:n_base], data, cache, tuple(diff[n_base:]))
            return result

        return run

    def call(self, op_name: str, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...], **seed: Any) -> Any:
        """``op(fn, Active(diff), Constant(data), Cache(cache), **seed)`` on the inner backend,
        prepared once per signature of leaves (and tangent batch size): a tuple of result
        leaves, or a list of them for a list of seeds (``tangents=`` / ``cotangents=``)."""
        ((seed_name, seed_value),) = seed.items()
        return self.bound(op_name, seed_name, diff, data, cache, seed_value)(diff, data, cache, seed_value)

    def bound(self, op_name: str, seed_name: str, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...],
              seed_value: Any) -> "_Bound":
        """The prepared ``op_name`` for this signature of leaves, as ``run(diff, data, cache, seed)``."""
        key = (
            op_name,
            seed_name,
            len(seed_value) if seed_name[-1] == "s" else None,
            tuple([(leaf.shape, leaf.dtype) for leaf in diff]),
            tuple([(leaf.shape, leaf.dtype) for leaf in data]),
            tuple([(leaf.shape, leaf.dtype) for leaf in cache]),
        )
        found = self._prepared.get(key)  # read without the lock: a dict lookup is atomic
        if found is None:
            found = self._prepare(key, op_name, seed_name, diff, data, cache, seed_value)
        return found

    def _prepare(self, key: tuple[Any, ...], op_name: str, seed_name: str, diff: tuple[Any, ...], data: tuple[Any, ...],
                 cache: tuple[Any, ...], seed_value: Any) -> "_Bound":
        import activity

        groups = (diff, data, cache)
        present = tuple(index for index, group in enumerate(groups) if group)
        # A group of one leaf goes to the operator as that leaf, not a 1-tuple, and so do a
        # seed and a result of one leaf: the prepared operators' fastest path (no pytree walk).
        bare = tuple(len(groups[index]) == 1 for index in present)
        out_bare = len(self.out_avals) == 1
        diff_bare = len(diff) == 1
        seed_bare = out_bare if op_name == "pullback" else diff_bare
        result_bare = diff_bare if op_name == "pullback" else out_bare
        fn = self.fn

        def grouped(*values: Any) -> Any:
            given: list[tuple[Any, ...]] = [(), (), ()]
            for index, value, one in zip(present, values, bare):
                given[index] = (value,) if one else value
            out = fn(*given)
            return out[0] if out_bare else out

        def arguments(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> list[Any]:
            groups = (diff, data, cache)
            return [groups[index][0] if one else groups[index] for index, one in zip(present, bare)]

        batched = seed_name[-1] == "s"
        seed_of: Callable[[Any], Any] = (lambda seed: seed[0]) if seed_bare else (lambda seed: seed)
        example = [seed_of(seed) for seed in seed_value] if batched else seed_of(seed_value)
        op = getattr(activity, op_name)
        annotated = [_WRAPPERS[_KINDS[index]](value) for index, value in zip(present, arguments(diff, data, cache))]
        prepared = activity.prepare(op, grouped, *annotated, backend=self.owner.backend, **{seed_name: example})

        if batched:

            def run(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...], seed: Any) -> Any:
                results = prepared(*arguments(diff, data, cache), **{seed_name: [seed_of(s) for s in seed]})
                return [(result,) if result_bare else tuple(result) for result in results]

        elif present == (0,) and bare == (True,):  # one differentiated leaf: the common case, straight

            def run(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...], seed: Any) -> Any:
                result = prepared(diff[0], **{seed_name: seed[0] if seed_bare else seed})
                return (result,) if result_bare else tuple(result)

        else:

            def run(diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...], seed: Any) -> Any:
                result = prepared(*arguments(diff, data, cache), **{seed_name: seed_of(seed)})
                return (result,) if result_bare else tuple(result)

        with self._lock:
            self._prepared[key] = run
            while len(self._prepared) > MAX_SIGNATURES:
                self._prepared.popitem(last=False)  # the oldest prepared first
        return run


_Bound = Callable[[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], Any], Any]
"""A prepared inner operator for one signature: ``run(diff, data, cache, seed)``."""


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _leaf_meta(leaf: Any) -> tuple[Any, ...]:
    """Shape and dtype: the same for a concrete array and JAX's tracers of it, so a signature
    is shared by eager calls and every transform."""
    return tuple(arrays.shape(leaf)), str(getattr(leaf, "dtype", type(leaf)))


def _framework_of(backend: Any) -> str:
    """The framework ``backend`` differentiates in: ``"torch"``, ``"jax"`` or ``"numpy"``."""
    from .backends import SecondOrder

    if isinstance(backend, SecondOrder):
        return _framework_of(backend.inner)
    return getattr(backend, "framework", None) or "numpy"


# ------------------------------------------------------------------ array crossings


def _to_inner(leaf: Any, framework: str) -> Any:
    """A caller's array as the inner framework's, sharing memory where both sides allow (DLPack)."""
    if framework == "torch":
        import torch

        if arrays.is_torch(leaf):
            return leaf.detach()
        if arrays.is_jax(leaf) and leaf.dtype != np.dtype(bool):
            return torch.utils.dlpack.from_dlpack(leaf)
        return torch.from_numpy(np.array(leaf))  # bool and numpy: one copy
    if framework == "jax":
        import jax

        if arrays.is_jax(leaf):
            return leaf
        if arrays.is_torch(leaf):
            tensor = leaf.detach()
            if tensor.is_contiguous() and tensor.dtype != _torch().bool:
                return jax.dlpack.from_dlpack(tensor)
            return jax.numpy.asarray(tensor.cpu().numpy())  # non-contiguous or bool: one copy
        return jax.numpy.asarray(leaf)
    if arrays.is_torch(leaf):
        return leaf.detach().cpu().numpy()  # shares memory on CPU
    return np.asarray(leaf)


def _torch() -> Any:
    import torch

    return torch


def _to_numpy(leaf: Any, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An inner result as a numpy array of the shape and dtype announced to JAX."""
    if not isinstance(leaf, np.ndarray) and arrays.is_torch(leaf):
        tensor = leaf.detach().cpu()
        if tensor.dtype == _torch().bfloat16:  # numpy has no bfloat16 of torch's: through float32
            tensor = tensor.float()
        leaf = tensor.numpy()
    out = leaf if isinstance(leaf, np.ndarray) and leaf.dtype == dtype else np.asarray(leaf, dtype=dtype)
    if out.shape != shape:  # never broadcast: that would return numbers for a shape g did not give
        raise ValueError(_shape_changed(out.shape, shape))
    return out


def _shape_changed(got: tuple[int, ...], announced: tuple[int, ...]) -> str:
    return (
        f"activity.differentiate_with: g returned an array of shape {tuple(got)} where its first call gave "
        f"{tuple(announced)}; g's output shapes must follow from its input shapes and dtypes alone."
    )


# ------------------------------------------------------------------ the user-facing function


class _Mixed:
    """What `differentiate_with` returns: ``g`` callable from another framework's code."""

    def __init__(self, g: Callable[..., Any], backend: Any, has_aux: bool):
        self.g = g
        self.backend = backend
        self.has_aux = has_aux
        self.name = getattr(g, "__name__", None) or type(g).__name__
        self.inner = _framework_of(backend)
        self._signatures: OrderedDict[tuple[Any, ...], _Signature] = OrderedDict()
        self._lock = threading.Lock()
        self.__doc__ = getattr(g, "__doc__", None)
        self.__wrapped__ = g

    def __repr__(self) -> str:
        return f"activity.differentiate_with({self.name}, {self.backend!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        parsed = _parse(args, kwargs, self)
        outer = _outer_framework(parsed, self)
        if outer == "jax":
            from . import _mixing_jax

            return _mixing_jax.call(self, parsed)
        from . import _mixing_torch

        return _mixing_torch.call(self, parsed)

    def signature(self, parsed: "_Parsed", make: Callable[[], "_Signature"]) -> "_Signature":
        key = parsed.key()
        with self._lock:
            found = self._signatures.get(key)
            if found is not None:
                self._signatures.move_to_end(key)
                return found
        made = make()
        self._warn_of_stale_statics(parsed)
        with self._lock:
            self._signatures[key] = made
            while len(self._signatures) > MAX_SIGNATURES:
                self._signatures.popitem(last=False)
        return made

    def _warn_of_stale_statics(self, parsed: "_Parsed") -> None:
        """Warn, once per signature, of each non-array argument leaf whose later changes the
        inner operator, compiled once for it by AutoJAX, would not see (`prepare`'s warning):
        ``g``'s value would follow them, its derivatives not."""
        if _framework_of(self.backend) != "jax":
            return
        from .backends._jax import _stale_reason  # imports JAX: only where the inner backend is JAX

        for leaf in parsed.static:
            reason = _stale_reason(leaf)
            if reason is not None:
                warnings.warn(f"{self!r}: a non-array argument of g is {reason}", stacklevel=4)

    def noted(self, error: BaseException) -> BaseException:
        if not getattr(error, "_activity_mixing_noted", False):
            add_note(
                error,
                f"(raised inside activity.differentiate_with({self.name}, {self.backend!r}): g runs in "
                f"{self.inner} with derivatives from {type(self.backend).__name__})",
            )
            try:
                error._activity_mixing_noted = True  # type: ignore[attr-defined]
            except AttributeError:
                pass
        return error


class _Parsed:
    """The call's arguments split into leaves: differentiated, data, scratch, and static."""

    def __init__(self, entries: list[tuple[str | int, str, Any]]):
        self.entries = entries  # (position or keyword name, kind, value)
        self.specs: list[Any] = []
        self.roles: list[list[str]] = []  # per entry, per leaf: diff, data, cache, static
        self.diff: list[Any] = []
        self.data: list[Any] = []
        self.cache: list[Any] = []
        self.static: list[Any] = []
        for _, kind, value in entries:
            leaves, spec = flatten(value)
            self.specs.append(spec)
            roles = []
            for leaf in leaves:
                role = _role(kind, leaf)
                roles.append(role)
                getattr(self, role).append(leaf)
            self.roles.append(roles)
        # where each argument's leaves come from: (group, index) with groups diff, data, cache, static
        counters = dict.fromkeys(("diff", "data", "cache", "static"), 0)
        group_of = {"diff": 0, "data": 1, "cache": 2, "static": 3}
        self._places: list[tuple[str | int, Any, list[tuple[int, int]]]] = []
        for (name, _, _), spec, roles in zip(entries, self.specs, self.roles):
            places = []
            for role in roles:
                places.append((group_of[role], counters[role]))
                counters[role] += 1
            self._places.append((name, None if spec.num_nodes == 1 and len(roles) == 1 else spec, places))

    def key(self) -> tuple[Any, ...]:
        statics = tuple(_static_key(leaf) for leaf in self.static)
        return (
            tuple((name, kind) for name, kind, _ in self.entries),
            tuple(self.specs),
            tuple(tuple(roles) for roles in self.roles),
            tuple(_leaf_meta(leaf) for leaf in (*self.diff, *self.data, *self.cache)),
            statics,
        )

    def rebuild(self, diff: Sequence[Any], data: Sequence[Any], cache: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
        """g's positional and keyword arguments from new leaves (statics as given)."""
        groups = (diff, data, cache, self.static)
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        for name, spec, places in self._places:
            if spec is None:  # the argument is one leaf
                group, index = places[0]
                value = groups[group][index]
            else:
                value = unflatten(spec, [groups[group][index] for group, index in places])
            if isinstance(name, int):
                positional.append(value)
            else:
                keywords[name] = value
        return positional, keywords


def _role(kind: str, leaf: Any) -> str:
    if not arrays.is_array(leaf) or arrays.is_torch_module(leaf):
        return "static"
    if kind == "active":
        dtype_kind = arrays.dtype_kind(leaf)
        if dtype_kind == "c":  # as `Problem` refuses it: a complex leaf would get a zero derivative
            raise UnsupportedError(
                "activity.differentiate_with: an Active argument of g holds a complex array; complex "
                "differentiation is not supported. Split it into real and imaginary parts."
            )
        return "diff" if dtype_kind == "f" else "data"
    return "data" if kind == "constant" else "cache"


def _static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    return (type(leaf), leaf) if isinstance(leaf, (int, float, str, bool, type(None))) else ("id", id(leaf))


def _parse(args: tuple[Any, ...], kwargs: dict[str, Any], mixed: Any) -> _Parsed:
    entries: list[tuple[str | int, str, Any]] = []
    located: list[tuple[str | int, Any]] = [*enumerate(args), *kwargs.items()]
    for where, value in located:
        if isinstance(value, Annotation):
            if value.kind not in ("active", "constant", "cache"):
                raise TypeError(
                    f"{mixed!r}: argument {where!r} is a bare Annotation; annotate it Active(x), Constant(x) or Cache(x)."
                )
            if isinstance(value, Active) and value.where is not None:
                raise UnsupportedError(
                    f"{mixed!r}: argument {where!r} is Active(x, where=...), which differentiate_with does not "
                    f"take (it would differentiate every leaf). Pass the selected part as its own Active "
                    f"argument and the rest as Constant."
                )
            entries.append((where, value.kind, value.value))
        else:
            entries.append((where, "active", value))
    return _Parsed(entries)


def _outer_framework(parsed: _Parsed, mixed: _Mixed) -> str:
    found = set()
    for leaf in (*parsed.diff, *parsed.data, *parsed.cache):
        if arrays.is_jax(leaf) or _is_jax_tracer(leaf):
            found.add("jax")
        elif arrays.is_torch(leaf):
            found.add("torch")
    if len(found) == 1:
        return found.pop()
    if not found:
        raise TypeError(
            f"{mixed!r} was called without a JAX array or torch tensor among its arguments. It is called from "
            f"JAX code with JAX arrays, or from torch code with torch tensors; to run g on numpy arrays, "
            f"call g itself."
        )
    raise TypeError(
        f"{mixed!r} was called with both JAX arrays and torch tensors. Pass the arrays of the framework "
        f"that calls it (it converts them for g itself)."
    )


def _is_jax_tracer(leaf: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(leaf, jax.core.Tracer)


class _Signature:
    """What one argument signature needs: the level-one node and the output layout."""

    def __init__(self, mixed: _Mixed, parsed: _Parsed):
        self.mixed = mixed
        self.parsed = parsed
        self.out_spec: Any = None
        self.aux_spec: Any = None
        self.out_avals: tuple[Any, ...] = ()
        self.aux_avals: tuple[Any, ...] = ()
        self.out_float: tuple[bool, ...] = ()
        self._all_float = False
        self._one_array: type | None = None
        self.node: _Node | None = None

    def learn(self, outputs: Any) -> None:
        """Record the layout of ``g``'s (inner-framework) result."""
        out, aux = outputs if self.mixed.has_aux else (outputs, None)
        out_leaves, self.out_spec = flatten(out)
        aux_leaves, self.aux_spec = flatten(aux)
        for leaf in (*out_leaves, *aux_leaves):
            if not arrays.is_array(leaf) and not isinstance(leaf, (int, float, bool)):
                raise TypeError(
                    f"{self.mixed!r}: g returned a {type(leaf).__name__} leaf; g's output (and aux) must be "
                    f"arrays, numbers or pytrees of them, so they can cross to the caller's framework."
                )
        if any(arrays.is_array(leaf) and arrays.dtype_kind(leaf) == "c" for leaf in out_leaves):
            raise UnsupportedError(
                f"{self.mixed!r}: g returned a complex array; complex differentiation is not supported "
                f"(its derivative would be taken as zero). Return real and imaginary parts as separate arrays."
            )
        self.out_avals = tuple(_aval(leaf) for leaf in out_leaves)
        self.aux_avals = tuple(_aval(leaf) for leaf in aux_leaves)
        self.out_float = tuple(arrays.is_floating_dtype(dtype) for _, dtype in self.out_avals)
        self._all_float = all(self.out_float)
        # g returning one array (no pytree, no aux): `split` recognises it by its type alone
        one = not self.mixed.has_aux and self.out_spec.num_nodes == 1 and len(out_leaves) == 1
        self._one_array = type(out) if one and arrays.is_array(out) else None
        float_avals = tuple(a for a, f in zip(self.out_avals, self.out_float) if f)
        self.node = _Node(self._differentiable, float_avals, 0, self.mixed, "g")

    def run(self, diff: Sequence[Any], data: Sequence[Any], cache: Sequence[Any]) -> Any:
        """``g`` on inner-framework leaves, its exceptions noted."""
        positional, keywords = self.parsed.rebuild(diff, data, cache)
        try:
            return self.mixed.g(*positional, **keywords)
        except Exception as error:
            raise self.mixed.noted(error)

    def run_value(self, diff: Sequence[Any], data: Sequence[Any], cache: Sequence[Any]) -> Any:
        """``g`` for its value only: torch records no graph (the derivatives run g again)."""
        if self.mixed.inner != "torch":
            return self.run(diff, data, cache)
        import torch

        with torch.no_grad():
            return self.run(diff, data, cache)

    def split(self, outputs: Any) -> tuple[list[Any], list[Any]]:
        if type(outputs) is self._one_array:
            return [outputs], []
        if not self.mixed.has_aux:
            out_leaves, spec = flatten(outputs)
            if spec == self.out_spec:
                return out_leaves, []
            aux_leaves: list[Any] = []
            aux_spec = self.aux_spec
        else:
            out, aux = outputs
            out_leaves, spec = flatten(out)
            aux_leaves, aux_spec = flatten(aux)
        if spec != self.out_spec or aux_spec != self.aux_spec:
            raise ValueError(
                f"{self.mixed!r}: g's output changed structure between calls with the same argument "
                f"signature ({structure_difference(self.out_spec, spec) if spec != self.out_spec else 'of its aux: ' + structure_difference(self.aux_spec, aux_spec)}); "
                f"g must return the same structure."
            )
        return out_leaves, aux_leaves

    def _differentiable(self, diff: tuple[Any, ...], data: tuple[Any, ...], cache: tuple[Any, ...]) -> tuple[Any, ...]:
        out_leaves, _ = self.split(self.run(diff, data, cache))
        if self._all_float:
            return tuple(out_leaves)
        return tuple(leaf for leaf, floating in zip(out_leaves, self.out_float) if floating)


def _aval(leaf: Any) -> tuple[tuple[int, ...], str]:
    if arrays.is_torch(leaf):
        return tuple(leaf.shape), str(leaf.dtype).removeprefix("torch.")
    array = np.asarray(leaf)
    return tuple(array.shape), str(array.dtype)


def differentiate_with(g: Callable[..., Any], backend: Any, *, has_aux: bool = False) -> Callable[..., Any]:
    """``g`` made callable from code another framework differentiates, its derivatives from ``backend``.

    ``h = differentiate_with(g, backend)`` takes and returns the caller's arrays
    (JAX arrays inside ``jax.grad``/``jit``/``vmap``/``jvp``; torch tensors under
    ``loss.backward()``/``torch.autograd.grad``), converts them for ``g``'s own
    framework (by DLPack, without a copy where both sides allow), runs ``g``, and
    supplies derivatives through ``backend``'s `pullback` and `pushforward`,
    prepared once per signature. Arguments may be annotated like an operator's:
    ``h(Active(x), Constant(c))`` passes ``c`` as data (never differentiated);
    plain values are Active; a `Cache` is scratch space for ``g``. With
    ``has_aux=True``, ``g`` returns ``(output, aux)`` and ``h`` does too; ``aux`` is
    not differentiated. First and second derivatives are supported (see the
    "Mixing frameworks" page for which transforms and their limits).

    Args:
        g: the function, written in its own framework.
        backend: the activity backend that differentiates ``g`` (``AutoTorch()``,
            ``AutoJAX()``, ``AutoFiniteDifferences()``, ...).
        has_aux: ``g`` returns ``(output, aux)``; only ``output`` is differentiated.

    Returns:
        ``h``, called like ``g`` with the caller's arrays, and differentiable by the
        caller's framework.

    Raises:
        TypeError: ``backend`` is not an activity backend, or ``g`` is not callable.
        UnsupportedError: (from a call of ``h``) a third or higher derivative, or a transform
            the page lists as unsupported.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import activity as ad
    >>> h = ad.differentiate_with(lambda x: np.sum(np.sin(x)), ad.AutoFiniteDifferences())
    >>> np.round(jax.grad(h)(jnp.array([0.0, np.pi])), 6)
    Array([ 1., -1.], dtype=float32)
    """
    from .backends import Backend

    if not isinstance(backend, Backend):
        raise TypeError(
            f"activity.differentiate_with(g, backend): backend must be an activity backend "
            f"(AutoTorch(), AutoJAX(), AutoFiniteDifferences(), ...), got {backend!r}."
        )
    if not callable(g):
        raise TypeError(f"activity.differentiate_with(g, backend): g must be callable, got {type(g).__name__}.")
    return _Mixed(g, backend, has_aux)
