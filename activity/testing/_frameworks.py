"""Arrays and math in numpy, JAX or torch, so catalogues are written once."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._imports import optional

FRAMEWORKS = ("numpy", "jax", "torch")


class Framework:
    """``xp`` (the array module) and conversions from numpy for one framework."""

    def __init__(self, name: str):
        if name not in FRAMEWORKS:
            raise ValueError(f"unknown framework {name!r}; choose one of {FRAMEWORKS}.")
        self.name = name
        self.xp: Any
        if name == "jax":
            self.xp = optional("jax.numpy", f"activity.testing's {name} scenarios")
        elif name == "torch":
            self.xp = optional("torch", f"activity.testing's {name} scenarios")
        else:
            self.xp = np

    def array(self, values: Any) -> Any:
        """Float array in the framework's default float dtype (numpy: float64; JAX and torch: float32)."""
        values = np.asarray(values, dtype=np.float64)
        if self.name == "jax":
            return self.xp.asarray(values, dtype=self.xp.float32)
        if self.name == "torch":
            return self.xp.tensor(values, dtype=self.xp.float32)
        return values

    def stack(self, items: list[Any]) -> Any:
        return self.xp.stack(items)

    def concat(self, items: list[Any]) -> Any:
        return self.xp.cat(items) if self.name == "torch" else self.xp.concatenate(items)


def random(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Seeded normal samples: every catalogue value comes from an explicit seed, never a global RNG."""
    return scale * np.random.default_rng(seed).standard_normal(shape)
