"""A correctness sweep of AutoTorch (and the finite-difference reference) on third-party modules
the rest of the suite does not cover: torch's own layers (fast paths, parametrizations, packed
sequences, hooks) and Hugging Face models from tiny configs (random init, nothing downloaded).

Every expected value is independent of the library: a hand-written ``torch.autograd.grad`` on a
deep copy, ``torch.func``, or an analytic formula. Each call is also checked to leave the user's
arguments (parameters, buffers, ``.grad``, flags) and the global RNGs as they were.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import activity as ad
from activity import Active, Constant
from activity.backends._finite_differences import ReferencePrecisionWarning

from _sweeps import assert_close_dicts, generator, randn, raw_gradient, squared, trainable, untouched

FD = ad.AutoFiniteDifferences()


# ---------------------------------------------------------------- the finite-difference reference


def test_finite_differences_of_a_float32_loss_are_not_zeros():
    """A float64 model whose loss is computed in float32, as Hugging Face's causal-LM and CTC losses
    do (``logits.float()``): at small steps the float32 loss cannot move, every difference is 0 and
    looked converged, so the reference gradient came back wrong by 1e-2, in GPT-NeoX some entries
    exactly 0. The steps now stop
    where the outputs' rounding dominates; the result carries float32 precision, with a warning."""
    model = nn.Linear(4, 3, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(randn(3, 4, seed=1))
        model.bias.copy_(randn(3, seed=2))
    x, labels = randn(16, 4, seed=3), torch.tensor([0, 1, 2, 1] * 4)

    def loss(m, x, labels):
        return nn.functional.cross_entropy(m(x).float(), labels)

    want = raw_gradient(loss, model, x, labels)
    with pytest.warns(ReferencePrecisionWarning, match="float32"):
        got = ad.gradient(loss, Active(model), Constant(x), Constant(labels), backend=FD)
    assert_close_dicts(got, want, rtol=1e-3, atol=2e-4)  # was off by 1e-2, some entries exactly 0


def test_finite_differences_of_float64_functions_stay_exact():
    """No warning in float64, and full precision: the retries used to go on to smaller steps,
    where rounding dominates, and came back 5e-9 off (relative) here."""
    x = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferencePrecisionWarning)
        got = ad.gradient(lambda x: torch.log(1000.0 + torch.exp(x)).sum(), Active(x), backend=FD)
    torch.testing.assert_close(got, torch.exp(x) / (1000.0 + torch.exp(x)), rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- torch modules activity cannot view


def small_mlp() -> nn.Module:
    torch.manual_seed(0)  # (inside a forked RNG, see the callers)
    return nn.Sequential(nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))


@pytest.mark.parametrize("make", ["script", "trace", "submodule"])
def test_a_torchscript_module_is_refused_by_name(make):
    """Its parameters live in the compiled module: a view cannot replace them. It failed with
    "descriptor 'values' for 'dict' objects doesn't apply to a 'OrderedDictWrapper' object"."""
    x = randn(5, 3)
    with torch.random.fork_rng():
        eager = small_mlp()
    scripted = {
        "script": lambda: torch.jit.script(eager),
        "trace": lambda: torch.jit.trace(eager, x),
        "submodule": lambda: nn.Sequential(torch.jit.script(eager), nn.Tanh()),
    }[make]()
    where = "submodule 0" if make == "submodule" else "the module"
    for annotation in (Active, Constant):
        with pytest.raises(ad.UnsupportedError, match=f"{where}.*TorchScript module.*Pass the eager module"):
            ad.gradient(lambda m, x: m(x).sum(), annotation(scripted), Active(x) if annotation is Constant else Constant(x))
    with pytest.raises(ad.UnsupportedError, match="TorchScript"):
        ad.prepare(ad.gradient, squared, Active(scripted), Constant(x))


def test_an_uninitialized_lazy_module_is_refused_by_parameter():
    lazy = nn.Sequential(nn.Tanh(), nn.LazyLinear(2, dtype=torch.float64))
    x = randn(5, 3)
    with pytest.raises(ad.UnsupportedError, match=r"parameter 1\.weight is not initialized.*Run the module once"):
        ad.gradient(squared, Active(lazy), Constant(x))
    lazy(x)  # initialized: now an ordinary Linear
    assert_close_dicts(ad.gradient(squared, Active(lazy), Constant(x)), raw_gradient(squared, lazy, x))


# ---------------------------------------------------------------- packed sequences


def test_packed_sequences_as_data_and_as_the_differentiated_value():
    """Constant: the RNN's gradient through a packed batch. Active: the gradient is a
    PackedSequence with None at its integer fields, which PackedSequence(...) itself refuses
    (it raised "Expected data to be a list or tuple of length 2"): it is built as _make does."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

    with torch.random.fork_rng():
        torch.manual_seed(0)
        lstm = nn.LSTM(3, 4, num_layers=2, proj_size=2, batch_first=True, dtype=torch.float64)
    packed = pack_padded_sequence(randn(2, 4, 3, seed=1), torch.tensor([2, 4]), batch_first=True, enforce_sorted=False)

    def loss(m, p):
        out, (h, _) = m(p)
        return pad_packed_sequence(out, batch_first=True)[0].pow(2).sum() + h.sum()

    intact = untouched(Active(lstm), Constant(packed))
    assert_close_dicts(ad.gradient(loss, Active(lstm), Constant(packed)), raw_gradient(loss, lstm, packed))
    data = packed.data.clone().requires_grad_()
    like = PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    want = torch.autograd.grad(loss(copy.deepcopy(lstm), like), data)[0]
    for got in (
        ad.gradient(lambda p, m: loss(m, p), Active(packed), Constant(lstm)),
        ad.prepare(ad.gradient, lambda p, m: loss(m, p), Active(packed), Constant(lstm))(packed, lstm),
    ):
        assert type(got) is PackedSequence and got.batch_sizes is None
        torch.testing.assert_close(got.data, want)
    assert intact()


def test_hooks_the_user_registered_run_and_stay_and_those_f_registers_go():
    with torch.random.fork_rng():
        model = small_mlp()
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[2].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()]
    x = randn(5, 3)

    def loss(m, x):
        m[2].register_forward_hook(lambda mod, args, out: out + 1.0)  # on the view f is given
        return m(x).pow(2).sum()

    want = raw_gradient(loss, model, x)  # (a deep copy gets the extra hook)
    intact = untouched(Active(model), Constant(x))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    for got in (ad.gradient(loss, Active(model), Constant(x)), prepared(model, x), prepared(model, x)):
        assert_close_dicts(got, want)
    assert intact()
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()] == hooks


def test_f_writing_a_parameter_outside_the_tape_is_reported_by_name():
    """nn.Embedding(max_norm=...) renormalizes the rows it looks up in place, under no_grad: the
    view's tape leaves share the parameter's storage, so the user's table changed silently."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        table = nn.Embedding(6, 4, max_norm=1.0, dtype=torch.float64)
    with torch.no_grad():
        table.weight.mul_(3)  # rows longer than max_norm
    ids = torch.tensor([0, 2, 2, 5])

    def loss(m, ids):
        return m(ids).pow(2).sum()

    want = raw_gradient(loss, table, ids)  # a deep copy, renormalized by its own forward
    with pytest.warns(RuntimeWarning, match=r"f wrote weight of argument 0 .* in place outside the tape"):
        got = ad.gradient(loss, Active(table), Constant(ids))
    assert_close_dicts(got, want)

    with torch.random.fork_rng():
        clipped = small_mlp()

    def clip_then_loss(x, m):
        with torch.no_grad():
            m[2].weight.clamp_(-0.1, 0.1)  # weight clipping inside f, on a Constant module
        return m(x).pow(2).sum()

    with pytest.warns(RuntimeWarning, match=r"f wrote 2\.weight of argument 1"):
        ad.gradient(clip_then_loss, Active(randn(5, 3)), Constant(clipped))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ad.gradient(squared, Active(clipped), Constant(randn(5, 3)))  # f writes nothing: no warning


# ---------------------------------------------------------------- Hugging Face models


VOCAB = 64


def token_ids(seed: int, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, length), generator=generator(seed))


def hf_model(model_class, config, seed: int = 0):
    config._attn_implementation = "eager"  # plain differentiable ops (second order too)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_class(config).eval()


def distilbert():
    import transformers

    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=16, num_labels=3
    )
    return hf_model(transformers.DistilBertForSequenceClassification, config)


def classification_batch(seed: int) -> dict:
    ids = token_ids(seed)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (2,), generator=generator(seed + 1))}


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def test_a_first_forward_inside_activity_leaves_hugging_face_output_capture_intact():
    """transformers installs its output-capturing hooks on a model's first forward that asks for
    hidden states, and marks the model. When that forward ran inside activity (a view), the hooks
    reached the user's model but the mark did not: its next forward installed them again, and
    returned 5 hidden states for 2 layers, the last one wrong."""
    model = distilbert()
    twin = copy.deepcopy(model)  # never run by activity
    batch = classification_batch(3)
    hooks = hook_counts(model)

    def loss(m, batch):
        out = m(**batch, output_hidden_states=True, output_attentions=True)
        return out.loss, out

    intact = untouched(Active(model), Constant(batch))
    (value, aux), grads = ad.value_and_gradient(loss, Active(model), Constant(batch), has_aux=True)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(batch), has_aux=True)
    prepared_grads, prepared_aux = prepared(model, batch)
    assert intact() and hook_counts(model) == hooks
    want = twin(**batch, output_hidden_states=True, output_attentions=True)
    want_grads = raw_gradient(lambda m, b: loss(m, b)[0], twin, batch)
    with torch.no_grad():
        mine = model(**batch, output_hidden_states=True, output_attentions=True)  # the user's own forward, after
    for out in (aux, prepared_aux, mine):
        assert len(out.hidden_states) == 3 and len(out.attentions) == 2
        for got, expected in zip((*out.hidden_states, *out.attentions), (*want.hidden_states, *want.attentions)):
            torch.testing.assert_close(got, expected.detach())
    torch.testing.assert_close(value, want.loss.detach())
    assert_close_dicts(grads, want_grads)
    assert_close_dicts(prepared_grads, want_grads)


# ---------------------------------------------------------------- new kinds of input that work (representative)


def test_transformer_encoder_in_eval_takes_its_differentiable_path_with_a_padding_mask():
    """In eval without a tape, torch's encoder takes a nested-tensor fast path (zeros at padded
    positions). The differentiated call is the slow path, as torch.autograd.grad's is."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True

    def loss(m, x, mask):
        return m(x, src_key_padding_mask=mask).pow(3).sum()

    x0, x1 = randn(2, 5, 8, seed=1), randn(2, 5, 8, seed=2)
    intact = untouched(Active(encoder), Constant(x0), Constant(mask))
    prepared = ad.prepare(ad.gradient, loss, Active(encoder), Constant(x0), Constant(mask))
    for x in (x0, x1):
        want = raw_gradient(loss, encoder, x, mask)
        assert_close_dicts(ad.gradient(loss, Active(encoder), Constant(x), Constant(mask)), want)
        assert_close_dicts(prepared(encoder, x, mask), want)
    assert intact()


def test_checkpointed_segments_and_functional_call_ensembles():
    import torch.utils.checkpoint as checkpoint

    with torch.random.fork_rng():
        inner, head = small_mlp(), nn.Linear(2, 2, dtype=torch.float64)
        members = [small_mlp() for _ in range(3)]

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = inner, head

        def forward(self, x):
            return self.head(checkpoint.checkpoint(self.inner, x, use_reentrant=False))

    model, x = Checkpointed(), randn(5, 3)
    tangent = {n: torch.ones_like(p) for n, p in trainable(model)}
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    first = torch.autograd.grad(squared(twin, x), params, create_graph=True)
    want_hvp = dict(zip(names, torch.autograd.grad(first, params, [tangent[n] for n in names])))
    assert_close_dicts(ad.gradient(squared, Active(model), Constant(x)), raw_gradient(squared, model, x))
    assert_close_dicts(ad.hvp(squared, Active(model), Constant(x), tangent=tangent), want_hvp)

    stacked, buffers = torch.func.stack_module_state(members)
    skeleton = copy.deepcopy(members[0]).to("meta")

    def ensemble(params, x):
        run = lambda p, b, x: torch.func.functional_call(skeleton, (p, b), (x,))  # noqa: E731
        return torch.vmap(run, in_dims=(0, 0, None))(params, buffers, x).pow(2).sum()

    leaves = {k: v.detach().clone().requires_grad_() for k, v in stacked.items()}
    want = dict(zip(leaves, torch.autograd.grad(ensemble(leaves, x), list(leaves.values()))))
    assert_close_dicts(ad.gradient(ensemble, Active(stacked), Constant(x)), want)
    assert_close_dicts(ad.prepare(ad.gradient, ensemble, Active(stacked), Constant(x))(stacked, x), want)


def albert_and_clip():
    import transformers

    albert = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=8, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
    )  # one layer's weights shared by the three layers
    clip = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, projection_dim=8,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4, projection_dim=8),
        projection_dim=8,
    )
    return (
        hf_model(transformers.AlbertForSequenceClassification, albert),
        hf_model(transformers.CLIPModel, clip),
    )


def test_shared_layer_weights_and_two_towers_with_keyword_constants():
    albert, clip = albert_and_clip()

    def loss(m, **batch):
        return m(**batch).loss

    def clip_batch(seed):
        return {"input_ids": token_ids(seed), "pixel_values": randn(2, 3, 8, 8, seed=seed).float(), "return_loss": True}

    for model, batch_of in ((albert, classification_batch), (clip, clip_batch)):
        batches = batch_of(1), batch_of(2)
        keywords = {k: Constant(v) for k, v in batches[0].items()}
        intact = untouched(Active(model), *keywords.values())
        prepared = ad.prepare(ad.gradient, loss, Active(model), **keywords)
        for batch in batches:
            twin = copy.deepcopy(model)
            names, params = zip(*trainable(twin))
            want = dict(zip(names, torch.autograd.grad(loss(twin, **batch), params)))
            assert_close_dicts(ad.gradient(loss, Active(model), **{k: Constant(v) for k, v in batch.items()}), want)
            assert_close_dicts(prepared(model, **batch), want)
        assert intact()


def test_wav2vec2_weight_norm_in_train_mode_draws_its_masks_like_an_eager_forward():
    """The positional conv's weight_norm parametrization, dropout (torch RNG) and SpecAugment
    time masks (numpy's global RNG): the same draws as a raw call from the same seeds."""
    import numpy as np
    import transformers

    config = transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, pad_token_id=0, ctc_loss_reduction="mean", mask_time_prob=0.5,
        mask_time_length=2,
    )
    model = hf_model(transformers.Wav2Vec2ForCTC, config).train()
    assert any("parametrizations.weight.original" in n for n, _ in model.named_parameters())
    batch = {"input_values": randn(2, 400, seed=1).float(), "labels": torch.randint(1, VOCAB, (2, 5), generator=generator(2))}

    def loss(m, batch):
        return m(**batch).loss

    numpy_state = np.random.get_state()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(7), np.random.seed(7)
            twin = copy.deepcopy(model)
            names, params = zip(*trainable(twin))
            want = dict(zip(names, torch.autograd.grad(loss(twin, batch), params)))
            after = torch.random.get_rng_state(), np.random.get_state()[1].copy()
            torch.manual_seed(7), np.random.seed(7)
            got = ad.gradient(loss, Active(model), Constant(batch))
            assert torch.equal(torch.random.get_rng_state(), after[0])
            assert np.array_equal(np.random.get_state()[1], after[1])
    finally:
        np.random.set_state(numpy_state)
    assert_close_dicts(got, want)


def test_gradient_checkpointing_in_train_mode_and_a_constant_model_with_active_embeddings():
    import transformers

    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, sliding_window=4, pad_token_id=2, head_dim=8,
    )
    model = hf_model(transformers.MistralForCausalLM, config).double()
    ids = token_ids(5)
    batch = {"input_ids": ids, "labels": ids}

    def loss(m, batch):
        return m(**batch).loss

    trained = copy.deepcopy(model).train()
    trained.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.random.fork_rng():
        torch.manual_seed(3)
        want = raw_gradient(loss, trained, batch)
        torch.manual_seed(3)
        assert_close_dicts(ad.gradient(loss, Active(trained), Constant(batch)), want)

    embeddings = model.get_input_embeddings()(ids).detach()

    def from_embeddings(m, e, labels):
        return m(inputs_embeds=e, labels=labels).loss

    tangent = randn(*embeddings.shape, seed=6)
    e = embeddings.clone().requires_grad_()
    first = torch.autograd.grad(from_embeddings(copy.deepcopy(model), e, ids), e, create_graph=True)[0]
    intact = untouched(Constant(model), Active(embeddings))
    got = ad.hvp(from_embeddings, Constant(model), Active(embeddings), Constant(ids), tangent=tangent)
    torch.testing.assert_close(got, torch.autograd.grad(first, e, tangent)[0])
    assert intact()
