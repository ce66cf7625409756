"""Helpers the third-party model sweeps share (`test_wild_sweep_*.py`): seeded data and
leaf-by-leaf comparisons against the raw framework calls."""

from __future__ import annotations

import numpy as np

CLOSE = dict(rtol=2e-5, atol=2e-6)


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
