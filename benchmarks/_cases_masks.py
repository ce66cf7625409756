"""`Active(x, where=...)` cases, on torch and JAX, each a pair of prepared `activity` calls.

- "masked gradient": the gradient of the head of an MLP through a mask, against
  the same head passed as its own Active argument (the body a Constant): the mask
  must cost nothing (target ratio 1.02).
- "LoRA step": the gradient of the low-rank adapters of a frozen base, through a
  mask, against the full gradient of the same model: the frozen base is never
  differentiated, so the masked step must be faster (target ratio 1.0).

The "raw" side of these cases is itself an `activity` call (the thing to compare
with); its result is rearranged like ours only in ``check()``.
"""

from __future__ import annotations

from typing import Any

import activity as ad
from activity import Active, Constant

from ._case import PREPARED, Case

BATCH = 32
RANK = 4
LORA_LAYERS = 3
MASK_TARGET = 1.02  # a masked gradient costs what the same leaves as their own argument cost
LORA_TARGET = 1.0  # a masked LoRA step is faster than the full gradient


# ------------------------------------------------------------------ torch


def _torch_cases(widths: tuple[int, ...], lora_widths: tuple[int, ...]) -> list[Case]:
    import torch
    from torch import nn

    def mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    def head_loss(head: nn.Module, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return head(body(x)).pow(2).mean()

    cases = []
    for width in widths:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        body, head = model[:4], model[4]
        x = torch.randn(BATCH, width)
        masked = ad.prepare(ad.gradient, mse, Active(model, where=lambda path, p: path.startswith("4.")), Constant(x))
        own = ad.prepare(ad.gradient, head_loss, Active(head), Constant(body), Constant(x))
        cases.append(Case(
            "torch", "masked gradient", PREPARED, "MLP head vs head as own argument",
            sum(p.numel() for p in head.parameters()), f"width {width}",
            raw=lambda own=own, head=head, body=body, x=x: own(head, body, x),
            ours=lambda masked=masked, model=model, x=x: masked(model, x),
            raw_as_ours=lambda grads: {"4." + name: g for name, g in grads.items()},
            target=MASK_TARGET,
        ))

    class LoRALinear(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.base = nn.Linear(width, width)
            self.lora_a = nn.Parameter(torch.randn(RANK, width) * width**-0.5)
            self.lora_b = nn.Parameter(torch.zeros(width, RANK))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T

    for width in lora_widths:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(LORA_LAYERS):
            layers += [LoRALinear(width), nn.Tanh()]
        model = nn.Sequential(*layers)
        x = torch.randn(BATCH, width)
        adapters = lambda path, p: ".lora_" in path  # noqa: E731
        masked = ad.prepare(ad.gradient, mse, Active(model, where=adapters), Constant(x))
        full = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
        names = [name for name, p in model.named_parameters() if ".lora_" in name]
        cases.append(Case(
            "torch", "LoRA step", PREPARED, f"{LORA_LAYERS} LoRA layers, rank {RANK}, vs full gradient",
            sum(p.numel() for p in model.parameters()), f"width {width}",
            raw=lambda full=full, model=model, x=x: full(model, x),
            ours=lambda masked=masked, model=model, x=x: masked(model, x),
            raw_as_ours=lambda grads, names=names: {name: grads[name] for name in names},
            target=LORA_TARGET,
        ))
    return cases


# ------------------------------------------------------------------ JAX


def _jax_cases(widths: tuple[int, ...], lora_widths: tuple[int, ...]) -> list[Case]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ._cases_jax import blocked

    rng = np.random.default_rng(0)

    def normal(*shape: int, scale: float = 1.0) -> Any:
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype=jnp.float32)

    def mlp_loss(params: dict, x: Any) -> Any:
        h = x
        for w, b in params["body"]:
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h @ params["head"]["w"] + params["head"]["b"]) ** 2)

    def head_loss(head: dict, body: list, x: Any) -> Any:
        return mlp_loss({"body": body, "head": head}, x)

    cases = []
    for width in widths:
        s = width**-0.5
        params = {
            "body": [(normal(width, width, scale=s), jnp.zeros(width)) for _ in range(2)],
            "head": {"w": normal(width, 1, scale=s), "b": jnp.zeros(1)},
        }
        x = normal(BATCH, width)
        masked = ad.prepare(ad.gradient, mlp_loss, Active(params, where={"body": False, "head": True}), Constant(x))
        own = ad.prepare(ad.gradient, head_loss, Active(params["head"]), Constant(params["body"]), Constant(x))
        cases.append(Case(
            "jax", "masked gradient", PREPARED, "MLP head vs head as own argument", width + 1, f"width {width}",
            raw=blocked(own, params["head"], params["body"], x),
            ours=blocked(masked, params, x),
            raw_as_ours=lambda head: {"body": [(None, None), (None, None)], "head": head},
            target=MASK_TARGET,
        ))

    def lora_loss(params: dict, x: Any) -> Any:
        h = x
        for (w, b), (a, u) in zip(params["base"], params["lora"]):
            h = jnp.tanh(h @ w + b + (h @ a) @ u)
        return jnp.mean(h**2)

    for width in lora_widths:
        s = width**-0.5
        params = {
            "base": [(normal(width, width, scale=s), jnp.zeros(width)) for _ in range(LORA_LAYERS)],
            "lora": [(normal(width, RANK, scale=s), jnp.zeros((RANK, width))) for _ in range(LORA_LAYERS)],
        }
        x = normal(BATCH, width)
        masked = ad.prepare(ad.gradient, lora_loss, Active(params, where={"base": False, "lora": True}), Constant(x))
        full = ad.prepare(ad.gradient, lora_loss, Active(params), Constant(x))
        cases.append(Case(
            "jax", "LoRA step", PREPARED, f"{LORA_LAYERS} LoRA layers, rank {RANK}, vs full gradient",
            sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params)), f"width {width}",
            raw=blocked(full, params, x),
            ours=blocked(masked, params, x),
            raw_as_ours=lambda grads: {"base": [(None, None)] * LORA_LAYERS, "lora": grads["lora"]},
            target=LORA_TARGET,
        ))
    return cases


def mask_cases(frameworks: tuple[str, ...], widths: tuple[int, ...]) -> list[Case]:
    """The masked-gradient rows at every MLP width, the LoRA rows at the two largest."""
    builders = {"torch": _torch_cases, "jax": _jax_cases}
    cases = []
    for framework in frameworks:
        cases += builders[framework](widths, widths[-2:])
    return cases
