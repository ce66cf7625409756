"""A PyTorch training loop: gradient(loss, Active(model), Constant(batch)) and plain SGD.

The gradient comes back as a dict keyed like model.named_parameters(); the
update is ordinary torch code. The model's .grad fields are never touched.
"""

import torch

import activity as ad
from activity import Active, Constant

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
params = dict(model.named_parameters())


def loss(model, batch):
    x, y = batch
    return (model(x).squeeze(-1) - y).pow(2).mean()


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 2, generator=g)
    return x, torch.sin(x[:, 0]) * x[:, 1]


learning_rate = 0.1
test_batch = make_batch(10_000)
for step in range(101):
    grads = ad.gradient(loss, Active(model), Constant(make_batch(step)))
    with torch.no_grad():
        for name, g in grads.items():
            params[name] -= learning_rate * g
        if step % 25 == 0:
            print(f"step {step:3d}  held-out loss {loss(model, test_batch).item():.4f}")

print("gradient keys:", sorted(grads))
print("model .grad untouched:", all(p.grad is None for p in model.parameters()))
