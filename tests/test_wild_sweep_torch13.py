"""Round 13 of the PyTorch sweep: backward passes inside f and inside a backward. Hugging Face
Reformer in train mode (its reversible layers recompute each block in a custom autograd.Function's
backward and accumulate the blocks' parameter gradients with a ``torch.autograd.backward`` of their
own), the same pattern in a hand-written Function, a WGAN-GP critic loss (an input gradient taken
with ``create_graph`` inside f) and a MAML meta-loss (an inner gradient of the module's parameters
inside f, then ``functional_call`` on the fast weights).

Expected values come from ``loss.backward()`` on an independent deep copy (the reversible layers'
gradients live only in ``.grad``: ``torch.autograd.grad`` itself misses them) or from
``torch.autograd.grad`` / a triple backward on a copy; the user's model, its ``.grad`` and flags
are checked unchanged.

Fixed here: the parameters behind a reversible layer got a silent zero gradient (their part went
to the tape leaves' ``.grad``, which nothing read), and with the model a Constant (or the
parameters an ``Active(model, where=...)`` leaves out) that part went into the user's own
parameters' ``.grad``. Pushforward (on the tape) and Jacobians take that part too; second order
through such a backward is a clear error.

Also tried and fine, not kept: Hugging Face BigBird with block-sparse attention in train mode
(numpy draws advance like an eager forward), the WGAN-GP loss's pushforward in the real samples,
MAML through ``module.parameters()`` directly and its hessian.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import activity as ad
from activity import Active, Constant

from _sweeps import CLOSE, SECOND_ORDER, assert_close_dicts, built, generator, randn, untouched


def _call(m, x):
    return m(x)


def _backward_gradient(loss, model, *args) -> dict:
    """What a training loop reads: ``.grad`` after ``loss.backward()`` on a deep copy (zeros for an unused parameter)."""
    twin = copy.deepcopy(model)
    loss(twin, *args).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in twin.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------ a backward inside the backward


class _Reversible(torch.autograd.Function):
    """``x + block(x)``, recomputed in the backward, where a backward pass of its own accumulates
    the block's parameter gradients into their ``.grad`` (Reformer's ``_ReversibleFunction``)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return x + block(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(x + ctx.block(x), g)
        return x.grad, None


class _ReversibleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4, dtype=torch.float64)
        self.block = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh())
        self.out = nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, x):
        return self.out(_Reversible.apply(self.inp(x), self.block)).pow(2).sum()


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


def _block_outputs(m, x):
    return _Reversible.apply(m.inp(x), m.block)


def test_parameters_behind_a_backward_that_runs_its_own_backward_pass_get_their_gradient():
    """The block's parameters got zeros (wrong by 100%), unprepared and prepared; their part is
    the tape leaves' ``.grad``, which a reused view's leaves must not carry into the next call."""
    net, x, y = _seeded(_ReversibleNet), randn(5, 3, seed=1), randn(5, 3, seed=2)
    intact = untouched(Active(net), Constant(x))
    assert_close_dicts(ad.gradient(_call, Active(net), Constant(x)), _backward_gradient(_call, net, x), **CLOSE)
    prepared = ad.prepare(ad.gradient, _call, Active(net), Constant(x))
    for data in (x, y, x):
        assert_close_dicts(prepared(net, data), _backward_gradient(_call, net, data), **CLOSE)
    value, grad = ad.value_and_gradient(_call, Active(net), Constant(y))
    torch.testing.assert_close(value, copy.deepcopy(net)(y).detach())
    assert_close_dicts(grad, _backward_gradient(_call, net, y), **CLOSE)
    # forward mode on the tape and a Jacobian's batched pullbacks take the same part
    tangent = {n: randn(*p.shape, seed=10 + i) for i, (n, p) in enumerate(net.named_parameters())}
    want = _backward_gradient(_call, net, x)
    pushed = ad.pushforward(_call, Active(net), Constant(x), tangent=tangent)
    torch.testing.assert_close(pushed, sum((want[n] * tangent[n]).sum() for n in want), **CLOSE)
    rows, outputs = ad.jacobian(_block_outputs, Active(net), Constant(x)), randn(5, 4, seed=3)
    twin = copy.deepcopy(net)
    _block_outputs(twin, x).backward(outputs)
    for n, p in twin.named_parameters():
        expected = torch.zeros_like(p) if p.grad is None else p.grad  # (out.* unused)
        torch.testing.assert_close(torch.tensordot(outputs, rows[n], dims=2), expected, msg=n, **CLOSE)
    assert intact()


def test_a_constant_model_behind_such_a_backward_keeps_its_grad_and_second_order_is_an_error():
    """With the model a Constant (or the block left out by ``where``), the backward inside the
    backward accumulated into the user's own parameters' ``.grad``; an hvp through it would leave that part out: a clear error."""
    net, x = _seeded(_ReversibleNet), randn(5, 3, seed=1)
    intact = untouched(Constant(net), Active(x))
    xx = x.clone().requires_grad_()
    copy.deepcopy(net)(xx).backward()
    torch.testing.assert_close(ad.gradient(_call, Constant(net), Active(x)), xx.grad, **CLOSE)
    prepared = ad.prepare(ad.gradient, _call, Constant(net), Active(x))
    torch.testing.assert_close(prepared(net, x), xx.grad, **CLOSE)
    # the block left out by `where`: differentiated nowhere, its .grad the user's
    outside = lambda path, leaf: not path.startswith("block.")  # noqa: E731
    want = {n: g for n, g in _backward_gradient(_call, net, x).items() if outside(n, None)}
    assert_close_dicts(ad.gradient(_call, Active(net, where=outside), Constant(x)), want, **CLOSE)
    masked = ad.prepare(ad.gradient, _call, Active(net, where=outside), Constant(x))
    assert_close_dicts(masked(net, x), want, **CLOSE)
    assert_close_dicts(masked(net, x), want, **CLOSE)
    assert all(p.grad is None for p in net.parameters())
    assert intact()
    tangent = {n: torch.ones_like(p) for n, p in net.named_parameters()}
    for backend in (ad.AutoTorch(), ad.AutoTorch(hvp_mode="reverse-over-reverse")):
        with pytest.raises(RuntimeError, match="backward pass of its own"):
            ad.hvp(_call, Active(net), Constant(x), tangent=tangent, backend=backend)
    assert intact()


_REFORMER = dict(
    vocab_size=50, hidden_size=16, num_attention_heads=2, attention_head_size=8, attn_layers=["local", "lsh"],
    feed_forward_size=32, axial_pos_embds=False, max_position_embeddings=16, local_attn_chunk_length=4,
    lsh_attn_chunk_length=4, num_buckets=2, is_decoder=True, hash_seed=0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
)


def _lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def _embeds_loss(m, embeds, ids):
    return m(inputs_embeds=embeds, labels=ids).loss


def test_reformer_in_train_mode_gets_the_gradient_of_its_reversible_layers():
    """Reformer's reversible layers (train mode, where its backward recomputes them): every layer
    parameter got a zero gradient, silently, and as a Constant model (the gradient for its input
    embeddings) its parameters' ``.grad`` were written. (Its forward reseeds the global RNG, so
    the RNG is not compared.)"""
    model = built(transformers.ReformerModelWithLMHead, transformers.ReformerConfig, train=True, **_REFORMER)
    ids, other = (torch.randint(0, 50, (2, 16), generator=generator(seed)) for seed in (1, 2))
    prepared = ad.prepare(ad.gradient, _lm_loss, Active(model), Constant(ids))
    assert_close_dicts(ad.gradient(_lm_loss, Active(model), Constant(ids)), _backward_gradient(_lm_loss, model, ids), **CLOSE)
    assert_close_dicts(prepared(model, other), _backward_gradient(_lm_loss, model, other), **CLOSE)
    embeds = randn(2, 16, 16, seed=3)
    twin, leaf = copy.deepcopy(model), embeds.clone().requires_grad_()
    _embeds_loss(twin, leaf, ids).backward()
    got = ad.gradient(_embeds_loss, Constant(model), Active(embeds), Constant(ids))
    torch.testing.assert_close(got, leaf.grad, **CLOSE)
    assert all(p.grad is None for p in model.parameters()) and model.training


# ------------------------------------------------------------------ a gradient taken inside f


def _critic_loss(critic, real, fake, mix):
    """WGAN-GP: the critic's gradient at points between real and fake samples, penalised."""
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (slope,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    return critic(fake).mean() - critic(real).mean() + 10 * ((slope.norm(dim=1) - 1) ** 2).mean()


def _maml_loss(m, xs, ys, xq, yq):
    params = dict(m.named_parameters())
    inner = ((torch.func.functional_call(m, params, (xs,)) - ys) ** 2).mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
    return ((torch.func.functional_call(m, fast, (xq,)) - yq) ** 2).mean()


def _raw_gradient_and_hvp(loss, model, tangent, *args):
    twin = copy.deepcopy(model)
    names, params = zip(*twin.named_parameters())
    grads = torch.autograd.grad(loss(twin, *args), params, create_graph=True)
    product = sum((g * tangent[n]).sum() for n, g in zip(names, grads) if g.requires_grad)
    hvps = torch.autograd.grad(product, params, materialize_grads=True)
    return dict(zip(names, (g.detach() for g in grads))), dict(zip(names, hvps))


@pytest.mark.parametrize("loss", [_critic_loss, _maml_loss], ids=["wgan-gp", "maml"])
def test_losses_that_take_a_gradient_inside_f_in_gradient_prepared_gradient_and_hvp(loss):
    critic = _seeded(lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double())
    if loss is _critic_loss:
        data = [randn(5, 3, seed=1), randn(5, 3, seed=2), torch.rand(5, 1, generator=generator(3), dtype=torch.float64)]
        new = [randn(5, 3, seed=4), *data[1:]]
    else:
        data = [randn(4, 3, seed=1), randn(4, 1, seed=2), randn(4, 3, seed=3), randn(4, 1, seed=4)]
        new = [data[2], data[3], data[0], data[1]]
    tangent = {n: randn(*p.shape, seed=10 + i) for i, (n, p) in enumerate(critic.named_parameters())}
    intact = untouched(Active(critic), *map(Constant, data))
    want, want_hvp = _raw_gradient_and_hvp(loss, critic, tangent, *data)
    assert_close_dicts(ad.gradient(loss, Active(critic), *map(Constant, data)), want, **CLOSE)
    prepared = ad.prepare(ad.gradient, loss, Active(critic), *map(Constant, data))
    assert_close_dicts(prepared(critic, *new), _raw_gradient_and_hvp(loss, critic, tangent, *new)[0], **CLOSE)
    assert_close_dicts(ad.hvp(loss, Active(critic), *map(Constant, data), tangent=tangent), want_hvp, **SECOND_ORDER)
    assert intact()


def _first_order_maml(m, x, y):
    """A first-order MAML step as training code writes it: ``backward()`` in the forward, the fast
    weights read from ``p.grad`` (no graph), then the query loss."""
    inner = (m(x) - y).pow(2).mean()
    inner.backward()
    fast = m.weight - 0.1 * m.weight.grad.detach()
    if not torch.isfinite(y).all():
        raise ValueError("a call that fails after its inner backward")
    return (nn.functional.linear(x, fast, m.bias) - y).pow(2).mean()


def test_a_backward_pass_in_f_s_forward_is_no_part_of_f_s_gradient_and_leaves_nothing_for_the_next_call():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = randn(4, 3, seed=1).float(), randn(4, 1, seed=2).float()

    def expected():
        copied = copy.deepcopy(model)
        out = _first_order_maml(copied, x, y)
        for p in copied.parameters():
            p.grad = None  # what the inner backward left is not the meta-gradient
        return dict(zip(("weight", "bias"), torch.autograd.grad(out, list(copied.parameters()))))

    unchanged = untouched(Active(model))
    assert_close_dicts(ad.gradient(_first_order_maml, Active(model), Constant(x), Constant(y)), expected())
    prepared = ad.prepare(ad.gradient, _first_order_maml, Active(model), Constant(x), Constant(y))
    for _ in range(2):
        assert_close_dicts(prepared(model, x, y), expected())
    with pytest.raises(ValueError, match="fails after its inner backward"):
        prepared(model, x, torch.full_like(y, float("nan")))
    assert_close_dicts(prepared(model, x, y), expected())  # the failed call's inner .grad is not added in
    assert unchanged() and model.weight.grad is None
