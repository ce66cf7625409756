"""`differentiate_with`: a torch MLP inside a jitted JAX gradient, against hand-written bridges.

The loss is JAX code, ``sum(model(x) ** 2)``, whose ``model`` is a torch
``nn.Sequential`` (the benchmark's MLP). Two raw versions, both written out here as a
user would write them: ``jax.pure_callback`` + ``jax.custom_vjp`` with DLPack crossings
and ``torch.autograd.grad`` in the backward pass (the hand-written bridge), and the
torch2jax style (numpy crossings, ``torch.func.vjp`` in the backward pass). Ours is
``ad.differentiate_with(model, ad.AutoTorch())``. All three run under one ``jax.jit``
of ``jax.grad`` over the input ``x``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import activity as ad

from ._case import Case
from ._cases_jax import blocked
from ._cases_torch import mlp

MIXING = "mixing"
TARGET = 1.10
BATCH = 32


def _hand_written(model: torch.nn.Module) -> Callable[[jax.Array], jax.Array]:
    def run(x: jax.Array) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_dlpack(x)).numpy()

    def pull(x: jax.Array, ct: jax.Array) -> np.ndarray:
        xt = torch.from_dlpack(x).detach().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(model(xt), xt, torch.from_dlpack(ct))
        return grad.numpy()

    @jax.custom_vjp
    def bridge(x: jax.Array) -> jax.Array:
        return jax.pure_callback(run, jax.ShapeDtypeStruct((x.shape[0], 1), x.dtype), x)

    def forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return bridge(x), x

    def backward(x: jax.Array, ct: jax.Array) -> tuple[jax.Array]:
        return (jax.pure_callback(pull, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ct),)

    bridge.defvjp(forward, backward)
    return bridge


def _torch2jax_style(model: torch.nn.Module) -> Callable[[jax.Array], jax.Array]:
    params = {name: p.detach() for name, p in model.named_parameters()}

    def apply(x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,))

    def run(x: Any) -> np.ndarray:
        return apply(torch.from_numpy(np.array(x))).detach().numpy()

    def pull(x: Any, ct: Any) -> np.ndarray:
        _, vjp = torch.func.vjp(apply, torch.from_numpy(np.array(x)))
        return vjp(torch.from_numpy(np.array(ct)))[0].numpy()

    @jax.custom_vjp
    def bridge(x: jax.Array) -> jax.Array:
        return jax.pure_callback(run, jax.ShapeDtypeStruct((x.shape[0], 1), x.dtype), x)

    def forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return bridge(x), x

    def backward(x: jax.Array, ct: jax.Array) -> tuple[jax.Array]:
        return (jax.pure_callback(pull, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ct),)

    bridge.defvjp(forward, backward)
    return bridge


def _gradient_of(bridge: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(jax.grad(lambda x: jnp.sum(bridge(x) ** 2)))


def cases(widths: tuple[int, ...]) -> list[Case]:
    """For each width: ours against the hand-written bridge and against the torch2jax style."""
    made = []
    for width in widths:
        model = mlp(width)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((BATCH, width)), dtype=jnp.float32)
        ours = _gradient_of(ad.differentiate_with(model, ad.AutoTorch()))
        for label, raw in (("hand-written", _hand_written(model)), ("torch2jax-style", _torch2jax_style(model))):
            raw_gradient = _gradient_of(raw)
            made.append(Case(
                framework="jax+torch", operator="gradient", family=MIXING,
                model=f"torch MLP in JAX vs {label}", size=sum(p.numel() for p in model.parameters()),
                size_label=f"w={width}",
                raw=blocked(raw_gradient, x),
                ours=blocked(ours, x),
                target=TARGET,
            ))
    return made


SECTION = (
    "## Mixing frameworks: a torch model inside a JAX gradient\n\n"
    "`jax.jit(jax.grad(lambda x: jnp.sum(h(x) ** 2)))` with `h = ad.differentiate_with(model, "
    "ad.AutoTorch())` and `model` the torch MLP above (batch 32), against the same JAX gradient "
    "over a hand-written `jax.pure_callback` + `jax.custom_vjp` bridge (DLPack crossings, "
    "`torch.autograd.grad` in the backward pass) and over a torch2jax-style bridge (numpy "
    "crossings, `torch.func.vjp`). Target: ratio <= 1.10. See [Mixing frameworks](mixing-frameworks.md)."
)
