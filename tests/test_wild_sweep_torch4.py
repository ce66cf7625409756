"""Round four of the AutoTorch sweep on third-party modules: torch utilities users combine with
their models (parametrization caching, pruning, fake quantization) and Hugging Face models the
rest of the suite does not build (mixture-of-experts routing, soft-capped attention).

Every expected value is independent of the library: a hand-written ``torch.autograd.grad`` on a
copy of the model built the same way. Each call is also checked to leave the user's arguments
(parameters, buffers, ``.grad``, flags) and the global RNGs as they were.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import types
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import activity as ad
from activity import Active, Constant

from _sweeps import assert_close_dicts, generator, randn, squared, trainable, untouched
from _sweeps import raw_gradient_of as raw_gradient

FD = ad.AutoFiniteDifferences()


# ---------------------------------------------------------------- parametrizations


class Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def parametrized_mlp() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    parametrize.register_parametrization(model[0], "weight", Doubled())  # a chain of two
    parametrize.register_parametrization(model[2], "bias", Doubled())
    return model


@pytest.mark.parametrize("backend", [None, FD], ids=["AutoTorch", "finite differences"])
def test_inside_a_parametrize_cached_block_f_computes_its_own_parametrized_weights(backend):
    """torch caches a parametrized weight under the id of the module it was registered on, the
    same key for the user's module and the view f runs on. After the user's own forward in the
    block, f read the user's cached weight (not made from the tape's leaves): the gradient of
    every parametrized tensor was exactly zero, with AutoTorch and the finite differences alike,
    and each call left a weight computed from its tape in the user's cache for the next one."""
    model, x0, x1 = parametrized_mlp(), randn(3, 4, seed=1), randn(3, 4, seed=2)

    def loss(m, x):
        return m(x).pow(2).sum() + m[0].weight.sum() * m[2].bias.sum()

    # (outside the block: torch's cache keys by id(), which a new twin may reuse from a dead one)
    wants = [raw_gradient(loss, parametrized_mlp(), x) for x in (x0, x1, x1)]
    intact = untouched(Active(model), Constant(x0))
    with parametrize.cached():
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x0), backend=backend)
        for x, want in zip((x0, x1, x1), wants):
            model(x)  # the user's own forward fills the cache
            users_cache = dict(parametrize._cache)
            tolerances = {} if backend is None else dict(rtol=1e-6, atol=1e-8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the reference's precision notes
                assert_close_dicts(ad.gradient(loss, Active(model), Constant(x), backend=backend), want, **tolerances)
                assert_close_dicts(prepared(model, x), want, **tolerances)
            assert parametrize._cache == users_cache  # the same tensors: none from f's runs
    assert intact()


def test_parametrize_cached_inside_f_and_second_order():
    model, x = parametrized_mlp(), randn(3, 4, seed=1)

    def loss(m, x):
        with parametrize.cached():
            return m(x).pow(2).sum() + m[0].weight.sum() * m(x).sum()

    tangent = {n: randn(*p.shape, seed=7) for n, p in trainable(model)}
    twin = parametrized_mlp()
    names, params = zip(*trainable(twin))
    first = torch.autograd.grad(loss(twin, x), params, create_graph=True)
    want_hvp = dict(zip(names, torch.autograd.grad(first, params, [tangent[n] for n in names])))
    want = raw_gradient(loss, parametrized_mlp(), x)
    intact = untouched(Active(model), Constant(x))
    with parametrize.cached():
        model(x)
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), want)
        for mode in ("reverse-over-reverse", "forward-over-reverse"):
            got = ad.hvp(loss, Active(model), Constant(x), tangent=tangent, backend=ad.AutoTorch(hvp_mode=mode))
            assert_close_dicts(got, want_hvp)
    assert intact()


@pytest.mark.parametrize("rnn_type", [nn.LSTM, nn.GRU])
def test_an_rnn_with_orthogonal_hidden_weights(rnn_type):
    """The view rebuilt an RNN's weight list from its parameter slots, where a parametrized
    weight is not (it is computed on access): the list held None there, and torch's kernel
    failed with "expected Tensor as element 1 in argument 2, but got NoneType"."""

    def orthogonal_rnn() -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            rnn = rnn_type(3, 4, num_layers=2, batch_first=True, dtype=torch.float64)
            return nn.utils.parametrizations.orthogonal(rnn, "weight_hh_l0")

    def loss(m, x):
        out, _ = m(x)
        return out.pow(2).sum()

    model, xs = orthogonal_rnn(), (randn(2, 5, 3, seed=1), randn(2, 5, 3, seed=2))
    intact = untouched(Active(model), Constant(xs[0]))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(xs[0]))
    for x in xs:
        want = raw_gradient(loss, orthogonal_rnn(), x)
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), want)
        assert_close_dicts(prepared(model, x), want)
    inputs = xs[0].clone().requires_grad_()
    want_input = torch.autograd.grad(loss(orthogonal_rnn(), inputs), inputs)[0]
    torch.testing.assert_close(ad.gradient(lambda x, m: loss(m, x), Active(xs[0]), Constant(model)), want_input)
    assert intact()


# ---------------------------------------------------------------- parameters held outside the slots


Pair = collections.namedtuple("Pair", "weight seen")


@dataclasses.dataclass(frozen=True)
class Record:
    weight: torch.Tensor
    seen: torch.Tensor


class Child(nn.Module):
    """A submodule that reaches its parent's tensors through a weak reference (no cycle of modules)."""

    def __init__(self, parent: nn.Module):
        super().__init__()
        self.parent = weakref.ref(parent)

    def forward(self, h):
        return h @ self.parent().inner.weight


class Holder:
    """A plain helper object (no dataclass, not callable), as a library's cache or strategy object is."""

    def __init__(self, weight, seen):
        self.weight, self.seen = weight, seen


class HeldElsewhere(nn.Module):
    """Parameters and a buffer its forward reaches through plain Python containers as well
    as through its slots, as models that keep lists of their weights do."""

    def __init__(self, how: str):
        super().__init__()
        self.inner = nn.Linear(4, 4, dtype=torch.float64)
        self.head = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("seen", torch.zeros(4, dtype=torch.float64))
        self.how = how
        held = {
            "list": lambda: [self.inner.weight, self.seen],
            "dict": lambda: collections.OrderedDict(weight=self.inner.weight, seen=self.seen),
            "namedtuple": lambda: Pair(self.inner.weight, self.seen),
            "dataclass": lambda: Record(self.inner.weight, self.seen),
            "namespace": lambda: types.SimpleNamespace(weight=self.inner.weight, seen=self.seen),
            "plain object": lambda: Holder(self.inner.weight, self.seen),
        }
        if how in held:
            self.extra = held[how]()
        elif how == "partial":
            self.project = functools.partial(nn.functional.linear, weight=self.head.weight, bias=self.head.bias)
        else:
            self.child = Child(self)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        if self.how == "partial":
            return self.project(h)
        if self.how == "weakref":
            return self.head(self.child(h))
        extra = self.extra
        weight, seen = {
            "list": lambda: extra,
            "dict": lambda: (extra["weight"], extra["seen"]),
        }.get(self.how, lambda: (extra.weight, extra.seen))()
        with torch.no_grad():
            seen.add_(1.0)  # a running count, written in place
        return self.head(h @ weight) * (1 + seen)


def held_elsewhere(how: str) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return HeldElsewhere(how)


@pytest.mark.parametrize("how", ["list", "dict", "namedtuple", "dataclass", "namespace", "plain object", "partial", "weakref"])
def test_a_parameter_held_in_a_plain_container_is_differentiated_there_too(how):
    """The view redirected lists, tuples and dicts of submodules, not of tensors, nor any
    other container: f's forward reached the user's own parameter through ``self.extra``
    (or a weak reference to the parent), which no tape leaf stands for, and that path's
    contribution was silently missing (a.weight off by 1.3 here); the running count written
    through the container went to the user's buffer."""
    model, xs = held_elsewhere(how), (randn(3, 4, seed=1), randn(3, 4, seed=2))
    intact = untouched(Active(model), Constant(xs[0]))
    prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(xs[0]))
    for x in xs:
        want = raw_gradient(squared, held_elsewhere(how), x)  # (a deep copy would keep the weak reference)
        assert_close_dicts(ad.gradient(squared, Active(model), Constant(x)), want)
        assert_close_dicts(prepared(model, x), want)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reference's precision notes
            got = ad.gradient(squared, Active(model), Constant(x), backend=FD)
        assert_close_dicts(got, want, rtol=1e-6, atol=1e-8)
    assert intact()


class Gain:
    """A forward hook object that scales a submodule's output by a parameter of the model."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, module, args, out):
        return out * self.model.gain


def gained(how: str) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))
    model.register_parameter("gain", nn.Parameter(torch.tensor(1.5, dtype=torch.float64)))
    if how == "object":
        model[2].register_forward_hook(Gain(model))
    elif how == "partial":
        model[2].register_forward_hook(functools.partial(Gain.__call__, Gain(model)))
    else:
        gain = model.gain
        model[2].register_forward_hook(lambda module, args, out: out * gain)
    return model


@pytest.mark.parametrize("how", ["object", "partial", "closure"])
def test_a_users_hook_that_holds_the_model_runs_on_the_view(how):
    """Hooks are called with the view, but one that holds the model itself (a callable object,
    a partial) read the user's parameter: its gradient came back exactly 0. One that closes over
    a parameter was refused; it runs on a copy whose cell holds the view's parameter."""
    model, x = gained(how), randn(3, 4, seed=1)
    twin = gained(how)  # (a deep copy would keep the hook's reference to the original)
    names, params = zip(*trainable(twin))
    want = dict(zip(names, torch.autograd.grad(squared(twin, x), params)))
    intact = untouched(Active(model), Constant(x))
    prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(x))
    for got in (ad.gradient(squared, Active(model), Constant(x)), prepared(model, x), prepared(model, x)):
        assert_close_dicts(got, want)
    assert intact()


class Tuple2(tuple):
    pass


def test_a_tuple_subclass_holding_a_parameter_is_refused_by_name():
    model = held_elsewhere("list")
    model.extra = Tuple2(model.extra)  # cannot be rebuilt around the view's tensors
    with pytest.raises(ad.UnsupportedError, match=r"HeldElsewhere\.extra is a Tuple2 \(a tuple subclass\)"):
        ad.gradient(squared, Active(model), Constant(randn(3, 4, seed=1)))


class Scaled(nn.Module):
    def __init__(self, over: str):
        super().__init__()
        self.inner = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("scale", torch.full((4,), 2.0, dtype=torch.float64))
        held = self.inner.weight if over == "parameter" else self.scale
        self.rescale = lambda h: h * held.sum(0)

    def forward(self, x):
        return self.rescale(torch.tanh(self.inner(x)))


@pytest.mark.parametrize("over", ["parameter", "buffer"])
def test_a_function_attribute_closing_over_a_parameter_or_a_buffer_runs_on_the_view(over):
    """A closure over a trainable parameter was refused (its path would have been silently left
    out); the view holds a copy of the function whose cell holds the view's tensor."""
    x = randn(3, 4, seed=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, twin = Scaled(over), Scaled(over)  # (a deep copy would keep the closure over the original)
    twin.load_state_dict(model.state_dict())
    intact = untouched(Active(model), Constant(x))
    want = raw_gradient(squared, twin, x)
    prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(x))
    for got in (ad.gradient(squared, Active(model), Constant(x)), prepared(model, x), prepared(model, x)):
        assert_close_dicts(got, want)
    assert intact()


def test_a_complex_parameter_of_a_module_follows_torch_and_the_finite_differences_refuse_it():
    """A learned spectral filter (torch.fft). AutoTorch gives torch's own gradient; the finite
    differences, which step real values only, failed inside f with "mat1 and mat2 must have the
    same dtype, but got Double and ComplexDouble"."""

    class SpectralFilter(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(4, 4, dtype=torch.float64)
            self.filter = nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))

        def forward(self, x):
            return torch.fft.irfft2(torch.fft.rfft2(self.mix(x)) * self.filter, s=x.shape[-2:])

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SpectralFilter()
    x = randn(2, 4, 4, seed=1)
    assert_close_dicts(ad.gradient(squared, Active(model), Constant(x)), raw_gradient(squared, copy.deepcopy(model), x))
    with pytest.raises(ad.UnsupportedError, match="cannot differentiate a complex parameter"):
        ad.gradient(squared, Active(model), Constant(x), backend=FD)


# ---------------------------------------------------------------- new kinds of input that work (representative)

VOCAB = 64


def token_batch(seed: int) -> dict:
    """Right-padded ids with the padding left out of the loss."""
    ids = torch.randint(3, VOCAB, (2, 6), generator=generator(seed))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_top_k_expert_routing_with_the_router_loss_over_training_steps():
    """Mixtral: each token's top-2 experts (index selection, a grouped matmul torch has no forward
    rule for) and the auxiliary load-balancing loss from the router logits. float32: transformers'
    grouped matmul takes no float64."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config).eval()
    twin = copy.deepcopy(model)

    def loss(m, batch):
        out = m(**batch)
        assert out.aux_loss is not None  # the router loss is part of the loss differentiated
        return out.loss

    tolerances = dict(rtol=1e-4, atol=1e-6)
    prepared = ad.prepare(ad.value_and_gradient, loss, Active(model), Constant(token_batch(0)))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    for step in range(3):
        batch = token_batch(step)
        intact = untouched(Active(model), Constant(batch))
        value, got = prepared(model, batch)
        assert intact()
        names, params = zip(*trainable(twin))
        want_value = loss(twin, batch)
        want = dict(zip(names, torch.autograd.grad(want_value, params)))
        torch.testing.assert_close(value, want_value.detach(), **tolerances)
        assert_close_dicts(got, want, **tolerances)
        for (name, p), (_, q) in zip(trainable(model), trainable(twin)):
            p.grad, q.grad = got[name].clone(), want[name].clone()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    tangent = {n: randn(*p.shape, seed=4).float() for n, p in trainable(model)}
    first = torch.autograd.grad(loss(twin, batch), params, create_graph=True)
    want_hvp = dict(zip(names, torch.autograd.grad(first, params, [tangent[n] for n in names])))
    assert_close_dicts(ad.hvp(loss, Active(model), Constant(batch), tangent=tangent), want_hvp, rtol=1e-3, atol=1e-5)


def test_pruned_and_fake_quantized_modules():
    """Pruning: the weight is an attribute a forward pre-hook recomputes (weight_orig * mask).
    Quantization-aware training: observers update their statistics in forward (on the view's
    copies: the user's stay), and fake quantization passes the gradient straight through."""
    import torch.ao.quantization as quantization
    from torch.nn.utils import prune

    def pruned() -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 5, dtype=torch.float64), nn.Tanh(), nn.Linear(5, 2, dtype=torch.float64))
        prune.l1_unstructured(model[0], "weight", amount=0.5)
        return model  # (a pruned module cannot be deep-copied: its weight is not a leaf)

    model, x = pruned(), randn(3, 4, seed=1)
    intact = untouched(Active(model), Constant(x))
    assert_close_dicts(ad.gradient(squared, Active(model), Constant(x)), raw_gradient(squared, pruned(), x))
    assert intact() and model[0].weight.grad_fn is not None  # the user's attribute, not one from f's tape

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
            self.fc1, self.relu, self.fc2 = nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)

        def forward(self, x):
            return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notes
        with torch.random.fork_rng():
            torch.manual_seed(0)
            net = Net().train()
        net.qconfig = quantization.get_default_qat_qconfig("fbgemm")
        qat = quantization.prepare_qat(net)
    qat(x.float())  # the observers have seen data
    for batch in (randn(8, 4, seed=2).float(), randn(8, 4, seed=3).float()):
        intact = untouched(Active(qat), Constant(batch))
        want = raw_gradient(squared, copy.deepcopy(qat), batch)
        assert_close_dicts(ad.gradient(squared, Active(qat), Constant(batch)), want, rtol=1e-5, atol=1e-6)
        assert intact()
