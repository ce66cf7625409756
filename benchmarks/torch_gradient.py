"""Prepared `gradient(loss, Active(model), Constant(x))` against hand-written `torch.autograd.grad`.

Both run alternately in one process, on the same model and data; the table
gives medians and the ratio activity / raw. Run: `python -m benchmarks.torch_gradient`.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import activity as ad
from activity import Active, Constant


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def measure(width: int, batch: int = 32, rounds: int = 30, inner: int = 20) -> dict[str, float]:
    torch.manual_seed(0)
    model, x = mlp(width), torch.randn(batch, width)
    params = [p for p in model.parameters() if p.requires_grad]
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))

    def raw() -> object:
        return torch.autograd.grad(loss(model, x), params)

    def ours() -> object:
        return prepared(model, x)

    for fn in (raw, ours):  # warm up
        for _ in range(inner):
            fn()
    times: dict[str, list[float]] = {"raw": [], "activity": []}
    for _ in range(rounds):
        for name, fn in (("raw", raw), ("activity", ours)):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    raw_median, ours_median = statistics.median(times["raw"]), statistics.median(times["activity"])
    return {"width": width, "raw_us": raw_median * 1e6, "activity_us": ours_median * 1e6, "ratio": ours_median / raw_median}


def main() -> None:
    torch.set_num_threads(1)
    print("| MLP width | torch.autograd.grad (us) | prepared activity.gradient (us) | ratio |")
    print("| --- | --- | --- | --- |")
    for width in (8, 256, 1024):
        r = measure(width, rounds=15 if width == 1024 else 30)
        print(f"| {r['width']} | {r['raw_us']:.1f} | {r['activity_us']:.1f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
