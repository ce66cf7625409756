"""Round six of the AutoTorch sweep on third-party modules: Hugging Face models the rest of the
suite does not build (DeBERTa-v2, Falcon with ALiBi, BLOOM, GPT-NeoX, Mamba's slow path, Swin,
ViT-MAE), their random draws in train mode, reentrant and non-reentrant checkpointing; custom
differentiation in user code (``torch.library.custom_op``, autograd Functions with
``setup_context``, a vmap rule, tensors kept on ``ctx``, ``@once_differentiable``, no forward
rule); distributions, autocast, ``torch.export``, sparse constants, nested module containers with
a shared layer, and hooks that change inputs, outputs and gradients.

Every expected value is independent of the library: a hand-written ``torch.autograd.grad`` (or
``torch.autograd.functional`` / ``torch.func``) on a fresh copy of the model, or a closed form.
Each call is also checked to leave the user's arguments and the global RNG as they were, or, where
f draws, to advance the RNG exactly as one eager forward does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import SECOND_ORDER, assert_close_dicts, built, generator, randn, raw_gradient, trainable, untouched

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def token_ids(seed):
    return torch.randint(3, 50, (2, 6), generator=generator(seed))


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def raw_hvp(loss, model, x, tangent):
    """Double backward on a copy of ``model``, keyed like ``named_parameters()``."""
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    grads = torch.autograd.grad(loss(twin, x), params, create_graph=True)
    return dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names])))


def tangent_of(model):
    return {name: randn(*p.shape, seed=i) for i, (name, p) in enumerate(trainable(model))}


# ---------------------------------------------------------------- Hugging Face models

SMALL = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
LANGUAGE_MODELS = {
    # disentangled attention: content-to-position and position-to-content relative terms
    "deberta_v2": lambda: built(
        transformers.DebertaV2ForMaskedLM, transformers.DebertaV2Config, **SMALL, intermediate_size=32,
        max_position_embeddings=40, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
    ),
    "falcon_alibi": lambda: built(transformers.FalconForCausalLM, transformers.FalconConfig, **SMALL, alibi=True),
    "bloom": lambda: built(
        transformers.BloomForCausalLM, transformers.BloomConfig, vocab_size=50, hidden_size=16, n_layer=2, n_head=2
    ),
    "gpt_neox": lambda: built(
        transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig, **SMALL, intermediate_size=32, max_position_embeddings=40
    ),
    # without the CUDA kernels: the selective scan as a Python loop over time steps
    "mamba": lambda: built(
        transformers.MambaForCausalLM, transformers.MambaConfig, vocab_size=50, hidden_size=16, state_size=4,
        num_hidden_layers=2, intermediate_size=32, time_step_rank=4, conv_kernel=3,
    ),
}


@pytest.mark.parametrize("name", list(LANGUAGE_MODELS))
def test_deberta_v2_falcon_bloom_gpt_neox_and_mamba_with_labels_unprepared_and_prepared(name):
    model, first = LANGUAGE_MODELS[name](), token_ids(1)
    intact = untouched(Active(model), Constant(first))
    assert_close_dicts(ad.gradient(lm_loss, Active(model), Constant(first)), raw_gradient(lm_loss, model, first))
    prepared = ad.prepare(ad.gradient, lm_loss, Active(model), Constant(first))
    prepared(model, first)
    new = token_ids(2)
    assert_close_dicts(prepared(model, new), raw_gradient(lm_loss, model, new))
    assert intact()


def swin():
    return built(
        transformers.SwinForImageClassification, transformers.SwinConfig, train=True, image_size=8, patch_size=2,
        num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2, num_labels=3,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.3,
    )


def vit_mae():
    return built(
        transformers.ViTMAEForPreTraining, transformers.ViTMAEConfig, image_size=8, patch_size=2, num_channels=3,
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, decoder_hidden_size=16,
        decoder_num_hidden_layers=1, decoder_num_attention_heads=2, decoder_intermediate_size=32, mask_ratio=0.5,
    )


def deberta_in_train_mode():
    # StableDropout: DeBERTa's own autograd.Function, its mask drawn from the global RNG
    return built(
        transformers.DebertaV2ForMaskedLM, transformers.DebertaV2Config, train=True, **SMALL, intermediate_size=32,
        max_position_embeddings=40, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2,
    )


def image_loss(model, pixels):
    return model(pixel_values=pixels, labels=torch.tensor([0, 2])).loss


def mae_loss(model, pixels):
    return model(pixel_values=pixels).loss  # the patches it masks: a random shuffle of each image's


DRAWING_MODELS = {
    "swin_stochastic_depth": (swin, image_loss, lambda seed: randn(2, 3, 8, 8, seed=seed)),
    "vit_mae_random_masking": (vit_mae, mae_loss, lambda seed: randn(2, 3, 8, 8, seed=seed)),
    "deberta_stable_dropout": (deberta_in_train_mode, lm_loss, token_ids),
}


@pytest.mark.parametrize("name", list(DRAWING_MODELS))
def test_swin_drop_path_vit_mae_masking_and_deberta_dropout_draw_like_one_eager_forward(name):
    """The same seed gives the same draws as an eager forward (so the same gradient), and leaves
    the global RNG where the eager forward leaves it, unprepared and prepared."""
    make, loss, data = DRAWING_MODELS[name]
    model = make()

    def both(call, x, seed):
        torch.manual_seed(seed)
        got = call(x)
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        want = raw_gradient(loss, model, x)
        assert torch.equal(after, torch.get_rng_state())
        assert_close_dicts(got, want)

    with torch.random.fork_rng():
        both(lambda x: ad.gradient(loss, Active(model), Constant(x)), data(1), seed=3)
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(data(1)))
        prepared(model, data(1))
        both(lambda x: prepared(model, x), data(2), seed=4)
    assert model.training == (name != "vit_mae_random_masking")


def test_falcon_alibi_hvp_prepared_on_new_ids_and_bloom_hidden_states_loss():
    falcon = built(
        transformers.FalconForCausalLM, transformers.FalconConfig, **{**SMALL, "num_hidden_layers": 1}, alibi=True,
        attn_implementation="eager",
    )
    tangent = tangent_of(falcon)
    first, new = token_ids(1), token_ids(2)
    intact = untouched(Active(falcon), Constant(first))
    got = ad.hvp(lm_loss, Active(falcon), Constant(first), tangent=tangent)
    assert_close_dicts(got, raw_hvp(lm_loss, falcon, first, tangent), **SECOND_ORDER)
    prepared = ad.prepare(ad.hvp, lm_loss, Active(falcon), Constant(first), tangent=tangent)
    prepared(falcon, first, tangent=tangent)
    assert_close_dicts(prepared(falcon, new, tangent=tangent), raw_hvp(lm_loss, falcon, new, tangent), **SECOND_ORDER)
    assert intact()

    bloom = LANGUAGE_MODELS["bloom"]()

    def hidden_states_loss(model, ids):
        return sum(h.pow(2).mean() for h in model(input_ids=ids, output_hidden_states=True).hidden_states)

    got = ad.value_and_gradient(hidden_states_loss, Active(bloom), Constant(token_ids(3)))
    torch.testing.assert_close(got[0], hidden_states_loss(bloom, token_ids(3)))
    assert_close_dicts(got[1], raw_gradient(hidden_states_loss, bloom, token_ids(3)))


def test_gpt_neox_checkpointing_in_train_mode_non_reentrant_is_right_and_reentrant_is_torchs_clear_error():
    model = built(
        transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig, train=True, **SMALL, intermediate_size=32,
        max_position_embeddings=40, hidden_dropout=0.1, attention_dropout=0.1,
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    intact = untouched(Active(model))
    with torch.random.fork_rng():
        torch.manual_seed(3)
        got = ad.gradient(lm_loss, Active(model), Constant(token_ids(1)))
        torch.manual_seed(3)
        assert_close_dicts(got, raw_gradient(lm_loss, model, token_ids(1)))  # the recomputation redraws the masks
    assert intact() and model.training
    # Reentrant checkpointing has no torch.autograd.grad (HF makes the checkpointed inputs
    # require grad, so torch says so): an error that says what to do, not a number.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        ad.gradient(lm_loss, Active(model), Constant(token_ids(1)))


# ---------------------------------------------------------------- custom differentiation


class _OnceCube(torch.autograd.Function):
    """x**3 with a backward marked ``@once_differentiable`` and no jvp."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class _OnceCubeWithJvp(_OnceCube):
    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * t


class _CubeWithoutForwardRule(torch.autograd.Function):
    """x**3 whose backward is differentiable, with no jvp: forward mode must come from the tape."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def sin_of_cube_hvp(x, t):
    """The Hessian of sum(sin(x**3)) times t, in closed form."""
    return (6 * x * torch.cos(x**3) - 9 * x**4 * torch.sin(x**3)) * t


ONCE_DIFFERENTIABLE_CALLS = {
    "hvp": lambda f, x, t: ad.hvp(f, Active(x), tangent=t),
    "prepared_hvp": lambda f, x, t: ad.prepare(ad.hvp, f, Active(x), tangent=t)(x, tangent=t),
    "batched_hvp": lambda f, x, t: ad.hvp(f, Active(x), tangents=[t, 2 * t])[0],
    "hessian": lambda f, x, t: ad.hessian(f, Active(x)) @ t,
    "reverse_over_reverse": lambda f, x, t: ad.hvp(f, Active(x), tangent=t, backend=ad.AutoTorch(hvp_mode="reverse-over-reverse")),
    "second_derivative": lambda f, x, t: ad.second_derivative(f, Active(x[0])) * t[0],
}


@pytest.mark.parametrize("call", list(ONCE_DIFFERENTIABLE_CALLS))
@pytest.mark.parametrize("cube", [_OnceCube, _OnceCubeWithJvp], ids=["without_jvp", "with_jvp"])
def test_second_order_through_a_once_differentiable_backward_under_a_nonlinear_loss_is_an_error(call, cube):
    """Behind sin, the gradient flowing into the once-differentiable backward depends on x, so
    torch hands that backward's output behind a node that raises only if run, cut from x: a
    double backward silently leaves that part out (it gave zeros), and torch.func's forward over
    reverse drops its tangent (zeros too, even with a jvp). Each is an error that says why."""
    x, t = torch.tensor([1.0, 1.3], dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    f = lambda x: cube.apply(x).sin().sum()  # noqa: E731
    run = ONCE_DIFFERENTIABLE_CALLS[call]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        run(f, x, t)


def test_second_derivative_through_a_function_without_a_forward_rule_comes_from_the_tape():
    """torch.func has no jvp for the Function; the tape's forward mode inside the outer tape's
    pass must stay on that pass's graph (it gave 0 where it detached)."""
    s = torch.tensor(1.3, dtype=torch.float64)
    want = sin_of_cube_hvp(s, 1.0)
    f = lambda s: _CubeWithoutForwardRule.apply(s).sin()  # noqa: E731
    torch.testing.assert_close(ad.second_derivative(f, Active(s)), want)
    prepared = ad.prepare(ad.second_derivative, f, Active(s))
    prepared(s)
    new = torch.tensor(0.7, dtype=torch.float64)
    torch.testing.assert_close(prepared(new), sin_of_cube_hvp(new, 1.0))
    torch.testing.assert_close(ad.hessian(f, Active(s)), want)


@torch.library.custom_op("activity_sweep6::cube", mutates_args=())
def library_cube(x: torch.Tensor) -> torch.Tensor:
    return x.pow(3)


@library_cube.register_fake
def _(x):
    return torch.empty_like(x)


def _cube_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _cube_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return 3 * x.pow(2) * g


library_cube.register_autograd(_cube_backward, setup_context=_cube_setup)


class _CubeWithVmapRule(_CubeWithoutForwardRule):
    generate_vmap_rule = True


class _CubeOnCtx(torch.autograd.Function):
    """The old style: ``forward(ctx, ...)``, the input kept as a ctx attribute, not saved."""

    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x.pow(3)

    @staticmethod
    def backward(ctx, g):
        return 3 * ctx.x.pow(2) * g


CUBES = {
    "custom_op_with_register_autograd": library_cube,
    "function_with_a_generated_vmap_rule": _CubeWithVmapRule.apply,
    "function_keeping_its_input_on_ctx": _CubeOnCtx.apply,
}


@pytest.mark.parametrize("name", list(CUBES))
def test_custom_ops_and_autograd_functions_in_every_reverse_and_second_order_operator(name):
    cube = CUBES[name]
    x, t = randn(4, seed=1), randn(4, seed=2)
    scalar, vector = (lambda x: cube(x).sin().sum()), (lambda x: cube(x).sin())
    exact_scalar, exact_vector = (lambda z: torch.sin(z**3).sum()), (lambda z: torch.sin(z**3))
    intact = untouched(Active(x))
    torch.testing.assert_close(ad.gradient(scalar, Active(x)), 3 * x**2 * torch.cos(x**3))
    prepared = ad.prepare(ad.gradient, scalar, Active(x))
    prepared(x)
    torch.testing.assert_close(prepared(2 * x), 12 * x**2 * torch.cos(8 * x**3))
    torch.testing.assert_close(ad.jacobian(vector, Active(x)), torch.autograd.functional.jacobian(exact_vector, x))
    torch.testing.assert_close(ad.pullback(vector, Active(x), cotangent=t), torch.autograd.functional.vjp(exact_vector, x, t)[1])
    torch.testing.assert_close(ad.pushforward(vector, Active(x), tangent=t), torch.autograd.functional.jvp(exact_vector, x, t)[1])
    torch.testing.assert_close(ad.hvp(scalar, Active(x), tangent=t), sin_of_cube_hvp(x, t))
    torch.testing.assert_close(ad.hessian(scalar, Active(x)), torch.autograd.functional.hessian(exact_scalar, x))
    assert intact()


# ---------------------------------------------------------------- losses and modules in unusual forms


class GaussianEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mean, self.log_scale = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return torch.distributions.Normal(self.mean(x), self.log_scale(x).exp())


def vae_loss(encoder, x):
    """A reparameterised sample (drawn from the global RNG), its log-density and a KL term."""
    q = encoder(x)
    z = q.rsample()
    prior = torch.distributions.Normal(torch.zeros(()), torch.ones(()))
    return z.pow(2).sum() - q.log_prob(z).sum() + torch.distributions.kl_divergence(q, prior).sum()


def test_a_vae_loss_with_rsample_log_prob_and_kl_of_a_module_made_distribution():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        encoder = GaussianEncoder().double()
        x = randn(4, 3, seed=1)
        torch.manual_seed(3)
        got = ad.gradient(vae_loss, Active(encoder), Constant(x))
        torch.manual_seed(3)
        assert_close_dicts(got, raw_gradient(vae_loss, encoder, x))
        tangent = tangent_of(encoder)
        torch.manual_seed(4)
        got = ad.hvp(vae_loss, Active(encoder), Constant(x), tangent=tangent)
        torch.manual_seed(4)
        assert_close_dicts(got, raw_hvp(vae_loss, encoder, x, tangent), **SECOND_ORDER)


def test_bfloat16_autocast_inside_f_and_a_torch_export_module_in_train_mode():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
        batchnormed = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()

    def autocast_loss(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        return y.float().pow(2).sum()

    x = torch.randn(3, 4, generator=generator(1))
    intact = untouched(Active(mlp), Constant(x))
    assert_close_dicts(ad.gradient(autocast_loss, Active(mlp), Constant(x)), raw_gradient(autocast_loss, mlp, x))
    assert intact()

    def squared(model, x):
        return model(x).pow(2).sum()

    exported = torch.export.export(batchnormed.train(), (randn(3, 4, seed=1),)).module()
    intact = untouched(Active(exported))
    for seed in (1, 2):  # its running statistics are buffers of the exported module
        x = randn(3, 4, seed=seed)
        assert_close_dicts(ad.gradient(squared, Active(exported), Constant(x)), raw_gradient(squared, exported, x))
    assert intact()


def test_a_sparse_coo_constant_in_gradient_pushforward_jacobian_and_the_kits_intact_check():
    """torch.sparse.mm has no forward-mode rule and its backward no batching rule (\"expand is
    unsupported for Sparse tensors\" under vmap): the Jacobian comes one cotangent at a time.
    The kit's check that nothing changed compares a sparse tensor in dense form."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = nn.Linear(4, 4).double()
    indices = torch.tensor([[0, 1, 2, 3, 0], [1, 2, 3, 0, 0]])
    adjacency = torch.sparse_coo_tensor(indices, randn(5, seed=2), (4, 4)).coalesce()

    def propagate(layer, a):
        return torch.tanh(torch.sparse.mm(a, layer.weight) + layer.bias)

    def loss(layer, a):
        return propagate(layer, a).pow(2).sum()

    intact = untouched(Active(layer), Constant(adjacency))
    assert_close_dicts(ad.gradient(loss, Active(layer), Constant(adjacency)), raw_gradient(loss, layer, adjacency))
    weight, bias = layer.weight.detach(), layer.bias.detach()
    jw, jb = torch.autograd.functional.jacobian(lambda w, b: torch.tanh(torch.sparse.mm(adjacency, w) + b), (weight, bias))
    jacobian = ad.jacobian(propagate, Active(layer), Constant(adjacency))
    torch.testing.assert_close(jacobian["weight"], jw)
    torch.testing.assert_close(jacobian["bias"], jb)
    tangent = tangent_of(layer)
    want = torch.einsum("ijkl,kl->ij", jw, tangent["weight"]) + torch.einsum("ijk,k->ij", jb, tangent["bias"])
    torch.testing.assert_close(ad.pushforward(propagate, Active(layer), Constant(adjacency), tangent=tangent), want)
    assert intact()
    moved = torch.sparse_coo_tensor(indices, randn(5, seed=3), (4, 4)).coalesce()
    check_moved = untouched(Constant(moved))
    moved.values().mul_(2)
    assert not check_moved()


class Towers(nn.Module):
    """Two towers in a ModuleDict of ModuleLists, one Linear in both and also as ``.alias``."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(3, 3)
        self.towers = nn.ModuleDict({"a": nn.ModuleList([shared, nn.Linear(3, 3)]), "b": nn.ModuleList([nn.Linear(3, 3), shared])})
        self.alias = shared

    def forward(self, x):
        for name in ("a", "b"):
            for layer in self.towers[name]:
                x = torch.tanh(layer(x))
        return self.alias(x)


def test_a_module_dict_of_module_lists_with_one_linear_registered_under_three_names():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Towers().double()

    def loss(model, x):
        return model(x).pow(2).sum()

    intact = untouched(Active(model))
    got = ad.gradient(loss, Active(model), Constant(randn(2, 3, seed=1)))
    assert "alias.weight" not in got and "towers.b.1.weight" not in got  # the shared one, once
    assert_close_dicts(got, raw_gradient(loss, model, randn(2, 3, seed=1)))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(randn(2, 3, seed=1)))
    prepared(model, randn(2, 3, seed=1))
    assert_close_dicts(prepared(model, randn(2, 3, seed=2)), raw_gradient(loss, model, randn(2, 3, seed=2)))
    assert intact()


def test_hooks_that_change_inputs_outputs_and_output_gradients_apply_as_in_the_eager_forward():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    model[0].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    model[1].register_forward_pre_hook(lambda module, args, kwargs: ((args[0] + 1,), kwargs), with_kwargs=True)
    model[2].register_forward_hook(lambda module, args, out: out + module.weight.sum())
    model[2].register_full_backward_pre_hook(lambda module, grad_output: (grad_output[0] * 10,))

    def loss(model, x):
        return model(x).pow(2).sum()

    x = randn(2, 3, seed=1)
    intact = untouched(Active(model), Constant(x))
    global_hooks = [
        nn.modules.module.register_module_forward_hook(lambda m, args, out: out * 1.5 if isinstance(m, nn.Linear) else None),
        nn.modules.module.register_module_forward_pre_hook(lambda m, args: (args[0] - 0.5,) if isinstance(m, nn.Tanh) else None),
    ]
    try:
        assert_close_dicts(ad.gradient(loss, Active(model), Constant(x)), raw_gradient(loss, model, x))
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
        prepared(model, x)
        new = randn(2, 3, seed=2)
        assert_close_dicts(prepared(model, new), raw_gradient(loss, model, new))
    finally:
        for handle in global_hooks:
            handle.remove()
    assert intact()
