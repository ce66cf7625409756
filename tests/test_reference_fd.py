"""The finite-difference reference's own defects: copies, domains, parameters, precision."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Cache, Constant
from activity.backends._finite_differences import ReferencePrecisionWarning

FD = ad.AutoFiniteDifferences()


def host(a):
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_every_evaluation_of_f_gets_its_own_copies(framework):
    xp = np if framework == "numpy" else torch
    v, c = xp.asarray([1.0, 2.0, 4.0]), xp.asarray([1.0, 1.0, 1.0])
    if framework == "torch":
        v, c = v.double(), c.double()
    v0, c0 = host(v).copy(), host(c).copy()

    def f(v, c):
        v -= v.mean()  # numpy-style in-place updates of both inputs
        c *= 2
        return (v**2 * c).sum()

    g = ad.gradient(f, Active(v), Constant(c), backend=FD)
    np.testing.assert_array_equal(host(v), v0)  # the user's values are untouched
    np.testing.assert_array_equal(host(c), c0)
    # f = sum((v - mean v)^2 * 2 c0): d/dv = 4 c0 (v - mean v) (the mean's terms cancel for equal c0)
    np.testing.assert_allclose(host(g), 4 * (v0 - v0.mean()), rtol=1e-8)


def test_a_step_outside_fs_domain_that_raises_restarts_smaller():
    p, y = torch.tensor([0.95, 0.5], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    bce = lambda p, y: torch.nn.functional.binary_cross_entropy(p, y)  # noqa: E731  # raises outside [0, 1]
    got = ad.gradient(bce, Active(p), Constant(y), backend=FD)
    expected = torch.func.grad(lambda p: bce(p, y))(p)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


def test_f_raising_at_every_step_raises_its_own_error():
    def f(x):
        if abs(float(x.sum()) - 3.0) > 0:  # any perturbation raises: no step can succeed
            raise ValueError("outside the domain")
        return (x**2).sum()

    with pytest.raises(ValueError, match="outside the domain"):
        ad.gradient(f, Active(np.ones(3)), backend=FD)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(step=0), "step=0"),
        (dict(step=float("nan")), "step=nan"),
        (dict(shrink=1.0), "shrink=1.0"),
        (dict(max_steps=0), "max_steps=0"),
        (dict(max_steps=1), "max_steps=1"),
        (dict(retries=0), "retries=0"),
        (dict(retries=2.5), "retries=2.5"),
    ],
)
def test_parameters_are_validated_at_construction(options, match):
    with pytest.raises(ValueError, match=match):
        ad.AutoFiniteDifferences(**options)


def test_f_computing_in_float32_is_reported():
    x = torch.ones(3, dtype=torch.float64)
    with pytest.warns(ReferencePrecisionWarning, match="float32"):
        ad.gradient(lambda x: (x.float() ** 2).sum(), Active(x), backend=FD)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferencePrecisionWarning)
        ad.gradient(lambda x: (x**2).sum(), Active(x), backend=FD)  # float64 throughout: no warning


@pytest.mark.parametrize("op", ["gradient", "hessian"])
def test_an_unreliable_reference_is_said_once_per_call_not_once_per_direction(op):
    x = torch.ones(4, dtype=torch.float64)
    for _ in range(2):  # and again on the next call
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            getattr(ad, op)(lambda x: (x.float() ** 2).sum(), Active(x), backend=FD)
        categories = [w.category for w in caught]
        assert ReferencePrecisionWarning in categories and len(categories) == len(set(categories)), categories


def test_a_jax_f_computing_in_float32_is_reported():
    """On JAX the reference evaluates f compiled, on the host, in float64: f's own float32 output
    was once converted before the check saw it, and the warning never came."""
    import jax.numpy as jnp

    x = jnp.ones(3)
    with pytest.warns(ReferencePrecisionWarning, match="float32"):
        ad.gradient(lambda x: jnp.sum(x.astype(jnp.float32) ** 2), Active(x), backend=FD)
    with pytest.warns(ReferencePrecisionWarning, match="activity.pushforward"):
        ad.pushforward(lambda x: jnp.sum(x.astype(jnp.float32) ** 2), Active(x), tangent=jnp.ones(3), backend=FD)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferencePrecisionWarning)
        ad.gradient(lambda x: jnp.sum(x**2), Active(x), backend=FD)  # float64 throughout: no warning


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_steps_stop_where_f_rounds_to_float32(framework):
    """The derivative of f that rounds to float32 inside is as good as float32 allows (about
    1e-5 here): Ridders' smaller steps once made it differences of rounding noise (about 1e-3)."""
    x = np.array([0.3, -1.2, 2.0, 0.7])
    if framework == "jax":
        import jax.numpy as jnp

        f, value = (lambda x: jnp.sum(jnp.sin(x.astype(jnp.float32)) * 3.0)), jnp.asarray(x)
    else:
        f, value = (lambda x: (torch.sin(x.float()) * 3.0).sum()), torch.tensor(x)
    want = 3 * np.cos(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferencePrecisionWarning)
        got = host(ad.gradient(f, Active(value), backend=FD))
        pushed = float(host(ad.pushforward(f, Active(value), tangent=value * 0 + 1, backend=FD)))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert abs(pushed - want.sum()) <= 1e-4 * np.abs(want).sum()


def test_the_kit_does_not_blame_a_backend_for_a_flax_layer_that_computes_in_float32():
    """nnx.Embed casts its table to its own dtype (float32), so the float64 reference computes in
    float32: `check` passes AutoJAX or says the reference is unreliable, never fails it."""
    import jax.numpy as jnp
    from flax import nnx

    from activity.testing import check

    layer = nnx.Embed(6, 3, rngs=nnx.Rngs(0))
    report = check(lambda m, i: jnp.sum(m(i)), Active(layer), Constant(jnp.array([1, 2, 2])))
    assert not report.failed, report


def _masked_square(w, key, p, dtype=None):
    import jax
    import jax.numpy as jnp

    if dtype is None:
        mask = jax.random.bernoulli(key, p, w.shape)  # a uniform draw at JAX's default dtype
    else:
        mask = jax.random.uniform(key, w.shape, dtype=dtype) < p
    return jnp.sum(jnp.where(mask, w, 0.0) ** 2)


def test_random_draws_that_float64_changes_are_reported_and_the_kit_does_not_blame_the_backend():
    """A dropout-like mask from a key passed as Constant: under the reference's float64 mode a
    draw at JAX's default dtype takes 64 random bits, so the mask, and the function, differ.
    The reference says so; `check` reports it unreliable, not AutoJAX wrong. With draws of an
    explicit dtype the masks are the same and the reference is right, without a warning."""
    import jax
    import jax.numpy as jnp

    from activity.backends._finite_differences import ReferenceRandomnessWarning
    from activity.testing import check

    w, key = jnp.linspace(-1.0, 1.0, 16), jax.random.PRNGKey(3)
    want = jax.grad(_masked_square)(w, key, 0.7)
    with pytest.warns(ReferenceRandomnessWarning, match="random numbers at JAX's default dtype"):
        got = ad.gradient(_masked_square, Active(w), Constant(key), Constant(0.7), backend=FD)
    assert not np.allclose(np.asarray(got), np.asarray(want))  # the reference's other mask: why it warns
    report = check(_masked_square, Active(w), Constant(key), Constant(0.7), operators=["gradient"])
    assert not report.failed and report.unreliable and "explicit dtype" in report.unreliable[0]

    def explicit(w, key):
        return _masked_square(w, key, 0.7, jnp.float32)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceRandomnessWarning)
        got = ad.gradient(explicit, Active(w), Constant(key), backend=FD)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(explicit)(w, key)), rtol=1e-6)


def test_a_cache_is_fresh_for_every_evaluation():
    def f(x, buffer):
        buffer += x  # accumulates if the same buffer were reused between evaluations
        return (buffer**2).sum()

    g = ad.gradient(f, Active(np.array([1.0, 2.0])), Cache(np.zeros(2)), backend=FD)
    np.testing.assert_allclose(g, [2.0, 4.0], rtol=1e-8)


def test_a_prepared_reference_on_jax_compiles_f_once():
    import jax
    import jax.numpy as jnp

    traces = []

    def f(w, x):
        traces.append(1)  # runs when JAX traces f, not when the compiled code runs
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w, x = jnp.ones(3), jnp.ones((4, 3))
    prepared = ad.prepare(ad.gradient, f, Active(w), Constant(x), backend=FD)
    expected = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
    for scale in (1.0, 0.5, 0.25):
        got = prepared(w, x * scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected(w, x * scale)), rtol=1e-5)
    assert len(traces) == 1  # one trace, then the compiled evaluation for every step of every call


def test_a_float32_loss_inside_a_float64_reference_is_reported_not_blamed():
    """The Hugging Face case: a causal-LM loss calls logits.float(), so the "float64" reference
    computes in float32; the kit says the reference cannot decide instead of failing AutoTorch."""
    import transformers

    from activity.testing import Scenario, test_differentiation

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))

    def loss(m, ids):
        logits = m(input_ids=ids).logits.float()  # what HF's loss functions do
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), ids.reshape(-1))

    # the final layer norm's 16 parameters: a reference over every parameter takes half a minute
    final_norm = lambda path, parameter: path.startswith("transformer.ln_f.")  # noqa: E731
    scenario = Scenario("gradient", loss, (Active(model, where=final_norm), Constant(ids)), name="gpt2_float_loss")
    report = test_differentiation([ad.AutoTorch()], [scenario], prepared=False, raise_on_failure=False)
    (outcome,) = report.outcomes
    assert outcome.status == "reference unreliable", outcome  # without the check: FAIL on every leaf
    assert "lower precision than the float64 reference" in outcome.message
    assert report.counts()["FAIL"] == 0


def test_a_wrong_backend_is_still_failed_where_the_reference_is_sound():
    from activity.testing import Scenario, test_differentiation

    class Wrong(ad.AutoTorch):
        def finalize(self, result, problem):
            return super().finalize(result, problem) * 1.01

    scenario = Scenario("gradient", lambda x: (x**3).sum(), (Active(torch.ones(3, dtype=torch.float64)),), name="cube")
    report = test_differentiation([Wrong()], [scenario], prepared=False, raise_on_failure=False)
    assert report.outcomes[0].status == "FAIL"


def test_a_reference_that_is_not_finite_is_an_error():
    from activity.testing import Scenario, test_differentiation

    scenario = Scenario("gradient", lambda x: np.log(x).sum(), (Active(np.zeros(2)),), name="log_at_0")
    report = test_differentiation([ad.AutoFiniteDifferences(step=0.05)], [scenario], prepared=False, raise_on_failure=False)
    (outcome,) = report.outcomes
    assert outcome.status == "FAIL" and "not finite" in outcome.message and "expected inf" not in outcome.message


def test_spectral_norm_in_train_mode_is_reference_unreliable_and_batchnorm_is_not():
    from activity.testing import Scenario, test_differentiation

    def scenario(model, name):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
        return Scenario("gradient", lambda m, x: m(x).pow(2).sum(), (Active(model), Constant(x)), name=name)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        spectral = torch.nn.utils.spectral_norm(torch.nn.Linear(3, 3)).train()
        batchnorm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).train()
    report = test_differentiation(
        [ad.AutoTorch()], [scenario(spectral, "spectral"), scenario(batchnorm, "batchnorm")], prepared=False, raise_on_failure=False
    )
    status = {o.scenario: o for o in report.outcomes}
    assert status["spectral"].status == "reference unreliable" and "spectral_norm" in status["spectral"].message
    assert status["batchnorm"].status == "pass"


def test_compiled_references_on_jax_are_dropped_with_their_call():
    import gc

    import jax.numpy as jnp

    from activity.backends import _finite_differences as fd

    gc.collect()
    before = len(fd._COMPILED)
    for _ in range(5):  # unprepared: each call compiles its own, which must not outlive it
        ad.gradient(lambda x: jnp.sum(x**2), Active(jnp.ones(3)), backend=FD)
    prepared = ad.prepare(ad.gradient, lambda x: jnp.sum(x**3), Active(jnp.ones(3)), backend=FD)
    prepared(jnp.ones(3))
    gc.collect()
    assert len(fd._COMPILED) == before + 1  # the prepared operator's, while it lives
    del prepared
    gc.collect()
    assert len(fd._COMPILED) == before
