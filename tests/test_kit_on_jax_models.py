"""Round 9: `activity.testing.check` on third-party JAX models (Equinox, Flax, Haiku, diffrax,
optax), as users have them (float32, random weights), and with errors planted in them."""

from __future__ import annotations

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from activity import Active, Constant
from activity.testing import check


def _wrong_tanh(factor: float):
    """tanh whose jvp rule (so its transpose, the vjp, too) is off by ``factor``: both modes wrong."""

    @jax.custom_jvp
    def act(z):
        return jnp.tanh(z)

    @act.defjvp
    def rule(primals, tangents):
        (z,), (dz,) = primals, tangents
        return jnp.tanh(z), factor * (1 - jnp.tanh(z) ** 2) * dz

    return act


def _mlp(activation=jax.nn.tanh):
    return eqx.nn.MLP(3, 2, 4, 1, activation=activation, key=jax.random.key(0))


def _loss(m, x):
    return jnp.sum(jnp.sin(jax.vmap(m)(x)))


X = jax.random.normal(jax.random.key(1), (4, 3))


def test_hvp_of_a_layer_whose_custom_jvp_is_wrong_in_both_modes_fails_even_alone():
    """The hvp's reference was finite differences of the backend's own gradient: where a wrong
    jvp rule makes that gradient wrong too, its derivative agreed with the (wrong) hvp, and
    check() reported hvp ok, alone (operators=["hvp"]) or beside a failed gradient. The hvp is
    now compared with the reference's own second derivative wherever the backend's gradient
    disagrees with the reference along that direction."""
    x = X
    with pytest.raises(AssertionError) as info:
        check(_loss, Active(_mlp(_wrong_tanh(1.01))), Constant(x), operators=["hvp"], directions=1)
    assert "hvp[u0] on AutoJAX() vs the reference's derivative of the gradient" in str(info.value)
    # the unmodified model (and the same custom_jvp with the right rule) passes, without a doubt
    for activation in (jax.nn.tanh, _wrong_tanh(1.0)):
        report = check(_loss, Active(_mlp(activation)), Constant(x), operators=["hvp"], directions=1)
        assert report.passed and not report.failed and not report.unreliable
