"""Round five of the AutoTorch sweep on third-party modules: Hugging Face models the rest of the
suite does not build (RoBERTa masked LM, BART with labels, Qwen2, Phi, ResNet, ConvNeXt), a
tokenizer's ``BatchEncoding`` as data, and torch modules holding parameters in unusual places
(ParameterList/Dict, ``functools.partial``, old and new spectral norm, several parametrizations,
fused conv-bn), in bfloat16, non-contiguous or channels-last, compiled, or changed between
prepared calls.

Every expected value is independent of the library: a hand-written ``torch.autograd.grad`` (or
``torch.func``) on a fresh copy of the model. Each call is also checked to leave the user's
arguments (parameters, buffers, ``.grad``, flags) and the global RNGs as they were.
"""

from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import assert_close_dicts, built, generator, randn, raw_gradient, squared, trainable, untouched

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def assert_gradient_unprepared_and_prepared(model, x, loss=squared, **tolerances):
    """Unprepared, then prepared and called on the preparation data and on new data."""
    intact = untouched(Active(model), Constant(x))
    assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), raw_gradient(loss, model, x), **tolerances)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    prepared(model, x)
    new = randn(*x.shape, seed=7).to(dtype=x.dtype, memory_format=_memory_format(x))
    assert_close_dicts(prepared(model, new), raw_gradient(loss, model, new), **tolerances)
    assert intact()


def _memory_format(x):
    return torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


def token_ids(seed, shape, vocab):
    return torch.randint(3, vocab, shape, generator=generator(seed))


# ---------------------------------------------------------------- Hugging Face models


def tiny_roberta():
    return built(
        transformers.RobertaForMaskedLM, transformers.RobertaConfig, False,
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


def encoded(seed):
    """What a tokenizer returns: a BatchEncoding (a UserDict, not a dict) of ids, mask and labels."""
    ids = token_ids(seed, (2, 7), 50)
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})


def masked_lm_loss(model, batch):
    return model(**batch).loss


def test_a_tokenizers_batch_encoding_is_data_and_a_prepared_call_takes_new_batches():
    """A BatchEncoding is flattened item by item: its tensors are data, so a prepared call takes
    the next batch instead of refusing it as a different constant. The tied decoder weight of
    RoBERTa's masked-LM head gets one gradient, under the embedding's name."""
    model, first = tiny_roberta(), encoded(1)
    intact = untouched(Active(model), Constant(first))
    got = ad.gradient(masked_lm_loss, Active(model), Constant(first))
    assert "lm_head.decoder.weight" not in got and "roberta.embeddings.word_embeddings.weight" in got
    assert_close_dicts(got, raw_gradient(masked_lm_loss, model, first))
    prepared = ad.prepare(ad.value_and_gradient, masked_lm_loss, Active(model), Constant(first))
    prepared(model, first)
    for seed in (2, 3):
        batch = encoded(seed)
        value, gradient = prepared(model, batch)
        torch.testing.assert_close(value, masked_lm_loss(model, batch))
        assert_close_dicts(gradient, raw_gradient(masked_lm_loss, model, batch))
    assert intact()


class Scaled(collections.UserDict):
    """A UserDict with an attribute of its own beside its items."""

    def __init__(self, data, scale):
        super().__init__(data)
        self.scale = scale


def test_a_user_dicts_own_attributes_are_compared_and_never_taken_from_the_preparation_values():
    def loss(w, batch):
        return ((w * batch["x"]).sum() * batch.scale) ** 2

    w = randn(3, seed=1)

    def expected(batch):
        leaf = w.clone().requires_grad_()
        return torch.autograd.grad(loss(leaf, batch), leaf)[0]

    first = Scaled({"x": randn(3, seed=2)}, torch.tensor(2.0, dtype=torch.float64))
    prepared = ad.prepare(ad.gradient, loss, Active(w), Constant(first))
    torch.testing.assert_close(prepared(w, first), expected(first))
    new = Scaled({"x": randn(3, seed=3)}, torch.tensor(7.0, dtype=torch.float64))
    torch.testing.assert_close(prepared(w, new), expected(new))  # the new items and the new scale
    prepared = ad.prepare(ad.gradient, loss, Active(w), Constant(Scaled({"x": randn(3, seed=2)}, 2.0)))
    with pytest.raises(ad.PreparationMismatchError, match=r"at \.scale: expected the value 2\.0, got the value 7\.0"):
        prepared(w, Scaled({"x": randn(3, seed=3)}, 7.0))


def test_a_fast_tokenizers_batch_encoding_is_refused_by_a_prepared_call_with_what_to_pass_instead():
    """A fast tokenizer's BatchEncoding carries its Encoding objects, which compare by identity:
    unprepared it is right; a prepared call names them and says to pass the ``.data`` dict,
    which then takes new batches."""
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {word: i for i, word in enumerate(["[PAD]", "[UNK]", "a", "b", "c", "d", "e"])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    first, second = (tokenizer(texts, return_tensors="pt") for texts in (["a b c", "d e a"], ["c c d", "a e b"]))
    model = built(
        transformers.BertForMaskedLM, transformers.BertConfig, False,
        vocab_size=7, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )

    def loss(model, batch):
        return model(**batch, labels=batch["input_ids"]).loss

    assert_close_dicts(ad.gradient(loss, Active(model), Constant(first)), raw_gradient(loss, model, first))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(first))
    prepared(model, first)
    with pytest.raises(ad.PreparationMismatchError, match=r"_encodings\[0\].*compares by identity.*\.data dict"):
        prepared(model, second)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(first.data))
    prepared(model, first.data)
    assert_close_dicts(prepared(model, second.data), raw_gradient(loss, model, second))


def tiny_resnet():
    return built(
        transformers.ResNetForImageClassification, transformers.ResNetConfig, True,
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )


def test_a_feature_extractors_batch_feature_as_the_active_input_gets_its_gradient_in_its_own_type():
    """The gradient of a BatchFeature of pixel values is a BatchFeature keyed the same way; train
    mode BatchNorm on channels-last images leaves the model's running statistics alone."""
    model = tiny_resnet()
    pixels = randn(2, 3, 16, 16, seed=1).to(memory_format=torch.channels_last)
    labels = torch.tensor([0, 2])

    def loss(inputs, model, labels):
        return model(**inputs, labels=labels).loss

    inputs = transformers.BatchFeature({"pixel_values": pixels})
    intact = untouched(Active(inputs), Constant(model))
    got = ad.gradient(loss, Active(inputs), Constant(model), Constant(labels))
    assert type(got) is transformers.BatchFeature and list(got) == ["pixel_values"]
    leaf = pixels.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss({"pixel_values": leaf}, copy.deepcopy(model), labels), leaf)
    torch.testing.assert_close(got["pixel_values"], want)
    prepared = ad.prepare(ad.gradient, loss, Active(inputs), Constant(model), Constant(labels))
    prepared(inputs, model, labels)
    new = transformers.BatchFeature({"pixel_values": randn(2, 3, 16, 16, seed=2)})
    leaf = new["pixel_values"].clone().requires_grad_()
    (want,) = torch.autograd.grad(loss({"pixel_values": leaf}, copy.deepcopy(model), labels), leaf)
    torch.testing.assert_close(prepared(new, model, labels)["pixel_values"], want)
    assert intact() and model.training


def test_resnet_and_convnext_image_classifiers_on_channels_last_images():
    labels = torch.tensor([0, 2])

    def loss(model, pixels):
        return model(pixel_values=pixels, labels=labels).loss

    pixels = randn(2, 3, 16, 16, seed=1).to(memory_format=torch.channels_last)
    assert_gradient_unprepared_and_prepared(tiny_resnet(), pixels, loss)  # BatchNorm in train mode
    convnext = built(
        transformers.ConvNextForImageClassification, transformers.ConvNextConfig, False,
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, patch_size=2
    )
    assert_gradient_unprepared_and_prepared(convnext, pixels, loss)


def test_a_lora_like_mask_on_the_attention_projections_of_bart_with_labels():
    model = built(
        transformers.BartForConditionalGeneration, transformers.BartConfig, False,
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )

    def loss(model, ids, labels):
        return model(input_ids=ids, labels=labels).loss

    def adapted(path, _):
        return "q_proj" in path or "v_proj" in path

    def expected(ids, labels):
        twin = copy.deepcopy(model)
        for name, parameter in twin.named_parameters():
            parameter.requires_grad_(adapted(name, parameter))
        names, params = zip(*trainable(twin))
        return dict(zip(names, torch.autograd.grad(loss(twin, ids, labels), params)))

    ids, labels = token_ids(1, (2, 6), 40), token_ids(2, (2, 5), 40)
    intact = untouched(Active(model), Constant(ids), Constant(labels))
    got = ad.gradient(loss, Active(model, where=adapted), Constant(ids), Constant(labels))
    assert len(got) == 12  # q and v (weight and bias) in the encoder self-, decoder self- and cross-attention
    assert_close_dicts(got, expected(ids, labels))
    prepared = ad.prepare(ad.gradient, loss, Active(model, where=adapted), Constant(ids), Constant(labels))
    prepared(model, ids, labels)
    new = token_ids(3, (2, 6), 40)
    assert_close_dicts(prepared(model, new, labels), expected(new, labels))
    assert intact()


def test_qwen2_with_grouped_query_attention_pullback_pushforward_and_loss():
    model = built(
        transformers.Qwen2ForCausalLM, transformers.Qwen2Config, False,
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
        attn_implementation="eager",  # torch has no forward-mode rule for CPU flash attention
    )
    ids = token_ids(1, (2, 6), 40)
    intact = untouched(Active(model), Constant(ids))

    def logits(model, ids):
        return model(input_ids=ids).logits

    cotangent = randn(2, 6, 40, seed=2)
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    want = dict(zip(names, torch.autograd.grad(logits(twin, ids), params, cotangent)))
    assert_close_dicts(ad.pullback(logits, Active(model), Constant(ids), cotangent=cotangent), want)

    tangent = {name: randn(*p.shape, seed=index) for index, (name, p) in enumerate(trainable(model))}
    _, want = torch.func.jvp(lambda ps: torch.func.functional_call(twin, ps, (ids,)).logits, ({name: p.detach() for name, p in twin.named_parameters()},), (tangent,))
    torch.testing.assert_close(ad.pushforward(logits, Active(model), Constant(ids), tangent=tangent), want)

    def loss(model, ids):
        return model(input_ids=ids, labels=ids).loss

    value, gradient = ad.value_and_gradient(loss, Active(model), Constant(ids))
    torch.testing.assert_close(value, loss(model, ids))
    assert_close_dicts(gradient, raw_gradient(loss, model, ids))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(ids))
    prepared(model, ids)
    new = token_ids(4, (2, 6), 40)
    assert_close_dicts(prepared(model, new), raw_gradient(loss, model, new))
    assert intact()


def test_phi_in_train_mode_draws_its_dropout_masks_like_one_eager_forward():
    model = built(
        transformers.PhiForCausalLM, transformers.PhiConfig, True,
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, partial_rotary_factor=0.5, resid_pdrop=0.1, embd_pdrop=0.1,
    )
    ids = token_ids(1, (2, 6), 40)

    def loss(model, ids):
        return model(input_ids=ids, labels=ids).loss

    with torch.random.fork_rng():
        torch.manual_seed(5)
        got = ad.gradient(loss, Active(model), Constant(ids))
        after = torch.get_rng_state()
        torch.manual_seed(5)
        want = raw_gradient(loss, model, ids)
        assert torch.equal(after, torch.get_rng_state())  # the same draws, as many
    assert_close_dicts(got, want)
    assert model.training


# ---------------------------------------------------------------- parameters in unusual places


class Listed(nn.Module):
    """Parameters in a ParameterList and a ParameterDict, and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(randn(3, 3, seed=seed)) for seed in (1, 2)])
        self.offsets = nn.ParameterDict({"b": nn.Parameter(randn(3, seed=3)), "a": nn.Parameter(randn(3, seed=4))})
        self.register_buffer("scale", randn(3, seed=5), persistent=False)

    def forward(self, x):
        for weight in self.weights:
            x = torch.tanh(x @ weight + self.offsets["a"]) * self.scale
        return x + self.offsets["b"]


class Partial(nn.Module):
    """A parameter reached only through ``functools.partial(F.linear, weight=...)``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(randn(3, 3, seed=1))
        self.project = functools.partial(F.linear, weight=self.w)

    def forward(self, x):
        return torch.tanh(self.project(x))


def test_parameter_containers_a_non_persistent_buffer_and_a_partial_holding_a_parameter():
    assert_gradient_unprepared_and_prepared(Listed(), randn(2, 3, seed=6))
    model, x = Partial(), randn(2, 3, seed=6)
    assert_gradient_unprepared_and_prepared(model, x)

    def on_w(w):
        return torch.tanh(F.linear(x, w)).pow(2).sum()

    tangent = {"w": randn(3, 3, seed=8)}
    _, want = torch.func.jvp(torch.func.grad(on_w), (model.w.detach(),), (tangent["w"],))
    torch.testing.assert_close(ad.hvp(squared, Active(model), Constant(x), tangent=tangent)["w"], want)


def test_old_and_new_spectral_norm_in_train_mode_run_their_power_iteration_on_copies():
    """``nn.utils.spectral_norm`` updates its ``weight_u`` buffer in a pre-forward hook and the
    parametrization version its ``_u``: each call starts from the user's vectors, as a forward on
    a fresh copy does, and leaves them as they were."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.utils.spectral_norm(nn.Linear(3, 4, dtype=torch.float64)),
            nn.Tanh(),
            nn.utils.parametrizations.spectral_norm(nn.Linear(4, 2, dtype=torch.float64)),
        ).train()
    assert_gradient_unprepared_and_prepared(model, randn(2, 3, seed=1))
    assert_gradient_unprepared_and_prepared(model.eval(), randn(2, 3, seed=2))


def test_weight_norm_orthogonal_and_a_bias_parametrization_and_fused_conv_batchnorm():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        normed = nn.utils.parametrizations.weight_norm(nn.Linear(3, 3, dtype=torch.float64))
        torch.nn.utils.parametrize.register_parametrization(normed, "bias", nn.Tanh())
        orthogonal = nn.utils.parametrizations.orthogonal(nn.Linear(3, 3, dtype=torch.float64))
        conv, norm = nn.Conv2d(2, 3, 3, dtype=torch.float64).eval(), nn.BatchNorm2d(3, dtype=torch.float64).eval()
    assert_gradient_unprepared_and_prepared(nn.Sequential(normed, nn.Softplus(), orthogonal), randn(2, 3, seed=1))
    with torch.no_grad():
        norm.running_mean.copy_(randn(3, seed=2))
        norm.running_var.copy_(randn(3, seed=3).abs() + 0.5)
    fused = torch.nn.utils.fusion.fuse_conv_bn_eval(conv, norm)
    assert_gradient_unprepared_and_prepared(fused, randn(1, 2, 5, 5, seed=4))


def test_bfloat16_non_contiguous_and_channels_last_parameters():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        half = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 1)).to(torch.bfloat16)
        transposed = nn.Linear(3, 4, dtype=torch.float64)
        conv = nn.Conv2d(2, 3, 3, dtype=torch.float64).to(memory_format=torch.channels_last)
    x = randn(2, 3, seed=1).to(torch.bfloat16)
    got = ad.gradient(squared, Active(half), Constant(x))
    assert {g.dtype for g in got.values()} == {torch.bfloat16}
    assert_close_dicts(got, raw_gradient(squared, half, x))
    transposed.weight = nn.Parameter(randn(3, 4, seed=2).T)  # a non-contiguous parameter
    assert_gradient_unprepared_and_prepared(transposed, randn(2, 3, seed=3))
    assert_gradient_unprepared_and_prepared(conv, randn(1, 2, 5, 5, seed=4).to(memory_format=torch.channels_last))


# ---------------------------------------------------------------- modules changed between calls


class Stack(nn.Module):
    def __init__(self, width=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width, dtype=torch.float64)])
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


def test_a_prepared_gradient_follows_train_and_eval_and_refuses_a_frozen_or_appended_layer_by_name():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Stack().eval()
    x = randn(2, 3, seed=1)
    prepared = ad.prepare(ad.gradient, squared, Active(model), Constant(x))
    assert_close_dicts(prepared(model, x), raw_gradient(squared, model, x))
    model.train()  # dropout now draws: the same mask as one eager forward
    with torch.random.fork_rng():
        torch.manual_seed(3)
        got = prepared(model, x)
        torch.manual_seed(3)
        want = raw_gradient(squared, model, x)
    assert_close_dicts(got, want)
    assert not torch.equal(got["layers.0.weight"], raw_gradient(squared, model.eval(), x)["layers.0.weight"])
    assert_close_dicts(prepared(model, x), raw_gradient(squared, model, x))  # eval again
    model.layers[0].bias.requires_grad_(False)
    with pytest.raises(ad.PreparationMismatchError, match="layers.0.bias"):
        prepared(model, x)
    model.layers[0].bias.requires_grad_(True)
    model.layers.append(nn.Linear(3, 3, dtype=torch.float64))
    with pytest.raises(ad.PreparationMismatchError, match="layers.1.weight"):
        prepared(model, x)


# ---------------------------------------------------------------- compiled and functional users


def test_an_aot_eager_compiled_module_and_a_module_compiled_in_place():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 1, dtype=torch.float64))
    compiled = torch.compile(model, backend="aot_eager")
    x = randn(2, 3, seed=1)
    assert_gradient_unprepared_and_prepared(compiled, x)
    tangent = {name: randn(*p.shape, seed=index) for index, (name, p) in enumerate(compiled.named_parameters())}
    names, params = zip(*trainable(twin := copy.deepcopy(model)))
    gradients = torch.autograd.grad(squared(twin, x), params, create_graph=True)
    want = torch.autograd.grad(gradients, params, [tangent["_orig_mod." + name] for name in names])
    got = ad.hvp(squared, Active(compiled), Constant(x), tangent=tangent)
    assert_close_dicts(got, {"_orig_mod." + name: h for name, h in zip(names, want)})
    in_place = copy.deepcopy(model)
    in_place.compile(backend="aot_eager")
    assert_gradient_unprepared_and_prepared(in_place, x)


def test_parameters_given_to_functional_call_as_the_active_dict_and_as_constant_overrides():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 1, dtype=torch.float64))
    x = randn(2, 3, seed=1)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    def loss(params, model, x):
        return torch.func.functional_call(model, params, (x,)).pow(2).sum()

    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    want = dict(zip(leaves, torch.autograd.grad(loss(leaves, model, x), list(leaves.values()))))
    assert_close_dicts(ad.gradient(loss, Active(params), Constant(model), Constant(x)), want)
    tangent = {name: randn(*p.shape, seed=index) for index, (name, p) in enumerate(params.items())}
    _, want = torch.func.jvp(torch.func.grad(lambda ps: loss(ps, model, x)), (params,), (tangent,))
    assert_close_dicts(ad.hvp(loss, Active(params), Constant(model), Constant(x), tangent=tangent), want)

    def overridden(model, override, x):  # the override replaces one parameter of the Active model
        return torch.func.functional_call(model, override, (x,)).pow(2).sum()

    override = {"0.weight": 2 * params["0.weight"]}
    twin = copy.deepcopy(model)
    names, ps = zip(*trainable(twin))
    want = dict(zip(names, torch.autograd.grad(overridden(twin, override, x), ps, materialize_grads=True)))
    assert_close_dicts(ad.gradient(overridden, Active(model), Constant(override), Constant(x)), want)


# ---------------------------------------------------------------- f reaching into the module


REGULARIZED = {
    "parameters()": lambda m, x: m(x).sum() + 0.1 * sum(p.pow(2).sum() for p in m.parameters()),
    "named_parameters()": lambda m, x: m(x).sum() + 0.1 * sum(p.pow(2).sum() for n, p in m.named_parameters() if "weight" in n),
    "state_dict()": lambda m, x: m(x).sum() + sum(v.pow(2).sum() for v in m.state_dict().values()),
    "modules()": lambda m, x: m(x).sum() + sum(l.weight.pow(2).sum() for l in m.modules() if isinstance(l, nn.Linear)),
    "an attribute": lambda m, x: (x @ m[0].weight.T).tanh().sum() * m[2].bias.sum(),
    "children()": lambda m, x: list(m.children())[0](x).pow(2).sum(),
}


@pytest.mark.parametrize("name", REGULARIZED)
def test_a_loss_reading_parameters_through_the_modules_own_methods_is_differentiated_there(name):
    """A weight-decay term over ``model.parameters()`` (or ``state_dict()``, ``modules()``...) in f
    reads the differentiated tensors, in every operator, prepared or not."""
    loss = REGULARIZED[name]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 1, dtype=torch.float64))
    x = randn(2, 3, seed=1)
    intact = untouched(Active(model), Constant(x))
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    gradients = torch.autograd.grad(loss(twin, x), params, create_graph=True, materialize_grads=True)
    want = dict(zip(names, (g.detach() for g in gradients)))
    assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), want)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    prepared(model, x)
    assert_close_dicts(prepared(model, x), want)
    tangent = {name: randn(*p.shape, seed=index) for index, (name, p) in enumerate(twin.named_parameters())}
    curved = [i for i, g in enumerate(gradients) if g.requires_grad]  # the others are constant: zero rows
    products = torch.autograd.grad([gradients[i] for i in curved], params, [tangent[names[i]] for i in curved], materialize_grads=True)
    assert_close_dicts(ad.hvp(loss, Active(model), Constant(x), tangent=tangent), dict(zip(names, products)))
    assert intact()


# ---------------------------------------------------------------- outputs and operators on HF models


def test_pushforward_and_pullback_of_a_model_output_with_hidden_states_and_an_unused_pooler():
    """f returns ResNet's ModelOutput (logits and a tuple of hidden states): the pushforward is
    that ModelOutput type, the pullback takes one as its cotangent. A BERT pooler the loss does
    not use gets zeros, not a missing key."""
    model = built(transformers.ResNetForImageClassification, transformers.ResNetConfig, False, num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1], layer_type="basic", num_labels=3)
    pixels = randn(2, 3, 8, 8, seed=1)

    def outputs(model, pixels):
        return model(pixel_values=pixels, output_hidden_states=True)

    twin = copy.deepcopy(model)
    params = {name: p.detach() for name, p in twin.named_parameters()}
    tangent = {name: randn(*p.shape, seed=index) for index, (name, p) in enumerate(params.items())}
    got = ad.pushforward(outputs, Active(model), Constant(pixels), tangent=tangent)
    _, want = torch.func.jvp(lambda ps: torch.func.functional_call(twin, ps, (pixels,), {"output_hidden_states": True}), (params,), (tangent,))
    assert type(got) is type(want) and list(got) == ["logits", "hidden_states"]
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.hidden_states, want.hidden_states)

    reference = outputs(twin, pixels)
    cotangent = type(reference)(logits=randn(2, 3, seed=2), hidden_states=tuple(randn(*h.shape, seed=3 + i) for i, h in enumerate(reference.hidden_states)))
    names, leaves = zip(*trainable(twin))
    pulled = torch.autograd.grad([reference.logits, *reference.hidden_states], leaves, [cotangent.logits, *cotangent.hidden_states], materialize_grads=True)
    assert_close_dicts(ad.pullback(outputs, Active(model), Constant(pixels), cotangent=cotangent), dict(zip(names, pulled)))

    bert = built(
        transformers.BertModel, transformers.BertConfig, False,
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )

    def hidden(model, ids):
        return model(input_ids=ids).last_hidden_state.pow(2).sum()

    ids = token_ids(1, (2, 5), 30)
    twin = copy.deepcopy(bert)
    names, leaves = zip(*trainable(twin))
    want = dict(zip(names, torch.autograd.grad(hidden(twin, ids), leaves, materialize_grads=True)))
    got = ad.gradient(hidden, Active(bert), Constant(ids))
    assert_close_dicts(got, want)
    assert not got["pooler.dense.weight"].any()


def test_a_prepared_hvp_follows_a_batchnorm_switched_to_train_mode_and_back():
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3, dtype=torch.float64)
            self.norm = nn.BatchNorm1d(3, dtype=torch.float64).eval()

        def forward(self, x):
            return self.norm(torch.tanh(self.lin(x)))

    def expected(model, x, tangent):
        twin = copy.deepcopy(model)
        names, params = zip(*trainable(twin))
        gradients = torch.autograd.grad(squared(twin, x), params, create_graph=True)
        return dict(zip(names, torch.autograd.grad(gradients, params, [tangent[n] for n in names])))

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Normed()
    x, tangent = randn(4, 3, seed=1), {name: randn(*p.shape, seed=i) for i, (name, p) in enumerate(model.named_parameters())}
    prepared = ad.prepare(ad.hvp, squared, Active(model), Constant(x), tangent=tangent)
    assert_close_dicts(prepared(model, x, tangent=tangent), expected(model, x, tangent))
    model.norm.train()  # batch statistics now: a different function
    intact = untouched(Active(model), Constant(x))
    assert_close_dicts(prepared(model, x, tangent=tangent), expected(model, x, tangent))
    new = randn(4, 3, seed=2)
    assert_close_dicts(prepared(model, new, tangent=tangent), expected(model, new, tangent))
    assert intact()  # running statistics untouched
    model.norm.eval()
    assert_close_dicts(prepared(model, new, tangent=tangent), expected(model, new, tangent))


def test_gradient_and_hvp_of_qwen2_restricted_to_its_query_and_value_projections():
    model = built(
        transformers.Qwen2ForCausalLM, transformers.Qwen2Config, False,
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
    )

    def loss(model, ids):
        return model(input_ids=ids, labels=ids).loss

    def adapted(path, _):
        return "q_proj" in path or "v_proj" in path

    tangent = {name: randn(*p.shape, seed=i) for i, (name, p) in enumerate(model.named_parameters()) if adapted(name, p)}
    twin = copy.deepcopy(model)
    for name, parameter in twin.named_parameters():
        parameter.requires_grad_(adapted(name, parameter))
    names, params = zip(*trainable(twin))

    def expected(ids):
        gradients = torch.autograd.grad(loss(twin, ids), params, create_graph=True)
        products = torch.autograd.grad(gradients, params, [tangent[n] for n in names])
        return dict(zip(names, (g.detach() for g in gradients))), dict(zip(names, products))

    ids = token_ids(1, (2, 5), 40)
    intact = untouched(Active(model), Constant(ids))
    assert_close_dicts(ad.hvp(loss, Active(model, where=adapted), Constant(ids), tangent=tangent), expected(ids)[1])
    prepared = ad.prepare(ad.gradient_and_hvp, loss, Active(model, where=adapted), Constant(ids), tangent=tangent)
    prepared(model, ids, tangent=tangent)
    new = token_ids(2, (2, 5), 40)
    gradient, product = prepared(model, new, tangent=tangent)
    want_gradient, want_product = expected(new)
    assert_close_dicts(gradient, want_gradient)
    assert_close_dicts(product, want_product)
    assert intact()


def test_gemma_with_its_embedding_scale_buffer_gradient_prepared_and_pushforward():
    model = built(
        transformers.GemmaForCausalLM, transformers.GemmaConfig, False,
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32, attn_implementation="eager",
    )

    def loss(model, ids):
        return model(input_ids=ids, labels=ids).loss

    ids = token_ids(1, (2, 5), 40)
    intact = untouched(Active(model), Constant(ids))
    assert_close_dicts(ad.gradient(loss, Active(model), Constant(ids)), raw_gradient(loss, model, ids))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(ids))
    prepared(model, ids)
    new = token_ids(2, (2, 5), 40)
    assert_close_dicts(prepared(model, new), raw_gradient(loss, model, new))
    tangent = {name: randn(*p.shape, seed=i) for i, (name, p) in enumerate(trainable(model))}
    twin = copy.deepcopy(model)
    params = {name: p.detach() for name, p in twin.named_parameters()}
    _, want = torch.func.jvp(lambda ps: torch.func.functional_call(twin, ps, (ids,)).logits, (params,), (tangent,))
    got = ad.pushforward(lambda model, ids: model(input_ids=ids).logits, Active(model), Constant(ids), tangent=tangent)
    torch.testing.assert_close(got, want)
    assert intact()
