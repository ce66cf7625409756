"""Snapshots that prove a call changed nothing: arrays bitwise, modules whole, global RNGs."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np

from .. import _arrays as arrays
from .._tree import flatten, leaf_paths


def _copy(leaf: Any) -> Any:
    if arrays.is_torch(leaf):
        return ("tensor", leaf.detach().clone(), leaf.requires_grad, None if leaf.grad is None else leaf.grad.clone())
    if arrays.is_torch_module(leaf):
        return (
            "module",
            {k: v.detach().clone() for k, v in leaf.state_dict(keep_vars=True).items()},
            [(p.requires_grad, None if p.grad is None else p.grad.clone()) for p in leaf.parameters()],
            [m.training for m in leaf.modules()],
            [tuple(len(getattr(m, name, ())) for name in _HOOKS) for m in leaf.modules()],
        )
    state = _nnx_state(leaf)
    if state is not None:
        return ("nnx", state[1], [_copy(x) for x in state[0]])
    if arrays.is_array(leaf):
        key = _key_data(leaf)
        if key is not None:
            return ("key", str(leaf.dtype), key)  # the implementation too: other bits of another kind differ
        return ("array", np.array(leaf, copy=True))
    return ("other", leaf)


def _nnx_state(leaf: Any) -> tuple[list[Any], Any] | None:
    """The leaves and structure of an NNX graph object's state where the object is a leaf here:
    an ``nnx.Object`` is no pytree, so its variables were never looked at and a change to them
    (a BatchStat written, an RNG count advanced) went unseen. None for anything else (a pytree
    NNX object is flattened into its variables before it gets here)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    from .._conventions import _nnx_object_type

    if not isinstance(leaf, _nnx_object_type(nnx)):
        return None
    leaves, structure = sys.modules["jax"].tree_util.tree_flatten(nnx.state(leaf))
    return leaves, structure


def _key_data(leaf: Any) -> Any:
    """A JAX typed PRNG key's raw data (``jax.random.key``: a dropout key, a diffrax
    Brownian tree's), or None for any other array: numpy cannot hold a key
    (``np.array(key)`` raises), so the snapshot of a scenario that passes one crashed
    before its call."""
    jax = sys.modules.get("jax")
    if jax is None or arrays.framework(leaf) != "jax" or not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return None
    return np.array(jax.random.key_data(leaf), copy=True)


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _equal(a: Any, b: Any) -> bool:
    """``torch.equal``, which has no kernel for sparse layouts: those compare in dense form."""
    import torch

    if a.layout != b.layout:
        return False
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a, b)


def _same(before: Any, leaf: Any) -> bool:
    return _same_copies(before, _copy(leaf))


def _same_copies(before: Any, now: Any) -> bool:
    kind = before[0]
    if kind != now[0]:
        return False
    if kind == "array":
        return before[1].dtype == now[1].dtype and np.array_equal(before[1], now[1], equal_nan=True)
    if kind == "nnx":  # the same structure holds as many variables' values
        return before[1] == now[1] and all(map(_same_copies, before[2], now[2]))
    if kind == "key":
        return before[1] == now[1] and np.array_equal(before[2], now[2])
    if kind == "tensor":
        same_grad = (before[3] is None and now[3] is None) or (
            before[3] is not None and now[3] is not None and _equal(before[3], now[3])
        )
        return _equal(before[1], now[1]) and before[2] == now[2] and same_grad
    if kind == "module":
        if before[1].keys() != now[1].keys() or before[3] != now[3] or before[4] != now[4]:  # [4]: hooks added or removed
            return False
        if not all(_equal(before[1][k], now[1][k]) for k in before[1]):
            return False
        return [(r, g is None) for r, g in before[2]] == [(r, g is None) for r, g in now[2]]
    return True


def _rng_states() -> dict[str, Any]:
    kind, key, position, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {"random": random.getstate(), "numpy": (kind, key.copy(), position, has_gauss, gauss)}  # type: ignore[attr-defined]
    if "torch" in sys.modules:
        states["torch"] = sys.modules["torch"].random.get_rng_state().clone()
    return states


class Snapshot:
    """The state of some arguments and of the global RNGs, to compare after a call."""

    def __init__(self, args: tuple[Any, ...]):
        self.args = args
        self.leaves = [[_copy(leaf) for leaf in flatten(a.value)[0]] for a in args]
        self.rng = _rng_states()

    def changes(self) -> list[str]:
        """What differs now: argument paths (Active and Constant) and RNG names."""
        found = []
        for position, (arg, before) in enumerate(zip(self.args, self.leaves)):
            if arg.kind == "cache":  # its content after a call is unspecified
                continue
            leaves = flatten(arg.value)[0]
            for index, (old, leaf) in enumerate(zip(before, leaves)):
                if not _same(old, leaf):
                    path = leaf_paths(arg.value)[index] or ""
                    found.append(f"argument {position} ({arg.kind}){path} was modified")
        now = _rng_states()
        for name, state in self.rng.items():
            if name == "torch":
                same = bool(sys.modules["torch"].equal(state, now[name]))
            elif name == "numpy":
                same = all(np.array_equal(a, b) for a, b in zip(state, now[name]))
            else:
                same = state == now[name]
            if not same:
                found.append(f"the global {name} RNG state changed")
        return found
