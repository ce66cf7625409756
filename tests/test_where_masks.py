"""`Active(value, where=...)`: differentiate only part of an argument.

Every reference is the hand-partitioned problem computed by the raw framework:
`jax.grad` over the selected leaves with the rest closed over as arrays, or
`torch.autograd.grad` over the selected parameters only.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import activity as ad
from activity import Active, Constant
from activity.testing import (
    Scenario,
    batchify,
    cachify,
    closurify,
    constantify,
    parametrize,
    test_differentiation,
)

KEY = jax.random.PRNGKey(0)
PARAMS = {
    "w": jax.random.normal(KEY, (3, 2)),
    "b": jnp.array([0.1, -0.2]),
    "scale": jnp.array(1.3),
}
X = jax.random.normal(jax.random.PRNGKey(1), (4, 3))


def loss(params, x):
    return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]) ** 2) * params["scale"]


def only_w(path, leaf):
    return path == "['w']"


def grad_of_w(params, x):
    """The hand-partitioned reference: jax.grad over w, b and scale closed over."""
    return jax.grad(lambda w: loss({**params, "w": w}, x))(params["w"])


# ------------------------------------------------------------------ pytrees on JAX


@pytest.mark.parametrize("where", [only_w, {"w": True, "b": False, "scale": False}], ids=["callable", "bools"])
@pytest.mark.parametrize("backend", [ad.AutoJAX(), ad.AutoFiniteDifferences()], ids=["jax", "fd"])
def test_masked_gradient_is_the_gradient_of_the_partitioned_function(where, backend, assert_tree_close):
    got = ad.gradient(loss, Active(PARAMS, where=where), Constant(X), backend=backend)
    assert got["b"] is None and got["scale"] is None
    assert_tree_close(got["w"], grad_of_w(PARAMS, X), rtol=1e-4, atol=1e-5)


def test_a_prefix_mask_covers_a_whole_subtree(assert_tree_close):
    params = {"encoder": {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}, "head": {"w": jnp.ones((2, 1)), "b": jnp.zeros(1)}}
    f = lambda p, x: jnp.sum((jnp.tanh(x @ p["encoder"]["w"] + p["encoder"]["b"]) @ p["head"]["w"] + p["head"]["b"]) ** 2)  # noqa: E731
    x = jnp.array([[1.0, 2.0]])
    got = ad.gradient(f, Active(params, where={"encoder": False, "head": True}), Constant(x))
    assert got["encoder"] == {"w": None, "b": None}
    expected = jax.grad(lambda head: f({**params, "head": head}, x))(params["head"])
    assert_tree_close(got["head"], expected, rtol=1e-6, atol=1e-6)


def test_hvp_jacobian_and_pushforward_with_a_mask(assert_tree_close):
    w = PARAMS["w"]
    only = lambda w: loss({**PARAMS, "w": w}, X)  # noqa: E731
    t = jnp.ones_like(w)
    # a tangent has the value's structure; the unselected leaves may be None or zeros
    for tangent in ({"w": t, "b": None, "scale": None}, {"w": t, "b": jnp.zeros(2), "scale": jnp.array(0.0)}):
        hv = ad.hvp(loss, Active(PARAMS, where=only_w), Constant(X), tangent=tangent)
        _, expected = jax.jvp(jax.grad(only), (w,), (t,))
        assert hv["b"] is None and hv["scale"] is None
        assert_tree_close(hv["w"], expected, rtol=1e-5, atol=1e-5)
        jvp = ad.pushforward(loss, Active(PARAMS, where=only_w), Constant(X), tangent=tangent)
        assert_tree_close(jvp, jax.jvp(only, (w,), (t,))[1], rtol=1e-5, atol=1e-5)
    out = lambda p, x: jnp.tanh(x @ p["w"] + p["b"])  # noqa: E731
    jac = ad.jacobian(out, Active(PARAMS, where=only_w), Constant(X))
    assert jac["b"] is None
    assert_tree_close(jac["w"], jax.jacobian(lambda w: out({**PARAMS, "w": w}, X))(w), rtol=1e-6, atol=1e-6)
    hess = ad.hessian(loss, Active(PARAMS, where={"w": False, "b": True, "scale": False}), Constant(X))
    expected_h = jax.hessian(lambda b: loss({**PARAMS, "b": b}, X))(PARAMS["b"])
    assert_tree_close(hess["b"]["b"], expected_h, rtol=1e-5, atol=1e-5)


def test_second_order_backends_with_a_mask(assert_tree_close):
    t = {"w": jnp.ones((3, 2)), "b": None, "scale": None}
    expected = jax.jvp(jax.grad(lambda w: loss({**PARAMS, "w": w}, X)), (PARAMS["w"],), (t["w"],))[1]
    for backend in (ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoJAX()), ad.SecondOrder(ad.AutoJAX(), ad.AutoJAX())):
        got = ad.hvp(loss, Active(PARAMS, where=only_w), Constant(X), tangent=t, backend=backend)
        assert_tree_close(got["w"], expected, rtol=1e-4, atol=1e-4)


def test_keyword_actives_take_masks_too(assert_tree_close):
    g_x, g_p = ad.gradient(lambda x, *, params: loss(params, x), Active(X), params=Active(PARAMS, where=only_w))
    assert_tree_close(g_x, jax.grad(lambda x: loss(PARAMS, x))(X), rtol=1e-6, atol=1e-6)
    assert_tree_close(g_p["w"], grad_of_w(PARAMS, X), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ finite differences


def test_finite_differences_perturb_only_the_selected_leaves():
    params = {"big": np.linspace(0.0, 1.0, 40), "small": np.array([0.3, 0.7])}

    def counted(calls):
        def f(p):
            calls.append(1)
            return np.sum(np.sin(p["big"])) * np.sum(p["small"] ** 2)

        return f

    fd = ad.AutoFiniteDifferences()
    masked, own, full = [], [], []
    got = ad.gradient(counted(masked), Active(params, where={"big": False, "small": True}), backend=fd)
    own_argument = lambda small, big: counted(own)({"big": big, "small": small})  # noqa: E731
    expected = ad.gradient(own_argument, Active(params["small"]), Constant(params["big"]), backend=fd)
    ad.gradient(counted(full), Active(params), backend=fd)
    # as many evaluations as for the two selected numbers passed as their own argument
    assert len(masked) == len(own) < len(full) / 10
    assert got["big"] is None
    np.testing.assert_allclose(got["small"], expected, rtol=1e-12)
    np.testing.assert_allclose(got["small"], 2 * params["small"] * np.sum(np.sin(params["big"])), rtol=1e-8)


# ------------------------------------------------------------------ prepare


def test_the_mask_is_part_of_the_prepared_signature_and_never_recompiles():
    traces = []

    def f(params, x):
        traces.append(1)
        return loss(params, x)

    prep = ad.prepare(ad.gradient, f, Active(PARAMS, where=only_w), Constant(X))
    traced = len(traces)
    for step in range(3):
        new = jax.tree_util.tree_map(lambda leaf: leaf + step, PARAMS)
        got = prep(new, X * step)
        np.testing.assert_allclose(got["w"], grad_of_w(new, X * step), rtol=1e-5, atol=1e-5)
        assert got["b"] is None
        got = prep(Active(new, where=only_w), Constant(X * step))  # the same mask, annotated
        np.testing.assert_allclose(got["w"], grad_of_w(new, X * step), rtol=1e-5, atol=1e-5)
    assert len(traces) == traced  # new values under the same mask: no new trace
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 0 .*: prepared with a where= selecting 1 leaf"):
        prep(Active(PARAMS), Constant(X))
    with pytest.raises(ad.PreparationMismatchError, match=r"selecting 1 leaf.*called with a where= selecting 2 leaf"):
        prep(Active(PARAMS, where={"w": True, "b": True, "scale": False}), Constant(X))
    # another callable that selects the same leaves is the same signature
    same = prep(Active(PARAMS, where=lambda path, leaf: path.endswith("['w']")), Constant(X))
    np.testing.assert_allclose(same["w"], grad_of_w(PARAMS, X), rtol=1e-5, atol=1e-5)


def test_strict_false_prepares_again_for_another_mask():
    prep = ad.prepare(ad.gradient, loss, Active(PARAMS, where=only_w), Constant(X), strict=False)
    full = prep(Active(PARAMS), Constant(X))
    expected = jax.grad(loss)(PARAMS, X)
    for name in PARAMS:
        np.testing.assert_allclose(full[name], expected[name], rtol=1e-5, atol=1e-5)
    assert prep(PARAMS, X)["b"] is None  # raw values keep the prepared mask


# ------------------------------------------------------------------ mistakes


def test_mask_mistakes_are_type_errors_naming_the_argument():
    with pytest.raises(TypeError, match=r"argument 0 .*selects nothing to differentiate. Mark the argument Constant"):
        ad.gradient(loss, Active(PARAMS, where=lambda path, leaf: False), Constant(X))
    with pytest.raises(TypeError, match=r"argument 0 .*the mask does not have a prefix of the value's structure"):
        ad.gradient(loss, Active(PARAMS, where={"w": True, "other": False}), Constant(X))
    with pytest.raises(TypeError, match=r"where\(\"\['b'\]\", \.\.\.\) returned int"):
        ad.gradient(loss, Active(PARAMS, where=lambda path, leaf: 1), Constant(X))
    with pytest.raises(TypeError, match=r"pytree of bools, but where holds int 1 at \['w'\]"):
        Active(PARAMS, where={"w": 1, "b": True, "scale": True})
    with pytest.raises(TypeError, match=r"keyword argument params= \(Active with where=\) selects nothing"):
        ad.gradient(lambda *, params: loss(params, X), params=Active(PARAMS, where={"w": False, "b": False, "scale": False}))


# ------------------------------------------------------------------ torch modules


def _torch_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def torch_loss(net, x):
    return net(x).pow(2).sum()


@pytest.mark.parametrize(
    "where",
    [lambda path, p: path.startswith("2."), {"0": False, "2": True}, {"0.weight": False, "0.bias": False, "2": True}],
    ids=["callable", "prefixes", "names"],
)
def test_masked_module_gradient_is_autograd_over_the_selected_parameters(where, assert_tree_close):
    net, x = _torch_net(), torch.randn(5, 3)
    flags = [p.requires_grad for p in net.parameters()]
    got = ad.gradient(torch_loss, Active(net, where=where), Constant(x))
    assert list(got) == ["2.weight", "2.bias"]  # absent from the dict, not None
    expected = torch.autograd.grad(torch_loss(net, x), [net[2].weight, net[2].bias])
    assert_tree_close(list(got.values()), list(expected), rtol=1e-6, atol=1e-6)
    assert [p.requires_grad for p in net.parameters()] == flags and all(p.grad is None for p in net.parameters())
    fd = ad.gradient(torch_loss, Active(net.double(), where=where), Constant(x.double()), backend=ad.AutoFiniteDifferences())
    assert list(fd) == ["2.weight", "2.bias"]


def test_masked_module_hvp_pushforward_and_jacobian(assert_tree_close):
    net, x = _torch_net(), torch.randn(5, 3)
    where = lambda path, p: path.startswith("2.")  # noqa: E731
    t = {"2.weight": torch.randn(2, 8), "2.bias": torch.randn(2)}
    params = dict(net.named_parameters())

    def head_only(w, b):
        return torch.func.functional_call(net, {**params, "2.weight": w, "2.bias": b}, (x,)).pow(2).sum()

    _, expected_hvp = torch.func.jvp(torch.func.grad(head_only, argnums=(0, 1)), (net[2].weight, net[2].bias), (t["2.weight"], t["2.bias"]))
    got = ad.hvp(torch_loss, Active(net, where=where), Constant(x), tangent=t)
    assert_tree_close(list(got.values()), list(expected_hvp), rtol=1e-5, atol=1e-5)
    _, expected_jvp = torch.func.jvp(head_only, (net[2].weight, net[2].bias), (t["2.weight"], t["2.bias"]))
    jvp = ad.pushforward(torch_loss, Active(net, where=where), Constant(x), tangent=t)
    assert_tree_close(jvp, expected_jvp, rtol=1e-5, atol=1e-5)
    out = lambda net, x: net(x)  # noqa: E731
    jac = ad.jacobian(out, Active(net, where=where), Constant(x))
    expected_jac = torch.autograd.functional.jacobian(
        lambda w, b: torch.func.functional_call(net, {**params, "2.weight": w, "2.bias": b}, (x,)), (net[2].weight, net[2].bias)
    )
    assert list(jac) == ["2.weight", "2.bias"]
    assert_tree_close(list(jac.values()), list(expected_jac), rtol=1e-5, atol=1e-5)


def test_a_prepared_masked_module_takes_new_modules_and_checks_the_mask(assert_tree_close):
    where = {"0": False, "2": True}
    prep = ad.prepare(ad.gradient, torch_loss, Active(_torch_net(), where=where), Constant(torch.randn(5, 3)))
    torch.manual_seed(3)
    net, x = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)), torch.randn(5, 3)
    expected = torch.autograd.grad(torch_loss(net, x), [net[2].weight, net[2].bias])
    for got in (prep(net, x), prep(Active(net, where=where), Constant(x))):
        assert list(got) == ["2.weight", "2.bias"]
        assert_tree_close(list(got.values()), list(expected), rtol=1e-6, atol=1e-6)
    with pytest.raises(ad.PreparationMismatchError, match=r"selecting 2 module parameter\(s\).*called with no where="):
        prep(Active(net), Constant(x))


def test_a_module_mask_must_cover_every_parameter():
    with pytest.raises(TypeError, match=r"says nothing about the parameter '2.weight'"):
        ad.gradient(torch_loss, Active(_torch_net(), where={"0": True}), Constant(torch.randn(5, 3)))


def test_fine_tune_only_the_head_of_a_hugging_face_model(assert_tree_close):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    ids, labels = torch.randint(0, 50, (2, 7)), torch.tensor([0, 2])

    def f(model, ids, labels):
        return model(input_ids=ids, labels=labels).loss

    got = ad.gradient(f, Active(model, where=lambda path, p: path.startswith("classifier.")), Constant(ids), Constant(labels))
    assert sorted(got) == ["classifier.bias", "classifier.weight"]
    expected = torch.autograd.grad(f(model, ids, labels), [model.classifier.weight, model.classifier.bias])
    assert_tree_close([got["classifier.weight"], got["classifier.bias"]], list(expected), rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


class LoRALinear(torch.nn.Module):
    """A frozen base weight plus a trainable low-rank update ``B @ A``."""

    def __init__(self, n_in, n_out, rank):
        super().__init__()
        self.base = torch.nn.Linear(n_in, n_out)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, n_in) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(n_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def test_lora_adapters_on_a_frozen_torch_base(assert_tree_close):
    torch.manual_seed(0)
    model = torch.nn.Sequential(LoRALinear(6, 6, 2), torch.nn.GELU(), LoRALinear(6, 1, 2))
    x = torch.randn(10, 6)
    got = ad.gradient(torch_loss, Active(model, where=lambda path, p: "lora_" in path), Constant(x))
    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    expected = torch.autograd.grad(torch_loss(model, x), adapters)
    assert list(got) == ["0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"]
    assert_tree_close(list(got.values()), list(expected), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ JAX model libraries


class Classifier(eqx.Module):
    embedding: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embedding = eqx.nn.Embedding(20, 4, key=k1)
        self.head = eqx.nn.Linear(4, 3, key=k2)

    def __call__(self, ids):
        return jax.vmap(self.head)(jax.vmap(self.embedding)(ids))


def test_freeze_the_embeddings_of_an_equinox_model(assert_tree_close):
    model, ids = Classifier(KEY), jnp.array([1, 5, 7])
    f = lambda m, ids: jnp.sum(jax.nn.log_softmax(m(ids)))  # noqa: E731
    spec = jax.tree_util.tree_map(lambda _: True, model)
    spec = eqx.tree_at(lambda m: m.embedding, spec, replace=False)  # an Equinox filter spec: a prefix of bools
    frozen, trainable = eqx.partition(model, jax.tree_util.tree_map(lambda s: not s, spec))
    expected = jax.grad(lambda t: f(eqx.combine(t, frozen), ids))(trainable)
    for where in (spec, lambda path, leaf: not path.startswith(".embedding")):
        got = ad.gradient(f, Active(model, where=where), Constant(ids))
        assert got.embedding.weight is None
        assert_tree_close(got.head.weight, expected.head.weight, rtol=1e-6, atol=1e-6)
        assert_tree_close(got.head.bias, expected.head.bias, rtol=1e-6, atol=1e-6)


def test_only_the_kernels_of_an_nnx_module(assert_tree_close):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(3, 4, rngs=rngs)
            self.second = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.second(jnp.tanh(self.first(x)))

    net, x = Net(nnx.Rngs(0)), jnp.ones((5, 3))
    f = lambda net, x: jnp.sum(net(x) ** 2)  # noqa: E731
    got = ad.gradient(f, Active(net, where=lambda path, leaf: path.endswith("['kernel']")), Constant(x))
    graph, kernels, rest = nnx.split(net, nnx.PathContains("kernel"), ...)
    expected = jax.grad(lambda k: f(nnx.merge(graph, k, rest), x))(kernels)
    assert got["first"]["bias"].get_value() is None and got["second"]["bias"].get_value() is None
    assert_tree_close(got["first"]["kernel"].get_value(), expected["first"]["kernel"].get_value(), rtol=1e-6, atol=1e-6)
    assert_tree_close(got["second"]["kernel"].get_value(), expected["second"]["kernel"].get_value(), rtol=1e-6, atol=1e-6)


def test_a_plain_dict_mask_of_an_nnx_module_reads_as_its_state(assert_tree_close):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(3, 4, rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.body(x)))

    net, x = Net(nnx.Rngs(0)), jnp.ones((5, 3))
    f = lambda net, x: jnp.sum(net(x) ** 2)  # noqa: E731
    graph, head, rest = nnx.split(net, nnx.PathContains("head"), ...)
    expected = jax.grad(lambda h: f(nnx.merge(graph, h, rest), x))(head)["head"]
    masks = [{"body": False, "head": True}, {"body": {"kernel": False, "bias": False}, "head": {"kernel": True, "bias": True}}]
    for where in masks:
        for got in (
            ad.gradient(f, Active(net, where=where), Constant(x)),
            ad.prepare(ad.gradient, f, Active(net, where=where), Constant(x))(net, x),
        ):
            assert got["body"]["kernel"].get_value() is None and got["body"]["bias"].get_value() is None
            assert_tree_close(got["head"]["kernel"].get_value(), expected["kernel"].get_value(), rtol=1e-6, atol=1e-6)
            assert_tree_close(got["head"]["bias"].get_value(), expected["bias"].get_value(), rtol=1e-6, atol=1e-6)
    # modules inside a pytree: each module's part of the mask may be a plain dict too
    got = ad.gradient(lambda p, x: f(p["net"], x) * p["scale"], Active({"net": net, "scale": jnp.asarray(2.0)},
                      where={"net": {"body": False, "head": True}, "scale": False}), Constant(x))
    assert got["scale"] is None and got["net"]["body"]["kernel"].get_value() is None
    assert_tree_close(got["net"]["head"]["kernel"].get_value(), 2 * expected["kernel"].get_value(), rtol=1e-6, atol=1e-6)
    # a wrong key still names what differs
    with pytest.raises(TypeError, match=r"missing \['head'\]; unexpected \['tail'\]"):
        ad.gradient(f, Active(net, where={"body": False, "tail": True}), Constant(x))


def test_a_plain_dict_mask_of_flax_multi_head_attention_selects_its_query_projection(assert_tree_close):
    attention = nnx.MultiHeadAttention(num_heads=2, in_features=4, qkv_features=4, decode=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(KEY, (3, 5, 4))
    f = lambda m, x: jnp.sum(jnp.tanh(m(x)) ** 2)  # noqa: E731
    graph, query, rest = nnx.split(attention, nnx.All(nnx.Param, nnx.PathContains("query")), ...)
    expected = jax.grad(lambda q: f(nnx.merge(graph, q, rest), x))(query)["query"]
    where = {"query": True, "key": False, "value": False, "out": False}
    got = ad.gradient(f, Active(attention, where=where), Constant(x))
    assert got["key"]["kernel"].get_value() is None and got["out"]["bias"].get_value() is None
    assert_tree_close(got["query"]["kernel"].get_value(), expected["kernel"].get_value(), rtol=1e-5, atol=1e-6)
    assert_tree_close(got["query"]["bias"].get_value(), expected["bias"].get_value(), rtol=1e-5, atol=1e-6)


def test_lora_adapters_on_a_frozen_jax_base(assert_tree_close):
    k1, k2, k3 = jax.random.split(KEY, 3)
    params = {
        "base": {"w": jax.random.normal(k1, (6, 6))},
        "lora": {"a": jax.random.normal(k2, (2, 6)) * 0.1, "b": jax.random.normal(k3, (6, 2)) * 0.1},
    }
    f = lambda p, x: jnp.sum(jnp.tanh(x @ (p["base"]["w"] + p["lora"]["b"] @ p["lora"]["a"]).T) ** 2)  # noqa: E731
    x = jax.random.normal(KEY, (10, 6))
    got = ad.gradient(f, Active(params, where={"base": False, "lora": True}), Constant(x))
    expected = jax.grad(lambda lora: f({"base": params["base"], "lora": lora}, x))(params["lora"])
    assert got["base"] == {"w": None}
    assert_tree_close(got["lora"], expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the testing kit


def _masked_scenarios():
    return [
        Scenario("gradient", loss, (Active(PARAMS, where=only_w), Constant(X)),
                 prep_args=(Active(jax.tree_util.tree_map(lambda v: v + 1, PARAMS), where=only_w), Constant(X * 2)),
                 name="masked-gradient"),
        Scenario("hvp", loss, (Active(PARAMS, where={"w": False, "b": True, "scale": True}), Constant(X)),
                 tangent={"w": None, "b": jnp.ones(2), "scale": jnp.array(1.0)}, name="masked-hvp"),
        Scenario("pushforward", lambda p, x: jnp.tanh(x @ p["w"]), (Active(PARAMS, where=only_w), Constant(X)),
                 tangent={"w": jnp.ones((3, 2)), "b": None, "scale": None}, name="masked-jvp"),
    ]


def test_masked_scenarios_through_every_transform():
    scenarios = _masked_scenarios()
    every = [*scenarios, *closurify(scenarios), *constantify(scenarios), *cachify(scenarios), *batchify(scenarios)]
    report = test_differentiation([ad.AutoJAX(), ad.AutoFiniteDifferences()], every)
    assert not report.failures
    assert scenarios[0].expected()["b"] is None


@parametrize([ad.AutoJAX()], lambda: _masked_scenarios())
def test_the_pytest_plugin_runs_masked_scenarios(activity_case):
    activity_case.check()


def test_a_module_tangent_may_name_the_unselected_parameters(assert_tree_close):
    net, x = _torch_net(), torch.randn(5, 3)
    where = {"0": False, "2": True}
    head = {"2.weight": torch.ones(2, 8), "2.bias": torch.ones(2)}
    expected = ad.pushforward(torch_loss, Active(net, where=where), Constant(x), tangent=head)
    params = dict(net.named_parameters())
    raw = torch.func.jvp(
        lambda w, b: torch.func.functional_call(net, {**params, "2.weight": w, "2.bias": b}, (x,)).pow(2).sum(),
        (net[2].weight, net[2].bias), (head["2.weight"], head["2.bias"]),
    )[1]
    assert_tree_close(expected, raw, rtol=1e-5, atol=1e-5)
    full = {**head, "0.weight": torch.zeros(8, 3), "0.bias": None}
    assert_tree_close(ad.pushforward(torch_loss, Active(net, where=where), Constant(x), tangent=full), raw, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"selected by where="):
        ad.pushforward(torch_loss, Active(net, where=where), Constant(x), tangent={"2.weight": torch.ones(2, 8)})


def test_a_module_inside_a_pytree_gets_paths_below_the_tree_path(assert_tree_close):
    net, x = _torch_net(), torch.randn(5, 3)
    scale = torch.tensor(1.5)
    seen = []

    def where(path, leaf):
        seen.append(path)
        return path in ("['net'].2.bias", "['scale']")

    f = lambda tree, x: torch_loss(tree["net"], x) * tree["scale"]  # noqa: E731
    got = ad.gradient(f, Active({"net": net, "scale": scale}, where=where), Constant(x))
    assert sorted(seen) == sorted(["['net'].0.weight", "['net'].0.bias", "['net'].2.weight", "['net'].2.bias", "['scale']"])
    scale_leaf = scale.clone().requires_grad_()
    expected = torch.autograd.grad(torch_loss(net, x) * scale_leaf, [net[2].bias, scale_leaf])
    assert list(got["net"]) == ["2.bias"]
    assert_tree_close([got["net"]["2.bias"], got["scale"]], list(expected), rtol=1e-5, atol=1e-5)


SCALAR_OPS = ["derivative", "value_and_derivative", "second_derivative", "value_derivative_and_second_derivative"]
ALL_OPS = [*SCALAR_OPS, "gradient", "value_and_gradient", "jacobian", "value_and_jacobian", "pushforward",
           "value_and_pushforward", "pullback", "value_and_pullback", "hessian", "value_gradient_and_hessian",
           "hvp", "gradient_and_hvp"]


@pytest.mark.parametrize("name", ALL_OPS)
@pytest.mark.parametrize("backend", [ad.AutoJAX(), ad.AutoFiniteDifferences()], ids=["jax", "fd"])
def test_every_operator_with_a_mask_equals_the_selected_leaf_as_its_own_argument(name, backend):
    """The selected leaf `a` through a mask, against `a` passed as its own Active argument and
    `b` as a Constant: the same numbers, the masked result holding None where `b` is."""
    from activity._tree import flatten

    a, b = jnp.array(0.7), jnp.array([1.0, -2.0, 0.5])
    scalar_out = name in ("gradient", "value_and_gradient", "hessian", "value_gradient_and_hessian", "hvp", "gradient_and_hvp")
    if scalar_out:
        g = lambda a, b: jnp.sum(jnp.sin(a * b) ** 2)  # noqa: E731
    else:
        g = lambda a, b: jnp.sin(a * b)  # noqa: E731
    op = getattr(ad, name)
    seeds_own, seeds_masked = {}, {}
    if name in ("pushforward", "value_and_pushforward", "hvp", "gradient_and_hvp"):
        seeds_own, seeds_masked = {"tangent": jnp.array(1.0)}, {"tangent": {"a": jnp.array(1.0), "b": None}}
    if name in ("pullback", "value_and_pullback"):
        seeds_own = seeds_masked = {"cotangent": jnp.ones(3)}
    masked = op(lambda p: g(p["a"], p["b"]), Active({"a": a, "b": b}, where={"a": True, "b": False}),
                backend=backend, **seeds_masked)
    own = op(g, Active(a), Constant(b), backend=ad.AutoJAX(), **seeds_own)
    got, expected = flatten(masked)[0], flatten(own)[0]
    assert len(got) == len(expected)
    for x, y in zip(got, expected):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
