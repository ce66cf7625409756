"""Round 9 sweep: `activity.testing.check` on real torch layers (nn.GRU, nn.LSTM,
nn.TransformerEncoderLayer), as they are and with an error planted in one submodule: a
custom autograd.Function whose backward is off by a factor or drops a term, or whose jvp
alone is wrong. The planted errors are known by construction, so which operators must fail
is the independent answer."""

from __future__ import annotations

import einops  # noqa: F401 - the round's packages, installed by `make test`
import peft  # noqa: F401
import pytest
import torch
import torchdiffeq  # noqa: F401

from activity import Active, Constant
from activity.testing import check

from _sweeps import randn


class Scaled(torch.autograd.Function):
    """The identity, with a backward multiplied by ``BACKWARD`` and a jvp by ``FORWARD``."""

    BACKWARD, FORWARD = 1.0, 1.0

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * Scaled.BACKWARD

    @staticmethod
    def jvp(ctx, tangent):
        return tangent * Scaled.FORWARD


class Wrapped(torch.nn.Module):
    """``inner`` (a real submodule) with its output through ``function``."""

    def __init__(self, inner, function):
        super().__init__()
        self.inner, self.function = inner, function

    def forward(self, x):
        return self.function.apply(self.inner(x))


def factor(backward=1.0, forward=1.0):
    return type("Planted", (Scaled,), {"BACKWARD": backward, "FORWARD": forward,
                                       "backward": staticmethod(lambda ctx, g: g * backward),
                                       "jvp": staticmethod(lambda ctx, t: t * forward)})


class DroppedTerm(torch.autograd.Function):
    """tanh, whose backward forgets the ``-tanh(x)**2`` term of ``1 - tanh(x)**2``; jvp right."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x = inputs[0]  # for the jvp only: the backward needs nothing

    @staticmethod
    def backward(ctx, grad):
        return grad

    @staticmethod
    def jvp(ctx, tangent):
        return tangent * (1 - torch.tanh(ctx.x) ** 2)


def gru_model(function, dtype=torch.float64):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        gru, head = torch.nn.GRU(3, 4, batch_first=True), torch.nn.Linear(4, 2)
    head = Wrapped(head, function)
    return torch.nn.ModuleDict({"gru": gru, "head": head}).to(dtype)


def gru_loss(m, x):
    return torch.tanh(m["head"](m["gru"](x)[0])).pow(2).mean()


def failing(error) -> set[str]:
    """The operators of the report's FAIL lines: ``pushforward`` for ``pushforward[u0]``,
    ``pullback`` for ``<pullback(v0), u0>``, the batch's line as it is."""
    names = set()
    for line in str(error).splitlines():
        if line.strip().startswith("FAIL"):
            name = line.strip()[len("FAIL  "):].split(" on ")[0]
            names.add(name[1:].split("(")[0].split(",")[0] if name.startswith("<") else name.split("[u")[0])
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rnn", [torch.nn.LSTM, torch.nn.GRU])
def test_real_recurrent_layers_pass_every_check_in_float32_and_float64(rnn, dtype):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = rnn(3, 4, batch_first=True).to(dtype)
    x = randn(2, 5, 3).to(dtype)
    report = check(lambda m, x: m(x)[0].pow(2).mean(), Active(layer), Constant(x))
    assert report.failed == [] and report.unreliable == []
    assert len(report.passed) == 10  # pushforward, pullback, gradient, hvp (2 directions each), batch, gradient_and_hvp


def test_the_identity_wrapper_alone_passes():
    report = check(gru_loss, Active(gru_model(factor())), Constant(randn(2, 4, 3)))
    assert report.failed == []


@pytest.mark.parametrize("wrong", [1.01, 2.0])
def test_a_backward_off_by_a_factor_around_the_head_fails_exactly_the_reverse_operators(wrong):
    with pytest.raises(AssertionError) as raised:
        check(gru_loss, Active(gru_model(factor(backward=wrong))), Constant(randn(2, 4, 3)), operators=["pushforward", "pullback", "gradient"])
    # AutoTorch computes a batch of tangents of a scalar f as <gradient, u>: wrong with the backward
    assert failing(raised.value) == {"pullback", "gradient", "pushforward(tangents=[...])"}


def test_a_backward_that_drops_a_term_fails_the_reverse_operators():
    with pytest.raises(AssertionError) as raised:
        check(gru_loss, Active(gru_model(DroppedTerm)), Constant(randn(2, 4, 3)), operators=["pushforward", "pullback", "gradient"])
    # AutoTorch computes a batch of tangents of a scalar f as <gradient, u>: wrong with the backward
    assert failing(raised.value) == {"pullback", "gradient", "pushforward(tangents=[...])"}


def test_a_wrong_jvp_alone_fails_exactly_pushforward():
    """AutoTorch's batch of tangents (from the gradient) is right here: it is compared with the
    reference, not with the wrong single tangents, which blamed the batch too before."""
    with pytest.raises(AssertionError) as raised:
        check(gru_loss, Active(gru_model(factor(forward=1.01))), Constant(randn(2, 4, 3)), operators=["pushforward", "pullback", "gradient"])
    assert failing(raised.value) == {"pushforward"}


def test_a_transformer_layer_with_fused_attention_fails_hvp_with_the_way_out_in_the_report():
    """torch has no second derivative through scaled_dot_product_attention's fused CPU kernel:
    the report line says so and keeps activity's advice (sdpa_kernel(SDPBackend.MATH)), which
    it dropped before; under that advice every check passes."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True).double().eval()
    x = randn(1, 3, 4)

    def loss(m, x):
        return m(x).pow(2).mean()

    with pytest.raises(AssertionError, match=r"(?s)hvp\[u0\] on AutoTorch\(\): raised .*sdpa_kernel\(SDPBackend.MATH\)"):
        check(loss, Active(layer), Constant(x), operators=["hvp"], directions=1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def math_loss(m, x):
        with sdpa_kernel(SDPBackend.MATH):
            return loss(m, x)

    report = check(math_loss, Active(layer), Constant(x), directions=1)
    assert report.failed == [] and report.unreliable == []


def test_batchnorm_in_train_mode_is_checked_in_seconds_with_its_full_hessian():
    """42 parameters: small enough for the full Hessian, whose reference was float64 second
    differences of finite differences (over 200 s); it is now finite differences of the
    backend's gradient, as for hvp. Train mode's statistics are written, not read: checked as usual."""
    import time

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh()).train()
    x = randn(8, 4).float()
    start = time.perf_counter()
    report = check(lambda m, x: m(x).pow(2).mean(), Active(model), Constant(x))
    assert time.perf_counter() - start < 20
    assert report.failed == [] and report.unreliable == []
    assert "hessian on AutoTorch() vs the reference's derivative of the gradient" in report.passed


def test_weight_norm_second_derivatives_check_against_a_hand_written_weight_norm():
    """torch's double backward of ``torch._weight_norm`` (2.13) is wrong in its ``v`` rows: the
    Hessian-vector product of the same loss with ``w = g v / |v|`` written out differs, and
    agrees with finite differences of torch's (right) gradient. check must fail hvp exactly
    where torch's second derivative differs from the hand-written one, and pass the gradient."""
    from torch.nn.utils.parametrizations import weight_norm

    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = weight_norm(torch.nn.Linear(4, 4).double())
    x = randn(8, 4)

    def loss(m, x):
        return torch.tanh(m(x)).pow(2).mean()

    b, g, v = (p.detach().clone().requires_grad_() for p in (layer.bias, layer.parametrizations.weight.original0, layer.parametrizations.weight.original1))
    t = [randn(*p.shape, seed=i + 1) for i, p in enumerate((b, g, v))]
    # the independent answer: double backward of the weight norm written out
    grads = torch.autograd.grad(torch.tanh(x @ (g * v / v.norm(dim=1, keepdim=True)).T + b).pow(2).mean(), [b, g, v], create_graph=True)
    by_hand = torch.autograd.grad(sum((d * u).sum() for d, u in zip(grads, t)), [b, g, v])
    twin = weight_norm(torch.nn.Linear(4, 4).double())
    twin.load_state_dict(layer.state_dict())
    params = list(twin.parameters())  # bias, original0 (g), original1 (v), as named_parameters() orders them
    raw = torch.autograd.grad(loss(twin, x), params, create_graph=True)
    torchs = torch.autograd.grad(sum((d * u).sum() for d, u in zip(raw, t)), params)
    torch_wrong = not all(torch.allclose(a, c, rtol=1e-6, atol=1e-9) for a, c in zip(torchs, by_hand))
    try:
        report = check(loss, Active(layer), Constant(x), operators=["gradient", "hvp"])
        failed = set()
    except AssertionError as error:
        failed, report = failing(error), None
    assert failed == ({"hvp"} if torch_wrong else set()), torch_wrong
    if report is not None:
        assert report.unreliable == []
