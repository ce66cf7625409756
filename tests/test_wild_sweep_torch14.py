"""Round 14 of the PyTorch sweep: Hugging Face models with state-space scans, linear attention,
sliding-window and global attention mixes and expert routing, each from a tiny config with
random weights in float64 (Mamba2, Jamba, Qwen2-MoE, OLMoE, GPT-OSS, RWKV, LFM2, Zamba2,
Longformer), their gradients in eval and train mode, prepared and unprepared, and the
forward-mode and second-order operators where a model looks rows up with a padding index.

Expected values come from ``torch.autograd.grad`` on an independent deep copy of the model
(a double backward for Hessian-vector products, ``<gradient, tangent>`` for a pushforward); the
user's model, its ``.grad``, flags and buffers are checked unchanged, and in train mode activity
must draw from torch's global generator exactly what one eager call draws.

Fixed here: ``nn.Embedding(padding_idx=...)`` gives the padding row no gradient (a fixed pad),
but torch's forward-mode rule for ``embedding`` looks the padding row's tangent up like any
other. So a pushforward was not ``<gradient, tangent>``, and the two Hessian-vector paths of
AutoTorch disagreed (forward over reverse, also what ``hessian`` runs, took the padding row's
tangent into every other parameter's second derivative; the double backward did not): wrong
numbers on every Hugging Face model with a pad token in its input (BERT, RoBERTa, Longformer,
LFM2-MoE, ...). While activity runs f in forward mode on modules holding a padding index, a
padded lookup's outputs at padding positions carry no tangent (`backends/_torch_lookups.py`).
Also fixed: ``hessian`` (forward over reverse first) raised torch's "mutate a captured Tensor" where f
writes a tensor in place under ``no_grad`` that the transform did not get (weight clipping in a
Constant critic's forward; RWKV in eval mode with ``where=`` leaving its rescaled weights out)
instead of falling back to the double backward as for any other transform limit; and the failed
first attempt took the check for such writes with it, so none was warned of.
And a hybrid model's cache (Jamba's, LFM2's, Qwen3-Next's: linear-attention layers holding the
Mamba or gated-delta layers' conv and recurrent states) was an opaque constant, its layer type
having a base of its own: a prepared call refused every new cache of a decoding loop, and
``Active(past)`` silently gave the states no gradient; it is a pytree like the attention layers.

Also tried and fine, not kept: the same gradient checks on Falcon-H1, Bamba, Nemotron-H,
Qwen3-Next (gated delta rule), RecurrentGemma (RG-LRU), Gemma-3n (AltUp, per-layer inputs,
activation sparsity), MiniMax (lightning attention), GraniteMoeHybrid, LFM2-MoE, JetMoE, Llama 4
(chunked attention, MoE) and Switch Transformers (router jitter noise in train mode, its draws
replayed); pushforward, pullback and both hvp paths on all of those and the models below (the
routers' float32 softmax and the scans' float32 chunks agree to float32 precision only;
Gemma-3n's second derivatives are NaN in torch itself); Longformer with dropout in train mode
(one eager call's draws) and with a global attention mask, LED, ``Active(model, where=...)`` on
the routers and embeddings of Qwen2-MoE and Jamba, the Hessian of a few selected parameters of
Qwen2-MoE, GPT-OSS (its attention sinks), Mamba2, RWKV and Longformer against hvp, OLMoE in
float32 with transformers' ``grouped_mm`` and ``batched_mm`` experts (gradient, pushforward, hvp;
``grouped_mm`` has no forward-mode rule, so only the double backward), and one decoding step
from a ``DynamicCache`` as a Constant (Mamba2, Qwen2-MoE; the linear-attention layers ``copy_``
their states into the cache's tensors in place, as a ``StaticCache`` does: pass each call a copy). Not built from a tiny config in this transformers version (5.25):
xLSTM, Zamba (its tied shared blocks), DBRX (clip_qkv=None). Found and not fixed: RWKV in eval
mode with ``rescale_every`` divides its layers' weights in place under ``no_grad`` once and sets
``layers_are_rescaled``; under activity the flag lands on the view while the write reaches the
user's weights, so every call halves them again (see the report of this round).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import CLOSE, SECOND_ORDER, assert_close_dicts, built, generator, randn, trainable, untouched

_EAGER_EXPERTS = dict(experts_implementation="eager")  # transformers' grouped matmul takes no float64
_SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32)

_MODELS = {
    # the SSD scan as chunked torch code (no CUDA kernels), two heads of state 4
    "mamba2": (transformers.Mamba2ForCausalLM, transformers.Mamba2Config, dict(
        vocab_size=64, hidden_size=16, state_size=4, num_heads=4, head_dim=8, n_groups=1, expand=2,
        num_hidden_layers=2, conv_kernel=3, chunk_size=4)),
    # a Mamba layer, then an attention layer with top-2 of 4 experts and the router loss
    "jamba": (transformers.JambaForCausalLM, transformers.JambaConfig, dict(
        _SMALL, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4,
        output_router_logits=True, router_aux_loss_coef=0.1, use_mamba_kernels=False, **_EAGER_EXPERTS)),
    # routed experts beside a gated shared expert
    "qwen2-moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, dict(
        _SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.1, decoder_sparse_step=1, **_EAGER_EXPERTS)),
    "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig, dict(
        _SMALL, num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
        **_EAGER_EXPERTS)),
    # attention sinks, a sliding-window layer and a full one, clamped SwiGLU experts as 3-d parameters
    "gpt-oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig, dict(
        _SMALL, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, output_router_logits=True,
        router_aux_loss_coef=0.1, layer_types=["sliding_attention", "full_attention"], **_EAGER_EXPERTS)),
    # the WKV recurrence as a Python loop over time steps (no cache: its in-place state update has no
    # backward; no rescaling: in eval mode it divides the weights in place, see the docstring)
    "rwkv": (transformers.RwkvForCausalLM, transformers.RwkvConfig, dict(
        vocab_size=64, hidden_size=16, attention_hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        context_length=16, use_cache=False, rescale_every=0)),
    # a gated short convolution layer, then attention
    "lfm2": (transformers.Lfm2ForCausalLM, transformers.Lfm2Config, dict(
        _SMALL, conv_L_cache=3, layer_types=["conv", "full_attention"])),
    # Mamba2 layers and a shared attention block with per-layer LoRA adapters
    "zamba2": (transformers.Zamba2ForCausalLM, transformers.Zamba2Config, dict(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=4,
        layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], num_mem_blocks=1, max_position_embeddings=32,
        intermediate_size=32, adapter_rank=4, use_shared_attention_adapter=True)),
}


def _lm_loss(m, ids):
    """Next-token cross entropy in the model's dtype, plus the router loss where the model has one."""
    out = m(input_ids=ids)
    logits = out.logits[:, :-1]
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    aux = getattr(out, "aux_loss", None)
    return loss if aux is None else loss + 0.1 * aux


def _raw(loss, model, *args):
    """Value and ``torch.autograd.grad`` on a deep copy (zeros for a parameter f does not use)."""
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    value = loss(twin, *args)
    grads = torch.autograd.grad(value, params, allow_unused=True, materialize_grads=True)
    return value.detach(), dict(zip(names, grads))


def _same_draws(ours, theirs):
    """``ours()`` and ``theirs()`` from the same state of torch's generator; activity must leave it
    where the eager call does."""
    state = torch.get_rng_state()
    got = ours()
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    want = theirs()
    assert torch.equal(after, torch.get_rng_state()), "activity drew other random numbers than one eager call"
    return got, want


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(_MODELS))
def test_state_space_and_mixture_of_experts_models_match_torch(name, train):
    model_type, config_type, config = _MODELS[name]
    model = built(model_type, config_type, train=train, attn_implementation="eager", **config)
    ids, other = (torch.randint(0, 64, (2, 8), generator=generator(seed)) for seed in (1, 2))
    intact = untouched(Active(model), Constant(ids))
    got, (_, want) = _same_draws(lambda: ad.gradient(_lm_loss, Active(model), Constant(ids)), lambda: _raw(_lm_loss, model, ids))
    assert_close_dicts(got, want, **CLOSE)
    prepared = ad.prepare(ad.gradient, _lm_loss, Active(model), Constant(ids))
    for data in (other, ids):
        got, (_, want) = _same_draws(lambda: prepared(model, data), lambda: _raw(_lm_loss, model, data))
        assert_close_dicts(got, want, **CLOSE)
    (value, grads), (want_value, want) = _same_draws(
        lambda: ad.value_and_gradient(_lm_loss, Active(model), Constant(other)), lambda: _raw(_lm_loss, model, other)
    )
    torch.testing.assert_close(value, want_value, **CLOSE)
    assert_close_dicts(grads, want, **CLOSE)
    if not train:
        assert intact()
    assert model.training is train and all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ padded lookups in forward mode


def _raw_hvp(loss, model, tangent, *args):
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    grads = torch.autograd.grad(loss(twin, *args), params, create_graph=True, allow_unused=True, materialize_grads=True)
    product = sum((g * tangent[n]).sum() for n, g in zip(names, grads) if g.requires_grad)
    hvps = torch.autograd.grad(product, params, allow_unused=True, materialize_grads=True)
    return {n: g.detach() for n, g in zip(names, grads)}, dict(zip(names, hvps))


def _tangent(model, seed=5):
    return {n: randn(*p.shape, seed=seed + i) for i, (n, p) in enumerate(trainable(model))}


def _forward_over_reverse():
    return ad.AutoTorch(hvp_mode="forward-over-reverse")


class _Tagger(nn.Module):
    """A padded lookup through ``nn.Embedding`` and one through ``F.embedding`` (a padding index
    counted from the end), as model libraries write their embedding modules."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(6, 3, padding_idx=0, dtype=torch.float64)
        self.positions = nn.Parameter(randn(5, 3, seed=3))
        self.padding_idx = -1
        self.out = nn.Linear(3, 2, dtype=torch.float64)

    def forward(self, ids):
        positions = torch.where(ids == 0, 4, torch.arange(ids.shape[-1]))
        looked = self.words(ids) + nn.functional.embedding(positions, self.positions, padding_idx=self.padding_idx)
        return self.out(torch.tanh(looked))


def _tagger_loss(m, ids):
    return m(ids).pow(2).sum()


def test_a_padded_lookup_has_the_same_derivatives_in_forward_mode_as_in_reverse_mode():
    """The padding rows' tangents went into the pushforward and into the forward-over-reverse
    Hessian-vector product (and the Hessian); the double backward left them out."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _Tagger()
    ids = torch.tensor([[0, 2, 2, 5], [3, 0, 1, 0]])
    tangent = _tangent(model)
    intact = untouched(Active(model), Constant(ids))
    grads, want = _raw_hvp(_tagger_loss, model, tangent, ids)
    along = sum((grads[n] * tangent[n]).sum() for n in grads)
    assert float(grads["words.weight"][0].abs().sum()) == 0 and float(grads["positions"][4].abs().sum()) == 0
    torch.testing.assert_close(ad.pushforward(_tagger_loss, Active(model), Constant(ids), tangent=tangent), along, **CLOSE)
    prepared = ad.prepare(ad.pushforward, _tagger_loss, Active(model), Constant(ids), tangent=tangent)
    for _ in range(2):
        torch.testing.assert_close(prepared(model, ids, tangent=tangent), along, **CLOSE)
    batch = [tangent, _tangent(model, seed=20)]  # several tangents: torch.func.jvp under vmap
    for got, each in zip(ad.pushforward(_tagger_loss, Active(model), Constant(ids), tangents=batch), batch):
        torch.testing.assert_close(got, sum((grads[n] * each[n]).sum() for n in grads), **CLOSE)
    for backend in (ad.AutoTorch(), _forward_over_reverse(), ad.AutoTorch(hvp_mode="reverse-over-reverse")):
        got = ad.hvp(_tagger_loss, Active(model), Constant(ids), tangent=tangent, backend=backend)
        assert_close_dicts(got, want, **SECOND_ORDER)
    hessian = ad.hessian(_tagger_loss, Active(model), Constant(ids))  # batched: forward over reverse
    for row in want:
        contracted = sum(torch.tensordot(hessian[row][column], tangent[column], dims=tangent[column].dim()) for column in tangent)
        torch.testing.assert_close(contracted, want[row], msg=row, **SECOND_ORDER)
    # the tape's Jacobian of the outputs, applied to the tangent, is the pushforward of the outputs
    outputs = ad.pushforward(lambda m, i: m(i), Active(model), Constant(ids), tangent=tangent)
    rows = ad.jacobian(lambda m, i: m(i), Active(model), Constant(ids))
    torch.testing.assert_close(outputs, sum(torch.tensordot(rows[n], tangent[n], dims=tangent[n].dim()) for n in tangent), **CLOSE)
    assert intact()


_LONGFORMER = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   attention_window=4, max_position_embeddings=40, pad_token_id=1)


def _masked_lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def test_longformer_with_padded_inputs_in_forward_mode_and_both_hvp_paths():
    """Longformer's word and position embeddings both have a padding index: the pushforward was
    off by the padding rows' tangents (by 11%) and forward over reverse
    disagreed with the double backward."""
    model = built(transformers.LongformerForMaskedLM, transformers.LongformerConfig, **_LONGFORMER)
    ids = torch.randint(2, 64, (2, 8), generator=generator(1))
    ids[1, -3:] = 1  # padded (no attention mask: torch's own gradient is NaN where a window is all masked)
    tangent = _tangent(model)
    intact = untouched(Active(model), Constant(ids))
    grads, want = _raw_hvp(_masked_lm_loss, model, tangent, ids)
    along = sum((grads[n] * tangent[n]).sum() for n in grads)
    torch.testing.assert_close(ad.pushforward(_masked_lm_loss, Active(model), Constant(ids), tangent=tangent), along, **CLOSE)
    for backend in (_forward_over_reverse(), ad.AutoTorch(hvp_mode="reverse-over-reverse")):
        got = ad.hvp(_masked_lm_loss, Active(model), Constant(ids), tangent=tangent, backend=backend)
        assert_close_dicts(got, want, **CLOSE)
    assert intact()


def _squared(m, h):
    out = m(h)
    return (out[0] if isinstance(out, tuple) else out).pow(2).sum()


def test_expert_routing_and_a_state_space_mixer_second_order_on_small_submodules():
    """OLMoE's sparse block (top-2 of 4 experts, index_add of each expert's tokens) and Mamba2's
    mixer (the chunked scan): both hvp paths, and a pullback of the mixer's outputs. Both compute a
    part in float32 (the router's softmax, the gated RMSNorm), so forward over reverse agrees with
    the double backward to float32 precision of the largest entry."""
    olmoe = built(transformers.OlmoeForCausalLM, transformers.OlmoeConfig, **_MODELS["olmoe"][2]).model.layers[0].mlp
    mamba = built(transformers.Mamba2ForCausalLM, transformers.Mamba2Config, **_MODELS["mamba2"][2]).backbone.layers[0].mixer
    x = randn(2, 8, 16, seed=1)
    for block in (olmoe, mamba):
        tangent = _tangent(block)
        intact = untouched(Active(block), Constant(x))
        _, want = _raw_hvp(_squared, block, tangent, x)
        float32 = dict(rtol=1e-5, atol=1e-6 * max(float(h.abs().max()) for h in want.values()))
        for backend in (_forward_over_reverse(), ad.AutoTorch(hvp_mode="reverse-over-reverse")):
            assert_close_dicts(ad.hvp(_squared, Active(block), Constant(x), tangent=tangent, backend=backend), want, **float32)
        assert intact()
    cotangent = randn(2, 8, 16, seed=2)
    twin, leaf = copy.deepcopy(mamba), x.clone().requires_grad_()
    names, params = zip(*trainable(twin))
    raw = torch.autograd.grad(twin(leaf), (leaf, *params), cotangent)
    got_model, got_x = ad.pullback(lambda m, h: m(h), Active(mamba), Active(x), cotangent=cotangent)
    torch.testing.assert_close(got_x, raw[0], **CLOSE)
    assert_close_dicts(got_model, dict(zip(names, raw[1:])), **CLOSE)


# ------------------------------------------------------------------ an in-place write the transform did not get


class _ClippedCritic(nn.Module):
    """A WGAN critic clipping its weights inside its forward, under ``no_grad`` (as RWKV rescales
    its layers in eval mode)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=torch.float64)
        self.out = nn.Linear(2, 1, dtype=torch.float64)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.6, 0.6)  # nn.Linear(3, 2) starts within 1/sqrt(3)
        return torch.tanh(self.out(torch.tanh(self.lin(x)))).pow(2).sum()


def test_a_hessian_through_weight_clipping_in_the_forward_falls_back_to_the_double_backward():
    """Forward over reverse (what ``hessian`` runs first) refuses an in-place write to a tensor
    the transform did not get (a Constant module's parameter, or one ``where=`` leaves out):
    ``hessian`` raised where ``hvp`` worked; the tape answers, as for any transform limit."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        critic = _ClippedCritic()
    x = randn(4, 3, seed=1)
    weight = critic.lin.weight.detach().clone()
    twin = copy.deepcopy(critic)
    want_x = torch.autograd.functional.hessian(lambda v: twin(v), x)
    bias = twin.out.bias.detach().clone()

    def of_bias(b):
        return torch.func.functional_call(twin, {"out.bias": b}, (x,), strict=False)

    want_bias = torch.autograd.functional.hessian(of_bias, bias)
    with pytest.warns(RuntimeWarning, match="in place outside the tape"):  # the clamp bumps the version
        got_x = ad.hessian(_call, Constant(critic), Active(x))
    torch.testing.assert_close(got_x, want_x, **SECOND_ORDER)
    got = ad.hessian(_call, Active(critic, where=lambda path, leaf: path == "out.bias"), Constant(x))
    torch.testing.assert_close(got["out.bias"]["out.bias"], want_bias, **SECOND_ORDER)
    assert torch.equal(critic.lin.weight.detach(), weight)  # within the clip range: the write changed no value


def _call(m, x):
    return m(x)


# ------------------------------------------------------------------ a hybrid model's cache


def _step_loss(m, ids, past):
    return m(input_ids=ids, past_key_values=past, use_cache=True, cache_position=torch.tensor([6])).logits.pow(2).mean()


def _states(past):
    return [t for layer in past.layers for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
            for t in states.values() if t is not None]


def test_a_hybrid_model_s_cache_of_linear_attention_states_is_a_pytree_like_its_attention_layers():
    """Jamba's cache holds a linear-attention layer (the Mamba layer's conv and SSM states) beside
    an attention layer. That layer type has a base of its own, which activity took for an opaque
    constant: a prepared call refused every new cache of a decoding loop ("compares by identity"),
    and ``Active(past)`` silently had no gradient for the states."""
    model_type, config_type, config = _MODELS["jamba"]
    model = built(model_type, config_type, attn_implementation="eager", **config)
    ids, step = torch.randint(2, 64, (2, 6), generator=generator(1)), torch.randint(2, 64, (2, 1), generator=generator(2))
    with torch.no_grad():
        past = model(input_ids=ids, use_cache=True).past_key_values
    assert len(_states(past)) == 2
    prepared = ad.prepare(ad.gradient, _step_loss, Active(model), Constant(step), Constant(copy.deepcopy(past)))
    for _ in range(2):  # each step's own copy: the layer writes its states into the cache's tensors in place
        _, want = _raw(_step_loss, model, step, copy.deepcopy(past))
        assert_close_dicts(prepared(model, step, copy.deepcopy(past)), want, **CLOSE)
    # the states as an Active part of the cache
    held = copy.deepcopy(past)
    leaves = [t.clone().requires_grad_() for t in _states(held)]
    want = torch.autograd.grad(sum((t * t.tanh()).sum() for t in leaves), leaves)
    got = ad.gradient(lambda c: sum((t * t.tanh()).sum() for t in _states(c)), Active(held))
    assert type(got) is type(held)
    for g, w in zip(_states(got), want, strict=True):
        torch.testing.assert_close(g, w, **CLOSE)
