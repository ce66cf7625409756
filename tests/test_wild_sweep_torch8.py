"""Round eight of the AutoTorch sweep: real libraries users bring. peft (LoRA with dropout, DoRA,
rsLoRA, IA3, prompt and prefix tuning, VeRA, LoHa, LoKr, OFT, BOFT, AdaLoRA, ``modules_to_save``,
several adapters, ``disable_adapter()`` inside f, ``merge_adapter`` between prepared calls,
``merge_and_unload``), torchdiffeq (``odeint`` and ``odeint_adjoint`` of a module vector field),
einops layers and functions, accelerate's CPU offloading of a Constant model, and torch's own
orthogonal maps, encoder and attention fast paths in eval mode, and an autograd Function with a
``vmap`` rule and a non-differentiable output.

Every expected value is independent of the library: ``torch.autograd.grad`` on a fresh copy (a
double backward for second order, the full reverse-mode Jacobian for forward mode where
``torch.func`` cannot run the library's code), or the float64 finite-difference reference. Each
call is checked to leave the user's model, its flags, the active adapter and the global RNG as they
were.
"""

from __future__ import annotations

import copy
import functools

import accelerate
import einops
import peft
import pytest
import torch
import torchdiffeq
from einops.layers.torch import EinMix, Rearrange, Reduce
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import (
    CLOSE,
    assert_close_dicts,
    built,
    double_backward_hvp,
    randn,
    raw_gradient,
    reverse_mode_pushforward,
    tangent_for,
    trainable,
    untouched,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

IDS = torch.tensor([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]])
NEW_IDS = torch.tensor([[3, 2, 1, 4, 5], [9, 6, 7, 8, 1]])
GPT2 = dict(n_layer=1, n_head=2, n_embd=8, vocab_size=17, n_positions=8, attn_implementation="eager")


def gpt2(**config):
    return built(transformers.GPT2LMHeadModel, transformers.GPT2Config, **{**GPT2, **config})


def adapted(model, config, **kwargs):
    """``get_peft_model``, with the adapter weights moved off their initial values (LoRA's B
    starts at zero, which would hide every derivative through A)."""
    model = peft.get_peft_model(model, config, **kwargs)
    with torch.no_grad():
        for i, (_, p) in enumerate(trainable(model)):
            p.add_(randn(*p.shape, seed=3 + i) * 0.3)
    return model


def lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def seeded(call, seed=5):
    """``call()`` from a seeded global RNG, the RNG put back afterwards (dropout in train mode)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return call()


# ---------------------------------------------------------------- peft on tiny Hugging Face models


PEFT_CONFIGS = {
    "lora_dropout_train": (lambda: peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.3, fan_in_fan_out=True), True),
    "lora_dropout_eval": (lambda: peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.3, fan_in_fan_out=True), False),
    "dora": (lambda: peft.LoraConfig(r=2, target_modules=["c_attn", "c_fc"], use_dora=True, fan_in_fan_out=True), False),
    "rslora": (lambda: peft.LoraConfig(r=2, target_modules=["c_attn"], use_rslora=True, fan_in_fan_out=True), False),
    "ia3": (lambda: peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"], fan_in_fan_out=True), False),
    "prompt_tuning": (lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2), False),
    "prefix_tuning": (lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2), False),
    "adalora_train": (
        lambda: peft.AdaLoraConfig(init_r=3, target_r=2, target_modules=["c_attn"], total_step=10, orth_reg_weight=5.0, fan_in_fan_out=True),
        True,
    ),
}


@pytest.mark.parametrize("name", list(PEFT_CONFIGS))
def test_peft_adapters_on_gpt2_are_differentiated_in_their_trainable_parameters(name):
    """The result is keyed exactly like the trainable ``named_parameters()`` (the frozen base model
    absent) and equals torch.autograd.grad over them, with the same dropout masks in train mode
    (AdaLoRA adds its orthogonality penalty to the loss in train mode); prepared on new ids too."""
    make, train = PEFT_CONFIGS[name]
    model = adapted(gpt2(), make()).train(train)
    active_adapter = model.active_adapter
    intact = untouched(Active(model), Constant(IDS))
    prepared = ad.prepare(ad.gradient, lm_loss, Active(model), Constant(IDS))
    for ids in (IDS, NEW_IDS):
        want = seeded(lambda: raw_gradient(lm_loss, model, ids))
        got = seeded(lambda: ad.gradient(lm_loss, Active(model), Constant(ids)))
        assert list(got) == [n for n, _ in trainable(model)]
        assert_close_dicts(got, want, **CLOSE)
        assert_close_dicts(seeded(lambda: prepared(model, ids)), want, **CLOSE)
    assert intact() and model.active_adapter == active_adapter and model.training == train


def kl_to_the_base_model(m, ids):
    """A DPO-style loss: the adapted model's log-probabilities against the base model's, read
    through ``disable_adapter()`` inside f."""
    logits = m(input_ids=ids).logits
    with m.disable_adapter():
        reference = m(input_ids=ids).logits
    return (logits.log_softmax(-1) - reference.log_softmax(-1)).pow(2).sum()


def logit_gap_to_the_base_model(m, ids):
    logits = m(input_ids=ids).logits
    with m.disable_adapter():
        return logits - m(input_ids=ids).logits


def test_disable_adapter_inside_f_with_lora_a_selected_and_in_forward_and_second_order():
    """peft's ``disable_adapter()`` flips flags and ``requires_grad`` on the adapter layers inside f;
    the user's flags and model stay as they were, and every operator sees the adapted and the
    base forward."""
    model = adapted(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    lora_a = lambda path, leaf: "lora_A" in path  # noqa: E731
    intact = untouched(Active(model), Constant(IDS))
    prepared = ad.prepare(ad.gradient, kl_to_the_base_model, Active(model, where=lora_a), Constant(IDS))
    for ids in (IDS, NEW_IDS):
        want = {k: v for k, v in raw_gradient(kl_to_the_base_model, model, ids).items() if "lora_A" in k}
        assert_close_dicts(ad.gradient(kl_to_the_base_model, Active(model, where=lora_a), Constant(ids)), want, **CLOSE)
        assert_close_dicts(prepared(model, ids), want, **CLOSE)
    tangent = tangent_for(model)
    want = ad.pushforward(logit_gap_to_the_base_model, Active(model), Constant(IDS), tangent=tangent, backend=ad.AutoFiniteDifferences())
    got = ad.pushforward(logit_gap_to_the_base_model, Active(model), Constant(IDS), tangent=tangent)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    hvp = ad.hvp(kl_to_the_base_model, Active(model), Constant(IDS), tangent=tangent)
    assert_close_dicts(hvp, double_backward_hvp(kl_to_the_base_model, model, tangent, IDS), rtol=1e-6, atol=1e-9)
    assert intact() and all(p.requires_grad for _, p in trainable(model)) and len(trainable(model)) == 2


def test_set_adapter_is_followed_unprepared_and_refused_by_name_prepared():
    model = adapted(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True), adapter_name="one")
    model.add_adapter("two", peft.LoraConfig(r=3, target_modules=["c_attn"], fan_in_fan_out=True))
    with torch.no_grad():
        for i, (n, p) in enumerate(model.named_parameters()):
            if ".two." in n:
                p.add_(randn(*p.shape, seed=20 + i) * 0.3)
    prepared = ad.prepare(ad.gradient, lm_loss, Active(model), Constant(IDS))
    assert_close_dicts(prepared(model, IDS), raw_gradient(lm_loss, model, IDS), **CLOSE)
    model.set_adapter("two")
    intact = untouched(Active(model), Constant(IDS))
    got = ad.gradient(lm_loss, Active(model), Constant(IDS))
    assert all(".two." in k for k in got)
    assert_close_dicts(got, raw_gradient(lm_loss, model, IDS), **CLOSE)
    with pytest.raises(ad.PreparationMismatchError, match=r"lora_A\.one\.weight': expected requires_grad True, got False"):
        prepared(model, NEW_IDS)
    relaxed = ad.prepare(ad.gradient, lm_loss, Active(model), Constant(IDS), strict=False)
    assert_close_dicts(relaxed(model, NEW_IDS), raw_gradient(lm_loss, model, NEW_IDS), **CLOSE)
    assert intact() and model.active_adapter == "two"


def test_merge_and_unmerge_between_prepared_calls_and_merge_and_unload():
    """Merging writes the base weights in place: a prepared gradient over every parameter follows
    it (the LoRA factors then get zeros, as torch's materialized gradients are); with only the
    LoRA factors trainable, a merged model no longer depends on them, a clear error as in torch."""
    model = adapted(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    prepared = ad.prepare(ad.gradient, lm_loss, Active(model), Constant(IDS))
    prepared(model, IDS)
    model.merge_adapter()
    with pytest.raises(ValueError, match="does not depend on the Active argument"):
        prepared(model, NEW_IDS)
    model.unmerge_adapter()
    assert_close_dicts(prepared(model, NEW_IDS), raw_gradient(lm_loss, model, NEW_IDS), **CLOSE)

    for p in model.parameters():
        p.requires_grad_(True)
    everything = ad.prepare(ad.gradient, lm_loss, Active(model), Constant(IDS))
    everything(model, IDS)
    model.merge_adapter()
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    want = dict(zip(names, torch.autograd.grad(lm_loss(twin, NEW_IDS), params, materialize_grads=True)))
    assert_close_dicts(everything(model, NEW_IDS), want, **CLOSE)
    model.unmerge_adapter()
    assert_close_dicts(everything(model, NEW_IDS), raw_gradient(lm_loss, model, NEW_IDS), **CLOSE)

    base = model.merge_and_unload()
    assert_close_dicts(ad.gradient(lm_loss, Active(base), Constant(NEW_IDS)), raw_gradient(lm_loss, base, NEW_IDS), **CLOSE)


def test_a_bert_classifier_with_lora_and_modules_to_save():
    bert = built(
        transformers.BertForSequenceClassification, transformers.BertConfig, hidden_size=8, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, vocab_size=17, max_position_embeddings=8, num_labels=3,
    )  # fmt: skip
    config = peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"], modules_to_save=["classifier"])
    model, labels = adapted(bert, config), torch.tensor([0, 2])

    def loss(m, ids, labels):
        return m(input_ids=ids, labels=labels).loss

    intact = untouched(Active(model), Constant(IDS), Constant(labels))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(IDS), Constant(labels))
    for ids in (IDS, NEW_IDS):
        want = raw_gradient(loss, model, ids, labels)
        assert any("modules_to_save" in k for k in want)
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(ids), Constant(labels)), want, **CLOSE)
        assert_close_dicts(prepared(model, ids, labels), want, **CLOSE)
    assert intact()


# ---------------------------------------------------------------- peft tuners on a user's module


class TokenMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(11, 8), nn.Conv1d(8, 8, 3, padding=1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, ids):
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2).tanh()
        h = h + self.attn(h, h, h)[0]  # peft's LoRA for attention swaps in merged weights during forward
        return self.out(self.lin(h).tanh()).sum(1)


TUNERS = {
    "lora_embedding_conv_attention": lambda: peft.LoraConfig(r=2, target_modules=["emb", "conv", "attn", "lin"]),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=["lin", "out"]),
    "loha": lambda: peft.LoHaConfig(r=2, target_modules=["conv", "lin"]),
    "lokr": lambda: peft.LoKrConfig(r=2, target_modules=["conv", "lin"]),
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=["lin"]),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["lin"]),
}


@pytest.mark.parametrize("name", list(TUNERS))
def test_peft_tuners_on_a_users_module_in_reverse_forward_and_second_order(name):
    """LoHa's weight is an autograd Function without ``setup_context`` (torch.func cannot run
    it), VeRA shares frozen projections between layers, LoRA on attention swaps parameters."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base = TokenMixer().double()
    model = adapted(base, TUNERS[name]()).eval()  # LoHa and LoKr draw in train mode: see the module dropout test

    def out(m, ids):
        return m(ids)

    def loss(m, ids):
        return m(ids).pow(2).sum()

    intact = untouched(Active(model), Constant(IDS))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(IDS))
    for ids in (IDS, NEW_IDS):
        want = raw_gradient(loss, model, ids)
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(ids)), want, **CLOSE)
        assert_close_dicts(prepared(model, ids), want, **CLOSE)
    tangent = tangent_for(model)
    got = ad.pushforward(out, Active(model), Constant(IDS), tangent=tangent)
    torch.testing.assert_close(got, reverse_mode_pushforward(out, model, tangent, IDS), **CLOSE)
    hvp = ad.hvp(loss, Active(model), Constant(IDS), tangent=tangent)
    assert_close_dicts(hvp, double_backward_hvp(loss, model, tangent, IDS), rtol=1e-6, atol=1e-9)
    assert intact()


# ---------------------------------------------------------------- torchdiffeq


class VectorField(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, t, y):
        return self.net(y) * torch.cos(t) * self.scale


def vector_field():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        field = VectorField().double()
    field.net[0].bias.requires_grad_(False)
    return field


TIMES = torch.linspace(0, 1, 4, dtype=torch.float64)


@pytest.mark.parametrize("solve", [torchdiffeq.odeint, torchdiffeq.odeint_adjoint], ids=["odeint", "odeint_adjoint"])
@pytest.mark.parametrize("method", ["dopri5", "rk4"])
def test_an_ode_of_a_module_vector_field(solve, method):
    """odeint_adjoint is an autograd Function over the field's parameters (``adjoint_params``):
    the view's, so the gradient, a where= mask and several Active arguments come out as torch's.
    Forward mode comes from reverse mode (torch.func cannot run torchdiffeq's Functions): checked
    against the reverse-mode Jacobian; second order through the adjoint is a clear error."""
    field, y0, y1 = vector_field(), randn(2, 3, seed=1), randn(2, 3, seed=2)

    def trajectory(m, y, ts):
        return solve(m, y, ts, method=method, rtol=1e-9, atol=1e-10)

    def loss(m, y, ts):
        return trajectory(m, y, ts).pow(2).sum()

    intact = untouched(Active(field), Constant(y0), Constant(TIMES))
    last_layer = lambda path, leaf: path.startswith("net.2")  # noqa: E731
    prepared = ad.prepare(ad.gradient, loss, Active(field, where=last_layer), Constant(y0), Constant(TIMES))
    for y in (y0, y1):
        want = raw_gradient(loss, field, y, TIMES)
        assert_close_dicts(ad.gradient(loss, Active(field), Constant(y), Constant(TIMES)), want, **CLOSE)
        assert_close_dicts(prepared(field, y, TIMES), {k: v for k, v in want.items() if last_layer(k, v)}, **CLOSE)

    twin, y, ts = copy.deepcopy(field), y0.clone().requires_grad_(), TIMES.clone().requires_grad_()
    names, params = zip(*trainable(twin))
    *want_field, want_y, want_ts = torch.autograd.grad(loss(twin, y, ts), (*params, y, ts))
    got_field, got_y, got_ts = ad.gradient(loss, Active(field), Active(y0), Active(TIMES))
    assert_close_dicts(got_field, dict(zip(names, want_field)), **CLOSE)
    torch.testing.assert_close(got_y, want_y, **CLOSE)
    torch.testing.assert_close(got_ts, want_ts, **CLOSE)

    tangent = tangent_for(field)
    got = ad.pushforward(trajectory, Active(field), Constant(y0), Constant(TIMES), tangent=tangent)
    torch.testing.assert_close(got, reverse_mode_pushforward(trajectory, field, tangent, y0, TIMES), **CLOSE)
    if solve is torchdiffeq.odeint:
        hvp = ad.hvp(loss, Active(field), Constant(y0), Constant(TIMES), tangent=tangent)
        assert_close_dicts(hvp, double_backward_hvp(loss, field, tangent, y0, TIMES), rtol=1e-5, atol=1e-8)
    else:
        with pytest.raises(RuntimeError) as error:
            ad.hvp(loss, Active(field), Constant(y0), Constant(TIMES), tangent=tangent)
        assert "no second-order derivative can be taken" in "\n".join(getattr(error.value, "__notes__", []))
    assert intact()


# ---------------------------------------------------------------- einops


def test_einops_layers_in_a_model_and_functions_in_f():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=2, p2=2),
            EinMix("b t c -> b t d", weight_shape="c d", bias_shape="d", c=12, d=6),
            nn.GELU(),
            EinMix("b t d -> b d", weight_shape="t d", t=4, d=6),
            Reduce("b (d two) -> b d", "max", two=2),
        ).double()
    x0, x1 = randn(2, 3, 4, 4, seed=1), randn(2, 3, 4, 4, seed=2)

    def out(m, x):
        return m(x)

    def loss(m, x):
        return m(x).pow(2).sum()

    intact = untouched(Active(model), Constant(x0))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x0))
    for x in (x0, x1):
        assert_close_dicts(prepared(model, x), raw_gradient(loss, model, x), **CLOSE)
    twin = copy.deepcopy(model)
    params = {n: p.detach() for n, p in twin.named_parameters()}
    tangent = tangent_for(model)
    _, want = torch.func.jvp(lambda ps: torch.func.functional_call(twin, ps, (x0,)), (params,), (tangent,))
    torch.testing.assert_close(ad.pushforward(out, Active(model), Constant(x0), tangent=tangent), want, **CLOSE)
    assert_close_dicts(ad.hvp(loss, Active(model), Constant(x0), tangent=tangent), double_backward_hvp(loss, model, tangent, x0), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ad.jacobian(out, Constant(model), Active(x0)), torch.func.jacrev(twin)(x0), **CLOSE)
    assert intact()

    def f(w, x, pattern):
        patches = einops.rearrange(x, pattern, p1=2, p2=2)
        return einops.reduce(einops.einsum(patches, w, "b t c, c d -> b t d").tanh(), "b t d -> b d", "mean")

    w, pattern = randn(12, 5, seed=4), "b c (h p1) (w p2) -> b (h w) (p1 p2 c)"
    prepared = ad.prepare(ad.jacobian, f, Active(w), Constant(x0), Constant(pattern))
    for x in (x0, x1):
        torch.testing.assert_close(prepared(w, x, pattern), torch.func.jacrev(lambda w: f(w, x, pattern))(w), **CLOSE)
    with pytest.raises(ad.PreparationMismatchError, match="argument 2"):
        prepared(w, x1, "b c (h p1) (w p2) -> b (w h) (p2 p1 c)")
    tangents = [randn(12, 5, seed=s) for s in (5, 6)]
    for got, t in zip(ad.pushforward(f, Active(w), Constant(x0), Constant(pattern), tangents=tangents), tangents):
        torch.testing.assert_close(got, torch.func.jvp(lambda w: f(w, x0, pattern), (w,), (t,))[1], **CLOSE)


# ---------------------------------------------------------------- accelerate


def test_a_constant_model_offloaded_by_accelerate_gives_input_derivatives():
    """``cpu_offload`` leaves the parameters on the meta device and loads them in a hook around
    each forward: a Constant model runs as called."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    twin, x0, x1 = copy.deepcopy(model), randn(5, 3, seed=1), randn(5, 3, seed=2)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))

    def loss(m, x):
        return m(x).pow(2).sum()

    prepared = ad.prepare(ad.gradient, loss, Constant(model), Active(x0))
    for x in (x0, x1):
        leaf = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(loss(twin, leaf), leaf)
        torch.testing.assert_close(ad.gradient(loss, Constant(model), Active(x)), want, **CLOSE)
        torch.testing.assert_close(prepared(model, x), want, **CLOSE)
    torch.testing.assert_close(ad.jacobian(lambda m, x: m(x), Constant(model), Active(x0)), torch.autograd.functional.jacobian(twin, x0), **CLOSE)


@pytest.mark.parametrize("prepared", [False, True])
def test_an_offloaded_model_as_the_active_argument_is_refused_by_parameter(prepared):
    """Its parameters hold no values (accelerate loads fresh tensors inside each forward, and
    its loader could not rebuild a view's tensor: a TypeError deep inside accelerate)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    x = randn(5, 3, seed=1)

    def loss(m, x):
        return m(x).pow(2).sum()

    call = ad.prepare(ad.gradient, loss, Active(model), Constant(x)) if prepared else functools.partial(ad.gradient, loss)
    with pytest.raises(TypeError, match=r"argument 0 .* parameter '0\.weight' is on the meta device.*accelerate offloads.*Constant"):
        call(Active(model), Constant(x))


# ---------------------------------------------------------------- torch's own


def test_orthogonal_maps_with_and_without_trivialization_in_forward_and_second_order():
    x = randn(5, 4, seed=1)

    def out(m, x):
        return m(x)

    def loss(m, x):
        return m(x).sin().pow(2).sum()

    for orthogonal_map in ("matrix_exp", "cayley", "householder"):
        for trivialization in (True, False):
            with torch.random.fork_rng():
                torch.manual_seed(0)
                linear = nn.Linear(4, 4, dtype=torch.float64)
                nn.utils.parametrizations.orthogonal(linear, orthogonal_map=orthogonal_map, use_trivialization=trivialization)
                model = nn.Sequential(linear, nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))
            intact, tangent = untouched(Active(model), Constant(x)), tangent_for(model)
            got = ad.pushforward(out, Active(model), Constant(x), tangent=tangent)
            torch.testing.assert_close(got, reverse_mode_pushforward(out, model, tangent, x), **CLOSE)
            hvp = ad.hvp(loss, Active(model), Constant(x), tangent=tangent)
            assert_close_dicts(hvp, double_backward_hvp(loss, model, tangent, x), rtol=1e-6, atol=1e-9)
            cotangent = randn(5, 2, seed=3)
            twin = copy.deepcopy(model)
            names, params = zip(*trainable(twin))
            want = dict(zip(names, (2 * g for g in torch.autograd.grad(out(twin, x), params, cotangent))))
            assert_close_dicts(ad.pullback(out, Active(model), Constant(x), cotangents=[cotangent, 2 * cotangent])[1], want, **CLOSE)
            assert intact(), (orthogonal_map, trivialization)


def test_frozen_encoder_and_attention_in_eval_give_values_and_derivatives_of_one_path():
    """With frozen weights and no tape, torch's encoder and attention take fused fast paths (the
    encoder's nested tensors put zeros at padded positions). Forward-mode operators must not mix
    the fast path's values with the slow path's derivatives: both come from the path
    ``torch.autograd`` differentiates, checked against its reverse-mode Jacobian."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
        attention = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    for p in (*encoder.parameters(), *attention.parameters()):
        p.requires_grad_(False)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    x, tangent = randn(2, 5, 8, seed=1), randn(2, 5, 8, seed=2)

    def encode(m, x, mask):
        return m(x, src_key_padding_mask=mask)

    def attend(m, x, mask):
        return m(x, x, x, key_padding_mask=mask, need_weights=False)[0]

    for model, out in ((encoder, encode), (attention, attend)):
        intact = untouched(Constant(model), Active(x), Constant(mask))
        slow = out(model, x.clone().requires_grad_(), mask).detach()
        jacobian = torch.autograd.functional.jacobian(lambda x: out(model, x, mask), x)
        want = torch.einsum("abcdef,def->abc", jacobian, tangent)
        value, got = ad.value_and_pushforward(out, Constant(model), Active(x), Constant(mask), tangent=tangent)
        torch.testing.assert_close(value, slow, **CLOSE)
        torch.testing.assert_close(got, want, **CLOSE)
        value, got = ad.value_and_pushforward(out, Constant(model), Active(x), Constant(mask), tangents=[tangent, 2 * tangent])
        torch.testing.assert_close(got[1], 2 * want, **CLOSE)
        value, got = ad.value_and_jacobian(out, Constant(model), Active(x), Constant(mask))
        torch.testing.assert_close(value, slow, **CLOSE)
        torch.testing.assert_close(got, jacobian, **CLOSE)
        assert intact()


class ScaledSquare(torch.autograd.Function):
    """``w * x**2`` with a backward, a jvp and a hand-written vmap rule."""

    @staticmethod
    def forward(x, w):
        return w * x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return 2 * w * x * g, (x * x * g).reshape(-1, w.shape[-1]).sum(0)

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return (0 if tx is None else 2 * w * x * tx) + (0 if tw is None else tw * x * x)

    @staticmethod
    def vmap(info, in_dims, x, w):
        x_dim, w_dim = in_dims
        x = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
        if w_dim is not None:
            w = w.movedim(w_dim, 0).reshape(info.batch_size, *([1] * (x.dim() - 2)), w.shape[-1])
        return w * x * x, 0


class TopTwo(torch.autograd.Function):
    """The two largest entries and their (non-differentiable) indices."""

    @staticmethod
    def forward(x):
        return x.topk(2, dim=-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])
        ctx.shape = inputs[0].shape
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g_values, g_indices):
        (indices,) = ctx.saved_tensors
        return None if g_values is None else torch.zeros(ctx.shape, dtype=g_values.dtype).scatter(-1, indices, g_values)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.w = nn.Linear(3, 4), nn.Parameter(torch.randn(4))

    def forward(self, x):
        values, indices = TopTwo.apply(ScaledSquare.apply(self.lin(x).tanh(), self.w))
        return values * (indices.double() + 1)


def test_autograd_functions_with_a_vmap_rule_and_a_non_differentiable_output_in_jacobians_and_batched_pullbacks():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Gated().double()
    x = randn(5, 3, seed=1)

    def out(m, x):
        return m(x)

    intact = untouched(Active(model), Constant(x))
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    y = out(twin, x)
    rows = [torch.autograd.grad(y.reshape(-1)[k], params, retain_graph=True) for k in range(y.numel())]
    jacobian = ad.jacobian(out, Active(model), Constant(x))
    for j, name in enumerate(names):
        torch.testing.assert_close(jacobian[name], torch.stack([r[j] for r in rows]).reshape(*y.shape, *params[j].shape), **CLOSE)
    cotangents = [randn(5, 2, seed=s) for s in (3, 4)]
    for got, cotangent in zip(ad.pullback(out, Active(model), Constant(x), cotangents=cotangents), cotangents):
        assert_close_dicts(got, dict(zip(names, torch.autograd.grad(y, params, cotangent, retain_graph=True))), **CLOSE)
    tangent = tangent_for(model)
    got = ad.pushforward(out, Active(model), Constant(x), tangents=[tangent, tangent])[1]
    torch.testing.assert_close(got, reverse_mode_pushforward(out, model, tangent, x), **CLOSE)
    assert intact()


# ---------------------------------------------------------------- second order past an unused leaf


class OldStyleSquare(torch.autograd.Function):
    """x**2 in the old style (``forward(ctx, x)``, no ``setup_context``): torch.func cannot run
    it, so second order comes from the tape's double backward alone."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_an_unused_active_leaf_next_to_a_custom_function_has_zero_second_derivatives():
    """A leaf f never uses gets no gradient at all: zero second derivatives, whatever f's other
    operations are. It was taken for a gradient a custom backward had cut from the graph, which
    only forward over reverse can judge, and that cannot run the Function: an error."""
    x, unused, t = randn(4, seed=1), randn(3, seed=2), randn(4, seed=3)

    def f(x, unused):
        return OldStyleSquare.apply(x).sin().sum()

    hvp_x = (2 * torch.cos(x**2) - 4 * x**2 * torch.sin(x**2)) * t
    zeros = torch.zeros(3, dtype=torch.float64)
    for got in (
        ad.hvp(f, Active(x), Active(unused), tangent=(t, unused)),
        ad.hvp(f, Active(x), Active(unused), tangents=[(t, unused), (2 * t, unused)])[0],
        ad.prepare(ad.hvp, f, Active(x), Active(unused), tangent=(t, unused))(x, unused, tangent=(t, unused)),
    ):
        torch.testing.assert_close(got[0], hvp_x, **CLOSE)
        torch.testing.assert_close(got[1], zeros, **CLOSE)
    hessian = ad.hessian(f, Active(x), Active(unused))
    torch.testing.assert_close(hessian[0][0] @ t, hvp_x, **CLOSE)
    torch.testing.assert_close(hessian[1][1], torch.zeros(3, 3, dtype=torch.float64))

    class WithAnUnusedPooler(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.pooler = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return OldStyleSquare.apply(self.a(x)).sin().sum()

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = WithAnUnusedPooler().double()
    data, tangent = randn(2, 3, seed=4), tangent_for(model)
    twin = copy.deepcopy(model)
    grads = torch.autograd.grad(twin(data), (twin.a.weight, twin.a.bias), create_graph=True)
    want = dict(zip(("a.weight", "a.bias"), torch.autograd.grad(grads, (twin.a.weight, twin.a.bias), (tangent["a.weight"], tangent["a.bias"]))))
    want.update({n: torch.zeros_like(p) for n, p in model.pooler.named_parameters(prefix="pooler")})
    assert_close_dicts(ad.hvp(lambda m, x: m(x), Active(model), Constant(data), tangent=tangent), want, **CLOSE)


def test_lohas_module_dropout_in_train_mode_draws_like_an_eager_forward_in_every_operator():
    """In train mode LoHa draws whether each adapted layer applies its adapter; a skipped
    adapter's factors are unused (zeros, as torch's materialized gradients are), also in the hvp,
    and every operator advances the global RNG as one eager forward does."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base = TokenMixer().double()
    model = adapted(base, peft.LoHaConfig(r=2, target_modules=["conv", "lin"], module_dropout=0.5)).train()
    tangent = tangent_for(model)

    def out(m, ids):
        return m(ids)

    def loss(m, ids):
        return m(ids).pow(2).sum()

    def materialized_gradient():
        twin = copy.deepcopy(model)
        names, params = zip(*trainable(twin))
        return dict(zip(names, torch.autograd.grad(loss(twin, IDS), params, materialize_grads=True)))

    def materialized_hvp():
        twin = copy.deepcopy(model)
        names, params = zip(*trainable(twin))
        grads = torch.autograd.grad(loss(twin, IDS), params, create_graph=True, materialize_grads=True)
        return dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names], allow_unused=True, materialize_grads=True)))

    def drawn(call, seed=0):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return call(), torch.get_rng_state()

    _, after_eager = drawn(lambda: copy.deepcopy(model)(IDS))
    want, _ = drawn(materialized_gradient)
    assert any(not g.any() for g in want.values()) and any(g.any() for g in want.values())  # one adapter skipped
    for got, after in (
        drawn(lambda: ad.gradient(loss, Active(model), Constant(IDS))),
        drawn(lambda: ad.prepare(ad.gradient, loss, Active(model), Constant(IDS))(model, IDS)),
    ):
        assert_close_dicts(got, want, **CLOSE)
        assert torch.equal(after, after_eager)
    got, after = drawn(lambda: ad.pushforward(out, Active(model), Constant(IDS), tangent=tangent))
    torch.testing.assert_close(got, drawn(lambda: reverse_mode_pushforward(out, model, tangent, IDS))[0], **CLOSE)
    assert torch.equal(after, after_eager)
    got, after = drawn(lambda: ad.hvp(loss, Active(model), Constant(IDS), tangent=tangent))
    assert_close_dicts(got, drawn(materialized_hvp)[0], rtol=1e-6, atol=1e-9)
    assert torch.equal(after, after_eager)


def test_attention_with_dropout_and_both_masks_in_train_mode_draws_like_an_eager_forward():
    """``need_weights=False`` sends attention through scaled_dot_product_attention, whose dropout
    draws inside the fused kernel (which has no forward-mode rule): every operator uses the masks
    one eager forward draws and advances the RNG as it does."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        attention = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True, dtype=torch.float64).train()
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    x, cotangent, tangent = randn(2, 5, 8, seed=1), randn(2, 5, 8, seed=9), tangent_for(attention)

    def out(m, x, padding, causal):
        return m(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)[0]

    def loss(m, x, padding, causal):
        return out(m, x, padding, causal).pow(2).sum()

    def drawn(call):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return call(), torch.get_rng_state()

    def raw_pullback():
        twin = copy.deepcopy(attention)
        names, params = zip(*trainable(twin))
        return dict(zip(names, torch.autograd.grad(out(twin, x, padding, causal), params, cotangent)))

    data = (Constant(x), Constant(padding), Constant(causal))
    intact = untouched(Active(attention), *data)
    _, after_eager = drawn(lambda: out(copy.deepcopy(attention), x, padding, causal))
    for call, reference in (
        (lambda: ad.gradient(loss, Active(attention), *data), lambda: raw_gradient(loss, attention, x, padding, causal)),
        (lambda: ad.pullback(out, Active(attention), *data, cotangents=[cotangent, cotangent])[1], raw_pullback),
    ):
        got, after = drawn(call)
        assert_close_dicts(got, drawn(reference)[0], **CLOSE)
        assert torch.equal(after, after_eager)
    want = drawn(lambda: reverse_mode_pushforward(out, attention, tangent, x, padding, causal))[0]
    for call in (
        lambda: ad.pushforward(out, Active(attention), *data, tangent=tangent),
        lambda: ad.pushforward(out, Active(attention), *data, tangents=[tangent, tangent])[0],
    ):
        got, after = drawn(call)
        torch.testing.assert_close(got, want, **CLOSE)
        assert torch.equal(after, after_eager)
    got, after = drawn(lambda: ad.jacobian(out, Constant(attention), Active(x), Constant(padding), Constant(causal)))
    want = drawn(lambda: torch.autograd.functional.jacobian(lambda x: out(copy.deepcopy(attention), x, padding, causal), x))[0]
    torch.testing.assert_close(got, want, **CLOSE)
    assert torch.equal(after, after_eager) and intact()
