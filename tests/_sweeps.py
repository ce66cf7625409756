"""Helpers the third-party model sweeps share (`test_wild_sweep_*.py`): seeded data and
leaf-by-leaf comparisons against the raw framework calls."""

from __future__ import annotations

import numpy as np

CLOSE = dict(rtol=2e-5, atol=2e-6)
SECOND_ORDER = dict(rtol=1e-6, atol=1e-9)  # float64 models against torch's own second derivatives


def built(model_type, config_type, train=False, **config):
    """A Hugging Face model of class ``model_type`` from a tiny ``config_type(**config)``, in float64,
    initialised from seed 0 without moving the global RNG."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_type(config_type(**config)).double()
    return model.train(train)


def generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0):
    """A float64 torch tensor of seeded normal draws."""
    import torch

    return torch.randn(*shape, generator=generator(seed), dtype=torch.float64)


def trainable(model) -> list:
    """``(name, parameter)`` of the parameters that require grad, as ``named_parameters()`` orders them."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def raw_gradient_of(loss, twin, *args) -> dict:
    """``torch.autograd.grad`` of ``loss(twin, *args)`` on ``twin`` itself (a copy of the user's
    model the caller made), keyed like ``named_parameters()``."""
    import torch

    names, params = zip(*trainable(twin))
    return dict(zip(names, torch.autograd.grad(loss(twin, *args), params)))


def raw_gradient(loss, model, *args) -> dict:
    """`raw_gradient_of` on a deep copy of ``model``: the user's model never runs in the raw call."""
    import copy

    return raw_gradient_of(loss, copy.deepcopy(model), *args)


def assert_close_dicts(got, want, **tolerances) -> None:
    """The same keys in the same order, then ``torch.testing.assert_close`` key by key."""
    import torch

    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key, **tolerances)


def untouched(*annotated):
    """A check, to call after the calls, that nothing of ``annotated`` (nor a global RNG) changed."""
    from activity.testing._intact import Snapshot

    snapshot = Snapshot(annotated)
    return lambda: snapshot.changes() == []


def squared(m, x):
    return m(x).pow(2).sum()


def normal(seed: int, *shape: int):
    """A JAX array of seeded normal draws."""
    import jax

    return jax.random.normal(jax.random.key(seed), shape)


def assert_trees(actual, expected, **tolerance):
    """Same structure (``None`` positions and container types included), then leaf by leaf."""
    import jax

    tolerance = tolerance or CLOSE
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected), (
        f"{jax.tree_util.tree_structure(actual)}\n!=\n{jax.tree_util.tree_structure(expected)}"
    )
    compared = 0
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(path), **tolerance)
        compared += 1
    assert compared, "no leaf compared"


def nnx_snapshot(module):
    """A copy of an NNX module's state as numpy arrays (random keys as their data), to compare after."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def copied(a):
        return np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)

    return jax.tree_util.tree_map(copied, nnx.state(module))


def assert_same_state(before, after):
    """Two `nnx_snapshot`s are equal: the same structure, every leaf exactly."""
    import jax

    assert jax.tree_util.tree_structure(before) == jax.tree_util.tree_structure(after)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(a, b)


def tangent_for(model, seed=40) -> dict:
    """A seeded tangent for ``model``'s trainable parameters, keyed like ``named_parameters()``."""
    return {n: randn(*p.shape, seed=seed + i) for i, (n, p) in enumerate(trainable(model))}


def double_backward_hvp(loss, model, tangent, *args) -> dict:
    """The Hessian-vector product by ``torch.autograd.grad`` twice, on a deep copy of ``model``."""
    import copy

    import torch

    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    grads = torch.autograd.grad(loss(twin, *args), params, create_graph=True)
    return dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names])))


def reverse_mode_pushforward(out, model, tangent, *args):
    """The pushforward from the rows of the reverse-mode Jacobian (``torch.autograd.grad`` per
    output element) on a deep copy of ``model``, for code ``torch.func`` cannot run."""
    import copy

    import torch

    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    y = out(twin, *args)
    rows = [torch.autograd.grad(y.reshape(-1)[k], params, retain_graph=True, materialize_grads=True) for k in range(y.numel())]
    return torch.stack([sum((g * tangent[n]).sum() for g, n in zip(row, names)) for row in rows]).reshape(y.shape)
