"""Keras 3 models, on its torch backend in this process and on its JAX backend in a subprocess
(`keras_jax_checks.py`): Keras picks one backend per process, from ``KERAS_BACKEND``, when it
is first imported. Every gradient is compared with Keras's own functional call,
``model.stateless_call``, differentiated by the raw framework (``torch.autograd.grad`` /
``jax.grad``), on the same weights and data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import activity as ad
from activity import Active, Constant
from activity.backends._finite_differences import ReferenceUnreliableWarning
from activity.testing._intact import Snapshot

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def keras():
    if "keras" not in sys.modules:
        before = os.environ.get("KERAS_BACKEND")
        os.environ["KERAS_BACKEND"] = "torch"
        try:
            import keras  # noqa: F401
        finally:
            if before is None:
                del os.environ["KERAS_BACKEND"]
            else:
                os.environ["KERAS_BACKEND"] = before
    keras = sys.modules["keras"]
    assert keras.backend.backend() == "torch", "another test imported Keras on another backend in this process"
    return keras


def _model(keras, kind):
    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "sequential (BatchNorm, Dropout)":
        return keras.Sequential([keras.Input((4,)), layers.Dense(8, activation="tanh"), layers.BatchNormalization(),
                                 layers.Dropout(0.3), layers.Dense(1)])
    if kind == "functional (residual, LayerNorm)":
        inputs = keras.Input((4,))
        hidden = layers.LayerNormalization()(layers.Dense(6, activation="gelu")(inputs))
        return keras.Model(inputs, layers.Dense(1)(hidden + layers.Dense(6)(inputs)))

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.head = layers.Dense(5, activation="softplus"), layers.Dense(1)

        def call(self, x, training=False):
            return self.head(self.hidden(x))

    model = Subclassed()
    model(torch.zeros(1, 4))
    return model


KINDS = ["sequential (BatchNorm, Dropout)", "functional (residual, LayerNorm)", "subclassed"]


def _loss(model, x, y, training=True):
    return ((model(x, training=training) - y) ** 2).mean()


def _stateless_loss(model, trainable, x, y, training):
    """The loss through Keras's own functional call, on the user's values of the other variables."""
    others = [v.value.detach().clone() for v in model.non_trainable_variables]
    out, _ = model.stateless_call(trainable, others, x, training=training)
    return ((out - y) ** 2).mean()


def _names(model):
    """Each trainable Keras variable's name in ``named_parameters()`` (what activity keys a torch module's result by)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(v._value)] for v in model.trainable_variables]


def _by_name(model, per_variable):
    """Values, one per trainable Keras variable, keyed and ordered like ``named_parameters()``."""
    given = dict(zip(_names(model), per_variable))
    return {name: given[name] for name, p in model.named_parameters() if p.requires_grad}


def _trainable_leaves(model):
    return [v.value.detach().clone().requires_grad_() for v in model.trainable_variables]


def _raw_gradient(model, x, y, training=True, seed=5):
    trainable = _trainable_leaves(model)
    torch.manual_seed(seed)  # Keras's unseeded Dropout draws from torch's global generator
    return _by_name(model, torch.autograd.grad(_stateless_loss(model, trainable, x, y, training), trainable))


def _raw_hvp(model, x, y, tangent):
    trainable = _trainable_leaves(model)
    grads = torch.autograd.grad(_stateless_loss(model, trainable, x, y, False), trainable, create_graph=True)
    return _by_name(model, torch.autograd.grad(grads, trainable, [tangent[name] for name in _names(model)]))


def _assert_close(got, want, **tolerances):
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name, **(tolerances or TOLERANCE))


@pytest.mark.parametrize("kind", KINDS)
def test_a_keras_model_on_torch_is_differentiated_in_its_variables(keras, kind):
    model, x, y = _model(keras, kind), torch.randn(6, 4), torch.randn(6, 1)
    variables = [v.value.detach().clone() for v in model.variables]
    snapshot = Snapshot((Active(model), Constant(x), Constant(y)))
    want = _raw_gradient(model, x, y)
    torch.manual_seed(5)
    _assert_close(ad.gradient(_loss, Active(model), Constant(x), Constant(y)), want)
    prepared = ad.prepare(ad.gradient, _loss, Active(model), Constant(x), Constant(y))
    for data in (x, torch.randn(6, 4)):
        want = _raw_gradient(model, data, y, seed=7)
        torch.manual_seed(7)
        _assert_close(prepared(model, data, y), want)

    def evaluation(m, x, y):
        return _loss(m, x, y, training=False)

    tangent = {name: torch.randn(g.shape) for name, g in want.items()}
    _assert_close(ad.hvp(evaluation, Active(model), Constant(x), Constant(y), tangent=tangent), _raw_hvp(model, x, y, tangent))
    # Keras computes in float32 whatever it is given (ops.matmul of float64 tensors is float32): the
    # reference reaches the variables, and says its differences are coarse
    with pytest.warns(ReferenceUnreliableWarning):
        reference = ad.gradient(evaluation, Active(model), Constant(x), Constant(y), backend=ad.AutoFiniteDifferences())
    _assert_close(reference, _raw_gradient(model, x, y, training=False), rtol=1e-2, atol=1e-2)
    # BatchNorm's moving statistics and Dropout's seed state are variables too: none changed
    assert all(torch.equal(before, v.value.detach()) for before, v in zip(variables, model.variables))
    assert [change for change in snapshot.changes() if "RNG" not in change] == []  # (Dropout drew as eager calls do)


def test_a_keras_model_on_torch_as_a_constant_feature_extractor(keras):
    model, x = _model(keras, "functional (residual, LayerNorm)"), torch.randn(6, 4)

    def features(x, model):
        return model(x).tanh().sum()

    leaf = x.clone().requires_grad_()
    want = torch.autograd.grad(features(leaf, model), leaf)[0]
    torch.testing.assert_close(ad.gradient(features, Active(x), Constant(model)), want, **TOLERANCE)
    # Fine-tuning the head: a mask over the parameters' names, which hold the Keras variables' paths
    head = next(layer.name for layer in model.layers if getattr(layer, "units", None) == 1)

    def in_head(path, parameter=None):  # "..._torch_params.<layer>/kernel": the variable's layer
        return path.rsplit("/", 2)[-2].split(".")[-1] == head

    y = torch.zeros(6, 1)
    masked = ad.gradient(_loss, Active(model, where=in_head), Constant(x), Constant(y))
    want = _raw_gradient(model, x, y)
    assert sorted(masked) == sorted(filter(in_head, want)) != []
    _assert_close({name: masked[name] for name in sorted(masked)}, {name: want[name] for name in sorted(masked)})


def test_an_unbuilt_keras_layer_is_refused_by_name(keras):
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3)
    with pytest.raises(ad.UnsupportedError, match="Keras layer that is not built yet"):
        ad.gradient(lambda m, x: m(x).sum(), Active(layer), Constant(torch.ones(2, 4)))
    assert not layer.built


def test_keras_models_on_the_jax_backend():
    """`keras_jax_checks.py` in a process of its own, on Keras's JAX backend."""
    script = Path(__file__).with_name("keras_jax_checks.py")
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ok"] * 8, done.stdout
