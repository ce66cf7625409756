"""The per-call fast paths (issue 15): prepared torch calls past the generic dispatch, unprepared
torch gradients reusing the last call's checked split, and prepared JAX calls of arguments with
static leaves (Equinox modules) jitted over their arrays. Each gives what the raw call gives and
keeps every check of the slow path. Expected values come from `torch.autograd.grad` and
`eqx.filter_grad` written out here."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
eqx = pytest.importorskip("equinox")
import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402

import activity as ad  # noqa: E402
from activity import Active, Constant  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def mlp(width: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def mse(model, x):
    return model(x).pow(2).mean()


def data(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def raw_gradient(model, x, loss=mse) -> dict:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss(model, x), [p for _, p in named])
    return {name: g for (name, _), g in zip(named, grads)}


def assert_dicts_close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL)


# ---------------------------------------------------------------- prepared torch


def test_prepared_pullback_and_value_on_new_data_match_the_tape():
    model, x = mlp(), data(5, 4)
    cotangent = data(5, 1, seed=2)
    prepared = ad.prepare(ad.value_and_pullback, lambda m, x: m(x), Active(model), Constant(x), cotangent=cotangent)
    for seed in (3, 4):
        x_new, ct_new = data(5, 4, seed=seed), data(5, 1, seed=seed + 10)
        value, pulled = prepared(model, x_new, cotangent=ct_new)
        params = list(model.parameters())
        want = torch.autograd.grad(model(x_new), params, ct_new)
        torch.testing.assert_close(value, model(x_new).detach(), **TOL)
        assert_dicts_close(pulled, dict(zip(["0.weight", "0.bias", "2.weight", "2.bias"], want)))
        assert not value.requires_grad and all(model.get_parameter(n).grad is None for n in pulled)


def test_prepared_pullback_of_a_tuple_output_takes_a_tuple_cotangent():
    w = data(3, seed=5)
    f = lambda w, x: (torch.sin(w) * x, (w**2).sum())  # noqa: E731
    x = data(3, seed=6)
    cotangent = (data(3, seed=7), torch.tensor(2.0))
    prepared = ad.prepare(ad.pullback, f, Active(w), Constant(x), cotangent=cotangent)
    leaf = w.detach().requires_grad_()
    out = f(leaf, x)
    (want,) = torch.autograd.grad(out, leaf, cotangent)
    torch.testing.assert_close(prepared(w, x, cotangent=cotangent), want, **TOL)


def test_prepared_pullback_refuses_a_cotangent_of_another_shape_naming_it():
    model, x = mlp(), data(5, 4)
    prepared = ad.prepare(ad.pullback, lambda m, x: m(x), Active(model), Constant(x), cotangent=torch.ones(5, 1))
    with pytest.raises(ValueError, match=r"cotangent has shape \(5, 2\), but f's output there has shape \(5, 1\)"):
        prepared(model, x, cotangent=torch.ones(5, 2))


def test_prepared_pytree_of_tensors_is_checked_leaf_by_leaf():
    params = {"w": data(4, 3), "b": data(3, seed=2)}
    f = lambda p, x: torch.tanh(x @ p["w"] + p["b"]).sum()  # noqa: E731
    x = data(2, 4, seed=3)
    tangent = {"w": torch.ones(4, 3), "b": torch.ones(3)}
    prepared = ad.prepare(ad.pushforward, f, Active(params), Constant(x), tangent=tangent)
    _, want = torch.func.jvp(lambda p: f(p, x), (params,), (tangent,))
    torch.testing.assert_close(prepared(params, x, tangent=tangent), want, **TOL)
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 0 .*\['w'\].*shape \(4, 3\).*shape \(5, 3\)"):
        prepared({"w": data(5, 3), "b": data(3)}, x, tangent=tangent)
    with pytest.raises(ValueError, match=r"tangent\['b'\] has shape \(4,\), expected \(3,\)"):
        prepared(params, x, tangent={"w": torch.ones(4, 3), "b": torch.ones(4)})


def test_prepared_hvp_of_one_tangent_matches_double_backward():
    model, x = mlp(), data(5, 4)
    tangent = {name: torch.full_like(p, 0.5) for name, p in model.named_parameters()}
    prepared = ad.prepare(ad.hvp, mse, Active(model), Constant(x), tangent=tangent)
    params = list(model.parameters())
    grads = torch.autograd.grad(mse(model, x), params, create_graph=True)
    want = torch.autograd.grad(grads, params, list(tangent.values()))
    assert_dicts_close(prepared(model, x, tangent=tangent), dict(zip(tangent, want)))


# ---------------------------------------------------------------- unprepared torch


# A prepared torch gradient keeps a view of the module and tape leaves aliasing its
# parameters between calls (`ReusedView`): each test changes the module between calls the
# way users do and compares with `torch.autograd.grad` on the module as it is then.


@pytest.mark.parametrize("op", ["gradient", "value_and_gradient", "pullback"])
def test_prepared_calls_follow_in_place_updates_and_new_storage_of_parameters(op):
    model, x = mlp(), data(5, 4)
    loss = mse if op != "pullback" else (lambda m, x: m(x))
    seeds = {} if op != "pullback" else {"cotangent": torch.ones(5, 1)}
    prepared = ad.prepare(getattr(ad, op), loss, Active(model), Constant(x), **seeds)

    def expected() -> dict:
        if op != "pullback":
            return raw_gradient(model, x)
        named = [(n, p) for n, p in model.named_parameters()]
        grads = torch.autograd.grad(model(x), [p for _, p in named], torch.ones(5, 1))
        return {n: g for (n, _), g in zip(named, grads)}

    def got() -> dict:
        result = prepared(model, x, **seeds)
        return result[1] if op == "value_and_gradient" else result

    assert_dicts_close(got(), expected())
    with torch.no_grad():  # what an optimizer step does
        for p in model.parameters():
            p.add_(0.5 * torch.ones_like(p))
    assert_dicts_close(got(), expected())
    model[0].weight.data = data(4, 4, seed=7)  # new storage, same shape
    assert_dicts_close(got(), expected())
    with torch.no_grad():
        model[0].weight.copy_(data(4, 4, seed=8))
    assert_dicts_close(got(), expected())


def test_prepared_gradient_follows_train_and_eval_between_calls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    x = data(6, 4)
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    stats = model[1].running_mean.clone()
    for mode in (True, False, True, False):
        model.train(mode)
        twin = __import__("copy").deepcopy(model)  # the raw call changes its module's statistics
        assert_dicts_close(prepared(model, x), raw_gradient(twin, x))
        torch.testing.assert_close(model[1].running_mean, stats, rtol=0, atol=0)  # never the user's


class Counting(nn.Module):
    """Sets an attribute on itself in forward, and reads it: each call must see the module as
    the user has it (without the attribute), not what an earlier call left on a view."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        scale = 3.0 if getattr(self, "seen", False) else 1.0
        self.seen = True
        return scale * self.layer(x)


def test_prepared_gradient_does_not_carry_attributes_f_set_on_the_view_into_the_next_call():
    model, x = Counting(), data(5, 4)
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    fresh = Counting()
    fresh.load_state_dict(model.state_dict())
    for _ in range(3):
        assert_dicts_close(prepared(model, x), raw_gradient(__import__("copy").deepcopy(fresh), x))
    assert not hasattr(model, "seen")


def test_a_module_f_keeps_stays_usable_and_later_calls_stay_right():
    model, x = mlp(), data(5, 4)
    kept = []

    def loss(m, x):
        kept.append(m)
        return mse(m, x)

    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    first = prepared(model, x)
    assert_dicts_close(first, raw_gradient(model, x))
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    assert_dicts_close(prepared(model, x), raw_gradient(model, x))
    # the module f kept from the first call is still a whole module (its flags, its layers)
    assert kept[0].training and kept[0](x).shape == (5, 1)


def test_a_buffer_f_returns_in_its_aux_is_not_changed_by_later_calls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).train()

    def loss(m, x):
        return mse(m, x), m[1].running_mean  # the statistics this call computed

    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(data(6, 4)), has_aux=True)
    _, first = prepared(model, data(6, 4, seed=1))
    kept = first.clone()
    _, second = prepared(model, data(6, 4, seed=2) * 3.0 + 1.0)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    twin = __import__("copy").deepcopy(model)
    twin(data(6, 4, seed=2) * 3.0 + 1.0)  # one train-mode step from the user's statistics
    torch.testing.assert_close(second, twin[1].running_mean, **TOL)


def test_a_buffer_f_returns_as_an_output_is_not_changed_by_later_calls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).train()

    def f(m, x):
        return m(x), m[1].running_mean  # the statistics this call computed, as an output

    cotangent = (torch.ones(6, 1), torch.zeros(4))
    prepared = ad.prepare(ad.value_and_pullback, f, Active(model), Constant(data(6, 4)), cotangent=cotangent)
    (_, first), _ = prepared(model, data(6, 4, seed=1), cotangent=cotangent)
    kept = first.clone()
    (_, second), _ = prepared(model, data(6, 4, seed=2) * 3.0 + 1.0, cotangent=cotangent)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    twin = __import__("copy").deepcopy(model)
    twin(data(6, 4, seed=2) * 3.0 + 1.0)
    torch.testing.assert_close(second, twin[1].running_mean, **TOL)


def test_prepared_gradient_called_inside_f_of_itself_is_right():
    model, x = mlp(), data(5, 4)
    depth, inner = [0], []

    def loss(m, x):
        depth[0] += 1
        if depth[0] == 1:
            inner.append(prepared(model, x))  # a nested call while this call holds the view
        return mse(m, x)

    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    outer = prepared(model, x)
    assert len(inner) == 1
    assert_dicts_close(outer, raw_gradient(model, x))
    assert_dicts_close(inner[0], raw_gradient(model, x))
    depth[0] = 0
    assert_dicts_close(prepared(model, x), raw_gradient(model, x))  # the views went back whole


def test_an_error_raised_by_f_propagates_and_the_next_call_is_right():
    model, x = mlp(), data(5, 4)
    fail = [True]

    def loss(m, x):
        m.partial = True  # left on the view by the failed call
        if fail[0]:
            raise KeyError("from f")
        return mse(m, x)

    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    with pytest.raises(KeyError, match="from f"):
        prepared(model, x)
    fail[0] = False
    assert_dicts_close(prepared(model, x), raw_gradient(model, x))
    assert not hasattr(model, "partial")


def test_a_prepared_gradient_keeps_no_dropped_model_alive_once_it_is_dropped_too():
    model, x = mlp(), data(5, 4)
    model.forward = __import__("functools").partial(nn.Sequential.forward, model)  # a cycle through __dict__
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    for _ in range(3):
        assert_dicts_close(prepared(model, x), raw_gradient(model, x))
    module = weakref.ref(model)
    del model, prepared
    gc.collect()
    assert module() is None


@pytest.mark.parametrize("prepared", [False, True])
def test_one_tangent_pushforward_differentiates_only_the_active_occurrence(prepared):
    """Forward mode of one tangent runs on dual tensors: the same tensor passed again as a
    Constant, or captured by f, carries no tangent (against the analytic partial derivative)."""
    x = data(3, seed=2)
    t = data(3, seed=3)

    def f(x, c):
        return torch.sin(x) * c + x * x.detach().sum() + captured

    captured = x * 2.0
    want_value = torch.sin(x) * x + x * x.sum() + captured
    want = torch.cos(x) * x * t + t * x.sum()  # c, the detached sum and the capture held fixed
    if prepared:
        call = ad.prepare(ad.value_and_pushforward, f, Active(x), Constant(x), tangent=t)
        got_value, got = call(x, x, tangent=t)
    else:
        got_value, got = ad.value_and_pushforward(f, Active(x), Constant(x), tangent=t)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_value, want_value, **TOL)


class LoggedTensor(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` counts the calls it sees (as tracing and
    logging subclasses do): its loss must take the public `torch.autograd.grad`."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_loss_of_a_tensor_subclass_takes_torch_autograd_grad_and_is_right():
    model, x = mlp(), data(5, 4).as_subclass(LoggedTensor)
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    for _ in range(2):
        LoggedTensor.calls = 0
        got = prepared(model, x)
        assert LoggedTensor.calls > 0
        assert_dicts_close(got, raw_gradient(model, x.as_subclass(torch.Tensor)))


def test_unprepared_calls_of_one_signature_each_get_their_own_models_gradient():
    x = data(5, 4)
    first, second = mlp(seed=0), mlp(seed=1)
    for model in (first, second, first):
        assert_dicts_close(ad.gradient(mse, Active(model), Constant(x)), raw_gradient(model, x))


def test_unprepared_calls_see_a_layer_replaced_and_a_parameter_frozen_in_between():
    model, x = mlp(), data(5, 4)
    ad.gradient(mse, Active(model), Constant(x))
    model[2] = nn.Linear(4, 1)
    assert_dicts_close(ad.gradient(mse, Active(model), Constant(x)), raw_gradient(model, x))
    model[0].bias.requires_grad_(False)
    got = ad.gradient(mse, Active(model), Constant(x))
    assert "0.bias" not in got
    assert_dicts_close(got, raw_gradient(model, x))


def test_unprepared_pullbacks_see_new_models_layers_frozen_parameters_and_cotangents():
    """Unprepared pullbacks of one signature reuse the last call's checked path: each call
    still gets its own model's, layer's and cotangent's pullback (against torch.autograd.grad)."""
    x = data(5, 4)

    def want(model, ct):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(model(x), [p for _, p in named], ct)
        return {n: g for (n, _), g in zip(named, grads)}

    first, second = mlp(seed=0), mlp(seed=1)
    for model, seed in ((first, 2), (second, 3), (first, 4)):
        ct = data(5, 1, seed=seed)
        assert_dicts_close(ad.pullback(lambda m, x: m(x), Active(model), Constant(x), cotangent=ct), want(model, ct))
    first[2] = nn.Linear(4, 1)
    ct = data(5, 1, seed=5)
    assert_dicts_close(ad.pullback(lambda m, x: m(x), Active(first), Constant(x), cotangent=ct), want(first, ct))
    first[0].weight.requires_grad_(False)
    got = ad.pullback(lambda m, x: m(x), Active(first), Constant(x), cotangent=ct)
    assert "0.weight" not in got
    assert_dicts_close(got, want(first, ct))
    value, got = ad.value_and_pullback(lambda m, x: m(x), Active(second), Constant(x), cotangent=ct)
    torch.testing.assert_close(value, second(x).detach(), **TOL)
    assert_dicts_close(got, want(second, ct))
    with pytest.raises(ValueError, match="shape"):
        ad.pullback(lambda m, x: m(x), Active(second), Constant(x), cotangent=torch.ones(5, 2))


def test_unprepared_calls_keep_no_dropped_model_alive():
    model, x = mlp(), data(5, 4)
    ad.gradient(mse, Active(model), Constant(x))
    ad.gradient(mse, Active(model), Constant(x))
    module, weight = weakref.ref(model), weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert module() is None and weight() is None


def test_an_unprepared_call_of_the_same_kinds_with_jax_arrays_is_still_refused():
    backend = ad.AutoTorch()
    square = lambda w: (w**2).sum()  # noqa: E731
    ad.gradient(square, Active(torch.ones(3)), backend=backend)
    with pytest.raises(ad.UnsupportedError, match=r"cannot differentiate the JAX value"):
        ad.gradient(square, Active(jnp.ones(3)), backend=backend)


# ---------------------------------------------------------------- Equinox, prepared


def equinox_loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def test_prepared_equinox_module_gives_filter_grad_on_new_data_without_tracing_again():
    model = eqx.nn.MLP(3, 1, 8, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    traces = []

    def counted(model, x):
        traces.append(1)
        return equinox_loss(model, x)

    x = jnp.ones((4, 3))
    prepared = ad.prepare(ad.gradient, counted, Active(model), Constant(x))
    traced_at_prepare = len(traces)
    for seed in range(3):
        x_new = jax.random.normal(jax.random.PRNGKey(seed), (4, 3))
        got = prepared(model, x_new)
        want = eqx.filter_grad(equinox_loss)(model, x_new)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(traces) == traced_at_prepare


def test_prepared_equinox_module_refuses_another_activation_or_width():
    model = eqx.nn.MLP(3, 1, 8, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    x = jnp.ones((4, 3))
    prepared = ad.prepare(ad.gradient, equinox_loss, Active(model), Constant(x))
    relu = eqx.nn.MLP(3, 1, 8, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(0))
    with pytest.raises(ad.PreparationMismatchError, match="argument 0"):
        prepared(relu, x)
    wider = eqx.nn.MLP(3, 1, 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    with pytest.raises(ad.PreparationMismatchError, match="argument 0"):
        prepared(wider, x)
    with pytest.raises(ad.PreparationMismatchError, match="argument 1"):
        prepared(model, jnp.ones((4, 5)))


def _freeze_bias(model):
    model[0].bias.requires_grad_(False)


def _narrow_bias_to_a_view(model):
    model[0].bias.data = model[0].bias.data[:2]  # the same storage and data pointer, a smaller shape


def _make_bias_float64(model):
    model[0].bias.data = model[0].bias.data.double()


def _replace_bias_storage_with_a_longer_one(model):
    model[0].bias.data = torch.zeros(6)


@pytest.mark.parametrize("change", [_freeze_bias, _narrow_bias_to_a_view, _make_bias_float64, _replace_bias_storage_with_a_longer_one])
def test_a_prepared_call_sees_a_parameter_changed_in_place_between_calls(change):
    # The parameter object stays the same; only its requires_grad, shape or dtype changes: the
    # prepared call must not take its prepared path (a mismatch says what differs).
    model, x = mlp(), data(5, 4)
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    assert_dicts_close(prepared(model, x), raw_gradient(model, x))
    change(model)
    if change is _freeze_bias:
        got = ad.prepare(ad.gradient, mse, Active(model), Constant(x), strict=False)(model, x)
        assert "0.bias" not in got
        assert_dicts_close(got, raw_gradient(model, x))
    with pytest.raises(ad.PreparationMismatchError, match=r"0\.bias"):
        prepared(model, x)


def test_a_prepared_call_under_autocast_stays_right_and_prepared():
    # torch.compile's tensor guard (which still_describes asks first) also compares dispatch state:
    # under autocast it says no, and the parameters' metadata, unchanged, decides.
    model, x = mlp(), data(5, 4)
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    description = prepared._plan.problem._described[(0, 0)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert description.still_describes(model)
        got = prepared(model, x)
        want = raw_gradient(model, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_prepared_gradient_after_its_first_call_still_takes_every_kind_of_constant_and_loss():
    """After a first call, a Constant tensor and f's loss are checked by one guard each; what
    the guard refuses (a Constant that requires grad, one made in inference mode, another
    memory layout; a loss of another dtype) takes the full checks and is still right, and the
    Constant is left as it was."""

    def loss(model, x):
        out = model(x).pow(2).mean()
        return out.double() if bool(x[0, 0] > 100) else out

    model = mlp()
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(data(5, 4)))
    assert_dicts_close(prepared(model, data(5, 4, seed=2)), raw_gradient(model, data(5, 4, seed=2), loss))
    tracked = data(5, 4, seed=3).requires_grad_()
    assert_dicts_close(prepared(model, tracked), raw_gradient(model, tracked.detach(), loss))
    assert tracked.grad is None and tracked.requires_grad
    with torch.inference_mode():
        frozen = data(5, 4, seed=4)
    assert_dicts_close(prepared(model, frozen), raw_gradient(model, frozen.clone(), loss))
    transposed = data(4, 5, seed=5).T
    assert not transposed.is_contiguous()
    assert_dicts_close(prepared(model, transposed), raw_gradient(model, transposed, loss))
    big = data(5, 4, seed=6)
    big[0, 0] = 1000.0
    got = prepared(model, big)
    assert all(g.dtype == torch.float32 for g in got.values())
    assert_dicts_close(got, raw_gradient(model, big, loss))
    assert_dicts_close(prepared(model, data(5, 4, seed=7)), raw_gradient(model, data(5, 4, seed=7), loss))


def test_prepared_pullback_after_its_first_call_still_takes_every_kind_of_cotangent():
    """After a first call the cotangent and f's output are checked by one guard each; a
    cotangent the guard refuses (one that requires grad, another layout, another dtype) takes
    the full checks, which give the tape's answer (a float64 cotangent of a float32 output is
    taken as its float32 value, as it always was)."""
    model, x = mlp(), data(5, 4)
    params = [p for p in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    prepared = ad.prepare(ad.pullback, lambda m, x: m(x), Active(model), Constant(x), cotangent=data(5, 1, seed=2))

    def want(ct):
        return dict(zip(names, torch.autograd.grad(model(x), params, ct)))

    for ct in (data(5, 1, seed=3), data(5, 1, seed=4).requires_grad_(), data(1, 5, seed=5).T, data(5, 1, seed=6)):
        assert_dicts_close(prepared(model, x, cotangent=ct), want(ct.detach()))
    wide = data(5, 1, seed=7).double()
    assert_dicts_close(prepared(model, x, cotangent=wide), want(wide.float()))
    assert_dicts_close(prepared(model, x, cotangent=data(5, 1, seed=8)), want(data(5, 1, seed=8)))


def test_prepared_hvp_after_its_first_call_still_takes_every_kind_of_tangent():
    """After a first call a tangent's leaves are checked by one guard; a tangent it refuses (a
    leaf that requires grad, another layout) is checked leaf by leaf and still gives the double
    backward's answer, and one of float64 leaves the answer of its float32 values, as it always
    did, for a module and for a dict."""
    model, x = mlp(), data(5, 4)
    named = list(model.named_parameters())
    params = [p for _, p in named]

    def want(tangent):
        grads = torch.autograd.grad(mse(model, x), params, create_graph=True)
        return dict(zip([n for n, _ in named], torch.autograd.grad(grads, params, [t.detach() for t in tangent])))

    def tangent(seed, transform=lambda t: t):
        return [transform(data(*p.shape, seed=seed + i)) for i, (_, p) in enumerate(named)]

    prepared = ad.prepare(ad.hvp, mse, Active(model), Constant(x), tangent={n: torch.ones_like(p) for n, p in named})
    for t in (tangent(10), tangent(20, lambda t: t.requires_grad_()), tangent(30, lambda t: t.T.contiguous().T), tangent(40)):
        assert_dicts_close(prepared(model, x, tangent=dict(zip([n for n, _ in named], t))), want(t))
    wide = tangent(50, lambda t: t.double())
    assert_dicts_close(prepared(model, x, tangent=dict(zip([n for n, _ in named], wide))), want([t.float() for t in wide]))

    tree = {"w": data(4, 3, seed=3), "v": data(3, seed=4)}
    loss = lambda p, x: torch.tanh(x @ p["w"] @ p["v"]).pow(2).sum()  # noqa: E731
    tree_hvp = ad.prepare(ad.hvp, loss, Active(tree), Constant(x), tangent={"w": torch.ones(4, 3), "v": torch.ones(3)})
    for seed, dtype in ((60, torch.float32), (70, torch.float64), (80, torch.float32)):
        t = {"w": data(4, 3, seed=seed).to(dtype), "v": data(3, seed=seed + 1)}
        leaves = [tree["w"].detach().requires_grad_(), tree["v"].detach().requires_grad_()]
        grads = torch.autograd.grad(loss(dict(zip(("w", "v"), leaves)), x), leaves, create_graph=True)
        expected = torch.autograd.grad(grads, leaves, [t["w"].float(), t["v"]])
        got = tree_hvp(tree, x, tangent=t)
        torch.testing.assert_close(got["w"], expected[0], **TOL)
        torch.testing.assert_close(got["v"], expected[1], **TOL)


def test_prepared_hvp_gives_owned_zeros_when_a_later_call_takes_a_branch_whose_double_backward_is_a_zero_tensor():
    """After a first call the products are checked by one guard; torch's immutable ZeroTensor (the
    double backward of abs) on a later call is refused by it and still becomes zeros the caller
    may write to, as on the first call (against the analytic Hessian-vector products)."""

    def f(x, c):
        return (x**3).sum() if bool(c > 0) else x.abs().sum()

    x, t = data(3, seed=1), data(3, seed=2)
    prepared = ad.prepare(ad.hvp, f, Active(x), Constant(torch.tensor(1.0)), tangent=t)
    torch.testing.assert_close(prepared(x, torch.tensor(1.0), tangent=t), 6 * x * t, **TOL)
    zeros = prepared(x, torch.tensor(-1.0), tangent=t)
    assert not zeros._is_zerotensor()
    zeros += 1.0  # owned, writable
    torch.testing.assert_close(zeros, torch.ones(3))
    torch.testing.assert_close(prepared(x, torch.tensor(2.0), tangent=t), 6 * x * t, **TOL)


# ---------------------------------------------------------------- parameters carrying Python attributes


class _ScaledLinear(nn.Linear):
    """Reads a Python attribute of its weight in forward, as quantisation and pruning wrappers do."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight * self.weight.scale, self.bias)


@pytest.mark.parametrize("scales", [(2.0, 3.0, 3.0), (torch.tensor(2.0), torch.tensor(0.5), 4.0)], ids=["numbers", "tensors"])
def test_a_prepared_call_follows_the_attributes_its_parameters_carry_between_calls(scales):
    torch.manual_seed(0)
    layer = _ScaledLinear(3, 2)
    layer.weight.scale = scales[0]
    layer.bias._is_hf_initialized = True  # what a model loaded by Hugging Face carries on each parameter
    x = data(4, 3)
    prepared = ad.prepare(ad.gradient, mse, Active(layer), Constant(x))
    for scale in scales:
        layer.weight.scale = scale
        assert_dicts_close(prepared(layer, x), raw_gradient(layer, x))
    assert layer.weight.grad is None and layer.bias._is_hf_initialized is True


def test_a_model_loaded_by_from_pretrained_gets_its_gradient_on_new_data(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()  # marks each parameter it loads

    def loss(m, ids):
        return m(ids, labels=ids).loss

    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(ids))
    for seed in (1, 2):
        new = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(seed))
        assert_dicts_close(prepared(model, new), raw_gradient(model, new, loss))


def test_a_prepared_call_with_a_constant_module_follows_the_module_between_calls():
    model, x = mlp(), data(5, 4)
    seen = []

    def f(x, m):
        seen.append(getattr(m[0], "calls", 0))
        m[0].calls = getattr(m[0], "calls", 0) + 1  # f's own attribute: neither the user's nor the next call's
        return mse(m, x)

    def expected(x):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(mse(model, x), [x])[0]

    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(model))
    torch.testing.assert_close(prepared(x, model), expected(x), **TOL)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # in place
    torch.testing.assert_close(prepared(x, model), expected(x), **TOL)
    model[2].weight.data = torch.randn(1, 4)  # new storage
    torch.testing.assert_close(prepared(x, model), expected(x), **TOL)
    assert seen == [0, 0, 0] and not hasattr(model[0], "calls")
    assert all(p.grad is None for p in model.parameters())
