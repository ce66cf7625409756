"""Round four of the AutoTorch sweep on third-party modules: torch utilities users combine with
their models (parametrization caching, pruning, fake quantization) and Hugging Face models the
rest of the suite does not build (mixture-of-experts routing, soft-capped attention).

Every expected value is independent of the library: a hand-written ``torch.autograd.grad`` on a
copy of the model built the same way. Each call is also checked to leave the user's arguments
(parameters, buffers, ``.grad``, flags) and the global RNGs as they were.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import activity as ad
from activity import Active, Constant
from activity.testing._intact import Snapshot

FD = ad.AutoFiniteDifferences()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed), dtype=torch.float64)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def raw_gradient(loss, twin, *args):
    """``torch.autograd.grad`` on ``twin`` (a copy of the user's model), keyed like ``named_parameters()``."""
    names, params = zip(*trainable(twin))
    return dict(zip(names, torch.autograd.grad(loss(twin, *args), params)))


def assert_close_dicts(got, want, **tolerances):
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key, **tolerances)


def untouched(*annotated):
    """A check, to call after the calls, that nothing of ``annotated`` (nor a global RNG) changed."""
    snapshot = Snapshot(annotated)
    return lambda: snapshot.changes() == []


def squared(m, x):
    return m(x).pow(2).sum()


# ---------------------------------------------------------------- parametrizations


class Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def parametrized_mlp() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    parametrize.register_parametrization(model[0], "weight", Doubled())  # a chain of two
    parametrize.register_parametrization(model[2], "bias", Doubled())
    return model


@pytest.mark.parametrize("backend", [None, FD], ids=["AutoTorch", "finite differences"])
def test_inside_a_parametrize_cached_block_f_computes_its_own_parametrized_weights(backend):
    """torch caches a parametrized weight under the id of the module it was registered on, the
    same key for the user's module and the view f runs on. After the user's own forward in the
    block, f read the user's cached weight (not made from the tape's leaves): the gradient of
    every parametrized tensor was exactly zero, with AutoTorch and the finite differences alike,
    and each call left a weight computed from its tape in the user's cache for the next one."""
    model, x0, x1 = parametrized_mlp(), randn(3, 4, seed=1), randn(3, 4, seed=2)

    def loss(m, x):
        return m(x).pow(2).sum() + m[0].weight.sum() * m[2].bias.sum()

    # (outside the block: torch's cache keys by id(), which a new twin may reuse from a dead one)
    wants = [raw_gradient(loss, parametrized_mlp(), x) for x in (x0, x1, x1)]
    intact = untouched(Active(model), Constant(x0))
    with parametrize.cached():
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x0), backend=backend)
        for x, want in zip((x0, x1, x1), wants):
            model(x)  # the user's own forward fills the cache
            users_cache = dict(parametrize._cache)
            tolerances = {} if backend is None else dict(rtol=1e-6, atol=1e-8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the reference's precision notes
                assert_close_dicts(ad.gradient(loss, Active(model), Constant(x), backend=backend), want, **tolerances)
                assert_close_dicts(prepared(model, x), want, **tolerances)
            assert parametrize._cache == users_cache  # the same tensors: none from f's runs
    assert intact()


def test_parametrize_cached_inside_f_and_second_order():
    model, x = parametrized_mlp(), randn(3, 4, seed=1)

    def loss(m, x):
        with parametrize.cached():
            return m(x).pow(2).sum() + m[0].weight.sum() * m(x).sum()

    tangent = {n: randn(*p.shape, seed=7) for n, p in trainable(model)}
    twin = parametrized_mlp()
    names, params = zip(*trainable(twin))
    first = torch.autograd.grad(loss(twin, x), params, create_graph=True)
    want_hvp = dict(zip(names, torch.autograd.grad(first, params, [tangent[n] for n in names])))
    want = raw_gradient(loss, parametrized_mlp(), x)
    intact = untouched(Active(model), Constant(x))
    with parametrize.cached():
        model(x)
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), want)
        for mode in ("reverse-over-reverse", "forward-over-reverse"):
            got = ad.hvp(loss, Active(model), Constant(x), tangent=tangent, backend=ad.AutoTorch(hvp_mode=mode))
            assert_close_dicts(got, want_hvp)
    assert intact()
