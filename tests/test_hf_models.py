"""AutoTorch on Hugging Face models (tiny configs, random init): results against hand-written autograd.

Nothing is downloaded: every model is built from a small config with weights drawn from a fixed
seed (the global RNG is forked, so it is left as it was), and token ids come from a seeded
``torch.Generator``. Each model is built once per module and shared, so every test also checks
that the call left the model exactly as it was.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, NamedTuple

import pytest
import torch
import transformers

import activity as ad
from activity import Active, Constant

VOCAB = 64
BATCH, LENGTH = 2, 6


def generator(seed):
    return torch.Generator().manual_seed(seed)


def token_ids(seed, length=LENGTH):
    return torch.randint(3, VOCAB, (BATCH, length), generator=generator(seed))


# ---------------------------------------------------------------- the models


def gpt2_config():
    # Dropout stays at its default (0.1): eval() turns it off, the train-mode test uses it.
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=1
    )


def bert_config():
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=0,
    )


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def vit_config():
    return transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )


def t5_config():
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


def whisper_config():
    return transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=8,  # input_features then have 2 * 8 frames
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


def lm_batch(seed):
    ids = token_ids(seed)
    return {"input_ids": ids, "labels": ids}


def bert_batch(seed):
    ids = token_ids(seed)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # some padding, so the attention mask matters
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (BATCH,), generator=generator(seed + 1))}


def vit_batch(seed):
    g = generator(seed)
    return {"pixel_values": torch.randn(BATCH, 3, 8, 8, generator=g), "labels": torch.randint(0, 3, (BATCH,), generator=g)}


def t5_batch(seed):
    return {"input_ids": token_ids(seed), "labels": token_ids(seed + 1, length=4)}


def whisper_batch(seed):
    g = generator(seed)
    return {"input_features": torch.randn(BATCH, 8, 16, generator=g), "labels": token_ids(seed + 1, length=4)}


class Spec(NamedTuple):
    model_class: type
    config: Callable[[], object]
    batch: Callable[[int], dict]


SPECS = {
    "gpt2": Spec(transformers.GPT2LMHeadModel, gpt2_config, lm_batch),
    "bert": Spec(transformers.BertForSequenceClassification, bert_config, bert_batch),
    "llama": Spec(transformers.LlamaForCausalLM, llama_config, lm_batch),
    "vit": Spec(transformers.ViTForImageClassification, vit_config, vit_batch),
    "t5": Spec(transformers.T5ForConditionalGeneration, t5_config, t5_batch),
    "whisper": Spec(transformers.WhisperForConditionalGeneration, whisper_config, whisper_batch),
}


def build(name, seed=0):
    spec = SPECS[name]
    config = spec.config()
    # Eager attention: plain differentiable torch ops, second order included (no fused SDPA kernel).
    config._attn_implementation = "eager"
    with torch.random.fork_rng():  # random init from a fixed seed; the global RNG is restored on exit
        torch.manual_seed(seed)
        model = spec.model_class(config)
    if getattr(model, "loss_type", "") is None:  # (transformers < 4.46 has no loss_type)
        # transformers 5 cannot infer the loss from the class name "GPT2LMHeadModel", warns, and
        # then uses ForCausalLM anyway: name it, which silences the warning.
        model.loss_type = "ForCausalLM"
    return model.eval()


class Zoo:
    """Each model built once, on first use."""

    def __init__(self):
        self.models = {}

    def __call__(self, name):
        if name not in self.models:
            self.models[name] = build(name)
        return self.models[name]


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


@pytest.fixture(params=list(SPECS))
def named_model(request, zoo):
    return request.param, zoo(request.param)


@pytest.fixture
def gpt2(zoo):
    return zoo("gpt2")


# ---------------------------------------------------------------- helpers


def snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": [p.grad for p in model.parameters()],
        "requires_grad": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "training": [(n, m.training) for n, m in model.named_modules()],
    }


def assert_unchanged(model, before):
    after = snapshot(model)
    assert list(before["state"]) == list(after["state"])
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), f"{k} changed"
    assert all(g is None for g in after["grads"]), ".grad was set"
    assert before["requires_grad"] == after["requires_grad"]
    assert before["training"] == after["training"]


def loss(model, batch):
    return model(**batch).loss


def loss_and_output(model, batch):
    out = model(**batch)
    return out.loss, out


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def reference_gradient(model, batch):
    """Hand-written autograd, keyed like named_parameters()."""
    names, params = zip(*trainable(model))
    return dict(zip(names, torch.autograd.grad(loss(model, batch), params)))


def assert_gradients_equal(grads, expected):
    assert isinstance(grads, dict)
    assert list(grads) == list(expected)
    for k in expected:
        assert not grads[k].requires_grad, k
        torch.testing.assert_close(grads[k], expected[k], msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------- first order, every model


def test_gradient_matches_autograd(named_model):
    name, model = named_model
    batch = SPECS[name].batch(10)
    before = snapshot(model)
    grads = ad.gradient(loss, Active(model), Constant(batch))
    assert_unchanged(model, before)
    assert_gradients_equal(grads, reference_gradient(model, batch))


def test_gpt2_tied_weights_appear_once(gpt2):
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    grads = ad.gradient(loss, Active(gpt2), Constant(lm_batch(10)))
    assert "transformer.wte.weight" in grads and "lm_head.weight" not in grads
    assert list(grads) == [n for n, _ in gpt2.named_parameters()]


def test_prepared_gradient_uses_the_new_batch(named_model):
    name, model = named_model
    batch0, batch1 = SPECS[name].batch(20), SPECS[name].batch(21)
    before = snapshot(model)
    prep = ad.prepare(ad.gradient, loss, Active(model), Constant(batch0))
    grads1 = prep(model, batch1)
    grads0 = prep(model, batch0)
    assert_unchanged(model, before)
    expected1, expected0 = reference_gradient(model, batch1), reference_gradient(model, batch0)
    assert not all(torch.allclose(expected0[k], expected1[k]) for k in expected0), "the batches give the same gradient"
    assert_gradients_equal(grads1, expected1)
    assert_gradients_equal(grads0, expected0)


def test_has_aux_returns_the_model_output(named_model):
    name, model = named_model
    batch = SPECS[name].batch(30)
    before = snapshot(model)
    grads, aux = ad.gradient(loss_and_output, Active(model), Constant(batch), has_aux=True)
    (value, aux2), grads2 = ad.value_and_gradient(loss_and_output, Active(model), Constant(batch), has_aux=True)
    assert_unchanged(model, before)

    with torch.no_grad():
        plain = model(**batch)
    expected = reference_gradient(model, batch)
    assert_gradients_equal(grads, expected)
    assert_gradients_equal(grads2, expected)
    for out in (aux, aux2):
        assert type(out) is type(plain)
        assert list(out.keys()) == list(plain.keys())
        assert not out.logits.requires_grad
        torch.testing.assert_close(out.logits, plain.logits)
        torch.testing.assert_close(out.loss, plain.loss)
    assert not value.requires_grad
    torch.testing.assert_close(value, plain.loss)


def test_frozen_embeddings_are_left_out(named_model):
    name, shared_model = named_model
    model = copy.deepcopy(shared_model)
    model.get_input_embeddings().requires_grad_(False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen, "nothing was frozen"
    batch = SPECS[name].batch(40)
    before = snapshot(model)
    grads = ad.gradient(loss, Active(model), Constant(batch))
    assert_unchanged(model, before)
    assert list(grads) == [n for n, _ in trainable(model)]
    assert not frozen & set(grads)
    assert_gradients_equal(grads, reference_gradient(model, batch))


# ---------------------------------------------------------------- GPT-2: second order, pullback, train mode


def test_gpt2_hvp_matches_double_backward(gpt2):
    batch = lm_batch(50)
    names, params = zip(*trainable(gpt2))
    g = generator(51)
    tangent = {n: torch.randn(p.shape, generator=g) for n, p in zip(names, params)}
    before = snapshot(gpt2)
    hvp = ad.hvp(loss, Active(gpt2), Constant(batch), tangent=tangent)
    assert_unchanged(gpt2, before)

    grads = torch.autograd.grad(loss(gpt2, batch), params, create_graph=True)
    expected = dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names])))
    assert list(hvp) == list(expected)
    for k in expected:
        assert not hvp[k].requires_grad, k
        torch.testing.assert_close(hvp[k], expected[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_gpt2_pullback_of_logits(gpt2):
    ids = token_ids(60)

    def logits(model, ids):
        return model(input_ids=ids).logits

    cotangent = torch.randn(BATCH, LENGTH, VOCAB, generator=generator(61))
    before = snapshot(gpt2)
    pulled = ad.pullback(logits, Active(gpt2), Constant(ids), cotangent=cotangent)
    assert_unchanged(gpt2, before)

    names, params = zip(*trainable(gpt2))
    expected = dict(zip(names, torch.autograd.grad(logits(gpt2, ids), params, cotangent)))
    assert_gradients_equal(pulled, expected)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_train_mode_dropout_draws_like_an_eager_forward(name, zoo):
    model = copy.deepcopy(zoo(name)).train()
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    batch = SPECS[name].batch(70)
    before = snapshot(model)
    with torch.random.fork_rng():  # the global RNG is restored when the test ends
        torch.manual_seed(1234)
        grads = ad.gradient(loss, Active(model), Constant(batch))
        assert_unchanged(model, before)
        assert model.training
        torch.manual_seed(1234)
        expected = reference_gradient(model, batch)
        eval_grads = reference_gradient(copy.deepcopy(model).eval(), batch)
    assert not all(torch.allclose(eval_grads[k], expected[k]) for k in expected), "dropout had no effect"
    assert_gradients_equal(grads, expected)


# ---------------------------------------------------------------- as users wrap them


def test_compiled_gpt2_is_differentiated_as_its_eager_model():
    model = build("gpt2")
    batch = lm_batch(60)
    expected = reference_gradient(model, batch)
    compiled = torch.compile(model, backend="eager")
    before = snapshot(model)
    grads = ad.gradient(loss, Active(compiled), Constant(batch))
    assert_gradients_equal(grads, {"_orig_mod." + k: v for k, v in expected.items()})
    tangent = {k: torch.ones_like(v) for k, v in grads.items()}
    hvp = ad.hvp(loss, Active(compiled), Constant(batch), tangent=tangent)
    names, params = zip(*trainable(model))
    first = torch.autograd.grad(loss(model, batch), params, create_graph=True)
    second = torch.autograd.grad(first, params, [torch.ones_like(p) for p in params])
    for name, want in zip(names, second):
        torch.testing.assert_close(hvp["_orig_mod." + name], want, rtol=1e-4, atol=1e-5)
    assert_unchanged(model, before)


def test_a_hooked_block_forward_in_gpt2_is_followed():
    """What accelerate does to a submodule: its forward replaced by a partial over a wrapper
    that calls the old forward (here doubling the block's output)."""
    import functools

    model = build("gpt2")
    block = model.transformer.h[0]
    block._old_forward = block.forward

    def new_forward(module, *args, **kwargs):
        out = module._old_forward(*args, **kwargs)
        return (out[0] * 2, *out[1:]) if isinstance(out, tuple) else out * 2

    block.forward = functools.update_wrapper(functools.partial(new_forward, block), block._old_forward)
    batch = lm_batch(61)
    assert_gradients_equal(ad.gradient(loss, Active(model), Constant(batch)), reference_gradient(model, batch))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5"])
def test_a_prepared_gradient_follows_a_training_loop(name):
    """A prepared gradient keeps its view of the model between calls: over optimizer steps
    (in place), a parameter given new storage, train/eval switches (dropout) and new batches,
    each call gives `torch.autograd.grad` of the model as it is then (a twin copied at that step)."""
    model = build(name, seed=5)
    batch = SPECS[name].batch(70)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(batch))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        batch = SPECS[name].batch(71 + step)
        model.train(step == 2)  # dropout on in one step: both sides draw the same masks from one seed
        twin = copy.deepcopy(model)
        with torch.random.fork_rng():
            torch.manual_seed(step)
            want = reference_gradient(twin, batch)
            torch.manual_seed(step)
            got = prepared(model, batch)
        assert_gradients_equal(got, want)
        for p, g in zip((p for _, p in trainable(model)), (got[n] for n, _ in trainable(model))):
            p.grad = g.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            first = trainable(model)[0][1]
            first.data = first.data * 1.5  # new storage, as some training code does


def test_gpt2_prepared_pushforward_of_logits_matches_torch_func_jvp_on_its_first_and_later_calls(gpt2):
    # The first forward-mode call of a problem runs on copies of the parameters (tied embedding
    # included), later ones on views of them: both are torch.func.jvp's answer, and nothing warns.
    ids = token_ids(70)
    names, params = zip(*trainable(gpt2))
    g = generator(71)
    tangent = {n: torch.randn(p.shape, generator=g) for n, p in zip(names, params)}
    twin = copy.deepcopy(gpt2)
    primals = {n: p.detach() for n, p in twin.named_parameters()}
    want = torch.func.jvp(lambda ps: torch.func.functional_call(twin, ps, (), {"input_ids": ids}).logits, (primals,), (tangent,))[1]
    before = snapshot(gpt2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        prepared = ad.prepare(ad.pushforward, lambda m, i: m(input_ids=i).logits, Active(gpt2), Constant(ids), tangent=tangent)
        for _ in range(2):
            torch.testing.assert_close(prepared(gpt2, ids, tangent=tangent), want, rtol=1e-4, atol=1e-5)
    assert_unchanged(gpt2, before)
