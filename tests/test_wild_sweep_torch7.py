"""Round seven of the AutoTorch sweep: derivatives with respect to a model's INPUTS with the model
held as a Constant (saliency of BERT, GPT-2 and ViT logits, integrated gradients, FGSM through a
BatchNorm in train mode), ensembles stacked with ``torch.func.stack_module_state`` under ``vmap``,
``functional_call`` with tied weights, unusual parameter containers (a ``@property`` weight, a
``__getattr__`` override, ``to_empty`` after meta init, Hugging Face ``Conv1D``,
``__torch_function__`` subclasses, ``Active(model, where=...)`` next to buffers), and operations
(``torch.linalg``, ``torch.fft``, ``grid_sample``, ``CTCLoss``, ``EmbeddingBag``, ``cdist``).

Every expected value is independent of the library: ``torch.autograd.grad`` (or
``torch.autograd.functional`` / ``torch.func``) on a fresh copy, or the float64 finite-difference
reference where torch itself has no such derivative. Each call is checked to leave the user's
arguments, their ``.grad``, hooks, flags and the global RNG as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import SECOND_ORDER, assert_close_dicts, built, generator, randn, raw_gradient, trainable, untouched

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def input_gradient(f, model, x, *rest):
    """``torch.autograd.grad`` of ``f(copy, x, *rest)`` with respect to ``x`` alone."""
    x = x.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(copy.deepcopy(model), x, *rest), x)
    return grad


def alarm_hooks(model):
    """Tensor hooks on every parameter that record a call: a Constant model's parameters are never
    differentiated, so none may fire."""
    fired = []
    for p in model.parameters():
        p.register_hook(lambda g: fired.append("hook"))
        p.register_post_accumulate_grad_hook(lambda p: fired.append("accumulate"))
    return fired


def initialised(model, seed=0):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(randn(*p.shape, seed=seed + i) * 0.5)
    return model


# ---------------------------------------------------------------- saliency with the model Constant

BERT = dict(
    vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    max_position_embeddings=20, num_labels=3, attn_implementation="eager",
)
CLASSIFIERS = {
    "bert": (
        lambda train: built(transformers.BertForSequenceClassification, transformers.BertConfig, train, **BERT),
        lambda model, e: model(inputs_embeds=e).logits[:, 1].sum(),
        (2, 5, 16),
    ),
    # GPT-2's attention and MLP are Hugging Face Conv1D layers (a Linear with its weight transposed)
    "gpt2": (
        lambda train: built(
            transformers.GPT2LMHeadModel, transformers.GPT2Config, train, vocab_size=50, n_embd=16, n_layer=1, n_head=2,
            n_positions=20, attn_implementation="eager",
        ),
        lambda model, e: model(inputs_embeds=e).logits[..., 3].sum(),
        (2, 5, 16),
    ),
    "vit": (
        lambda train: built(
            transformers.ViTForImageClassification, transformers.ViTConfig, train, hidden_size=16, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4, num_labels=3,
            attn_implementation="eager",
        ),
        lambda model, x: model(pixel_values=x).logits[:, 0].sum(),
        (2, 3, 8, 8),
    ),
}


@pytest.mark.parametrize("name", CLASSIFIERS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_saliency_of_a_constant_classifiers_logit_with_respect_to_its_input_embeddings_or_pixels(name, train):
    make, logit, shape = CLASSIFIERS[name]
    model = make(train)
    fired = alarm_hooks(model)
    x = randn(*shape)
    torch.manual_seed(5)
    start = torch.get_rng_state()
    expected = input_gradient(logit, model, x)
    after_one_forward = torch.get_rng_state()

    torch.set_rng_state(start)
    intact = untouched(Constant(model), Active(x))
    torch.testing.assert_close(ad.gradient(logit, Constant(model), Active(x)), expected)
    if train:  # dropout draws as one eager forward does
        assert torch.equal(torch.get_rng_state(), after_one_forward)
        torch.set_rng_state(start)
    assert intact()

    prepared = ad.prepare(ad.gradient, logit, Constant(model), Active(randn(*shape, seed=1)))
    prepared(model, randn(*shape, seed=2))
    torch.set_rng_state(start)
    torch.testing.assert_close(prepared(model, x), expected)
    assert fired == []
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert model.training is train


def test_input_hvp_of_bert_and_integrated_gradients_as_batched_pullbacks_and_a_jacobian():
    bert = built(transformers.BertForSequenceClassification, transformers.BertConfig, **BERT)
    fired = alarm_hooks(bert)
    logit = CLASSIFIERS["bert"][1]
    e, tangent = randn(2, 5, 16), randn(2, 5, 16, seed=3)
    x = e.clone().requires_grad_()
    (g,) = torch.autograd.grad(logit(copy.deepcopy(bert), x), x, create_graph=True)
    (expected,) = torch.autograd.grad(g, x, tangent)
    torch.testing.assert_close(ad.hvp(logit, Constant(bert), Active(e), tangent=tangent), expected, **SECOND_ORDER)

    # integrated gradients: the logit at alpha * x for a path of alphas, one pullback per alpha
    alphas = torch.linspace(0.1, 1.0, 4, dtype=torch.float64)

    def along_the_path(model, x, alphas):
        return model(inputs_embeds=alphas[:, None, None] * x).logits[:, 1]

    base = randn(1, 5, 16, seed=4)
    jac = torch.autograd.functional.jacobian(lambda x: along_the_path(copy.deepcopy(bert), x, alphas), base)
    intact = untouched(Constant(bert), Active(base), Constant(alphas))
    pulled = ad.pullback(along_the_path, Constant(bert), Active(base), Constant(alphas), cotangents=list(torch.eye(4, dtype=torch.float64)))
    for got, want in zip(pulled, jac):
        torch.testing.assert_close(got, want)

    # and with respect to the path's weights, through a ViT
    vit = CLASSIFIERS["vit"][0](False)
    pixels = randn(1, 3, 8, 8, seed=5)

    def vit_path(model, alphas, x):
        return model(pixel_values=alphas[:, None, None, None] * x).logits[:, 0]

    expected = torch.autograd.functional.jacobian(lambda a: vit_path(copy.deepcopy(vit), a, pixels), alphas)
    torch.testing.assert_close(ad.jacobian(vit_path, Constant(vit), Active(alphas), Constant(pixels)), expected)
    assert intact() and fired == []


def test_saliency_with_respect_to_embeddings_still_on_the_embedding_tables_graph():
    """``model.get_input_embeddings()(ids)`` is attached to the table's graph: the derivative is the
    one with respect to the embeddings alone, and the table gets no ``.grad``."""
    bert = built(transformers.BertForSequenceClassification, transformers.BertConfig, **BERT)
    fired = alarm_hooks(bert)
    logit = CLASSIFIERS["bert"][1]
    ids = torch.randint(3, 50, (2, 5), generator=generator(0))
    embeddings = bert.get_input_embeddings()(ids)
    assert embeddings.grad_fn is not None
    expected = input_gradient(logit, bert, embeddings.detach())
    got = ad.gradient(logit, Constant(bert), Active(embeddings))
    assert not got.requires_grad
    torch.testing.assert_close(got, expected)
    prepared = ad.prepare(ad.gradient, logit, Constant(bert), Active(bert.get_input_embeddings()(ids.flip(0))))
    torch.testing.assert_close(prepared(bert, embeddings), expected)

    def logits(model, e):
        return model(inputs_embeds=e).logits[:, 1]

    tangent = randn(2, 5, 16, seed=1)
    _, jvp = torch.autograd.functional.jvp(lambda e: logits(copy.deepcopy(bert), e), embeddings.detach(), tangent)
    torch.testing.assert_close(ad.pushforward(logits, Constant(bert), Active(embeddings), tangent=tangent), jvp)
    assert fired == [] and bert.get_input_embeddings().weight.grad is None


def test_fgsm_through_a_constant_batchnorm_model_in_train_mode_leaves_its_running_statistics():
    model = initialised(nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3), nn.BatchNorm1d(3, momentum=None)
    ).double())
    with torch.no_grad():
        model[1].running_mean.add_(0.3)
    x, labels, tangent = randn(4, 3, 8, 8), torch.tensor([0, 2, 1, 1]), randn(4, 3, 8, 8, seed=6)

    def loss(model, x, labels):
        return F.cross_entropy(model(x), labels)

    expected = input_gradient(loss, model, x, labels)
    intact = untouched(Constant(model), Active(x), Constant(labels))
    torch.testing.assert_close(ad.gradient(loss, Constant(model), Active(x), Constant(labels)), expected)
    prepared = ad.prepare(ad.gradient, loss, Constant(model), Active(randn(4, 3, 8, 8, seed=1)), Constant(labels))
    prepared(model, randn(4, 3, 8, 8, seed=2), labels)
    torch.testing.assert_close(prepared(model, x, labels), expected)
    adversarial = x + 0.1 * prepared(model, x, labels).sign()
    assert torch.equal(adversarial, x + 0.1 * expected.sign())

    twin = copy.deepcopy(model)
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(twin, xx, labels), xx, create_graph=True)
    (hvp,) = torch.autograd.grad(g, xx, tangent)
    torch.testing.assert_close(ad.hvp(loss, Constant(model), Active(x), Constant(labels), tangent=tangent), hvp, **SECOND_ORDER)
    _, jvp = torch.autograd.functional.jvp(copy.deepcopy(model), x, tangent)  # train-mode BatchNorm writes its copy
    torch.testing.assert_close(ad.pushforward(lambda m, x: m(x), Constant(model), Active(x), tangent=tangent), jvp)
    assert intact() and model[5].num_batches_tracked == 0 and model.training


# ---------------------------------------------------------------- ensembles and functional_call


def test_a_stacked_ensemble_under_vmap_with_its_stacked_parameters_as_the_active_dict():
    members = [initialised(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double(), seed=10 * i) for i in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    skeleton = copy.deepcopy(members[0]).to("meta")
    x = randn(5, 3)

    def ensemble_loss(params, buffers, x):
        outputs = torch.vmap(lambda p, b: torch.func.functional_call(skeleton, (p, b), (x,)))(params, buffers)
        return outputs.pow(2).sum()

    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    expected = dict(zip(leaves, torch.autograd.grad(ensemble_loss(leaves, buffers, x), list(leaves.values()))))
    intact = untouched(Active(params), Constant(buffers), Constant(x))
    assert_close_dicts(ad.gradient(ensemble_loss, Active(params), Constant(buffers), Constant(x)), expected)
    prepared = ad.prepare(ad.gradient, ensemble_loss, Active(params), Constant(buffers), Constant(randn(5, 3, seed=1)))
    prepared(params, buffers, randn(5, 3, seed=2))
    assert_close_dicts(prepared(params, buffers, x), expected)

    tangent = {k: randn(*v.shape, seed=i) for i, (k, v) in enumerate(params.items())}
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    grads = torch.autograd.grad(ensemble_loss(leaves, buffers, x), list(leaves.values()), create_graph=True)
    expected_hvp = dict(zip(leaves, torch.autograd.grad(grads, list(leaves.values()), list(tangent.values()))))
    assert_close_dicts(ad.hvp(ensemble_loss, Active(params), Constant(buffers), Constant(x), tangent=tangent), expected_hvp, **SECOND_ORDER)
    assert intact() and all(p.grad is None for m in members for p in m.parameters())


class TwoLayersOneWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("tie", [True, False])
def test_functional_call_with_tied_weights_tied_and_untied(tie):
    model = initialised(TwoLayersOneWeight().double())
    x, weight = randn(5, 3), randn(3, 3, seed=7)

    def loss(model, weight, x):
        return torch.func.functional_call(model, {"a.weight": weight}, (x,), tie_weights=tie).pow(2).sum()

    intact = untouched(Constant(model), Active(weight), Constant(x))
    w = weight.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(copy.deepcopy(model), w, x), w)
    torch.testing.assert_close(ad.gradient(loss, Constant(model), Active(weight), Constant(x)), expected)

    # the model Active: the override replaces a.weight (and b.weight when tied), so only the rest has a use
    twin = copy.deepcopy(model)
    names, ps = zip(*twin.named_parameters())
    raw = torch.autograd.grad(loss(twin, weight, x), ps, allow_unused=True, materialize_grads=True)
    assert_close_dicts(ad.gradient(loss, Active(model), Constant(weight), Constant(x)), dict(zip(names, raw)))
    assert intact()


# ---------------------------------------------------------------- parameter containers


class WeightFromAProperty(nn.Module):
    def __init__(self):
        super().__init__()
        self.direction, self.scale = nn.Parameter(randn(4, 3)), nn.Parameter(randn(4, 1, seed=1))

    @property
    def weight(self):
        return self.scale * self.direction / self.direction.norm(dim=1, keepdim=True)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T)


class ForwardsUnknownAttributes(nn.Module):
    """A wrapper in the style of peft's: attributes it lacks are looked up on the wrapped model."""

    def __init__(self):
        super().__init__()
        self.base_model = initialised(nn.Linear(3, 4).double(), seed=3)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T + self.bias)


class DefaultsEveryAttribute(nn.Module):
    """A module whose missing attributes read as None, as a config object's options do: a library
    probing it with ``getattr(module, name, default)`` gets None, never its default."""

    def __init__(self):
        super().__init__()
        self.lin = initialised(nn.Linear(3, 4).double(), seed=4)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return None

    def forward(self, x):
        return torch.tanh(self.lin(x))


def materialised_from_meta():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return initialised(model.to_empty(device="cpu").double(), seed=5)


CONTAINERS = {
    "property": WeightFromAProperty,
    "getattr": ForwardsUnknownAttributes,
    "getattr_none": DefaultsEveryAttribute,
    "to_empty": materialised_from_meta,
    "hf_conv1d": lambda: initialised(nn.Sequential(
        transformers.pytorch_utils.Conv1D(4, 3), nn.Tanh(), transformers.pytorch_utils.Conv1D(2, 4)
    ).double()),
}


def squared(model, x):
    return model(x).pow(2).sum()


@pytest.mark.parametrize("name", CONTAINERS)
def test_parameters_behind_a_property_a_getattr_override_to_empty_and_hugging_face_conv1d(name):
    model, x = CONTAINERS[name](), randn(5, 3)
    expected = raw_gradient(squared, model, x)
    intact = untouched(Active(model), Constant(x))
    assert_close_dicts(ad.gradient(squared, Active(model), Constant(x)), expected)
    prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(randn(5, 3, seed=1)))
    prepared(model, randn(5, 3, seed=2))
    assert_close_dicts(prepared(model, x), expected)

    tangent = {n: randn(*p.shape, seed=i) for i, (n, p) in enumerate(trainable(model))}
    params = {n: p.detach() for n, p in model.named_parameters()}
    _, jvp = torch.func.jvp(lambda p: torch.func.functional_call(copy.deepcopy(model), p, (x,)), (params,), (tangent,))
    torch.testing.assert_close(ad.pushforward(lambda m, x: m(x), Active(model), Constant(x), tangent=tangent), jvp)
    twin = copy.deepcopy(model)
    names, ps = zip(*trainable(twin))
    grads = torch.autograd.grad(squared(twin, x), ps, create_graph=True)
    expected_hvp = dict(zip(names, torch.autograd.grad(grads, ps, [tangent[n] for n in names])))
    for backend in (ad.AutoTorch(), ad.AutoTorch(hvp_mode="forward-over-reverse")):
        assert_close_dicts(ad.hvp(squared, Active(model), Constant(x), tangent=tangent, backend=backend), expected_hvp, **SECOND_ORDER)
    assert intact()


class Tagged(torch.Tensor):
    """A ``__torch_function__`` subclass, as tensor-wrapping libraries write them."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_torch_function_subclasses_as_a_parameter_as_the_active_input_and_as_data():
    layer = initialised(nn.Linear(3, 4).double())
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Tagged))
    x, tangent = randn(5, 3), randn(5, 3, seed=4)
    intact = untouched(Active(layer), Constant(x))
    expected = dict(zip(["weight", "bias"], torch.autograd.grad(squared(layer, x), [layer.weight, layer.bias])))
    got = ad.gradient(squared, Active(layer), Constant(x))
    assert_close_dicts(got, expected)
    prepared = ad.prepare(ad.gradient, squared, Active(layer), Constant(randn(5, 3, seed=1)))
    prepared(layer, randn(5, 3, seed=2))
    assert_close_dicts(prepared(layer, x), expected)
    assert intact() and layer.weight.grad is None

    plain = initialised(nn.Linear(3, 4).double())
    tagged = x.as_subclass(Tagged)

    def out(model, x):
        return torch.tanh(model(x))

    g = ad.gradient(squared, Constant(plain), Active(tagged))
    assert type(g) is Tagged  # as torch.autograd.grad returns it
    torch.testing.assert_close(g.as_subclass(torch.Tensor), input_gradient(squared, plain, x))
    _, jvp = torch.func.jvp(lambda x: out(plain, x), (x,), (tangent,))
    pushed = ad.pushforward(out, Constant(plain), Active(tagged), tangent=tangent)
    torch.testing.assert_close(pushed.as_subclass(torch.Tensor), jvp)
    hvp = torch.autograd.functional.hvp(lambda x: out(plain, x).pow(2).sum(), x, tangent)[1]
    got = ad.hvp(lambda m, x: out(m, x).pow(2).sum(), Constant(plain), Active(tagged), tangent=tangent)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), hvp, **SECOND_ORDER)
    jac = torch.autograd.functional.jacobian(lambda x: out(plain, x), x)
    torch.testing.assert_close(ad.jacobian(out, Constant(plain), Active(tagged)).as_subclass(torch.Tensor), jac)


def test_active_where_is_asked_only_about_parameters_and_buffers_are_data_left_as_they_were():
    model = initialised(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double())
    x = randn(6, 3)
    asked = []

    def where(path, leaf):
        asked.append(path)
        return "weight" in path or "running" in path

    intact = untouched(Active(model), Constant(x))
    got = ad.gradient(squared, Active(model, where=where), Constant(x))
    assert asked == [name for name, _ in model.named_parameters()]
    twin = copy.deepcopy(model)
    names, ps = zip(*[(n, p) for n, p in twin.named_parameters() if "weight" in n])
    assert_close_dicts(got, dict(zip(names, torch.autograd.grad(squared(twin, x), ps))))
    assert intact() and model[1].num_batches_tracked == 0


def test_a_parameter_of_a_constant_model_passed_as_active_is_data_where_the_model_uses_it():
    """As with ``Active(P), Constant(P)``: the Constant model's use of the tensor is data, so the
    derivative is the partial through f's own use; with no other use, a clear error."""
    model = initialised(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    x = randn(5, 3)
    w = model[0].weight
    got = ad.gradient(lambda model, w, x: squared(model, x) + w.pow(2).sum(), Constant(model), Active(w), Constant(x))
    torch.testing.assert_close(got, 2 * w.detach())
    with pytest.raises(ValueError, match="does not depend on the Active argument"):
        ad.gradient(lambda model, w, x: squared(model, x), Constant(model), Active(w), Constant(x))


# ---------------------------------------------------------------- operations inside modules


class SpectralFilter(nn.Module):
    def __init__(self):
        super().__init__()
        self.real, self.imag = nn.Parameter(randn(9)), nn.Parameter(randn(9, seed=1))

    def forward(self, x):
        spectrum = torch.fft.rfft(x, dim=-1) * torch.complex(self.real, self.imag)
        return torch.fft.irfft(spectrum, n=x.shape[-1], dim=-1)


class Decompositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(randn(4, 4)), nn.Parameter(randn(4, 2, seed=1))

    def forward(self, x):
        spd = self.a @ self.a.T + 4 * torch.eye(4, dtype=self.a.dtype)
        eigenvalues, _ = torch.linalg.eigh(spd)
        _, r = torch.linalg.qr(self.a)
        singular = torch.linalg.svdvals(self.a + x[:1].T @ x[:1])
        solution = torch.linalg.lstsq(torch.cat([self.a, self.a.T]), torch.cat([self.b, x[:, :2]])).solution
        return torch.stack([
            torch.linalg.cholesky(spd).sum(), eigenvalues.pow(2).sum(), r.diagonal().abs().sum(), singular.sum(),
            torch.linalg.solve(spd, self.b).sum(), solution.pow(2).sum(),
        ])


class AffineWarp(nn.Module):
    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.8, 0.02]]], dtype=torch.float64))

    def forward(self, x):
        grid = F.affine_grid(self.theta.expand(x.shape[0], 2, 3), x.shape, align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag, self.out = nn.EmbeddingBag(10, 4, mode=mode).double(), nn.Linear(4, 1).double()
        self.mode = mode

    def forward(self, weights):
        ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 5])
        per_sample = weights if self.mode == "sum" else None
        return torch.tanh(self.out(self.bag(ids, offsets, per_sample_weights=per_sample)))


class Prototypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.prototypes = nn.Linear(3, 4).double(), nn.Parameter(randn(5, 4, seed=9))

    def forward(self, x):
        return torch.cdist(self.embed(x), self.prototypes)


OPERATIONS = {  # module, data, and whether torch can take its second derivative (double backward)
    "fft": (SpectralFilter, lambda seed: randn(3, 16, seed=seed), True),
    "linalg": (Decompositions, lambda seed: randn(4, 4, seed=seed), True),
    "grid_sample": (AffineWarp, lambda seed: randn(2, 1, 5, 5, seed=seed), True),
    "bag_sum": (lambda: Bag("sum"), lambda seed: randn(8, seed=seed), False),
    "bag_mean": (lambda: Bag("mean"), lambda seed: randn(8, seed=seed), False),
    "bag_max": (lambda: Bag("max"), lambda seed: randn(8, seed=seed), False),
    "cdist": (Prototypes, lambda seed: randn(6, 3, seed=seed), False),
}


@pytest.mark.parametrize("name", OPERATIONS)
def test_linalg_fft_grid_sample_embedding_bag_and_cdist_inside_a_module_in_each_operator(name):
    make, data, twice_differentiable = OPERATIONS[name]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = make()
    x = data(0)

    def loss(model, x):
        return model(x).pow(2).sum()

    def output(model, x):
        return model(x)

    intact = untouched(Active(model), Constant(x))
    expected = raw_gradient(loss, model, x)
    assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), expected)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(data(1)))
    prepared(model, data(2))
    assert_close_dicts(prepared(model, x), expected)

    tangent = {n: randn(*p.shape, seed=i + 20) for i, (n, p) in enumerate(trainable(model))}
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    cotangent = randn(*model(x).shape, seed=30)
    assert_close_dicts(
        ad.pullback(output, Active(model), Constant(x), cotangent=cotangent),
        dict(zip(names, torch.autograd.grad(output(twin, x), params, cotangent))),
    )
    # torch has no forward rule for grid_sample, embedding_bag or cdist: the reference is the FD one
    reference = ad.AutoFiniteDifferences()
    expected_push = ad.pushforward(output, Active(model), Constant(x), tangent=tangent, backend=reference)
    torch.testing.assert_close(ad.pushforward(output, Active(model), Constant(x), tangent=tangent), expected_push, rtol=1e-6, atol=1e-7)
    if twice_differentiable:
        grads = torch.autograd.grad(loss(twin, x), params, create_graph=True)
        expected_hvp = dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names])))
        assert_close_dicts(ad.hvp(loss, Active(model), Constant(x), tangent=tangent), expected_hvp, **SECOND_ORDER)
    else:  # neither a double backward nor a forward rule: an error that says so, never a number
        with pytest.raises(NotImplementedError, match="neither a forward-mode rule nor a differentiable backward"):
            ad.hvp(loss, Active(model), Constant(x), tangent=tangent)
    assert intact()


def test_ctc_loss_over_a_linear_projection_and_its_second_order_error():
    model = initialised(nn.Linear(3, 5).double())
    ctc = nn.CTCLoss(blank=0)
    targets, input_lengths, target_lengths = torch.tensor([[1, 2], [3, 3]]), torch.tensor([6, 5]), torch.tensor([2, 2])

    def loss(model, features):
        return ctc(model(features).log_softmax(-1), targets, input_lengths, target_lengths)

    features = randn(6, 2, 3)
    expected = raw_gradient(loss, model, features)
    intact = untouched(Active(model), Constant(features))
    assert_close_dicts(ad.gradient(loss, Active(model), Constant(features)), expected)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(randn(6, 2, 3, seed=1)))
    prepared(model, randn(6, 2, 3, seed=2))
    assert_close_dicts(prepared(model, features), expected)
    torch.testing.assert_close(
        ad.gradient(loss, Constant(model), Active(features)), input_gradient(loss, model, features)
    )
    tangent = {n: randn(*p.shape, seed=i) for i, (n, p) in enumerate(trainable(model))}
    with pytest.raises(NotImplementedError, match="neither a forward-mode rule nor a differentiable backward") as raised:
        ad.hvp(loss, Active(model), Constant(features), tangent=tangent)
    assert "sdpa_kernel" not in "\n".join(raised.value.__notes__)  # the attention advice only for attention
    assert intact()


def test_an_explicit_forward_over_reverse_hvp_of_a_batch_through_dropout_says_which_options_reach_vmaps_randomness():
    model = initialised(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Dropout(0.3), nn.Linear(4, 1)).double()).train()
    x, tangents = randn(5, 3), [randn(5, 3, seed=1), randn(5, 3, seed=2)]
    torch.manual_seed(3)
    start = torch.get_rng_state()
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(squared(copy.deepcopy(model), xx), xx, create_graph=True)
    expected = [torch.autograd.grad(g, xx, t, retain_graph=True)[0] for t in tangents]
    after_one_forward = torch.get_rng_state()

    chosen = ad.AutoTorch(hvp_mode="forward-over-reverse")
    with pytest.raises(RuntimeError, match="randomness") as raised:
        ad.hvp(squared, Constant(model), Active(x), tangents=tangents, backend=chosen)
    notes = "\n".join(raised.value.__notes__)
    assert "hvp_mode='auto'" in notes and "AutoTorch(randomness='same')" in notes
    # what the note offers: one mask for the batch, the one an eager forward draws
    for backend in (ad.AutoTorch(), ad.AutoTorch(hvp_mode="forward-over-reverse", randomness="same")):
        torch.set_rng_state(start)
        for got, want in zip(ad.hvp(squared, Constant(model), Active(x), tangents=tangents, backend=backend), expected):
            torch.testing.assert_close(got, want, **SECOND_ORDER)
        assert torch.equal(torch.get_rng_state(), after_one_forward)


def test_an_explicit_reverse_over_reverse_hvp_says_auto_would_try_forward_over_reverse_unprepared_and_prepared():
    model = Bag("mean")
    weights, tangent = randn(8), {n: randn(*p.shape, seed=i) for i, (n, p) in enumerate(trainable(Bag("mean")))}

    def loss(model, weights):
        return model(weights).pow(2).sum()

    chosen = ad.AutoTorch(hvp_mode="reverse-over-reverse")
    prepared = ad.prepare(ad.hvp, loss, Active(model), Constant(weights), backend=chosen, tangent=tangent)
    for call in (
        lambda: ad.hvp(loss, Active(model), Constant(weights), backend=chosen, tangent=tangent),
        lambda: ad.hvp(loss, Active(model), Constant(weights), backend=chosen, tangents=[tangent, tangent]),
        lambda: prepared(model, weights, tangent=tangent),
    ):
        with pytest.raises(NotImplementedError, match="_embedding_bag_backward") as raised:
            call()
        assert any("hvp_mode='auto'" in note and "forward over reverse" in note for note in raised.value.__notes__)
