"""Fine-tune part of a model with Active(model, where=...): the rest stays frozen.

1. PyTorch: a pretrained body with a new classification head; only the head's
   parameters are differentiated (`where=lambda path, p: path.startswith("head.")`),
   the model's own requires_grad flags are never touched.
2. PyTorch: LoRA-style adapters on a frozen base layer; only the adapters move.
3. JAX: the same with a parameter dict and a pytree of bools as the mask.

Each gradient is checked against the hand-partitioned call of the raw framework.
"""

import jax
import jax.numpy as jnp
import torch

import activity as ad
from activity import Active, Constant

# ---------------------------------------------------------------- 1. torch: only the head
torch.manual_seed(0)
model = torch.nn.ModuleDict({
    "body": torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh()),
    "head": torch.nn.Linear(16, 3),
})


def loss(model, x, labels):
    logits = model["head"](model["body"](x))
    return torch.nn.functional.cross_entropy(logits, labels)


x, labels = torch.randn(32, 4), torch.randint(0, 3, (32,))
body_before = [p.detach().clone() for p in model["body"].parameters()]
head_only = lambda path, p: path.startswith("head.")  # noqa: E731
step = ad.prepare(ad.value_and_gradient, loss, Active(model, where=head_only), Constant(x), Constant(labels))
for iteration in range(50):
    value, grads = step(model, x, labels)
    with torch.no_grad():
        for name, g in grads.items():
            model.get_parameter(name).sub_(0.5 * g)
    if iteration % 10 == 0:
        print(f"head fine-tuning, step {iteration:2d}: loss {value.item():.4f}")
print("differentiated:", sorted(grads))
reference = torch.autograd.grad(loss(model, x, labels), [model["head"].weight, model["head"].bias])
_, grads = step(model, x, labels)
assert torch.allclose(grads["head.weight"], reference[0], atol=1e-6)
assert all(torch.equal(a, b) for a, b in zip(body_before, model["body"].parameters())), "the body moved"
assert all(p.requires_grad and p.grad is None for p in model.parameters())
print("body unchanged, requires_grad flags untouched, .grad still None")


# ---------------------------------------------------------------- 2. torch: LoRA adapters
class LoRALinear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(n_in, n_out)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, n_in) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


torch.manual_seed(1)
layer = LoRALinear(8, 8, rank=2)
x, target = torch.randn(16, 8), torch.randn(16, 8)
mse = lambda layer, x, target: (layer(x) - target).pow(2).mean()  # noqa: E731
grads = ad.gradient(mse, Active(layer, where=lambda path, p: "lora_" in path), Constant(x), Constant(target))
print("LoRA gradient keys:", sorted(grads))
expected = torch.autograd.grad(mse(layer, x, target), [layer.lora_a, layer.lora_b])
assert torch.allclose(grads["lora_a"], expected[0], atol=1e-6) and torch.allclose(grads["lora_b"], expected[1], atol=1e-6)

# ---------------------------------------------------------------- 3. JAX: a mask of bools
key_w, key_a, key_x = jax.random.split(jax.random.PRNGKey(0), 3)
params = {
    "base": {"w": jax.random.normal(key_w, (8, 8))},
    "lora": {"a": jax.random.normal(key_a, (8, 2)) * 0.1, "b": jnp.zeros((2, 8))},
}


def jax_loss(params, x):
    w = params["base"]["w"] + params["lora"]["a"] @ params["lora"]["b"]
    return jnp.mean(jnp.tanh(x @ w) ** 2)


x = jax.random.normal(key_x, (16, 8))
grads = ad.gradient(jax_loss, Active(params, where={"base": False, "lora": True}), Constant(x))
print("JAX gradient:", jax.tree_util.tree_map(jnp.shape, grads))
expected = jax.grad(lambda lora: jax_loss({"base": params["base"], "lora": lora}, x))(params["lora"])
assert grads["base"]["w"] is None
assert jnp.allclose(grads["lora"]["a"], expected["a"], atol=1e-6)
print("all gradients match the hand-partitioned references")
