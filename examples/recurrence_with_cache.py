"""A recurrence whose state history lives in a Cache: f writes into it in place.

h[t+1] = tanh(w * h[t] + x[t]). The buffer's initial content does not matter; the
library hands f a buffer it may overwrite, and derivatives flow through what f
writes and reads back. Checked against float64 finite differences.
"""

import torch

import activity as ad
from activity import Active, Cache, Constant


def final_state_loss(w, xs, history):
    history[0] = 0.0
    for t in range(xs.shape[0]):
        # in-place write into the Cache; read the previous state back from the buffer
        history[t + 1] = torch.tanh(w * history[t].clone() + xs[t])
    return history[-1].pow(2).sum()


T = 20
xs = torch.linspace(-1.0, 1.0, T * 3).reshape(T, 3)
w = torch.tensor([0.5, -0.3, 0.9])
buffer = torch.empty(T + 1, 3)  # scratch space, reused across calls

args = (Active(w), Constant(xs), Cache(buffer))
g = ad.gradient(final_state_loss, *args)
reference = ad.gradient(final_state_loss, *args, backend=ad.AutoFiniteDifferences())
print("d loss / d w (AutoTorch)             :", g)
print("d loss / d w (AutoFiniteDifferences):", reference)
print(f"max difference: {(g - reference).abs().max().item():.1e}")

step = ad.prepare(ad.gradient, final_state_loss, *args)
for scale in (0.5, 1.0, 2.0):
    print(f"prepared, xs * {scale}: {step(w, xs * scale, buffer)}")
