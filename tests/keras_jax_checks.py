"""Keras 3 models on its JAX backend, run by `test_keras_models.py` in a process of its own with
``KERAS_BACKEND=jax`` (Keras picks its backend once per process). Each check prints ``ok`` or
raises. Every gradient is compared with ``jax.grad`` of Keras's own functional call,
``model.stateless_call``, on the same weights and data.

Nothing is imported at the top but the standard library: pytest's doctest collection imports
this file in processes whose Keras, if any, runs on torch."""

from __future__ import annotations

import warnings


def _setup():
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    import activity as ad
    from activity import Active, Constant

    assert keras.backend.backend() == "jax", keras.backend.backend()
    return jax, jnp, keras, np, ad, Active, Constant


def _model(keras, kind):
    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "sequential":
        return keras.Sequential([keras.Input((4,)), layers.Dense(8, activation="tanh"), layers.BatchNormalization(),
                                 layers.Dropout(0.3, seed=3), layers.Dense(1)])
    inputs = keras.Input((4,))
    hidden = layers.LayerNormalization()(layers.Dense(6, activation="gelu")(inputs))
    return keras.Model(inputs, layers.Dense(1)(hidden + layers.Dense(6)(inputs)))


def _loss(model, x, y, training=True):
    return ((model(x, training=training) - y) ** 2).mean()


def _evaluation(model, x, y):
    return _loss(model, x, y, training=False)


def _stateless(model, training):
    """The loss as a function of the trainable values, through ``model.stateless_call`` with the
    user's values of the other variables (a Dropout's seed state among them)."""
    others = [v.value for v in model.non_trainable_variables]

    def loss(trainable, x, y):
        out, _ = model.stateless_call(trainable, others, x, training=training)
        return ((out - y) ** 2).mean()

    return loss


def _by_path(model, per_variable):
    return dict(zip((v.path for v in model.trainable_variables), per_variable))


def _assert_close(np, got, want, rtol=1e-5, atol=1e-6):
    assert list(got) == list(want), (list(got), list(want))
    for path in want:
        np.testing.assert_allclose(np.asarray(got[path]), np.asarray(want[path]), rtol=rtol, atol=atol, err_msg=path)


def active_models_against_stateless_call():
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    x, y = jax.random.normal(jax.random.key(1), (6, 4)), jax.random.normal(jax.random.key(2), (6, 1))
    for kind in ("sequential", "functional"):
        model = _model(keras, kind)
        before = [np.array(v.value) for v in model.variables]
        trainable = [v.value for v in model.trainable_variables]
        raw = jax.grad(_stateless(model, training=True))
        # in training: BatchNorm's batch statistics and Dropout's mask, drawn from the user's seed state
        _assert_close(np, ad.gradient(_loss, Active(model), Constant(x), Constant(y)), _by_path(model, raw(trainable, x, y)))
        prepared = ad.prepare(ad.gradient, _loss, Active(model), Constant(x), Constant(y))
        for data in (x, 2 * x):
            _assert_close(np, prepared(model, data, y), _by_path(model, raw(trainable, data, y)))
        tangent = {v.path: jnp.ones(v.shape) for v in model.trainable_variables}
        evaluation = _stateless(model, training=False)
        hvp = jax.jvp(lambda t: jax.grad(evaluation)(t, x, y), (trainable,), ([tangent[v.path] for v in model.trainable_variables],))[1]
        _assert_close(np, ad.hvp(_evaluation, Active(model), Constant(x), Constant(y), tangent=tangent), _by_path(model, hvp))
        # BatchNorm statistics, the seed state: assigned inside the call's scope, never in the user's model
        assert all(np.array_equal(b, np.array(v.value)) for b, v in zip(before, model.variables))


def a_mask_fine_tunes_the_head():
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    model = _model(keras, "functional")
    x, y = jax.random.normal(jax.random.key(1), (6, 4)), jax.random.normal(jax.random.key(2), (6, 1))
    head = next(layer.name for layer in model.layers if getattr(layer, "units", None) == 1)
    got = ad.gradient(_evaluation, Active(model, where=lambda path, value: path.split("/")[-2] == head), Constant(x), Constant(y))
    want = _by_path(model, jax.grad(_stateless(model, training=False))([v.value for v in model.trainable_variables], x, y))
    assert [path for path, g in got.items() if g is not None] == [f"{head}/kernel", f"{head}/bias"], list(got)
    _assert_close(np, {p: g for p, g in got.items() if g is not None}, {p: want[p] for p in (f"{head}/kernel", f"{head}/bias")})


def a_constant_model_is_seen_with_its_new_weights():
    # It was an opaque constant: jax.jit kept the weights of the first call in the compiled code
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    model = _model(keras, "functional")
    x = jax.random.normal(jax.random.key(1), (6, 4))

    def features(x, model):
        return jnp.tanh(model(x)).sum()

    prepared = ad.prepare(ad.gradient, features, Active(x), Constant(model))
    np.testing.assert_allclose(prepared(x, model), jax.grad(features)(x, model), rtol=1e-5, atol=1e-6)
    kernel = model.trainable_variables[0]
    kernel.assign(kernel.value * 2)
    np.testing.assert_allclose(prepared(x, model), jax.grad(features)(x, model), rtol=1e-5, atol=1e-6)


def the_reference_warns_of_the_models_float32():
    # Keras computes in its float32 whatever it is given (ops.matmul of float64 arrays is float32):
    # the reference reaches the variables, and says its differences are coarse
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    from activity.backends._finite_differences import ReferenceUnreliableWarning

    model = _model(keras, "functional")
    x, y = jax.random.normal(jax.random.key(1), (6, 4)), jax.random.normal(jax.random.key(2), (6, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = ad.gradient(_evaluation, Active(model), Constant(x), Constant(y), backend=ad.AutoFiniteDifferences())
    assert caught and all(issubclass(w.category, ReferenceUnreliableWarning) for w in caught), [str(w.message) for w in caught]
    want = jax.grad(_stateless(model, training=False))([v.value for v in model.trainable_variables], x, y)
    _assert_close(np, reference, _by_path(model, want), rtol=1e-2, atol=1e-2)


def keras_variables_in_a_pytree_are_their_values():
    # A list of Keras variables was refused as holding no floating-point value, and a variable
    # in a Constant was a static leaf: a prepared call kept the value of its first trace after
    # variable.assign (only a warning said so).
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    model = _model(keras, "functional")
    x = jax.random.normal(jax.random.key(1), (2, 4))

    def stateless(trainable, x):  # Keras's own recipe, given the variables or their values
        return model.stateless_call(trainable, [], x)[0].sum()

    want = jax.grad(stateless)([v.value for v in model.trainable_variables], x)
    for got in (ad.gradient(stateless, Active(model.trainable_variables), Constant(x)),
                ad.gradient(lambda variables, x: model(x).sum(), Active(model.trainable_variables), Constant(x))):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    temperature = keras.Variable(2.0, name="temperature")

    def tempered(x, t):
        return jnp.tanh(x / t.value).sum()

    prepared = ad.prepare(ad.gradient, tempered, Active(x), Constant(temperature))
    temperature.assign(0.5)
    np.testing.assert_allclose(prepared(x, temperature), jax.grad(tempered)(x, temperature), rtol=1e-5, atol=1e-6)


def models_in_a_pytree_are_differentiated_and_read_afresh():
    # A Keras model inside a pytree was a static leaf: Active({"models": [...], "scale": s})
    # gave None for every weight (only `scale` differentiated), and a prepared call with it in
    # a Constant kept the weights of its first trace after kernel.assign (only a warning said so).
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    keras.utils.set_random_seed(0)
    layers = keras.layers
    encoder = keras.Sequential([keras.Input((4,)), layers.Dense(3, activation="tanh"), layers.BatchNormalization()])
    head = keras.Sequential([keras.Input((3,)), layers.Dense(1)])
    x = jax.random.normal(jax.random.key(1), (5, 4))
    held = {"models": [encoder, head], "scale": jnp.array(1.5)}
    before = [np.array(v.value) for v in (*encoder.variables, *head.variables)]

    def f(held, x):  # BatchNormalization in training: batch statistics, assigned inside the scope
        return (held["models"][1](held["models"][0](x, training=True)) ** 2 * held["scale"]).sum()

    def raw(encoder_values, head_values, scale, x):
        statistics = [v.value for v in encoder.non_trainable_variables]
        hidden, _ = encoder.stateless_call(encoder_values, statistics, x, training=True)
        return (head.stateless_call(head_values, [], hidden)[0] ** 2 * scale).sum()

    def expected(x):
        values = ([v.value for v in encoder.trainable_variables], [v.value for v in head.trainable_variables], held["scale"])
        grads = jax.grad(raw, (0, 1, 2))(*values, x)
        return _by_path(encoder, grads[0]), _by_path(head, grads[1]), grads[2]

    def assert_like(got, want):  # float32 sums of ~0 (a BatchNormalization's beta): an absolute tolerance
        _assert_close(np, got["models"][0], want[0], atol=1e-4)
        _assert_close(np, got["models"][1], want[1], atol=1e-4)
        np.testing.assert_allclose(got["scale"], want[2], rtol=1e-5)

    assert_like(ad.gradient(f, Active(held), Constant(x)), expected(x))
    masked = ad.gradient(f, Active(held, where={"models": [False, True], "scale": False}), Constant(x))
    assert masked["scale"] is None and all(g is None for g in masked["models"][0].values()), masked
    _assert_close(np, masked["models"][1], expected(x)[1])
    prepared = ad.prepare(ad.gradient, f, Active(held), Constant(x))
    kernel = head.trainable_variables[0]
    kernel.assign(kernel.value * 2)
    assert_like(prepared(held, 2 * x), expected(2 * x))

    def features(x, held):
        return jnp.tanh(held["model"](x)).sum()

    h = jnp.ones((2, 3))
    extractor = ad.prepare(ad.gradient, features, Active(h), Constant({"model": head}))
    kernel.assign(kernel.value * 3)
    np.testing.assert_allclose(extractor(h, {"model": head}), jax.grad(features)(h, {"model": head}), rtol=1e-5, atol=1e-6)
    # a model inside another one in the same pytree: their shared variables are one parameter, the first's
    stacked = keras.Sequential([encoder, head])
    both = ad.gradient(lambda models, x: models[0](x).sum() + models[1](x).sum(), Active([encoder, stacked]), Constant(x))
    assert list(both[1]) == [v.path for v in head.trainable_variables], list(both[1])
    assert all(np.array_equal(b, np.array(v.value)) for b, v in zip(before[: len(encoder.variables)], encoder.variables))


def an_unbuilt_layer_is_refused():
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    layer = keras.layers.Dense(3)
    try:
        ad.gradient(lambda m, x: m(x).sum(), Active(layer), Constant(jnp.ones((2, 4))))
    except TypeError as error:
        assert "not built yet" in str(error), error
    else:
        raise AssertionError("an unbuilt Keras layer was differentiated")
    assert not layer.built


def a_pytree_mixing_keras_and_nnx_models_is_refused():
    # Each library's convention split its own models and left the other's as static leaves: the
    # Keras model's weights came back None, silently.
    jax, jnp, keras, np, ad, Active, Constant = _setup()
    from flax import nnx

    keras.utils.set_random_seed(0)
    head = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    both = {"keras": head, "nnx": nnx.Linear(4, 3, rngs=nnx.Rngs(0))}
    try:
        ad.gradient(lambda m, x: m["keras"](m["nnx"](x)).sum(), Active(both), Constant(jnp.ones((2, 4))))
    except TypeError as error:
        assert "Keras models or variables and Flax NNX modules" in str(error), error
        assert "an argument of their own" in str(error), error
    else:
        raise AssertionError("a pytree of a Keras model and an NNX module was differentiated")


CHECKS = (
    active_models_against_stateless_call,
    a_mask_fine_tunes_the_head,
    a_constant_model_is_seen_with_its_new_weights,
    the_reference_warns_of_the_models_float32,
    keras_variables_in_a_pytree_are_their_values,
    models_in_a_pytree_are_differentiated_and_read_afresh,
    an_unbuilt_layer_is_refused,
    a_pytree_mixing_keras_and_nnx_models_is_refused,
)


if __name__ == "__main__":
    for check in CHECKS:
        check()
        print("ok", flush=True)
