"""AutoTorch on nn.Modules: gradients against hand-written autograd, and nothing of the model changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import activity as ad
from activity import Active, Cache, Constant


def generator(seed):
    return torch.Generator().manual_seed(seed)


def init(model, seed):
    """Deterministic parameters without touching the global RNG."""
    g = generator(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
    }


def assert_unchanged(model, before):
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), f"{k} changed"
    assert all(g is None for g in after["grads"]), ".grad was set"
    assert before["requires_grad"] == after["requires_grad"]
    assert before["training"] == after["training"]


def mean_loss(model, x):
    out = model(x)
    return out.mean() if isinstance(out, torch.Tensor) else out[0].mean()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, bias=False, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


def x_of(*shape, seed=100):
    return torch.randn(*shape, generator=generator(seed))


MODELS = {
    "linear_chain": (lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)), lambda: x_of(4, 3), True),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh()), lambda: x_of(2, 2, 5, 5), True),
    "batchnorm1d_train": (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), lambda: x_of(6, 3), True),
    "batchnorm1d_eval": (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), lambda: x_of(6, 3), False),
    "batchnorm2d_train": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3)), lambda: x_of(2, 2, 4, 4), True),
    "batchnorm2d_eval": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3)), lambda: x_of(2, 2, 4, 4), False),
    "layernorm": (lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)), lambda: x_of(5, 3), True),
    "embedding": (lambda: nn.Sequential(nn.Embedding(10, 3), nn.Linear(3, 2)), lambda: torch.tensor([[1, 4, 7], [0, 9, 4]]), True),
    "lstm": (lambda: nn.LSTM(3, 4, batch_first=True), lambda: x_of(2, 5, 3), True),
    "gru": (lambda: nn.GRU(3, 4, batch_first=True), lambda: x_of(2, 5, 3), True),
    "multihead_attention": (Attention, lambda: x_of(2, 4, 8), True),
}


def _model(name, seed=0):
    make_model, make_x, training = MODELS[name]
    model = init(make_model(), seed)
    model.train(training)
    if name.startswith("batchnorm"):  # non-trivial running statistics
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.running_mean.add_(0.2)
                    m.running_var.mul_(1.5)
    return model, make_x()


def _reference(model, x):
    """Hand-written autograd on a copy (train-mode BatchNorm would move the copy's statistics)."""
    twin = copy.deepcopy(model)
    names = [n for n, p in twin.named_parameters() if p.requires_grad]
    params = [p for p in twin.parameters() if p.requires_grad]
    value = mean_loss(twin, x)
    return value, dict(zip(names, torch.autograd.grad(value, params)))


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_gradient_matches_autograd(name, prepared):
    model, x = _model(name)
    before = snapshot(model)
    if prepared:
        stale_model, stale_x = _model(name, seed=1)
        if stale_x.dtype.is_floating_point:
            stale_x = stale_x + 1.0
        prep = ad.prepare(ad.value_and_gradient, mean_loss, Active(stale_model), Constant(stale_x))
        value, grads = prep(model, x)
    else:
        value, grads = ad.value_and_gradient(mean_loss, Active(model), Constant(x))
    expected_value, expected = _reference(model, x)
    assert list(grads) == list(expected)
    for k in expected:
        torch.testing.assert_close(grads[k], expected[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, expected_value.detach())
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["linear_chain", "batchnorm1d_train", "lstm"])
def test_model_gradient_matches_finite_differences(name):
    model, x = _model(name)
    before = snapshot(model)
    grads = ad.gradient(mean_loss, Active(model), Constant(x), backend=ad.AutoFiniteDifferences())
    _, expected = _reference(model, x)
    for k in expected:
        assert grads[k].dtype == expected[k].dtype
        torch.testing.assert_close(grads[k], expected[k], rtol=1e-4, atol=1e-6)
    assert_unchanged(model, before)


@pytest.mark.parametrize("op", ["hessian", "jacobian", "hvp", "pushforward", "pullback"])
def test_batchnorm_train_mode_in_other_operators_leaves_statistics(op):
    model, x = _model("batchnorm1d_train")
    before = snapshot(model)
    head = init(nn.Linear(4, 1), 5)
    w = torch.randn(3, generator=generator(7))

    def f(w, model, x):
        return head(model(x * w)).tanh().sum()

    def vector_f(w, model, x):
        return model(x * w).sum(0)

    args = (Active(w), Constant(model), Constant(x))
    if op == "hessian":
        ad.hessian(f, *args)
    elif op == "jacobian":
        ad.jacobian(vector_f, *args)
    elif op == "hvp":
        ad.hvp(f, *args, tangent=torch.ones(3))
    elif op == "pushforward":
        ad.pushforward(vector_f, *args, tangent=torch.ones(3))
    else:
        ad.pullback(vector_f, *args, cotangent=torch.ones(4))
    assert_unchanged(model, before)


def test_frozen_parameters_are_constants():
    model, x = _model("linear_chain")
    model[0].weight.requires_grad_(False)
    before = snapshot(model)
    grads = ad.gradient(mean_loss, Active(model), Constant(x))
    assert "0.weight" not in grads and set(grads) == {"0.bias", "2.weight", "2.bias"}
    _, expected = _reference(model, x)
    for k in expected:
        torch.testing.assert_close(grads[k], expected[k])
    assert_unchanged(model, before)


def test_constant_module_gives_input_gradients():
    model, x = _model("linear_chain")
    before = snapshot(model)
    g = ad.gradient(mean_loss, Constant(model), Active(x))
    xr = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(mean_loss(model, xr), xr)
    torch.testing.assert_close(g, expected)
    assert_unchanged(model, before)


def test_tied_parameters_count_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False)
            self.b = nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model = init(Tied(), 0)
    x = x_of(4, 3)
    grads = ad.gradient(mean_loss, Active(model), Constant(x))
    assert list(grads) == ["a.weight"]
    (expected,) = torch.autograd.grad(mean_loss(model, x), [model.a.weight])
    torch.testing.assert_close(grads["a.weight"], expected)


def test_grad_mode_restored_when_f_raises():
    model, x = _model("linear_chain")

    def broken(model, x):
        model(x)
        raise KeyError("boom")

    with torch.no_grad():
        with pytest.raises(KeyError) as info:
            ad.gradient(broken, Active(model), Constant(x))
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    assert any("activity.gradient" in note for note in info.value.__notes__)


def test_gradient_works_under_no_grad():
    model, x = _model("linear_chain")
    _, expected = _reference(model, x)
    with torch.no_grad():
        grads = ad.gradient(mean_loss, Active(model), Constant(x))
    for k in expected:
        torch.testing.assert_close(grads[k], expected[k])


# ---------------------------------------------------------------- the closure pitfall


def test_closure_that_mutates_a_captured_buffer_fails_in_torch_func_but_cache_works():
    w = torch.randn(4, generator=generator(0))
    buffer = torch.zeros(4)

    def closure(w):
        buffer[:] = torch.tanh(w)  # writes into a tensor captured from outside the transform
        return (buffer * buffer).sum()

    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        torch.func.grad(closure)(w)

    def f(w, buffer):
        buffer[:] = torch.tanh(w)
        return (buffer * buffer).sum()

    expected = 2 * torch.tanh(w) * (1 - torch.tanh(w) ** 2)
    torch.testing.assert_close(ad.gradient(f, Active(w), Cache(torch.zeros(4))), expected)
    # the same in operators that run inside torch.func transforms
    hess = ad.hessian(f, Active(w), Cache(torch.zeros(4)))
    t = torch.tanh(w)
    torch.testing.assert_close(torch.diagonal(hess), 2 * (1 - t**2) ** 2 - 4 * t**2 * (1 - t**2))
    torch.testing.assert_close(ad.hvp(f, Active(w), Cache(torch.zeros(4)), tangent=torch.ones(4)), hess.sum(1))


@pytest.mark.parametrize("op", ["gradient", "jacobian", "pushforward", "pullback", "hessian", "hvp"])
def test_cache_pytrees_written_in_place_in_every_operator(op):
    w = torch.randn(3, generator=generator(1), dtype=torch.float64)

    def f(w, cache):
        cache["a"][:] = w**2
        cache["b"][0].copy_(torch.sin(w))
        cache["b"][0].add_(cache["a"])
        return (cache["b"][0] * w).sum() if op in ("gradient", "hessian", "hvp") else cache["b"][0] * w

    def pure(w):
        return (torch.sin(w) + w**2) * w

    cache = Cache({"a": torch.zeros(3), "b": [torch.zeros(3), torch.zeros(2)]})
    t = torch.ones(3, dtype=torch.float64)
    if op == "gradient":
        torch.testing.assert_close(ad.gradient(f, Active(w), cache), torch.func.grad(lambda w: pure(w).sum())(w))
    elif op == "jacobian":
        torch.testing.assert_close(ad.jacobian(f, Active(w), cache), torch.func.jacrev(pure)(w))
    elif op == "pushforward":
        torch.testing.assert_close(ad.pushforward(f, Active(w), cache, tangent=t), torch.func.jvp(pure, (w,), (t,))[1])
    elif op == "pullback":
        torch.testing.assert_close(ad.pullback(f, Active(w), cache, cotangent=t), torch.func.vjp(pure, w)[1](t)[0])
    elif op == "hessian":
        torch.testing.assert_close(ad.hessian(f, Active(w), cache), torch.func.hessian(lambda w: pure(w).sum())(w))
    else:
        expected = torch.func.jvp(torch.func.grad(lambda w: pure(w).sum()), (w,), (t,))[1]
        torch.testing.assert_close(ad.hvp(f, Active(w), cache, tangents=[t])[0], expected)


@pytest.mark.parametrize("op", [ad.gradient, ad.value_and_gradient])
def test_prepared_gradient_sees_every_change_to_the_module_between_calls(op):
    """Prepared calls check that the module is the one prepared: parameters updated in place or
    a layer replaced by one of the same layout give the new gradients (never stale ones); any
    change of layout is a mismatch."""
    model, x = _model("linear_chain")
    prepared = ad.prepare(op, mean_loss, Active(model), Constant(x))

    def grads_of(result):
        return result[1] if op is ad.value_and_gradient else result

    def assert_matches_autograd():
        _, expected = _reference(model, x)
        got = grads_of(prepared(model, x))
        assert set(got) == set(expected)
        for k in expected:
            torch.testing.assert_close(got[k], expected[k])

    assert_matches_autograd()
    with torch.no_grad():  # an optimiser step: same objects, new values
        for p in model.parameters():
            p.mul_(0.5).add_(0.1)
    assert_matches_autograd()
    model[2] = nn.Linear(model[2].in_features, model[2].out_features)  # new objects, same layout
    assert_matches_autograd()

    def replace_layer():
        model[2] = nn.Linear(model[2].in_features, model[2].out_features, bias=False)

    def freeze():
        model[0].weight.requires_grad_(False)

    def reshape():
        model[0].bias.data = torch.zeros(model[0].bias.shape[0] + 1)

    def new_buffer():
        model[0].register_buffer("scale", torch.ones(1))

    for change, where in [(replace_layer, "2.bias"), (freeze, "0.weight"), (reshape, "0.bias"), (new_buffer, "scale")]:
        model, x = _model("linear_chain")
        prepared = ad.prepare(op, mean_loss, Active(model), Constant(x))
        prepared(model, x)
        change()
        with pytest.raises(ad.PreparationMismatchError, match=r"argument 0\b"):
            prepared(model, x)
