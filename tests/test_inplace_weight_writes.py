"""Libraries that write a module's frozen weights inside its forward: peft's LoRA on
``nn.MultiheadAttention`` merges the adapter into the base weights and unmerges it again on
every forward (``weight.data += delta``, then the slot re-pointed at a merged tensor and the
unmerge done on that one); peft's LoRA, LoHa, AdaLoRA and IA3 unmerge merged weights in place
(``weight.data -= delta``, ``weight.data.copy_(...)``) when a forward runs with the adapters
disabled; a plain module perturbs its weight under ``torch.no_grad()`` and takes the
perturbation off again; an accelerate hook does it around the forward.

A view holds a frozen parameter as a copy of its own (copy-on-write: no memory until written),
so none of these writes reaches the user's tensors: the user's state dict is bit-identical after
every call (a plain call would leave the add-then-subtract off by rounding, and peft's merge on
attention left the delta in the user's weight for good), a second call equals the first, and the
derivatives are those of a raw ``torch.autograd.grad`` (a double backward for second order, the
reverse-mode Jacobian for forward mode where ``torch.func`` refuses peft's in-place merge) on a
twin copied before any call.
"""

from __future__ import annotations

import copy
import warnings

import accelerate.hooks
import peft
import pytest
import torch
from torch import nn

import activity as ad
from activity import Active, Constant
from activity.backends._torch_modules import frozen_copy

from _sweeps import (
    CLOSE,
    SECOND_ORDER,
    assert_close_dicts,
    double_backward_hvp,
    randn,
    raw_gradient,
    reverse_mode_pushforward,
    tangent_for,
    trainable,
)

IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1]])
NEW_IDS = torch.tensor([[4, 3, 9, 1], [2, 8, 6, 5]])
EXACT = dict(rtol=0, atol=0)


def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(model, before) -> None:
    """Every tensor of ``model``'s state dict, frozen ones included, as it was, bit for bit."""
    after = model.state_dict()
    assert list(after) == list(before)
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert not changed, f"changed: {changed}"


def double_backward_hessian(loss, model, *args, where=lambda name: True) -> dict:
    """The Hessian in the selected trainable parameters, row by row by a double backward on a
    deep copy of ``model``, laid out as activity's: ``{name: {name: shape + shape}}``."""
    twin = copy.deepcopy(model)
    names, params = zip(*[(n, p) for n, p in trainable(twin) if where(n)])
    grads = torch.autograd.grad(loss(twin, *args), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = torch.stack([torch.cat([r.reshape(-1) for r in torch.autograd.grad(flat[k], params, retain_graph=True)]) for k in range(flat.numel())])
    sizes = [p.numel() for p in params]
    blocks = [row.split(sizes, dim=1) for row in rows.split(sizes, dim=0)]
    return {
        a: {b: blocks[i][j].reshape(*pa.shape, *pb.shape) for j, (b, pb) in enumerate(zip(names, params))}
        for i, (a, pa) in enumerate(zip(names, params))
    }


# ---------------------------------------------------------------- peft on a user's module


class TokenMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(10, 4), nn.Conv2d(4, 4, (3, 1), padding=(1, 0))
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, ids):
        h = self.conv(self.emb(ids).transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2).tanh()
        h = h + self.attn(h, h, h)[0]
        return self.out(self.lin(h).tanh()).sum(1)


TUNERS = {
    "lora": lambda: peft.LoraConfig(r=2, target_modules=["emb", "conv", "attn", "lin"]),
    # (peft's merge_adapter() on attention re-registers the merged base weights as parameters
    # that require grad: a model whose trainable set the merge changes, left out of the merged test)
    "lora_without_attention": lambda: peft.LoraConfig(r=2, target_modules=["emb", "conv", "lin"]),
    "loha": lambda: peft.LoHaConfig(r=2, target_modules=["conv", "lin"]),
    "adalora": lambda: peft.AdaLoraConfig(init_r=2, target_r=2, target_modules=["conv", "lin"], total_step=10),
    "ia3": lambda: peft.IA3Config(target_modules=["conv", "lin"], feedforward_modules=["lin"]),
}


def adapted(name):
    """A float64 TokenMixer with the tuner ``name``, its adapter weights moved off their initial
    values (LoRA's B starts at zero, IA3's scales at one), in eval mode (LoHa draws in train mode)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = peft.get_peft_model(TokenMixer().double(), TUNERS[name]())
    with torch.no_grad():
        for i, (_, p) in enumerate(trainable(model)):
            p.add_(randn(*p.shape, seed=3 + i) * 0.3)
    return model.eval()


def out(m, ids):
    return m(ids)


def loss(m, ids):
    return m(ids).pow(2).sum()


def base_then_adapted(m, ids):
    """A forward with the adapters disabled, which unmerges merged weights in place, then one
    with them (now unmerged in the model f runs: through the adapters' own weights)."""
    with m.disable_adapter():
        base = m(ids)
    return (base * m(ids)).sum()


def test_lora_merging_into_attention_inside_forward_leaves_the_users_weights_and_derivatives_as_torchs():
    """peft's LoRA for attention merges and unmerges in place on every forward: the merge's
    ``weight.data += delta`` reached the user's frozen ``out_proj`` weight for good (state change
    1.2), and each later call differentiated the model with the delta added again."""
    model = adapted("lora")
    reference, before = copy.deepcopy(model), state_of(model)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(NEW_IDS))
    for ids in (IDS, NEW_IDS):
        want = raw_gradient(loss, reference, ids)
        first = ad.gradient(loss, Active(model), Constant(ids))
        assert_close_dicts(first, want, **CLOSE)
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(ids)), first, **EXACT)
        assert_close_dicts(prepared(model, ids), want, **CLOSE)
        assert_close_dicts(prepared(model, ids), want, **CLOSE)
        assert_bit_identical(model, before)

    tangent = tangent_for(model)
    want = reverse_mode_pushforward(out, reference, tangent, IDS)
    torch.testing.assert_close(ad.pushforward(out, Active(model), Constant(IDS), tangent=tangent), want, **CLOSE)
    prepared = ad.prepare(ad.pushforward, out, Active(model), Constant(NEW_IDS), tangent=tangent)
    for _ in range(2):
        torch.testing.assert_close(prepared(model, IDS, tangent=tangent), want, **CLOSE)
    assert_close_dicts(
        ad.hvp(loss, Active(model), Constant(IDS), tangent=tangent), double_backward_hvp(loss, reference, tangent, IDS), **SECOND_ORDER
    )
    attention = lambda path, leaf: ".attn." in path  # noqa: E731  (the merging layer: 48 entries, a cheap Hessian)
    got = ad.hessian(loss, Active(model, where=attention), Constant(IDS))
    want = double_backward_hessian(loss, reference, IDS, where=lambda name: attention(name, None))
    assert list(got) == list(want)
    for key in want:
        assert_close_dicts(got[key], want[key], **SECOND_ORDER)
    assert_bit_identical(model, before)


@pytest.mark.parametrize("name", ["lora_without_attention", "loha", "adalora", "ia3"])
def test_a_merged_tuner_unmerging_in_place_inside_f_leaves_the_users_model_merged(name):
    """With the adapters merged (``merge_adapter()``), a forward with them disabled unmerges in
    place (``weight.data -= delta``; IA3 ``weight.data.copy_(...)``). That write reached the
    user's weights while the merge record, a list the view copies, stayed: the user's model was
    left unmerged but marked merged, and the next call unmerged it once more."""
    model = adapted(name)
    model.merge_adapter()
    merged = [m.merged for m in model.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]
    assert merged and all(merged)
    reference, before = copy.deepcopy(model), state_of(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unmerge result can be inaccurate", UserWarning)  # IA3's division
        want = raw_gradient(base_then_adapted, reference, IDS)
        prepared = ad.prepare(ad.gradient, base_then_adapted, Active(model), Constant(NEW_IDS))
        first = ad.gradient(base_then_adapted, Active(model), Constant(IDS))
        assert_close_dicts(first, want, **CLOSE)
        assert_close_dicts(ad.gradient(base_then_adapted, Active(model), Constant(IDS)), first, **EXACT)
        for _ in range(2):
            assert_close_dicts(prepared(model, IDS), want, **CLOSE)
    assert_bit_identical(model, before)
    assert [m.merged for m in model.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)] == merged


# ---------------------------------------------------------------- a plain module, an accelerate hook


class Perturbed(nn.Module):
    """A frozen weight perturbed in the forward (sharpness-aware style) and put back, three ways."""

    def __init__(self, write):
        super().__init__()
        self.write = write
        self.weight = nn.Parameter(randn(3, 3, seed=1), requires_grad=False)
        self.register_buffer("noise", randn(3, 3, seed=2) * 0.5)
        self.scale, self.bias = nn.Parameter(randn(3, seed=3)), nn.Parameter(randn(3, seed=4))

    def forward(self, x):
        if self.write == "add_then_subtract":
            with torch.no_grad():
                self.weight.add_(self.noise)
            h = nn.functional.linear(x, self.weight)
            with torch.no_grad():
                self.weight.sub_(self.noise)
        elif self.write == "data_copy":
            saved = self.weight.detach().clone()
            self.weight.data.copy_(saved + self.noise)
            h = nn.functional.linear(x, self.weight)
            self.weight.data.copy_(saved)
        else:  # peft's attention merge: the write stays on the old tensor, the unmerge is done on its replacement
            merged = self.weight.data.detach() + self.noise
            self.weight.data += self.noise
            del self.weight
            self.weight = merged
            h = nn.functional.linear(x, self.weight)
            unmerged = self.weight.data - self.noise
            del self.weight
            self.register_parameter("weight", nn.Parameter(unmerged, requires_grad=False))
        return torch.tanh(h * self.scale + self.bias)


def module_loss(m, x):
    return m(x).pow(3).sum()


X = randn(4, 3, seed=5)


@pytest.mark.parametrize("write", ["add_then_subtract", "data_copy", "merge_then_unmerge_on_a_replacement"])
def test_a_module_writing_its_frozen_weight_inside_forward_in_every_operator(write):
    model = Perturbed(write)
    reference, before = copy.deepcopy(model), state_of(model)
    want = raw_gradient(module_loss, reference, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the user's weight is never written: nothing to warn of
        first = ad.gradient(module_loss, Active(model), Constant(X))
        assert_close_dicts(first, want, **CLOSE)
        assert_close_dicts(ad.gradient(module_loss, Active(model), Constant(X)), first, **EXACT)
        prepared = ad.prepare(ad.gradient, module_loss, Active(model), Constant(randn(4, 3, seed=6)))
        for _ in range(2):
            assert_close_dicts(prepared(model, X), want, **CLOSE)

        tangent = tangent_for(model)  # (torch.func.jvp refuses the forward's write to a tensor it did not get)
        want_tangent = reverse_mode_pushforward(out, reference, tangent, X)
        torch.testing.assert_close(ad.pushforward(out, Active(model), Constant(X), tangent=tangent), want_tangent, **CLOSE)
        assert_close_dicts(
            ad.hvp(module_loss, Active(model), Constant(X), tangent=tangent),
            double_backward_hvp(module_loss, reference, tangent, X),
            **SECOND_ORDER,
        )
        got, want_hessian = ad.hessian(module_loss, Active(model), Constant(X)), double_backward_hessian(module_loss, reference, X)
        for key in want_hessian:
            assert_close_dicts(got[key], want_hessian[key], **SECOND_ORDER)
    assert_bit_identical(model, before)
    assert model.weight is model._parameters["weight"] and type(model.weight) is nn.Parameter  # the user's own slot


class PerturbAround(accelerate.hooks.ModelHook):
    """An accelerate hook that perturbs its module's frozen weight for the forward and takes it off after."""

    def __init__(self, noise):
        super().__init__()
        self.noise = noise

    def pre_forward(self, module, *args, **kwargs):
        with torch.no_grad():
            module.weight.add_(self.noise)
        return args, kwargs

    def post_forward(self, module, output):
        with torch.no_grad():
            module.weight.sub_(self.noise)
        return output


def hooked_network():
    """A fresh network each time (the raw call's twin is built, not copied from the user's)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        network = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    network[0].weight.requires_grad_(False)
    accelerate.hooks.add_hook_to_module(network[0], PerturbAround(randn(4, 3, seed=7) * 0.5))
    return network


def test_an_accelerate_hook_writing_a_frozen_weight_around_the_forward():
    model, twin = hooked_network(), hooked_network()
    before = state_of(model)
    want = dict(zip([n for n, _ in trainable(twin)], torch.autograd.grad(module_loss(twin, X), [p for _, p in trainable(twin)])))
    first = ad.gradient(module_loss, Active(model), Constant(X))
    assert_close_dicts(first, want, **CLOSE)
    assert_close_dicts(ad.gradient(module_loss, Active(model), Constant(X)), first, **EXACT)
    prepared = ad.prepare(ad.gradient, module_loss, Active(model), Constant(randn(4, 3, seed=6)))
    for _ in range(2):
        assert_close_dicts(prepared(model, X), want, **CLOSE)
    tangent = tangent_for(model)
    assert_close_dicts(
        ad.hvp(module_loss, Active(model), Constant(X), tangent=tangent), double_backward_hvp(module_loss, twin, tangent, X), **SECOND_ORDER
    )
    assert_bit_identical(model, before)


# ---------------------------------------------------------------- the copy itself


def test_a_frozen_parameter_is_copied_only_where_written_and_by_a_plain_clone_without_torchs_lazy_clone(monkeypatch):
    """The copy a view holds shares the user's memory until written (torch's copy-on-write
    clone); where torch has none, a plain clone, which the same writes leave apart as well."""
    weight = nn.Parameter(randn(3, 3, seed=1), requires_grad=False)
    kept = weight.detach().clone()
    is_cow = getattr(torch._C, "_is_cow_tensor", lambda tensor: False)
    lazy = frozen_copy(weight)
    if hasattr(torch, "_lazy_clone"):
        assert is_cow(lazy) and is_cow(weight)  # no memory of its own yet
    lazy.data += 1.0
    assert torch.equal(weight, kept) and torch.equal(lazy, kept + 1.0)

    monkeypatch.delattr(torch, "_lazy_clone", raising=False)
    plain = frozen_copy(weight)
    assert type(plain) is nn.Parameter and not plain.requires_grad and torch.equal(plain, kept)
    assert not is_cow(plain)  # the fallback's own memory
    plain.data.copy_(torch.zeros(3, 3))
    assert torch.equal(weight, kept)
    model = Perturbed("merge_then_unmerge_on_a_replacement")
    before, want = state_of(model), raw_gradient(module_loss, model, X)
    assert_close_dicts(ad.gradient(module_loss, Active(model), Constant(X)), want, **CLOSE)
    assert_bit_identical(model, before)


def test_a_prepared_call_takes_new_copies_of_frozen_weights_the_user_changed_between_calls():
    """A prepared call's view is kept between calls, its frozen copies are not: an RNN's frozen
    weight (in its weight lists too) and one carrying a Python attribute follow the user's
    ``merge_adapter()``-like write between calls, and an idle view holds no copy."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.ModuleDict(dict(rnn=nn.LSTM(3, 4, batch_first=True), head=nn.Linear(4, 2))).double()
    model.rnn.weight_hh_l0.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    model.head.weight.tag = "frozen head"  # an attribute the view's copy carries as well

    def rnn_loss(m, x):
        return m.head(m.rnn(x)[0]).pow(2).sum()

    tags = []

    def tagged_loss(m, x):
        tags.append(getattr(m.head.weight, "tag", None))
        return rnn_loss(m, x)

    x = randn(2, 5, 3, seed=8)
    prepared = ad.prepare(ad.gradient, tagged_loss, Active(model), Constant(randn(2, 5, 3, seed=9)))
    for scale in (1.0, 0.5):
        with torch.no_grad():
            model.rnn.weight_hh_l0.mul_(scale)
            model.head.weight.mul_(scale)
        before = state_of(model)
        want = raw_gradient(rnn_loss, model, x)
        for _ in range(2):
            assert_close_dicts(prepared(model, x), want, **CLOSE)
        assert_bit_identical(model, before)
    assert tags and set(tags) == {"frozen head"}
    (idle,) = ad.backends._torch_modules.described(model).reused
    assert idle.held.count(None) == len(idle.renewed) == 2
