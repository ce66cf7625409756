"""Round 9: `activity.testing.check` on third-party JAX models as users have them (float32,
random weights), and with errors planted in them. Equinox MLP, Conv, GRUCell, LayerNorm, Flax NNX
Linear+BatchNorm, a Haiku MLP and optax losses passed as they were; these are the two defects
found (a missed error and a false alarm), on the smallest models that show them."""

from __future__ import annotations

import attrs
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import activity as ad
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
    return eqx.nn.MLP(2, 1, 3, 1, activation=activation, key=jax.random.key(0))


def _loss(m, x):
    return jnp.sum(jnp.sin(jax.vmap(m)(x)))


X = jax.random.normal(jax.random.key(1), (3, 2))


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
    # the same custom_jvp with the right rule passes, without a doubt
    report = check(_loss, Active(_mlp(_wrong_tanh(1.0))), Constant(x), operators=["hvp"], directions=1)
    assert report.passed and not report.failed and not report.unreliable


def test_hessian_of_a_layer_whose_custom_jvp_is_wrong_in_both_modes_fails_even_alone():
    """The full Hessian's reference takes the same rule as the hvp's: the backend's gradient is
    differentiated only where it agrees with the reference (else its wrong Hessian would agree)."""
    with pytest.raises(AssertionError, match="hessian on AutoJAX"):
        check(_loss, Active(_mlp(_wrong_tanh(1.01))), Constant(X), operators=["hessian"], directions=1)
    report = check(_loss, Active(_mlp(_wrong_tanh(1.0))), Constant(X), operators=["hessian"], directions=1)
    assert report.passed and not report.failed and not report.unreliable


@attrs.frozen
class HvpOnePercentOff(ad.AutoJAX):
    def value_and_hvp(self, F, xs, ts, batched):
        ys, grads, aux, hvps = super().value_and_hvp(F, xs, ts, batched)
        return ys, grads, aux, tuple(1.01 * h for h in hvps)


def test_float32_attention_whose_key_bias_has_an_exactly_zero_hessian_passes_and_a_planted_error_fails():
    """A key bias adds the same logit to every key of a query: softmax ignores it, its second
    derivatives are exactly 0 (the reference: 1e-11) and a float32 hvp leaves rounding noise of the
    Hessian's own size there (2e-4 where that size is 100s), above atol=1e-5: a false alarm on a
    right Equinox (and Flax linen) attention. An hvp 1 % off is still caught."""
    mha = eqx.nn.MultiheadAttention(
        1, 4, use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True, key=jax.random.key(1)
    )
    q = 3 * jax.random.normal(jax.random.key(11), (3, 4))
    f = lambda m, q: jnp.sum(m(q, q, q) ** 2)  # noqa: E731
    report = check(f, Active(mha), Constant(q), operators=["hvp"], directions=1)
    assert report.passed and not report.failed and not report.unreliable
    with pytest.raises(AssertionError, match=r"hvp\[u0\] on HvpOnePercentOff\(\)"):
        check(f, Active(mha), Constant(q), operators=["hvp"], directions=1, backends=HvpOnePercentOff())
