"""AutoTorch on what users really bring: regressions for the "PyTorch in the wild" issue.

Every expected value is independent of the library: a hand-written
``torch.autograd.grad`` / double backward, ``torch.autograd.functional``,
``torch.func`` or an analytic formula.
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import activity as ad
from activity import Active, Constant, SecondOrder, UnsupportedError
from activity.backends import _torch as torch_backend

ALL_CLOSE = dict(rtol=1e-5, atol=1e-6)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=generator(seed), dtype=dtype)


def init(model: nn.Module, seed: int = 0) -> nn.Module:
    g = generator(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def named_trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": [p.grad for p in model.parameters()],
        "flags": [(p.requires_grad, m.training) for m in model.modules() for p in m.parameters(recurse=False)],
    }


def assert_unchanged(model, before):
    after = snapshot(model)
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), f"{key} changed"
    assert all(g is None for g in after["grads"]), ".grad was set"
    assert before["flags"] == after["flags"]


def hand_gradient(loss, model, *args):
    names, params = zip(*named_trainable(model))
    grads = torch.autograd.grad(loss(model, *args), params)
    return dict(zip(names, grads))


def hand_hvp(loss, model, tangent, *args):
    names, params = zip(*named_trainable(model))
    grads = torch.autograd.grad(loss(model, *args), params, create_graph=True)
    hvps = torch.autograd.grad(grads, params, [tangent[n] for n in names])
    return dict(zip(names, hvps))


def assert_dict_close(actual, expected, **tolerances):
    assert list(actual) == list(expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **(tolerances or ALL_CLOSE), msg=key)


def mlp(seed=0):
    return init(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), seed)


def squared(m, x):
    return m(x).pow(2).sum()


# ---------------------------------------------------------------- 7: only the Active occurrence


def test_a_parameter_also_passed_as_constant_is_differentiated_once():
    P = nn.Parameter(randn(3))
    g = ad.gradient(lambda a, c: (a * c).sum(), Active(P), Constant(P))
    torch.testing.assert_close(g, P.detach())  # d/da sum(a * c) = c, not 2P
    prepared = ad.prepare(ad.gradient, lambda a, c: (a * c).sum(), Active(P), Constant(P))
    torch.testing.assert_close(prepared(P, P), P.detach())


def test_the_same_parameter_twice_in_an_active_tree_gets_each_partial():
    P = nn.Parameter(randn(3))
    g = ad.gradient(lambda d: (d["a"] * d["b"] ** 2).sum(), Active({"a": P, "b": P}))
    torch.testing.assert_close(g["a"], P.detach() ** 2)
    torch.testing.assert_close(g["b"], 2 * P.detach() ** 2)


def test_a_parameter_captured_by_f_is_a_constant():
    P = nn.Parameter(randn(3))
    for op in (ad.gradient, functools.partial(ad.pullback, cotangent=torch.tensor(1.0))):
        torch.testing.assert_close(op(lambda a: (a * P).sum(), Active(P)), P.detach())
    jac = ad.jacobian(lambda a: a * P, Active(P))
    torch.testing.assert_close(jac, torch.diag(P.detach()))


def test_an_embedding_tied_between_an_active_decoder_and_a_constant_encoder():
    shared = nn.Embedding(6, 4)
    encoder = nn.Sequential(shared, nn.Linear(4, 4))
    decoder = nn.Sequential(shared, nn.Linear(4, 3))
    init(encoder, 1), init(decoder[1], 2)
    ids = torch.tensor([0, 2, 5])

    def loss(dec, enc, ids):
        return (dec(ids).sum(1, keepdim=True) * enc(ids)).pow(2).sum()

    # Hand-written: the encoder's use of the shared table is data, so it is detached there.
    table = shared.weight.detach().requires_grad_()
    head = decoder[1].weight.detach().requires_grad_(), decoder[1].bias.detach().requires_grad_()
    dec_out = torch.nn.functional.linear(table[ids], *head)
    enc_out = encoder(ids).detach()
    expected = torch.autograd.grad((dec_out.sum(1, keepdim=True) * enc_out).pow(2).sum(), (table, *head))
    before = snapshot(encoder)
    for backend in (ad.AutoTorch(), None):
        g = ad.gradient(loss, Active(decoder), Constant(encoder), Constant(ids), backend=backend)
        assert list(g) == ["0.weight", "1.weight", "1.bias"]
        for got, want in zip(g.values(), expected):
            torch.testing.assert_close(got, want)
    prepared = ad.prepare(ad.gradient, loss, Active(decoder), Constant(encoder), Constant(ids))
    for got, want in zip(prepared(decoder, encoder, ids).values(), expected):
        torch.testing.assert_close(got, want)
    assert_unchanged(encoder, before)


# ---------------------------------------------------------------- 8: compiled and rebound modules


def bn_model(seed=0):
    return init(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)), seed)


def compiled_variants(make):
    eager = make()
    wrapped = torch.compile(make(), backend="eager")
    in_place = make()
    in_place.compile(backend="eager")
    rebound = make()
    rebound.forward = functools.partial(type(rebound).forward, rebound)  # an instance-level forward
    hooked = make()  # what accelerate's hooks do: a partial over a wrapper, the old forward kept
    hooked._old_forward = hooked.forward

    def new_forward(module, *args):
        return module._old_forward(*args)

    hooked.forward = functools.update_wrapper(functools.partial(new_forward, hooked), hooked._old_forward)
    return eager, {"torch.compile": wrapped, "m.compile": in_place, "rebound forward": rebound, "accelerate hook": hooked}


@pytest.mark.parametrize("train", [False, True])
def test_compiled_and_rebound_modules_are_differentiated_as_called(train):
    x = randn(5, 3, seed=3)
    eager, variants = compiled_variants(lambda: bn_model().train(train))
    names = [n for n, _ in named_trainable(eager)]
    tangent = {n: randn(*p.shape, seed=i) for i, (n, p) in enumerate(named_trainable(eager))}
    want_grad = hand_gradient(squared, eager, x)
    want_hvp = hand_hvp(squared, eager, tangent, x)
    buffers = lambda: {n: b.clone() for n, b in eager.named_buffers()}  # noqa: E731  # made inside: BatchNorm updates them
    want_jvp = torch.func.jvp(
        lambda *ps: torch.func.functional_call(eager, {**dict(zip(names, ps)), **buffers()}, (x,)),
        tuple(p.detach() for _, p in named_trainable(eager)),
        tuple(tangent[n] for n in names),
    )[1]
    for label, model in variants.items():
        prefix = "_orig_mod." if label == "torch.compile" else ""
        before = snapshot(model)
        keyed = lambda d: {prefix + k: v for k, v in d.items()}  # noqa: E731
        assert_dict_close(ad.gradient(squared, Active(model), Constant(x)), keyed(want_grad))
        assert_dict_close(ad.hvp(squared, Active(model), Constant(x), tangent=keyed(tangent)), keyed(want_hvp), rtol=1e-4, atol=1e-5)
        got_jvp = ad.pushforward(lambda m, x: m(x), Active(model), Constant(x), tangent=keyed(tangent))
        torch.testing.assert_close(got_jvp, want_jvp, rtol=1e-4, atol=1e-5)
        assert got_jvp.abs().max() > 0
        assert_unchanged(model, before)  # BatchNorm statistics of the user's model included


def test_a_forward_closing_over_the_module_runs_on_the_view():
    model, x = bn_model().train(), randn(5, 3)
    original = model.forward
    model.forward = lambda x: original(x) * 2  # captures the module through `original`
    before = snapshot(model)
    want = hand_gradient(lambda m, x: 4 * squared(m, x), bn_model().train(), x)
    assert_dict_close(ad.gradient(squared, Active(model), Constant(x)), want)
    assert_unchanged(model, before)  # the view's BatchNorm ran, not the user's


_GLOBAL_FORWARD = None


def test_a_forward_reaching_the_module_through_a_global_name_is_refused_before_f_runs():
    global _GLOBAL_FORWARD
    model = mlp()
    _GLOBAL_FORWARD = model.forward
    try:
        model.forward = lambda x: _GLOBAL_FORWARD(x) * 2
        with pytest.raises(UnsupportedError, match="global name"):
            ad.gradient(squared, Active(model), Constant(randn(2, 3)))
    finally:
        _GLOBAL_FORWARD = None


# ---------------------------------------------------------------- 9: outer grad modes


OPERATORS = {
    "gradient": lambda f, *a: ad.gradient(f, *a),
    "value_and_gradient": lambda f, *a: ad.value_and_gradient(f, *a)[1],
    "pullback": lambda f, *a: ad.pullback(f, *a, cotangent=torch.tensor(1.0)),
    "jacobian": lambda f, *a: ad.jacobian(f, *a),
    "pushforward": lambda f, *a: ad.pushforward(f, *a, tangent=torch.ones(3)),
    "hvp": lambda f, *a: ad.hvp(f, *a, tangent=torch.ones(3)),
    "hessian": lambda f, *a: ad.hessian(f, *a),
}


def cubic(x, c):
    return (c * x**3).sum()


def cubic_expected(name, x, c):
    """Analytic derivatives of sum(c * x**3)."""
    gradient = 3 * c * x**2
    return {
        "gradient": gradient,
        "value_and_gradient": gradient,
        "pullback": gradient,
        "jacobian": gradient,
        "pushforward": gradient.sum(),
        "hvp": 6 * c * x,
        "hessian": torch.diag(6 * c * x),
    }[name]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("made_inside", [False, True])
@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_every_operator_is_right_under_an_outer_grad_mode(mode, made_inside, name):
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    make = lambda: (torch.tensor([1.0, -2.0, 0.5]), torch.tensor([2.0, 1.0, 3.0]))  # noqa: E731
    if not made_inside:
        x, c = make()
    with context():
        if made_inside:
            x, c = make()
        result = OPERATORS[name](cubic, Active(x), Constant(c))
        assert torch.is_grad_enabled() is False  # the mode is the user's again after the call
    torch.testing.assert_close(result.clone(), cubic_expected(name, x.clone(), c.clone()))


def test_a_module_made_in_inference_mode_is_differentiated():
    with torch.inference_mode():
        model = mlp()
        x = randn(2, 3)
        g = ad.gradient(squared, Active(model), Constant(x))
    twin = mlp()  # the same values, made normally
    assert_dict_close(g, hand_gradient(squared, twin, x.clone()))
    assert not any(v.is_inference() for v in g.values())


# ---------------------------------------------------------------- 10: output cut from the graph


def cut(kind):
    def f(x):
        y = (x**2).sum()
        if kind == "item":
            return torch.tensor(y.item())
        if kind == "detach":
            return y.detach()
        if kind == "numpy":
            return torch.from_numpy(np.asarray(y.detach().numpy()))
        if kind == "no_grad":
            with torch.no_grad():
                return (x**2).sum()
        if kind == "requires_grad_false":
            return (x.detach().requires_grad_(False) ** 2).sum()
        raise AssertionError(kind)

    return f


CUT_OPERATORS = {
    "gradient": lambda f, x: ad.gradient(f, Active(x)),
    "value_and_gradient": lambda f, x: ad.value_and_gradient(f, Active(x))[1],
    "pullback": lambda f, x: ad.pullback(f, Active(x), cotangent=torch.tensor(1.0)),
    "jacobian": lambda f, x: ad.jacobian(f, Active(x)),
    "hessian": lambda f, x: ad.hessian(f, Active(x)),
    "hvp": lambda f, x: ad.hvp(f, Active(x), tangent=torch.ones(2)),
    "pushforward": lambda f, x: ad.pushforward(f, Active(x), tangent=torch.ones(2)),
    "prepared gradient": lambda f, x: ad.prepare(ad.gradient, f, Active(x))(x),
}


@pytest.mark.parametrize("kind", ["item", "detach", "numpy", "no_grad", "requires_grad_false"])
@pytest.mark.parametrize("name", sorted(CUT_OPERATORS))
def test_an_output_cut_from_the_graph_raises_or_is_right_never_zeros(kind, name):
    x = torch.tensor([1.0, 2.0])
    true = {"gradient": 2 * x, "value_and_gradient": 2 * x, "pullback": 2 * x, "prepared gradient": 2 * x,
            "jacobian": 2 * x, "hessian": 2 * torch.eye(2), "hvp": 2 * torch.ones(2), "pushforward": (2 * x).sum()}[name]
    try:
        result = CUT_OPERATORS[name](cut(kind), x)
    except ValueError as error:
        assert "does not depend on the Active argument" in str(error) and ".detach()" in str(error)
        return
    except RuntimeError as error:  # torch's own refusal (e.g. .numpy() on a tensor in a transform)
        assert "numpy" in str(error).lower() or "item" in str(error).lower(), error
        return
    # Forward mode is not cut by torch.no_grad() (forward AD ignores it): then the answer is right.
    torch.testing.assert_close(result, true)


def test_a_function_with_a_partly_unused_input_still_gets_zeros_there():
    g = ad.gradient(lambda a, b: (a**2).sum() + 0 * b.sum().detach(), Active(torch.ones(2)), Active(torch.ones(3)))
    torch.testing.assert_close(g[0], 2 * torch.ones(2))
    torch.testing.assert_close(g[1], torch.zeros(3))


# ---------------------------------------------------------------- 11: plain results


def test_results_are_plain_values_off_the_graph():
    model = mlp()
    x = randn(2, 3)
    tangent = {n: torch.ones_like(p) for n, p in named_trainable(model)}
    P = nn.Parameter(torch.tensor(0.7))
    results = {
        "jacobian": ad.jacobian(lambda m, x: m(x), Active(model), Constant(x)),
        "pushforward": ad.pushforward(lambda m, x: m(x), Active(model), Constant(x), tangent=tangent),
        "hvp": ad.hvp(squared, Active(model), Constant(x), tangent=tangent),
        "hessian": ad.hessian(lambda p: (p * torch.arange(3.0)).pow(3).sum(), Active(nn.Parameter(torch.ones(3)))),
        "gradient_and_hvp": ad.gradient_and_hvp(squared, Active(model), Constant(x), tangent=tangent),
        "derivative": ad.derivative(lambda p, m, x: m(p * x), Active(P), Constant(model), Constant(x)),
        "second_derivative": ad.second_derivative(lambda p, m, x: m(p * x), Active(P), Constant(model), Constant(x)),
        "aux": ad.gradient(lambda m, x: (squared(m, x), m(x)), Active(model), Constant(x), has_aux=True)[1],
        "value_and_jacobian": ad.value_and_jacobian(lambda m, x: m(x), Active(model), Constant(x)),
    }
    for name, result in results.items():
        for leaf in torch.utils._pytree.tree_leaves(result):
            assert not leaf.requires_grad and leaf.grad_fn is None, name
            leaf.numpy()  # plain values convert


# ---------------------------------------------------------------- 12: one evaluation


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = init(nn.Linear(4, 3))
        self.dropout = nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x):
        type(self).calls += 1
        return self.linear(self.dropout(x))


def test_value_and_jacobian_come_from_one_evaluation_with_one_dropout_mask():
    model = Counted().train()
    x = torch.ones(4)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(20):
            Counted.calls = 0
            value, jac = ad.value_and_jacobian(lambda m, x: m(x), Constant(model), Active(x))
            assert Counted.calls == 1
            kept = jac.abs().sum(0) > 0  # inputs the mask kept
            expected = model.linear(x * kept * 2.0)  # dropout(p=0.5) scales kept entries by 2
            torch.testing.assert_close(value, expected)
            torch.testing.assert_close(jac, model.linear.weight.detach() * kept * 2.0)


@pytest.mark.parametrize(
    "name, call, evaluations",
    [
        ("gradient", lambda f, x: ad.gradient(f, Active(x)), 1),
        ("pullback", lambda f, x: ad.pullback(f, Active(x), cotangent=torch.tensor(1.0)), 1),
        ("pullback batch", lambda f, x: ad.pullback(f, Active(x), cotangents=[torch.tensor(1.0)] * 3), 1),
        ("jacobian", lambda f, x: ad.jacobian(f, Active(x)), 1),
        ("pushforward", lambda f, x: ad.pushforward(f, Active(x), tangent=torch.ones(3)), 1),
        ("hvp", lambda f, x: ad.hvp(f, Active(x), tangent=torch.ones(3)), 1),
        ("hessian", lambda f, x: ad.hessian(f, Active(x)), 1),
    ],
)
def test_operators_evaluate_f_once(name, call, evaluations):
    count = []

    def f(x):
        count.append(1)
        return (x**3).sum()

    call(f, torch.tensor([1.0, 2.0, 3.0]))
    assert len(count) == evaluations, name


# ---------------------------------------------------------------- 15: random layers, hooks


def dropout_model():
    return init(nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 1))).train()


RNG_OPERATORS = {
    "gradient": lambda m, x: ad.gradient(squared, Active(m), Constant(x)),
    "value_and_gradient": lambda m, x: ad.value_and_gradient(squared, Active(m), Constant(x)),
    "pullback": lambda m, x: ad.pullback(lambda m, x: m(x), Active(m), Constant(x), cotangent=torch.ones(2, 1)),
    "jacobian": lambda m, x: ad.jacobian(lambda m, x: m(x), Constant(m), Active(x)),
    "pushforward": lambda m, x: ad.pushforward(lambda m, x: m(x), Constant(m), Active(x), tangent=torch.ones(2, 3)),
    "hvp": lambda m, x: ad.hvp(squared, Constant(m), Active(x), tangent=torch.ones(2, 3)),
    "hessian": lambda m, x: ad.hessian(squared, Constant(m), Active(x)),
    "prepared gradient": lambda m, x: ad.prepare(ad.gradient, squared, Active(m), Constant(x))(m, x),
}


@pytest.mark.parametrize("name", sorted(RNG_OPERATORS))
def test_dropout_advances_the_global_rng_exactly_as_one_eager_forward(name):
    model, x = dropout_model(), randn(2, 3)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        if name == "prepared gradient":
            torch.manual_seed(5)  # preparation may evaluate f; the prepared call is what is checked
        start = torch.get_rng_state()
        model(x)
        after_eager = torch.get_rng_state()
        torch.set_rng_state(start)
        if name == "prepared gradient":
            prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(x))
            torch.set_rng_state(start)
            prepared(model, x)
        else:
            RNG_OPERATORS[name](model, x)
        assert torch.equal(torch.get_rng_state(), after_eager)


def test_dropout_gradient_uses_the_mask_an_eager_forward_draws():
    model, x = dropout_model(), randn(2, 3)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        got = ad.gradient(squared, Active(model), Constant(x))
        torch.manual_seed(11)
        want = hand_gradient(squared, model, x)
    assert_dict_close(got, want)


def test_forward_hooks_see_views_so_hooks_key_by_name():
    """The documented rule: hooks run on the view f sees, so a hook that records something
    keys it by the submodule's name (bound when the hook is registered), not by identity."""
    model = mlp()
    seen: dict[str, tuple] = {}
    handles = [
        sub.register_forward_hook(functools.partial(lambda name, module, args, out: seen.__setitem__(name, out.shape), name))
        for name, sub in model.named_modules()
        if isinstance(sub, nn.Linear)
    ]
    try:
        ad.gradient(squared, Active(model), Constant(randn(5, 3)))
    finally:
        for handle in handles:
            handle.remove()
    assert seen == {"0": torch.Size([5, 4]), "2": torch.Size([5, 2])}


# ---------------------------------------------------------------- 3: nested under torch.func.vmap


def test_per_example_hessians_and_forward_operators_under_vmap():
    xs = randn(4, 3, seed=1)
    f = lambda v: (v**3).sum() + v.prod()  # noqa: E731
    torch.testing.assert_close(
        torch.func.vmap(lambda x: ad.hessian(f, Active(x)))(xs), torch.func.vmap(torch.func.hessian(f))(xs)
    )
    s = xs[:, 0]
    torch.testing.assert_close(torch.func.vmap(lambda x: ad.derivative(torch.sin, Active(x)))(s), torch.cos(s))
    torch.testing.assert_close(torch.func.vmap(lambda x: ad.second_derivative(torch.sin, Active(x)))(s), -torch.sin(s))
    g = lambda v: torch.stack([v.sum(), (v**2).sum(), v.prod(), v[0] * v[1]])  # noqa: E731  # 4 outputs > 3 inputs
    torch.testing.assert_close(
        torch.func.vmap(lambda x: ad.jacobian(g, Active(x)))(xs), torch.func.vmap(torch.func.jacfwd(g))(xs)
    )
    ts = [torch.ones(3), torch.arange(3.0)]
    got = torch.func.vmap(lambda x: torch.stack(ad.pushforward(g, Active(x), tangents=ts)))(xs)
    want = torch.stack([torch.func.vmap(lambda x: torch.func.jvp(g, (x,), (t,))[1])(xs) for t in ts], 1)
    torch.testing.assert_close(got, want)
    got = torch.func.vmap(lambda x: torch.stack(ad.hvp(f, Active(x), tangents=ts)))(xs)
    want = torch.stack([torch.func.vmap(lambda x: torch.func.jvp(torch.func.grad(f), (x,), (t,))[1])(xs) for t in ts], 1)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- 5 and 13: where vmap cannot (or is wrong)


def tape_jacobian(f, x):
    return torch.autograd.functional.jacobian(f, x)


def test_cdist_jacobian_and_batched_pullback_match_the_tape():
    x, y = randn(3, 4, seed=1, dtype=torch.float64), randn(5, 4, seed=2, dtype=torch.float64)
    f = lambda x, y: torch.cdist(x, y)  # noqa: E731
    torch.testing.assert_close(ad.jacobian(f, Active(x), Constant(y)), tape_jacobian(lambda x: f(x, y), x))
    small_x, small_y = randn(2, 6, seed=3, dtype=torch.float64), randn(1, 6, seed=4, dtype=torch.float64)
    torch.testing.assert_close(  # fewer outputs than inputs: reverse mode
        ad.jacobian(f, Active(small_x), Constant(small_y)), tape_jacobian(lambda x: f(x, small_y), small_x)
    )
    cts = [randn(3, 5, seed=5, dtype=torch.float64), randn(3, 5, seed=6, dtype=torch.float64)]
    got = ad.pullback(f, Active(x), Constant(y), cotangents=cts)
    leaf = x.clone().requires_grad_()
    out = f(leaf, y)
    for g, ct in zip(got, cts):
        torch.testing.assert_close(g, torch.autograd.grad(out, leaf, ct, retain_graph=True)[0])


def test_prepared_jacobians_check_torchs_batching_once_and_stay_right():
    """A prepared operator checks its batched backward pass on its first call and keeps the
    verdict: cdist (a wrong batching rule) is looped on every call, warned about once; a
    function torch batches right is vectorised on every call, on new values too."""
    import warnings

    y = randn(1, 6, seed=4, dtype=torch.float64)
    f = lambda x, y: torch.cdist(x, y)  # noqa: E731
    x = randn(2, 6, seed=3, dtype=torch.float64)
    jacobian = ad.prepare(ad.jacobian, f, Active(x), Constant(y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (3, 7, 8):
            x = randn(2, 6, seed=seed, dtype=torch.float64)
            torch.testing.assert_close(jacobian(x, y), tape_jacobian(lambda x: f(x, y), x))
    assert sum("disagreed" in str(w.message) for w in caught) == 1
    g = lambda v, a: torch.tanh(a @ v)  # noqa: E731
    a = randn(3, 5, seed=1, dtype=torch.float64)
    right = ad.prepare(ad.jacobian, g, Active(randn(5, seed=2, dtype=torch.float64)), Constant(a))
    for seed in (2, 9):
        v = randn(5, seed=seed, dtype=torch.float64)
        torch.testing.assert_close(right(v, a), tape_jacobian(lambda v: g(v, a), v))


def test_a_prepared_jacobian_whose_branch_changes_with_the_data_checks_the_new_branch():
    """The first call runs operations torch batches right; a later one, on other data, runs
    cdist (a wrong batching rule): the verdict kept from the first call must not cover it."""
    y = randn(1, 6, seed=4, dtype=torch.float64)

    def f(x, y):
        if float(x.sum()) > 0:
            return torch.tanh(x @ y.T)
        return torch.cdist(x, y)

    positive = randn(2, 6, seed=3, dtype=torch.float64).abs()
    jacobian = ad.prepare(ad.jacobian, f, Active(positive), Constant(y))
    torch.testing.assert_close(jacobian(positive, y), tape_jacobian(lambda x: f(x, y), positive))
    negative = -positive
    with pytest.warns(RuntimeWarning, match="disagreed"):
        got = jacobian(negative, y)
    torch.testing.assert_close(got, tape_jacobian(lambda x: f(x, y), negative))


def test_cdist_jacobians_under_an_outer_vmap_are_right():
    # Inside torch.func the tape is unavailable and torch's batching rule for _cdist_backward
    # is wrong; the linearity probe must catch it.
    xs, y = randn(3, 2, 6, seed=7, dtype=torch.float64), randn(1, 6, seed=8, dtype=torch.float64)
    if True:
        got = torch.func.vmap(lambda x: ad.jacobian(lambda x, y: torch.cdist(x, y), Active(x), Constant(y)))(xs)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, tape_jacobian(lambda x: torch.cdist(x, y), x))


def test_the_linearity_probe_accepts_a_right_batch_and_rejects_a_wrong_one():
    W = randn(3, 4, seed=9, dtype=torch.float64)
    one = lambda cts: (cts[0] @ W,)  # noqa: E731  # the pullback of x -> W x
    cts = (randn(5, 3, seed=10, dtype=torch.float64),)
    right = (cts[0] @ W,)
    assert torch_backend._agrees_with_one(right, cts, one)
    wrong = (right[0].clone(),)
    wrong[0][1:] = right[0][0]  # every row the first one's, as the broken cdist rule gives
    with pytest.warns(RuntimeWarning):
        assert not torch_backend._agrees_with_one(wrong, cts, one)
    slightly = (right[0] * (1 + 1e-3),)
    with pytest.warns(RuntimeWarning):
        assert not torch_backend._agrees_with_one(slightly, cts, one)


class OldStyleSquare(torch.autograd.Function):
    """A custom Function without setup_context: torch.func cannot run it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def tensor_split(x):
    return torch.stack([part.sum() for part in torch.tensor_split(x, torch.tensor([1, 3]))] + [x[0] * x[-1]] * 3)


def as_strided_scatter(x):
    base = torch.zeros(8, dtype=x.dtype)
    return torch.as_strided_scatter(base, x, (x.numel(),), (2,)) * 3 + x.sum()


def grid_sample(x):
    grid = torch.linspace(-0.8, 0.8, 10, dtype=x.dtype).reshape(1, 1, 5, 2)
    return torch.nn.functional.grid_sample(x.reshape(1, 1, 2, 2), grid, align_corners=False).reshape(-1).repeat(2)


def channels_last(x):
    conv = nn.Conv2d(1, 2, 2).double()
    init(conv, 3)
    image = x.reshape(1, 1, 3, 3).contiguous(memory_format=torch.channels_last)
    return conv(image).reshape(-1).repeat(3)


WHERE_VMAP_CANNOT = {
    "cdist": (lambda x: torch.cdist(x.reshape(2, 2), torch.ones(5, 2, dtype=x.dtype)).reshape(-1), 4),
    "pdist": (lambda x: torch.pdist(x.reshape(4, 2)).repeat(2), 8),
    "grid_sampler_2d": (grid_sample, 4),
    "old-style Function": (lambda x: OldStyleSquare.apply(x).repeat(2), 3),
    "tensor_split": (tensor_split, 4),
    "as_strided_scatter": (as_strided_scatter, 3),
    "channels_last": (channels_last, 9),
}


@pytest.mark.parametrize("name", sorted(WHERE_VMAP_CANNOT))
def test_jacobian_pushforward_and_pullback_fall_back_to_the_tape(name):
    f, n = WHERE_VMAP_CANNOT[name]
    x = randn(n, seed=12, dtype=torch.float64)
    expected = tape_jacobian(f, x)
    torch.testing.assert_close(ad.jacobian(f, Active(x)), expected)
    ts = [randn(n, seed=13, dtype=torch.float64), randn(n, seed=14, dtype=torch.float64)]
    for got, t in zip(ad.pushforward(f, Active(x), tangents=ts), ts):
        torch.testing.assert_close(got, expected @ t)
    torch.testing.assert_close(ad.pushforward(f, Active(x), tangent=ts[0]), expected @ ts[0])
    cts = [randn(expected.shape[0], seed=15, dtype=torch.float64), randn(expected.shape[0], seed=16, dtype=torch.float64)]
    for got, ct in zip(ad.pullback(f, Active(x), cotangents=cts), cts):
        torch.testing.assert_close(got, ct @ expected)


def test_hessian_falls_back_where_forward_mode_cannot_run():
    x = randn(4, seed=17, dtype=torch.float64)
    f = lambda x: OldStyleSquare.apply(x).pow(2).sum() + x.prod()  # noqa: E731
    torch.testing.assert_close(ad.hessian(f, Active(x)), torch.autograd.functional.hessian(f, x))


def test_random_f_jacobian_draws_once_and_matches_the_tape_with_the_same_draw():
    x = randn(3, seed=18, dtype=torch.float64)
    f = lambda x: torch.nn.functional.dropout(x.repeat(3), 0.5, training=True) * x.sum()  # noqa: E731
    with torch.random.fork_rng():
        torch.manual_seed(3)
        got = ad.jacobian(f, Active(x))
        torch.manual_seed(3)
        expected = tape_jacobian(f, x)
    torch.testing.assert_close(got, expected)


def test_autotorch_options_choose_the_path():
    f, n = WHERE_VMAP_CANNOT["cdist"]
    x = randn(n, seed=19, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="forward AD"):
        ad.jacobian(f, Active(x), backend=ad.AutoTorch(vectorize=True))
    torch.testing.assert_close(ad.jacobian(f, Active(x), backend=ad.AutoTorch(vectorize=False)), tape_jacobian(f, x))
    g = lambda x: torch.nn.functional.dropout(x.repeat(3), 0.5, training=True)  # noqa: E731
    y = torch.ones(3, dtype=torch.float64)
    with torch.random.fork_rng():
        jac = ad.jacobian(g, Active(y), backend=ad.AutoTorch(randomness="same"))
    assert set(jac.unique().tolist()) <= {0.0, 2.0}
    for bad in (dict(hvp_mode="sideways"), dict(vectorize="yes"), dict(randomness="often")):
        with pytest.raises(ValueError, match="choose one of"):
            ad.AutoTorch(**bad)
    assert repr(ad.AutoTorch()) == "AutoTorch()" and "hvp_mode='reverse-over-reverse'" in repr(
        ad.AutoTorch(hvp_mode="reverse-over-reverse")
    )


# ---------------------------------------------------------------- 6: hvp modes


def norm_models():
    weight = nn.utils.weight_norm(init(nn.Linear(3, 3), 20))
    spectral = nn.utils.spectral_norm(init(nn.Linear(3, 3), 21)).eval()
    new_style = nn.utils.parametrizations.weight_norm(init(nn.Linear(3, 3), 22))
    return {"weight_norm": weight, "spectral_norm": spectral, "parametrizations.weight_norm": new_style}


@pytest.mark.parametrize("mode", ["auto", "reverse-over-reverse", "forward-over-reverse"])
@pytest.mark.parametrize("name", sorted(norm_models()))
def test_hvp_on_norm_reparametrised_modules(mode, name):
    # float64: the Hessian of these models reaches 3e4, where two float32 paths (forward over
    # reverse, double backward) may differ by 1e-5 in a small entry, by the order of a sum
    model, x = norm_models()[name].double(), randn(4, 3, seed=23, dtype=torch.float64)
    tangent = {n: randn(*p.shape, seed=i, dtype=torch.float64) for i, (n, p) in enumerate(named_trainable(model))}
    want = hand_hvp(squared, model, tangent, x)
    backend = ad.AutoTorch(hvp_mode=mode)
    try:
        got = ad.hvp(squared, Active(model), Constant(x), tangent=tangent, backend=backend)
    except NotImplementedError as error:  # forward over reverse, forced, where torch has no forward rule
        assert mode == "forward-over-reverse" and "forward" in str(error).lower()
        return
    assert_dict_close(got, want, rtol=1e-9, atol=1e-9)
    batch = ad.hvp(squared, Active(model), Constant(x), tangents=[tangent, tangent], backend=backend)
    assert_dict_close(batch[1], want, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- 14: threads


def test_every_operator_is_right_from_sixteen_threads():
    x = torch.tensor([0.5, -1.0, 2.0])
    f = lambda x: (x**3).sum() + x.prod()  # noqa: E731
    g = lambda x: torch.stack([x.sum(), (x**2).sum(), x.prod(), x[0] * x[1]])  # noqa: E731
    t = torch.tensor([1.0, 0.5, -1.0])
    expected_hvp = torch.autograd.functional.hvp(f, x, t)[1]
    calls = {
        "prepared hvp": (ad.prepare(ad.hvp, f, Active(x), tangent=t), lambda p: p(x, tangent=t), expected_hvp),
        "pushforward": (None, lambda _: ad.pushforward(g, Active(x), tangent=t), torch.func.jvp(g, (x,), (t,))[1]),
        "hessian": (None, lambda _: ad.hessian(f, Active(x)), torch.func.hessian(f)(x)),
        "derivative": (None, lambda _: ad.derivative(torch.sin, Active(torch.tensor(0.3))), torch.cos(torch.tensor(0.3))),
        "jacobian": (None, lambda _: ad.jacobian(g, Active(x)), torch.func.jacfwd(g)(x)),
        "gradient": (None, lambda _: ad.gradient(f, Active(x)), torch.func.grad(f)(x)),
    }
    for name, (state, call, expected) in calls.items():
        errors, wrong = [], []

        def work():
            for _ in range(30):
                try:
                    if not torch.allclose(call(state), expected, rtol=1e-5, atol=1e-6):
                        wrong.append(1)
                except Exception as error:  # noqa: BLE001 - counted and reported
                    errors.append(repr(error))

        threads = [threading.Thread(target=work) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors and not wrong, (name, len(errors), len(wrong), errors[:2])


def test_a_wrong_batched_pullback_from_torch_is_caught_and_recomputed(monkeypatch):
    """Fault injection: a vmap whose rows all repeat the first one, as torch's broken rules do."""
    real = torch.func.vmap

    def broken(function, *args, **kwargs):
        vectorised = real(function, *args, **kwargs)

        def call(*inputs):
            return torch.utils._pytree.tree_map(lambda g: g[:1].expand_as(g).clone(), vectorised(*inputs))

        return call

    monkeypatch.setattr(torch.func, "vmap", broken)
    x = randn(4, seed=24, dtype=torch.float64)
    f = lambda x: torch.stack([x.sum(), (x**2).sum()])  # noqa: E731
    with pytest.warns(RuntimeWarning, match="disagreed"):
        jac = ad.jacobian(f, Active(x))
    torch.testing.assert_close(jac, torch.stack([torch.ones(4, dtype=torch.float64), 2 * x]))


def test_a_model_dropped_by_the_user_is_freed():
    """Module descriptions are kept between calls (an unprepared call walks a model once),
    but never keep a model alive."""
    import gc
    import weakref

    model = bn_model().train()
    model.forward = functools.partial(nn.Sequential.forward, model)  # a reference cycle through __dict__
    x = randn(4, 3)
    ad.gradient(squared, Active(model), Constant(x))
    ad.hvp(squared, Active(model), Constant(x), tangent={n: torch.ones_like(p) for n, p in named_trainable(model)})
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_second_order_through_an_op_torch_cannot_differentiate_twice_says_what_to_do():
    q = randn(1, 2, 4, 8, seed=30)

    def f(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).pow(2).sum()

    try:
        torch.func.jvp(torch.func.grad(f), (q,), (q,))
        torch.autograd.grad(torch.autograd.grad(f(q.requires_grad_()), q, create_graph=True)[0].sum(), q)
    except (RuntimeError, NotImplementedError):
        pass  # this torch has a fused CPU kernel without second order: the library must say so
    else:
        torch.testing.assert_close(ad.hvp(f, Active(q.detach()), tangent=q.detach()), torch.func.jvp(torch.func.grad(f), (q.detach(),), (q.detach(),))[1])
        return
    with pytest.raises((RuntimeError, NotImplementedError)) as info:
        ad.hvp(f, Active(q.detach()), tangent=q.detach())
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "double backward failed too" in notes and "attn_implementation='eager'" in notes


def test_forward_mode_results_keep_the_input_dtype():
    """torch.func.jvp gives `float32 scalar / 2.0` a float64 tangent; results are float32 like the input."""
    s = torch.tensor(2.0)
    half = lambda s: (s * s) / 2.0  # noqa: E731
    results = {
        "pushforward": ad.pushforward(lambda s: s / 2.0, Active(s), tangent=torch.tensor(1.0)),
        "pushforward dict": ad.pushforward(lambda s: {"a": s / 2.0}, Active(s), tangent=torch.tensor(1.0))["a"],
        "jacobian": ad.jacobian(lambda s: torch.stack([s / 2.0, s * 3.0]), Active(s)),
        "derivative": ad.derivative(lambda s: s / 2.0, Active(s)),
        "second_derivative": ad.second_derivative(half, Active(s)),
        "hessian": ad.hessian(half, Active(s)),
        "hvp batch": ad.hvp(half, Active(s), tangents=[torch.tensor(1.0)] * 2)[1],
    }
    for name, result in results.items():
        assert result.dtype == torch.float32, (name, result.dtype)
    torch.testing.assert_close(results["second_derivative"], torch.tensor(1.0))
    torch.testing.assert_close(results["jacobian"], torch.tensor([0.5, 3.0]))


def test_a_module_built_on_the_meta_device_prepares_for_real_models():
    with torch.device("meta"):
        placeholder = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    prepared = ad.prepare(ad.gradient, squared, Active(placeholder), Constant(torch.empty(5, 3, device="meta")))
    model, x = bn_model(), randn(5, 3, seed=31)
    model[3] = init(nn.Linear(4, 2), 32)
    assert_dict_close(prepared(model, x), hand_gradient(squared, model, x))
    with pytest.raises(ad.PreparationMismatchError, match="module"):
        prepared(init(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))), x)


def test_a_forward_replaced_after_preparation_is_checked_again():
    model, x = bn_model().train(), randn(4, 3)
    model.forward = functools.partial(nn.Sequential.forward, model)
    prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(x))
    assert_dict_close(prepared(model, x), hand_gradient(squared, copy.deepcopy(model), x))
    before = snapshot(model)
    original = model.forward
    model.forward = lambda x: original(x) * 2  # same attribute, now a closure over the user's module
    want = hand_gradient(lambda m, x: 4 * squared(m, x), bn_model().train(), x)
    assert_dict_close(prepared(model, x), want)  # the new forward, on the view
    assert_unchanged(model, before)  # the original module never ran: its BatchNorm statistics are as they were


class _OnceCube(torch.autograd.Function):
    """x**3 whose backward is not differentiable (``@once_differentiable``) and that has no jvp:
    torch can take no second derivative through it, and its tape does not say so when the
    incoming gradient is a constant (the gradient just comes back without a graph)."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class _OnceCubeWithJvp(_OnceCube):
    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * t


@pytest.mark.parametrize("prepared", [False, True])
def test_hvp_through_a_once_differentiable_backward_raises_instead_of_giving_zeros(prepared):
    x, t = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])

    def f(x):
        return _OnceCube.apply(x).sum()

    with pytest.raises((RuntimeError, NotImplementedError), match="no second-order derivative"):
        if prepared:
            ad.prepare(ad.hvp, f, Active(x), tangent=t)(x, tangent=t)
        else:
            ad.hvp(f, Active(x), tangent=t)


@pytest.mark.parametrize("prepared", [False, True])
def test_hvp_through_a_once_differentiable_backward_with_a_jvp_is_right(prepared):
    x, t = torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0])

    def f(x):
        return _OnceCubeWithJvp.apply(x).sum()

    want = 6 * x * t  # d2/dx2 of x**3, times t
    if prepared:
        hvp = ad.prepare(ad.hvp, f, Active(x), tangent=t)
        for _ in range(3):
            torch.testing.assert_close(hvp(x, tangent=t), want)
    else:
        torch.testing.assert_close(ad.hvp(f, Active(x), tangent=t), want)


@pytest.mark.parametrize("prepared", [False, True])
def test_hvp_of_a_function_linear_in_one_parameter_is_right_on_every_call(prepared):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = randn(4, 3)

    def f(m, x):
        return m(x).sum()  # linear in the last bias: its gradient is a constant, its hvp zero

    params = dict(model.named_parameters())
    tangent = {name: torch.ones_like(p) for name, p in params.items()}
    want = torch.func.jvp(
        lambda p: torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(p), (params,), (tangent,)
    )[1]
    calls = [ad.prepare(ad.hvp, f, Active(model), Constant(x), tangent=tangent)] * 3 if prepared else [None]
    for call in calls:
        got = call(model, x, tangent=tangent) if prepared else ad.hvp(f, Active(model), Constant(x), tangent=tangent)
        for name in want:
            torch.testing.assert_close(got[name], want[name])


def _reparametrised_and_compiled():
    with torch.random.fork_rng():
        torch.manual_seed(3)
        orthogonal = nn.Linear(4, 4)
        torch.nn.utils.parametrizations.orthogonal(orthogonal)
        spectral = torch.nn.utils.spectral_norm(nn.Linear(4, 4))
        rnn = nn.GRU(4, 4, num_layers=2, bidirectional=True)
        compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), backend="eager")
        bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    take_output = lambda m, x: m(x)[0].pow(2).mean()  # noqa: E731
    return {
        "orthogonal parametrization": (nn.Sequential(orthogonal, nn.Tanh(), nn.Linear(4, 1)), squared),
        "spectral_norm (its power iteration updates buffers in train mode)": (spectral, squared),
        "GRU, 2 layers, bidirectional": (rnn, take_output),
        "torch.compile": (compiled, squared),
        "BatchNorm": (bn, squared),
    }


@pytest.mark.parametrize("name", sorted(_reparametrised_and_compiled()))
def test_prepared_gradient_over_training_steps_on_library_built_modules(name):
    """The view a prepared gradient keeps between calls, on modules torch itself rewires
    (parametrizations, spectral_norm's hooks and buffers, RNN flat weights, torch.compile):
    each step, after an in-place optimizer step and a train/eval switch, the gradient of a
    twin copied at that step."""
    import copy

    model, loss = _reparametrised_and_compiled()[name]
    x = randn(6, 4, seed=40) if "GRU" not in name else randn(5, 2, 4, seed=40)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, training in enumerate((True, False, True, False)):
        model.train(training)
        twin = copy.deepcopy(model)
        want = hand_gradient(loss, twin, x)
        got = prepared(model, x)
        assert_dict_close(got, want, rtol=1e-5, atol=1e-6)
        for (name_, p) in named_trainable(model):
            p.grad = got[name_].clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


_LINEAR_BACKENDS = {
    "auto": ad.AutoTorch(),
    "reverse-over-reverse": ad.AutoTorch(hvp_mode="reverse-over-reverse"),
    "forward-over-reverse": ad.AutoTorch(hvp_mode="forward-over-reverse"),
    "torch-over-torch": SecondOrder(ad.AutoTorch(), ad.AutoTorch()),
    "fd-over-torch": SecondOrder(ad.AutoFiniteDifferences(), ad.AutoTorch()),
}


def _linear_problems():
    """f linear in every Active argument: its gradient is a constant, so torch's gradient has no
    graph and no tangent at all, and every second derivative is zero."""
    torch.manual_seed(0)
    x = randn(3, dtype=torch.float64)
    embedding, ids = nn.Embedding(6, 2).double(), torch.tensor([1, 4, 4])
    layer, batch = nn.Linear(3, 2).double(), randn(5, 3, dtype=torch.float64)
    return {
        "tensor": (lambda x: (2 * x).sum() + 1.0, (Active(x),)),
        "embedding": (lambda m, i: m(i).sum(), (Active(embedding), Constant(ids))),
        "linear layer": (lambda m, b: m(b).sum(), (Active(layer), Constant(batch))),
    }


@pytest.mark.parametrize("backend", list(_LINEAR_BACKENDS), ids=list(_LINEAR_BACKENDS))
@pytest.mark.parametrize("problem", ["tensor", "embedding", "linear layer"])
@pytest.mark.parametrize("prepared", [False, True])
def test_second_derivatives_of_a_function_linear_in_every_argument_are_zero(backend, problem, prepared):
    """Once refused as "f's output does not depend on the Active argument(s)"; the gradient
    stays torch's own."""
    f, args = _linear_problems()[problem]
    backend_ = _LINEAR_BACKENDS[backend]
    value = args[0].value
    leaves = dict(value.named_parameters()) if isinstance(value, nn.Module) else {"": value}
    tangent = {n: torch.ones_like(p) for n, p in leaves.items()} if isinstance(value, nn.Module) else torch.ones_like(value)
    call = (lambda op, **seeds: ad.prepare(op, f, *args, backend=backend_, **seeds)(*(a.value for a in args), **seeds)) if prepared else (
        lambda op, **seeds: op(f, *args, backend=backend_, **seeds)
    )
    params = [p.detach().requires_grad_() for p in leaves.values()]
    rest = [a.value for a in args[1:]]
    own = (lambda *ps: torch.func.functional_call(value, dict(zip(leaves, ps)), tuple(rest))) if isinstance(value, nn.Module) else None
    want_gradient = torch.autograd.grad((own(*params) if own else (2 * params[0]).sum()).sum(), params)
    flat = lambda tree: list(tree.values()) if isinstance(tree, dict) else [tree]  # noqa: E731

    hvp = call(ad.hvp, tangent=tangent)
    gradient, hvp_too = call(ad.gradient_and_hvp, tangent=tangent)
    hessian = call(ad.hessian)
    for got in (*flat(hvp), *flat(hvp_too)):
        assert torch.count_nonzero(got) == 0 and got.dtype == torch.float64
    for got, want in zip(flat(gradient), want_gradient):
        torch.testing.assert_close(got, want)
    blocks = [block for row in flat(hessian) for block in flat(row)] if isinstance(hessian, dict) else [hessian]
    assert blocks and all(torch.count_nonzero(block) == 0 for block in blocks)


@pytest.mark.parametrize("prepared", [False, True])
def test_hvp_through_an_operation_without_a_forward_rule_that_f_is_linear_in(prepared):
    """embedding_bag and index_reduce have no forward-mode rule, and f is linear in what goes
    through them: their gradient has no graph. torch's own backward formulas record theirs, so
    that is a zero second derivative (it once went to forward over reverse, which raised)."""
    import torch.nn.functional as F

    w, v = randn(5, 3, dtype=torch.float64), randn(2, 3, seed=1, dtype=torch.float64)
    ids, offsets = torch.tensor([0, 2, 4, 1]), torch.tensor([0, 2])
    s, t = randn(3, seed=2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    index, weights = torch.tensor([0, 0, 2]), torch.arange(4.0, dtype=torch.float64)

    def bag(w):
        return (F.embedding_bag(ids, w, offsets, mode="mean") * v).sum()

    def bag_and_square(w):
        return bag(w) + (w**3).sum()

    def reduced(s):
        return (torch.zeros(4, dtype=torch.float64).index_reduce(0, index, s, "mean") * weights).sum()

    tw = randn(5, 3, seed=3, dtype=torch.float64)
    for f, x, tangent, want in ((bag, w, tw, torch.zeros_like(w)), (bag_and_square, w, tw, 6 * w * tw), (reduced, s, t, torch.zeros_like(s))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # index_reduce is in beta
            calls = [ad.prepare(ad.hvp, f, Active(x), tangent=tangent)] * 2 if prepared else [None]
            for call in calls:
                got = call(x, tangent=tangent) if call else ad.hvp(f, Active(x), tangent=tangent)
                torch.testing.assert_close(got, want)
            if not prepared:
                torch.testing.assert_close(ad.hessian(f, Active(x)).reshape(x.numel(), x.numel()) @ tangent.reshape(-1), want.reshape(-1))


def test_the_hessian_of_an_empty_argument_has_jax_layout():
    """No tangent at all (the Active leaf is empty): once an IndexError in the batched pass."""
    x, y = torch.zeros(0, 2, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert ad.hessian(lambda x: (x**2).sum(), Active(x)).shape == (0, 2, 0, 2)
    (xx, xy), (yx, yy) = ad.hessian(lambda x, y: (x**2).sum() + (y**3).sum(), Active(x), Active(y))
    assert xx.shape == (0, 2, 0, 2) and xy.shape == (0, 2, 2) and yx.shape == (2, 0, 2)
    torch.testing.assert_close(yy, torch.diag(6 * y))
    assert ad.prepare(ad.hessian, lambda x: (x**2).sum(), Active(x))(x).shape == (0, 2, 0, 2)


@pytest.mark.parametrize("prepared", [False, True])
def test_a_forward_rule_that_drops_the_tangent_is_caught_and_the_tape_answers(prepared):
    """scatter_reduce(..., "prod") has a forward-mode rule that gives no tangent, so
    torch.func.jvp returns zeros without a word. The pushforward sees no output carrying a
    tangent and asks the tape, which finds f does depend on x: J t from reverse mode."""
    x = randn(6, dtype=torch.float64) + 2.0
    index = torch.tensor([0, 1, 0, 2, 1, 2])

    def f(x):
        return torch.zeros(3, dtype=torch.float64).scatter_reduce(0, index, x, "prod", include_self=False) * 1.5

    t = randn(6, seed=1, dtype=torch.float64)
    assert torch.count_nonzero(torch.func.jvp(f, (x,), (t,))[1]) == 0  # torch's own silent zeros
    want = torch.autograd.functional.jacobian(f, x) @ t
    got = ad.prepare(ad.pushforward, f, Active(x), tangent=t)(x, tangent=t) if prepared else ad.pushforward(f, Active(x), tangent=t)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="does not depend on the Active argument"):  # a real cut still says so
        ad.pushforward(lambda x: f(x.detach()), Active(x), tangent=t)


@pytest.mark.parametrize("prepared", [False, True])
def test_second_derivatives_through_abs_and_sign_are_tensors_the_user_owns(prepared):
    """torch's double backward of abs (and the forward rule of sign) give ZeroTensors, which
    are immutable: a result the user adds into raised. Each is a plain zero tensor, and right."""
    x, t = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    s = torch.tensor(0.5, dtype=torch.float64)

    def call(op, f, value, **seeds):
        return ad.prepare(op, f, Active(value), **seeds)(value, **seeds) if prepared else op(f, Active(value), **seeds)

    results = [
        call(ad.hvp, lambda x: x.abs().sum(), x, tangent=t),
        call(ad.gradient_and_hvp, lambda x: x.abs().sum(), x, tangent=t)[1],
        call(ad.second_derivative, lambda s: s.abs(), s),
        call(ad.value_derivative_and_second_derivative, lambda s: s.abs(), s)[2],
    ]
    for result in results:
        assert not result._is_zerotensor() and torch.count_nonzero(result) == 0
        result += 1.0  # raised "ZeroTensors are immutable"


def test_the_hessian_of_mse_loss_of_a_scalar_falls_back_where_forward_over_reverse_fails():
    """torch's forward over reverse through mse_loss of a 0-d tensor writes a ZeroTensor and
    raises; the tape gives the Hessian, 2."""
    x, zero = torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)

    def f(x):
        return torch.nn.functional.mse_loss(x, zero)

    with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):
        torch.func.jacfwd(torch.func.grad(f))(x)  # torch's own failure, the reason for the fallback
    torch.testing.assert_close(ad.hessian(f, Active(x)), torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(ad.prepare(ad.hessian, f, Active(x))(x), torch.tensor(2.0, dtype=torch.float64))


def test_a_pushforward_through_an_embedding_with_max_norm_behaves_as_reverse_mode():
    # nn.Embedding(max_norm=...) renormalizes the rows it looks up in place, under no_grad: a
    # write outside the tape, which reverse mode lets through with a warning. Forward mode: the
    # first call runs on copies (the user's table untouched), a later call's write reaches the
    # user's table; both are warned of. The tangent is torch.func.jvp's on a copy of the module.
    torch.manual_seed(0)
    table = nn.Embedding(6, 3, max_norm=0.5)
    idx = torch.tensor([0, 2, 2])
    tangent = {"weight": torch.ones(6, 3)}
    twin = copy.deepcopy(table)
    want = torch.func.jvp(lambda w: torch.func.functional_call(twin, {"weight": w}, (idx,)), (twin.weight.detach(),), (tangent["weight"],))[1]
    prepared = ad.prepare(ad.pushforward, lambda m, i: m(i), Active(table), Constant(idx), tangent=tangent)
    before = table.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"f wrote the Active argument 0 .*yours are unchanged"):
        torch.testing.assert_close(prepared(table, idx, tangent=tangent), want)
    torch.testing.assert_close(table.weight.detach(), before, rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match=r"f wrote the Active argument 0 .*yours was changed"):
        torch.testing.assert_close(prepared(table, idx, tangent=tangent), want)


def test_a_prepared_pushforward_warns_of_an_in_place_write_of_f_on_a_later_call():
    # A write f makes only after the first call (a data-dependent branch) goes through the dual
    # views to the user's tensor, and is said so rather than silently.
    calls = []

    def f(x, c):
        calls.append(1)
        if len(calls) > 1:
            x.mul_(2.0)
        return x * c

    x, c, t = torch.ones(3), torch.full((3,), 3.0), torch.ones(3)
    prepared = ad.prepare(ad.pushforward, f, Active(x), Constant(c), tangent=t)
    calls.clear()
    torch.testing.assert_close(prepared(x, c, tangent=t), c)  # d(x * c) along t = c
    with pytest.warns(RuntimeWarning, match=r"f wrote the Active argument 0 .* yours was changed"):
        prepared(x, c, tangent=t)
    torch.testing.assert_close(x, torch.full((3,), 2.0))


def test_a_pushforward_too_large_to_copy_warns_of_an_in_place_write(monkeypatch):
    # Above the copy budget (say, a large model's parameters) the first call is not run on
    # copies: the write goes through, and is said so.
    from activity.backends import _torch

    monkeypatch.setattr(_torch, "_MOST_COPIED_BYTES", 8)
    x = torch.ones(3)

    def f(x):
        x.mul_(2.0)
        return x * 1.0

    with pytest.warns(RuntimeWarning, match=r"f wrote the Active argument 0 .* yours was changed"):
        ad.pushforward(f, Active(x), tangent=torch.ones(3))


_FORWARD_SEEDS = {
    "pushforward": ("pushforward", {"tangent": torch.ones(3)}),
    "value_and_pushforward": ("value_and_pushforward", {"tangent": torch.ones(3)}),
    "tangents": ("pushforward", {"tangents": [torch.ones(3), torch.zeros(3)]}),
}


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("case", _FORWARD_SEEDS.values(), ids=_FORWARD_SEEDS.keys())
def test_forward_mode_runs_a_first_call_that_writes_its_active_tensor_on_copies_and_says_so(case, prepared):
    # Reverse mode refuses f's in-place write to an Active tensor; forward mode's dual tensors let
    # it through. The first call runs on copies: the user's tensors stay as they were.
    name, seed = case
    op = getattr(ad, name)

    def scaled_in_place(x, scale):
        x.mul_(scale)
        return x**2

    x, scale = torch.ones(3), torch.tensor(2.0)
    call = ad.prepare(op, scaled_in_place, Active(x), Constant(scale), **seed) if prepared else functools.partial(op, scaled_in_place)
    with pytest.warns(RuntimeWarning, match=r"f wrote the Active argument 0 .*yours are unchanged"):
        call(x, scale, **seed) if prepared else call(Active(x), Constant(scale), backend=ad.AutoTorch(), **seed)
    torch.testing.assert_close(x, torch.ones(3), rtol=0, atol=0)


def test_forward_mode_through_a_module_whose_f_writes_a_parameter_leaves_the_module_as_it_was():
    net = nn.Linear(3, 2)
    before = copy.deepcopy(net.state_dict())

    def bumped(m, x):
        m.bias.add_(1.0)
        return m(x)

    tangent = {name: torch.ones_like(p) for name, p in net.named_parameters()}
    with pytest.warns(RuntimeWarning, match=r"f wrote the Active argument 0"):
        ad.pushforward(bumped, Active(net), Constant(torch.ones(2, 3)), tangent=tangent)
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_gradient_hooks_on_differentiated_tensors_are_named_in_a_warning_not_silently_skipped():
    # torch.autograd.grad passes a parameter's gradient through its Tensor.register_hook hooks;
    # activity (like torch.func) returns f's derivative: the user is told which tensors differ.
    model = init(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
    x = randn(5, 3, seed=1)
    handle = model[2].weight.register_hook(lambda g: 2 * g)
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    expected = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean())(
        {n: p.detach() for n, p in model.named_parameters()}
    )
    hooked_by_torch = torch.autograd.grad(loss(model, x), [model[2].weight])[0]
    torch.testing.assert_close(hooked_by_torch, 2 * expected["2.weight"])  # the hook is live
    with pytest.warns(UserWarning, match=r"gradient hooks .* on 2\.weight, which activity does not apply") as caught:
        grads = ad.gradient(loss, Active(model), Constant(x))
    assert len(caught) == 1
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name])

    w = torch.ones(3, requires_grad=True)
    w.register_hook(lambda g: 0 * g)
    with pytest.warns(UserWarning, match="gradient hooks .* on its root"):
        torch.testing.assert_close(ad.gradient(lambda w: (w**2).sum(), Active(w)), 2 * torch.ones(3))

    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ad.gradient(loss, Active(model), Constant(x))
        ad.gradient(loss, Constant(model), Active(x))  # a Constant module's hooks concern no result


def _parameter_asking_loss(model, x):
    """A loss whose code asks its module for nn.Parameters, as model code may: a decay over
    `isinstance(p, nn.Parameter)` and `get_parameter` (which refuses anything else)."""
    decay = sum((p**2).sum() for p in model.parameters() if isinstance(p, nn.Parameter))
    return (model(x) ** 2).mean() + model.get_parameter("0.weight").sum() + 0.1 * decay


def test_f_that_asks_its_module_for_nn_parameters_gets_them_in_reverse_mode_and_from_the_reference():
    """The view's differentiated tensors were plain tensors: `get_parameter` raised, and the decay
    over nn.Parameters silently dropped out of every gradient (against torch.autograd.grad)."""
    model = init(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double())
    x1, x2 = randn(5, 3, seed=1, dtype=torch.float64), randn(5, 3, seed=2, dtype=torch.float64)
    params = [p for _, p in named_trainable(model)]
    names = [n for n, _ in named_trainable(model)]
    before = snapshot(model)

    def want(x):
        return dict(zip(names, torch.autograd.grad(_parameter_asking_loss(model, x), params)))

    def assert_close(got, expected, **tolerance):
        assert sorted(got) == sorted(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **(tolerance or ALL_CLOSE))

    assert_close(ad.gradient(_parameter_asking_loss, Active(model), Constant(x1)), want(x1))
    prepared = ad.prepare(ad.gradient, _parameter_asking_loss, Active(model), Constant(x1))
    assert_close(prepared(model, x1), want(x1))
    assert_close(prepared(model, x2), want(x2))
    pulled = ad.pullback(_parameter_asking_loss, Active(model), Constant(x2), cotangent=torch.tensor(2.0, dtype=torch.float64))
    assert_close(pulled, {n: 2 * g for n, g in want(x2).items()})
    reference = ad.gradient(_parameter_asking_loss, Active(model), Constant(x1), backend=ad.AutoFiniteDifferences())
    assert_close(reference, want(x1), rtol=1e-6, atol=1e-8)

    tangent = [randn(*p.shape, seed=3 + i, dtype=torch.float64) for i, p in enumerate(params)]
    grads = torch.autograd.grad(_parameter_asking_loss(model, x1), params, create_graph=True)
    want_hvp = dict(zip(names, torch.autograd.grad(grads, params, tangent)))
    assert_close(ad.hvp(_parameter_asking_loss, Active(model), Constant(x1), tangent=dict(zip(names, tangent))), want_hvp)
    assert_unchanged(model, before)


def test_f_that_asks_for_an_nn_parameter_under_forward_mode_is_told_what_to_do():
    """Forward mode puts dual / torch.func tensors in the slots (as torch.func.functional_call
    does): torch's "not an nn.Parameter" gets a note naming the ways that work."""
    model = init(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
    tangent = {n: torch.ones_like(p) for n, p in named_trainable(model)}
    with pytest.raises(AttributeError, match="not an nn.Parameter") as raised:
        ad.pushforward(_parameter_asking_loss, Active(model), Constant(randn(5, 3)), tangent=tangent)
    assert "get_submodule(path).weight" in "\n".join(getattr(raised.value, "__notes__", []))


def test_an_active_parameter_reached_only_through_a_constant_module_says_to_pass_the_module():
    """`Active(model[0].weight), Constant(model)`: the module is data, so f does not depend on
    the Active tensor (torch.autograd.grad would differentiate the module's use of it); the
    error names the way that differentiates it, a mask on the module, whose result is the
    hand-written gradient."""
    model = init(nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)))
    x = randn(4, 3)
    loss = lambda w, m, x: m(x).sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"Active\(module, where=\.\.\.\)"):
        ad.gradient(loss, Active(model[0].weight), Constant(model), Constant(x))
    masked = ad.gradient(lambda m, x: m(x).sum(), Active(model, where=lambda path, p: path == "0.weight"), Constant(x))
    (want,) = torch.autograd.grad(model(x).sum(), model[0].weight)
    torch.testing.assert_close(masked["0.weight"], want, **ALL_CLOSE)
