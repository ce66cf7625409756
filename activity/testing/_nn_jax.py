"""The JAX catalogue: the same layers in Equinox, or as plain JAX pytrees where Equinox has none.

Gradients of a smooth loss with respect to ``Active(model)`` with
``Constant(input)``; kinks (max pooling, Maxout) are kept far from any
finite-difference step by constant offsets, as in the torch catalogue.
"""

from __future__ import annotations

from typing import Any, Callable

from .._annotations import Active, Constant
from .._imports import optional
from ._scenario import Scenario


def nn_scenarios_jax(seed: int = 0) -> list[Scenario]:
    jax = optional("jax", 'nn_scenarios("jax")')
    optional("equinox", 'nn_scenarios("jax")')  # a missing Equinox names the extra that installs it
    import equinox as eqx
    jnp = jax.numpy

    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 256))

    def key() -> Any:
        return next(keys)

    def randn(*shape: int, scale: float = 1.0) -> Any:
        return scale * jax.random.normal(key(), shape)

    def reduce(out: Any) -> Any:
        return jnp.mean(out**2) + jnp.mean(out)

    def batched(model: Any, x: Any) -> Any:
        return reduce(jax.vmap(model)(x))

    scenarios: list[Scenario] = []

    def add(name: str, make: Callable[[], Any], x: Any, f: Callable[..., Any] = batched) -> None:
        model, prep_model = make(), make()
        prep_x = x + 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x[::-1]
        scenarios.append(
            Scenario("gradient", f, (Active(model), Constant(x)), prep_args=(Active(prep_model), Constant(prep_x)), name=name)
        )

    class Scale(eqx.Module):
        weight: Any
        bias: Any

        def __call__(self, x: Any) -> Any:
            return (self.weight * x + self.bias) ** 2

    class Maxout(eqx.Module):
        branches: list[Any]
        offset: Any = eqx.field(static=True)

        def __call__(self, x: Any) -> Any:
            outs = jnp.stack([jnp.tanh(b(x)) for b in self.branches])
            return jnp.max(outs + jnp.asarray(self.offset)[:, None], axis=0)

    class Skip(eqx.Module):
        inner: eqx.nn.Linear
        concat: bool = eqx.field(static=True)

        def __call__(self, x: Any) -> Any:
            y = jnp.tanh(self.inner(x))
            return jnp.concatenate([y, x]) if self.concat else y + x

    class Chain(eqx.Module):
        layers: tuple[Any, ...]

        def __call__(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    class ConvMaxPool(eqx.Module):
        """2x2 max pooling written with reshape and max (the JVP of Equinox's
        reduce_window-based MaxPool2d is not implemented in this JAX)."""

        conv: eqx.nn.Conv2d

        def __call__(self, x: Any) -> Any:
            ramp = 3.0 * jnp.tile(jnp.arange(4.0).reshape(2, 2), (2, 2))
            y = jnp.tanh(self.conv(x)) + ramp
            c, h, w = y.shape
            return y.reshape(c, h // 2, 2, w // 2, 2).max(axis=(2, 4))

    class Attention(eqx.Module):
        mha: eqx.nn.MultiheadAttention

        def __call__(self, x: Any) -> Any:
            return self.mha(x, x, x)

    class Unrolled(eqx.Module):
        cell: Any
        lstm: bool = eqx.field(static=True)

        def __call__(self, xs: Any) -> Any:
            size = self.cell.hidden_size
            state = (jnp.zeros(size), jnp.zeros(size)) if self.lstm else jnp.zeros(size)
            outputs = []
            for t in range(xs.shape[0]):
                state = self.cell(xs[t], state)
                outputs.append(state[0] if self.lstm else state)
            return jnp.stack(outputs)

    class Scanned(eqx.Module):
        """A GRU over a sequence with `jax.lax.scan` (the compiled form of a recurrence)."""

        cell: eqx.nn.GRUCell

        def __call__(self, xs: Any) -> Any:
            def step(h: Any, x: Any) -> Any:
                h = self.cell(x, h)
                return h, h

            return jax.lax.scan(step, jnp.zeros(self.cell.hidden_size), xs)[1]

    def bilinear_loss(params: Any, x: Any) -> Any:
        return reduce(jnp.einsum("bi,oij,bj->bo", x, params["weight"], x) + params["bias"])

    def batchnorm_loss(params: Any, x: Any) -> Any:  # train mode: batch statistics
        mean, var = x.mean(0), x.var(0)
        return reduce((x - mean) / jnp.sqrt(var + 1e-5) * params["weight"] + params["bias"])

    def linear_batchnorm_loss(params: Any, x: Any) -> Any:
        h = jax.vmap(params["linear"])(x)
        mean, var = h.mean(0), h.var(0)
        return reduce((h - mean) / jnp.sqrt(var + 1e-5) * params["weight"] + params["bias"])

    def embedding_loss(model: Any, tokens: Any) -> Any:
        return reduce(jax.vmap(jax.vmap(model))(tokens))

    add("linear", lambda: eqx.nn.Linear(2, 4, key=key()), randn(3, 2))
    add("chain_tanh", lambda: eqx.nn.MLP(2, 3, 4, 1, activation=jnp.tanh, key=key()), randn(3, 2))
    add("scale", lambda: Scale(randn(4, scale=0.5) + 1, randn(4, scale=0.3)), randn(3, 4))
    add("conv2d", lambda: eqx.nn.Conv2d(2, 3, 3, key=key()), randn(1, 2, 3, 3))
    add("conv2d_chain", lambda: Chain((eqx.nn.Conv2d(2, 3, 3, key=key()), eqx.nn.Conv2d(3, 1, 3, key=key()), jnp.tanh)), randn(1, 2, 5, 5))
    add(
        "conv2d_same_avgpool",
        lambda: Chain((eqx.nn.Conv2d(2, 2, 4, padding="SAME", key=key()), eqx.nn.AvgPool2d(5, stride=5, padding=2))),
        randn(2, 2, 5, 5),
    )
    add("conv2d_maxpool", lambda: ConvMaxPool(eqx.nn.Conv2d(2, 2, 3, padding=1, key=key())), randn(1, 2, 4, 4))
    add("maxout", lambda: Maxout([eqx.nn.Linear(5, 4, key=key()) for _ in range(3)], (0.0, 2.5, 5.0)), randn(2, 5))
    add("skipconnection_concat", lambda: Skip(eqx.nn.Linear(2, 2, key=key()), True), randn(3, 2))
    add("skipconnection_residual", lambda: Skip(eqx.nn.Linear(2, 2, key=key()), False), randn(3, 2))
    add("bilinear", lambda: {"weight": randn(3, 2, 2, scale=0.5), "bias": randn(3, scale=0.3)}, randn(1, 2), f=bilinear_loss)
    add("convtranspose2d", lambda: eqx.nn.ConvTranspose2d(3, 2, 3, stride=2, key=key()), randn(1, 3, 5, 5, scale=0.5))
    add("layernorm", lambda: eqx.nn.LayerNorm(2), randn(10, 2))
    add("groupnorm", lambda: eqx.nn.GroupNorm(2, 4), randn(3, 4, 5))
    add("batchnorm_train", lambda: {"weight": 1 + randn(2, scale=0.2), "bias": randn(2, scale=0.2)}, randn(10, 2), f=batchnorm_loss)
    add(
        "linear_batchnorm_train",
        lambda: {"linear": eqx.nn.Linear(3, 4, key=key()), "weight": 1 + randn(4, scale=0.2), "bias": randn(4, scale=0.2)},
        randn(6, 3),
        f=linear_batchnorm_loss,
    )
    add("multihead_attention", lambda: Attention(eqx.nn.MultiheadAttention(2, 8, dropout_p=0.0, inference=True, key=key())), randn(2, 4, 8))
    add("embedding", lambda: Chain((eqx.nn.Embedding(10, 3, key=key()), eqx.nn.Linear(3, 2, key=key()))), jnp.array([[1, 4, 7], [0, 9, 4]]), f=embedding_loss)
    add("linear_gelu_nobias", lambda: Chain((eqx.nn.Linear(3, 4, use_bias=False, key=key()), jax.nn.gelu)), randn(3, 3))
    add("gru_cell_unrolled", lambda: Unrolled(eqx.nn.GRUCell(3, 4, key=key()), False), randn(2, 3, 3))
    add("lstm_cell_unrolled", lambda: Unrolled(eqx.nn.LSTMCell(3, 4, key=key()), True), randn(2, 3, 3))
    add("gru_scan", lambda: Scanned(eqx.nn.GRUCell(3, 5, key=key())), randn(2, 6, 3))
    return scenarios
