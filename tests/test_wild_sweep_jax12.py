"""AutoJAX on the libraries users bring (round 12): TensorFlow Probability's JAX substrate (a
joint distribution holding functions, prepared as a Constant). Keras 3 models and variables
inside a pytree, on Keras's JAX backend, are checked in `keras_jax_checks.py` (a process of
its own, run by `test_keras_models.py`): before this round they were static leaves, their
weights neither differentiated (``None``) nor seen to change by a prepared call.

Expected values come from ``jax.grad`` / ``jax.jvp`` written by hand, never from ``activity``.

Also tried and fine, not kept: tfp ``MultivariateNormalTriL``, ``MixtureSameFamily`` and
``TransformedDistribution`` as Active (hvp too), bijector chains, ``tfp.math`` functions, a
``JointDistributionCoroutineAutoBatched`` as Constant; numpyro ``log_density`` of a model
passed as a Constant (prepared, new data), SVI ELBO gradients in an
``AutoNormal`` / ``AutoDiagonalNormal`` guide's parameters across SVI steps (the guide's eager
initialisation alone takes 10 s, too slow to keep), ``potential_energy``,
``initialize_model``'s ``potential_fn``, ``handlers.seed``/``substitute``/``trace`` inside f, its
hessian, numpyro distributions as Active; gpjax 1.0 ``ConjugateModel`` (Equinox) as Active,
after ``gpx.fit``, with ``where=`` and hvp, the predictive mean's jacobian; tinygp kernels as
Active (a Python-number amplitude is static, ``None``), ``GaussianProcess`` objects as Active
and ``condition`` inside f, a quasiseparable kernel's hvp; quax ``LoraArray`` models
(``quax.quaxify``, ``where=`` on the adapters, pushforward; the reference differs on the
stop-gradient weight, as it should); jaxlie ``SE3`` as Active and a tangent through
``manifold.rplus``; ott-jax Sinkhorn (implicit and unrolled), a ``PointCloud`` as Active, the
Sinkhorn divergence; dm_pix SSIM, rotation, blur, hue; mctx (JAX itself cannot differentiate
its while loops in reverse mode: the note says so). numpyro's uninitialised autoguide differs
from an initialised one under ``jax.grad`` too (its first call draws its prototype trace).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import activity as ad
from activity import Active, Constant

from _sweeps import assert_trees, untouched


# ------------------------------------------------------------------ TFP on JAX


def test_a_prepared_joint_distribution_with_a_new_function_is_told_by_that_function():
    # The message said only "the static data of a node differs (an eqx.field(static=True), a
    # register_dataclass meta field)": nothing named the JointDistributionSequential nor its
    # new lambda, which is what differed.
    from tensorflow_probability.substrates import jax as tfp

    tfd = tfp.distributions

    def joint(loc):
        return tfd.JointDistributionSequential([tfd.Normal(loc, jnp.array(1.0)), lambda m: tfd.Normal(m, jnp.array(0.5))])

    def log_prob(v, model):
        return model.log_prob(v)

    values, model = [jnp.array(0.3), jnp.array(0.1)], joint(jnp.array(0.0))
    check = untouched(Active(values), Constant(model))
    prepared = ad.prepare(ad.gradient, log_prob, Active(values), Constant(model))
    assert_trees(prepared(values, model), jax.grad(log_prob)(values, model))
    with pytest.raises(ad.PreparationMismatchError, match=r"at the root, the JointDistributionSequential's .* is <function [\w.<>]*<lambda>>, prepared with .* \(another object\)"):
        prepared(values, joint(jnp.array(1.0)))
    assert check()
