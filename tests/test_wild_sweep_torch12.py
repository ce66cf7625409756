"""Round 12 of the PyTorch sweep: opacus (a GradSampleModule's per-parameter attributes and per-layer
activation lists), helpers held in ``__slots__`` objects, lists submodules and hooks share, a botorch
acquisition function's Hessian with its GP a Constant (``self.to()`` in its forward), and Hugging
Face key/value caches (``past_key_values``) as Constant and Active. Each expected value comes from
torch.autograd.grad (or a double backward) on an independent copy of the user's objects, and the
user's objects are checked unchanged.

Also tried and fine, not kept: botorch's LogEI, UCB, PosteriorMean and qLogEI (gradient, prepared,
pushforward, hvp w.r.t. the candidates; gradient and hvp w.r.t. the GP's hyper-parameters; the
ExactMarginalLogLikelihood in train mode), kornia filters, colour and geometry ops and an
AugmentationSequential (with given parameters, and drawing its own: the RNG advances as one eager
call), monai UNet, SegResNet and SwinUNETR (train and eval, model and input gradients),
vector-quantize-pytorch (EMA codebook buffers updated in forward: the user's stay), rotary-embedding-
torch (learned and fixed frequencies, xpos, its caches filled by the user between prepared calls),
sentence-transformers from a local tiny BERT (its forward writes into the features dict: the user's
stays), normflows (ActNorm's data-dependent init inside f leaves the user's uninitialised), torch-ema
(``average_parameters()`` inside f) and ``swa_utils.AveragedModel``, one parametrization registered
on a shared module and one object registered on two modules, Hugging Face Gemma2 (soft-capping,
sliding window), Gemma3, ModernBERT, Qwen3, Phi3, OLMo2 and Cohere. (BART's EncoderDecoderCache, extended by f as a DynamicCache was, is fixed by the same change.)
"""

from __future__ import annotations

import dataclasses

import gpytorch.settings
import linear_operator.settings
import pytest
import torch
from opacus import GradSampleModule
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import CLOSE, assert_close_dicts, generator, randn, raw_gradient, raw_gradient_of, untouched



def _import_botorch():
    """botorch's import turns linear_operator's fast computations off and raises its Cholesky sizes
    for the whole process: put back, so that the other test files see gpytorch's own defaults (round
    10's stochastic marginal likelihood expects its probe-vector path) whichever order they run in."""
    settings = [
        *((linear_operator.settings, name, "_default") for name in ("_fast_covar_root_decomposition", "_fast_log_prob", "_fast_solves")),
        *((linear_operator.settings, name, "_global_value") for name in ("cholesky_max_tries", "max_cholesky_size")),
        (gpytorch.settings, "max_eager_kernel_size", "_global_value"),
    ]
    saved = [getattr(getattr(module, name), field) for module, name, field in settings]
    import botorch.acquisition
    import botorch.models

    for (module, name, field), value in zip(settings, saved):
        setattr(getattr(module, name), field, value)
    return botorch


botorch = _import_botorch()

# opacus's full backward hooks fire on a loss whose inputs need no gradient, and torch says so
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


def _call(m, x):
    return m(x)


# ------------------------------------------------------------------ helpers held in __slots__


class _Runner:
    """A helper with ``__slots__`` (no ``__dict__``) holding a submodule, a private slot beside it."""

    __slots__ = ("layer", "__gain")

    def __init__(self, layer):
        self.layer, self.__gain = layer, 2.0

    def __call__(self, x):
        return self.layer(x) * self.__gain


@dataclasses.dataclass(slots=True, frozen=True)
class _Pair:
    layer: nn.Module
    weight: torch.Tensor


class _Slotted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.other = nn.Linear(3, 3, dtype=torch.float64)
        self.runner = _Runner(self.lin)
        self.pairs = [_Pair(self.other, self.other.weight), 3]

    def forward(self, x):
        pair = self.pairs[0]
        return (self.lin(x) + self.runner(x) + pair.layer(x) @ pair.weight).tanh().pow(2).sum()


def test_submodules_and_parameters_held_in_slotted_objects_are_the_views():
    """A plain object with ``__slots__`` (or a ``dataclass(slots=True)``) holding a submodule kept the
    user's submodule in the view: the path through it was left out of the gradient, silently
    (lin.weight off by 13.5, other.weight by 6.2 of the right values)."""
    model, x = _seeded(_Slotted), randn(4, 3, seed=1)
    intact = untouched(Active(model), Constant(x))
    prepared = ad.prepare(ad.gradient, _call, Active(model), Constant(x))
    assert_close_dicts(ad.gradient(_call, Active(model), Constant(x)), raw_gradient(_call, model, x), **CLOSE)
    assert_close_dicts(prepared(model, x), raw_gradient(_call, model, x), **CLOSE)
    assert intact()
    with torch.no_grad():
        model.lin.weight.mul_(2)  # between prepared calls
    assert_close_dicts(prepared(model, x), raw_gradient(_call, model, x), **CLOSE)
    assert model.runner.layer is model.lin and model.pairs[0].layer is model.other


# ------------------------------------------------------------------ opacus


def _dp_model():
    return GradSampleModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))


def _cross_entropy(m, x, y):
    return nn.functional.cross_entropy(m(x), y)


def _batch(size, seed):
    g = generator(seed)
    return torch.randn(size, 4, generator=g), torch.randint(0, 2, (size,), generator=g)


def _opacus_state(model):
    """What opacus keeps on the user's model: each parameter's attributes, each layer's activations."""
    params = {n: {k: (len(v) if isinstance(v, list) else v) for k, v in vars(p).items()} for n, p in model.named_parameters()}
    return params, {n: len(m.activations) for n, m in model.named_modules() if hasattr(m, "activations")}


def test_an_opacus_grad_sample_module_is_differentiated_and_keeps_its_own_state():
    """Opacus keeps a forward counter and the per-sample gradients on each parameter
    (``p._forward_counter``, ``p.grad_sample``), which its hooks read and write on the parameters
    the view holds: the tape's leaves had none (AttributeError '_forward_counter' in f), and as a
    Constant the view held the user's own parameters, whose ``grad_sample`` the call overwrote."""
    model = _seeded(_dp_model)
    x, y = _batch(5, 1)
    for _ in range(2):  # the user's own steps: grad_sample becomes a list of two batches
        _cross_entropy(model, x, y).backward()
    state = _opacus_state(model)
    intact = untouched(Active(model), Constant(x), Constant(y))
    want = raw_gradient_of(_cross_entropy, _seeded(_dp_model), x, y)
    prepared = ad.prepare(ad.gradient, _cross_entropy, Active(model), Constant(x), Constant(y))
    for got in (ad.gradient(_cross_entropy, Active(model), Constant(x), Constant(y)), prepared(model, x, y), prepared(model, x, y)):
        assert_close_dicts(got, want, **CLOSE)
    fd = ad.gradient(_cross_entropy, Active(model), Constant(x), Constant(y), backend=ad.AutoFiniteDifferences())
    assert_close_dicts(fd, want, rtol=1e-4, atol=1e-5)
    leaf = x.clone().requires_grad_()
    want_x = torch.autograd.grad(_cross_entropy(_seeded(_dp_model), leaf, y), leaf)[0]
    torch.testing.assert_close(ad.gradient(_cross_entropy, Constant(model), Active(x), Constant(y)), want_x, **CLOSE)
    assert _opacus_state(model) == state
    assert intact()


def test_an_opacus_model_called_twice_in_f_leaves_the_users_activation_lists_alone():
    """f calls the model twice (a loss and an aux output) and the backward pass pops one input per
    layer: the view shared the user's ``module.activations`` lists, so one entry stayed in them, and
    the user's next steps kept a stale ``max_batch_len``: a later batch of 3 got per-sample
    gradients padded to 5 rows and scaled by 5/3."""
    ours, reference = _seeded(_dp_model), _seeded(_dp_model)
    (x5, y5), (x3, y3) = _batch(5, 1), _batch(3, 2)
    for model in (ours, reference):
        _cross_entropy(model, x5, y5).backward()

    def with_logits(m, x, y):
        return _cross_entropy(m, x, y), m(x)

    before = _opacus_state(ours)
    ad.value_and_gradient(with_logits, Active(ours), Constant(x5), Constant(y5), has_aux=True)
    assert _opacus_state(ours) == before

    def next_steps(model):
        for x, y in ((x5, y5), (x3, y3)):
            for p in model.parameters():
                p.grad_sample = None
            _cross_entropy(model, x, y).backward()
        return [p.grad_sample for p in model.parameters()]

    for got, want in zip(next_steps(ours), next_steps(reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Block(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.features = features  # its parent's list

    def forward(self, x):
        y = self.lin(x).tanh()
        self.features.append(y)
        return y


class _Collecting(nn.Module):
    """Blocks that append their outputs to one list their parent holds and reads."""

    def __init__(self):
        super().__init__()
        self.features = []
        self.blocks = nn.ModuleList([_Block(self.features) for _ in range(2)])

    def forward(self, x):
        self.features.clear()
        for block in self.blocks:
            x = block(x)
        return sum(f.pow(2).sum() for f in self.features)


class _Hooked(nn.Module):
    """A forward hook whose closure appends to the list the forward reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.outputs = outputs = []
        self.lin.register_forward_hook(lambda module, args, out: outputs.append(out))

    def forward(self, x):
        self.outputs.clear()
        self.lin(x)
        return self.outputs[0].tanh().pow(2).sum()


@pytest.mark.parametrize("build", [_Collecting, _Hooked])
def test_a_list_submodules_or_hooks_share_stays_shared_in_the_view(build):
    """The view copies a module's plain lists (what f appends must not reach the user's), once per
    list: a copy per module gave each block its own list and the parent read an empty one. A list
    a hook's closure holds stays the user's: the hook appends where the forward reads."""
    model, x = _seeded(build), randn(2, 3, seed=1)
    want = raw_gradient_of(_call, _seeded(build), x)  # (a deep copy's hook would append to the user's list)
    prepared = ad.prepare(ad.gradient, _call, Active(model), Constant(x))
    for got in (ad.gradient(_call, Active(model), Constant(x)), prepared(model, x), prepared(model, x)):
        assert_close_dicts(got, want, **CLOSE)


# ------------------------------------------------------------------ botorch


def _fitted_gp():
    train_x = torch.rand(8, 2, dtype=torch.float64)
    return botorch.models.SingleTaskGP(train_x, train_x.sin().sum(-1, keepdim=True)).eval()


def _acquisition_sum(acquisition, candidates):
    return acquisition(candidates).sum()


def test_the_hessian_of_a_botorch_acquisition_function_with_its_model_a_constant():
    """botorch's analytic acquisition functions call ``self.to(device=X.device)`` in their forward,
    which assigns ``.data`` of every parameter: on the forward-over-reverse path (``hessian``) the
    Constant view held the user's own parameters, torch.func put its wrapper into them, and the
    process crashed (a segfault, the GP's parameters left broken). The view now holds aliases made
    inside the transform, torch refuses the write with an error, and the double backward runs."""
    LogExpectedImprovement = botorch.acquisition.LogExpectedImprovement
    gp = _seeded(_fitted_gp)
    acquisition = LogExpectedImprovement(gp, best_f=gp.train_targets.max())
    candidates = torch.rand(3, 1, 2, dtype=torch.float64, generator=generator(1))
    intact = untouched(Constant(acquisition), Active(candidates))
    twin = LogExpectedImprovement(_seeded(_fitted_gp), best_f=gp.train_targets.max())
    leaf = candidates.clone().requires_grad_()
    grad = torch.autograd.grad(_acquisition_sum(twin, leaf), leaf, create_graph=True)[0].reshape(-1)
    rows = [torch.autograd.grad(g, leaf, retain_graph=True)[0] for g in grad]
    want = torch.stack(rows).reshape(*candidates.shape, *candidates.shape)
    got = ad.hessian(_acquisition_sum, Constant(acquisition), Active(candidates))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ad.gradient(_acquisition_sum, Constant(acquisition), Active(candidates)), grad.detach().reshape(candidates.shape))
    assert intact()


# ------------------------------------------------------------------ Hugging Face key/value caches


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).double().eval()


@pytest.fixture(scope="module")
def llama():
    return _seeded(_llama)


_PREFIX = torch.randint(0, 32, (2, 4), generator=generator(1))
_NEXT = torch.randint(0, 32, (2, 3), generator=generator(2))


def _past(model):
    with torch.no_grad():
        return model(_PREFIX, use_cache=True).past_key_values


def _continued(m, ids, past):
    return m(ids, past_key_values=past, use_cache=True).logits.pow(2).sum()


def test_a_dynamic_cache_passed_as_a_constant_is_not_extended_by_f(llama):
    """The model's forward extends the DynamicCache it is given: held as an opaque constant, the
    user's cache grew by 3 positions on every call (4, 7, 10), and the second call attended over
    the first one's keys (its gradient off by 0.20). It is now a pytree of its layers' tensors,
    rebuilt for each call, and ``Active(past)`` gives a DynamicCache of gradients."""
    past = _past(llama)
    twin = _seeded(_llama)
    want = raw_gradient_of(_continued, twin, _NEXT, _past(twin))
    intact = untouched(Active(llama), Constant(_NEXT), Constant(past))
    prepared = ad.prepare(ad.gradient, _continued, Active(llama), Constant(_NEXT), Constant(past))
    for got in (ad.gradient(_continued, Active(llama), Constant(_NEXT), Constant(past)), prepared(llama, _NEXT, past), prepared(llama, _NEXT, past)):
        assert_close_dicts(got, want, **CLOSE)
    assert past.get_seq_length() == _PREFIX.shape[1]
    cached = _past(twin)
    leaves = [t.requires_grad_() for layer in cached.layers for t in (layer.keys, layer.values)]
    want_past = torch.autograd.grad(_continued(twin, _NEXT, cached), leaves)
    got = ad.gradient(lambda past, m, ids: _continued(m, ids, past), Active(past), Constant(llama), Constant(_NEXT))
    assert type(got) is type(past)
    for value, expected in zip([t for layer in got.layers for t in (layer.keys, layer.values)], want_past):
        torch.testing.assert_close(value, expected, **CLOSE)
    assert intact()
