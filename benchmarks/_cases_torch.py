"""PyTorch cases: prepared `activity` calls against hand-written `torch.autograd` / `torch.func`.

Networks are `nn.Module`s passed as `Active(model)`, so ours returns a dict keyed
like `named_parameters()`; the raw tuple of gradients is arranged into the same
dict only when checking, never inside the timed call.
"""

from __future__ import annotations

import torch
from torch import nn

import activity as ad
from activity import Active, Constant

from ._case import (
    FIRST_ORDER_TARGET, HVP_TARGET, PREPARED, SCALING, SMALL_STEP_TARGET, TORCH_HESSIAN_TARGET, TORCH_JACOBIAN_TARGET,
    UNPREPARED, UNPREPARED_TARGET, Case,
)

DOUBLE_BACKWARD = "double backward (`torch.autograd.grad` twice)"

FRAMEWORK = "torch"
BATCH = 32


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def cnn() -> nn.Module:
    """16x16 single-channel images: conv 3x3 (4), conv 3x3 stride 2 (8), linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(),
        nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.Tanh(),
        nn.Flatten(), nn.Linear(8 * 8 * 8, 1),
    )


LSTM_INPUT, LSTM_HIDDEN, LSTM_STEPS = 8, 32, 10


class LSTMRegressor(nn.Module):
    """`nn.LSTM` over (steps, batch, input), a linear head on the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(LSTM_INPUT, LSTM_HIDDEN)
        self.head = nn.Linear(LSTM_HIDDEN, 1)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(xs)
        return self.head(h[-1])


def mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _data(*shape: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(*shape)


def _by_name(model: nn.Module):
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return lambda grads: dict(zip(names, grads))


def _first_order_target(width: int | None) -> float:
    """The issue's torch targets: 1.05 from width 64 on, 1.10 below (a step of under 100 us)."""
    return SMALL_STEP_TARGET if width is not None and width < 64 else FIRST_ORDER_TARGET


def _gradient_case(model_name, model, x, size_label, family=PREPARED, raw_model=None, loss=mse, width=None) -> Case:
    """``raw_model``: a twin the raw call differentiates, for a module whose forward changes it
    (train-mode BatchNorm statistics: activity's view never changes the user's module)."""
    raw_model = model if raw_model is None else raw_model
    params = [p for p in raw_model.parameters() if p.requires_grad]
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    return Case(
        FRAMEWORK, "gradient", family, model_name, parameter_count(model), size_label,
        raw=lambda: torch.autograd.grad(loss(raw_model, x), params),
        ours=lambda: prepared(model, x),
        raw_as_ours=_by_name(raw_model),
        target=_first_order_target(width),
    )


class ResNetBlock(nn.Module):
    """conv-BatchNorm-ReLU-conv-BatchNorm plus the identity, ReLU; in train mode (batch statistics)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + x)


def resnet_block() -> nn.Module:
    torch.manual_seed(0)
    return ResNetBlock().train()


LM_VOCAB, LM_BATCH, LM_LENGTH = 64, 4, 12


def language_models() -> dict[str, nn.Module]:
    """Tiny Hugging Face GPT-2 and LLaMA built from configs (random weights, eager attention),
    or nothing where transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return {}
    configs = {
        "GPT-2 (tiny, HF)": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=LM_VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=1)),
        "LLaMA (tiny, HF)": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=LM_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=2)),
    }
    models = {}
    for name, (model_class, config) in configs.items():
        config._attn_implementation = "eager"  # plain differentiable ops: second order too
        torch.manual_seed(0)
        model = model_class(config).eval()
        model.loss_type = "ForCausalLM"
        models[name] = model
    return models


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _double_backward(loss, model, x, params, tangents):
    """The hand-written reverse-over-reverse product: a gradient with its graph, then its pullback."""
    grads = torch.autograd.grad(loss(model, x), params, create_graph=True)
    return torch.autograd.grad(grads, params, tangents)


def language_model_cases() -> list[Case]:
    cases = []
    torch.manual_seed(1)
    ids = torch.randint(3, LM_VOCAB, (LM_BATCH, LM_LENGTH))
    for name, model in language_models().items():
        label = f"{LM_BATCH}x{LM_LENGTH} tokens"
        cases.append(_gradient_case(name, model, ids, label, loss=lm_loss))
        if name.startswith("GPT-2"):
            params = [p for p in model.parameters() if p.requires_grad]
            tangents = [torch.ones_like(p) for p in params]
            tangent = _by_name(model)(tangents)
            hvp = ad.prepare(ad.hvp, lm_loss, Active(model), Constant(ids), tangent=tangent)
            cases.append(Case(
                FRAMEWORK, "hvp", PREPARED, name, parameter_count(model), label,
                raw=lambda model=model, params=params, t=tangents: _double_backward(lm_loss, model, ids, params, t),
                ours=lambda model=model, t=tangent, prepared=hvp: prepared(model, ids, tangent=t),
                raw_as_ours=_by_name(model), target=HVP_TARGET, raw_name=DOUBLE_BACKWARD, rtol=1e-3, atol=1e-4,
            ))
    return cases


# Plain tensors for the forward-mode case: `torch.func.jvp` differentiates functions of tensors.
def functional_mlp(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    h = torch.tanh(h @ params["w2"] + params["b2"])
    return h @ params["w3"] + params["b3"]


def functional_mlp_params(width: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    scale = width ** -0.5
    return {
        "w1": torch.randn(width, width) * scale, "b1": torch.zeros(width),
        "w2": torch.randn(width, width) * scale, "b2": torch.zeros(width),
        "w3": torch.randn(width, 1) * scale, "b3": torch.zeros(1),
    }


def vector_problem(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(n), torch.randn(n, n) * n ** -0.5


def vector_map(v: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ v)


def vector_loss(v: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ v).pow(2).sum()


def _vector_double_backward(v: torch.Tensor, a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    v = v.detach().requires_grad_()
    (grad,) = torch.autograd.grad(vector_loss(v, a), v, create_graph=True)
    return torch.autograd.grad(grad, v, t)[0]


def prepared_cases(mlp_widths, vector_sizes, networks: bool = True) -> list[Case]:
    cases = []
    for width in mlp_widths:
        model, x, label = mlp(width), _data(BATCH, width), f"width {width}"
        size = parameter_count(model)
        cases.append(_gradient_case("MLP", model, x, label, width=width))

        params = [p for p in model.parameters() if p.requires_grad]
        cotangent = torch.ones(BATCH, 1)
        pullback = ad.prepare(ad.pullback, forward, Active(model), Constant(x), cotangent=cotangent)
        cases.append(Case(
            FRAMEWORK, "pullback", PREPARED, "MLP", size, label,
            raw=lambda model=model, x=x, params=params, ct=cotangent: torch.autograd.grad(model(x), params, ct),
            ours=lambda model=model, x=x, ct=cotangent, prepared=pullback: prepared(model, x, cotangent=ct),
            raw_as_ours=_by_name(model), target=_first_order_target(width),
        ))

        tangents = [torch.ones_like(p) for p in params]
        mlp_hvp = ad.prepare(ad.hvp, mse, Active(model), Constant(x), tangent=_by_name(model)(tangents))
        cases.append(Case(
            FRAMEWORK, "hvp", PREPARED, "MLP", size, label,
            raw=lambda model=model, x=x, params=params, t=tangents: _double_backward(mse, model, x, params, t),
            ours=lambda model=model, x=x, t=_by_name(model)(tangents), prepared=mlp_hvp: prepared(model, x, tangent=t),
            raw_as_ours=_by_name(model), target=HVP_TARGET, raw_name=DOUBLE_BACKWARD,
        ))

        fparams = functional_mlp_params(width)
        tangent = {k: torch.ones_like(v) for k, v in fparams.items()}
        pushforward = ad.prepare(ad.pushforward, functional_mlp, Active(fparams), Constant(x), tangent=tangent)
        cases.append(Case(
            FRAMEWORK, "pushforward", PREPARED, "MLP (tensors)", size, label,
            raw=lambda p=fparams, x=x, t=tangent: torch.func.jvp(lambda p: functional_mlp(p, x), (p,), (t,))[1],
            ours=lambda p=fparams, x=x, t=tangent, prepared=pushforward: prepared(p, x, tangent=t),
            target=None if width < 64 else FIRST_ORDER_TARGET,
        ))

    if networks:
        cases.append(_gradient_case("CNN", cnn(), _data(BATCH, 1, 16, 16), "16x16 images"))
        cases.append(_gradient_case("LSTM", LSTMRegressor(), _data(LSTM_STEPS, BATCH, LSTM_INPUT), f"{LSTM_STEPS} steps"))
        cases.append(_gradient_case("ResNet block (BatchNorm, train)", resnet_block(), _data(BATCH, 8, 8, 8), "8x8x8 maps",
                                    raw_model=resnet_block()))
        cases += language_model_cases()

    for n in vector_sizes:
        v, a = vector_problem(n)
        label = f"n {n}"
        jacobian = ad.prepare(ad.jacobian, vector_map, Active(v), Constant(a))
        cases.append(Case(
            FRAMEWORK, "jacobian", PREPARED, "tanh(A v)", n, label,
            raw=lambda v=v, a=a: torch.func.jacrev(vector_map)(v, a),
            ours=lambda v=v, a=a, prepared=jacobian: prepared(v, a),
            target=TORCH_JACOBIAN_TARGET,
        ))
        hessian = ad.prepare(ad.hessian, vector_loss, Active(v), Constant(a))
        cases.append(Case(
            FRAMEWORK, "hessian", PREPARED, "sum tanh(A v)^2", n, label,
            raw=lambda v=v, a=a: torch.func.hessian(vector_loss)(v, a),
            ours=lambda v=v, a=a, prepared=hessian: prepared(v, a),
            target=TORCH_HESSIAN_TARGET,
        ))
        t = torch.ones(n)
        hvp = ad.prepare(ad.hvp, vector_loss, Active(v), Constant(a), tangent=t)
        cases.append(Case(
            FRAMEWORK, "hvp", PREPARED, "sum tanh(A v)^2", n, label,
            raw=lambda v=v, a=a, t=t: torch.func.jvp(lambda v: torch.func.grad(vector_loss)(v, a), (v,), (t,))[1],
            ours=lambda v=v, a=a, t=t, prepared=hvp: prepared(v, a, tangent=t),
            target=HVP_TARGET,
        ))
        cases.append(Case(
            FRAMEWORK, "hvp", PREPARED, "sum tanh(A v)^2", n, label,
            raw=lambda v=v, a=a, t=t: _vector_double_backward(v, a, t),
            ours=lambda v=v, a=a, t=t, prepared=hvp: prepared(v, a, tangent=t),
            target=HVP_TARGET, raw_name=DOUBLE_BACKWARD,
        ))
    return cases


def unprepared_cases(mlp_widths) -> list[Case]:
    """Without `prepare`: every call re-inspects the arguments; the raw call is the same autograd call."""
    cases = []
    backend = ad.AutoTorch()
    for width in mlp_widths:
        model, x, label = mlp(width), _data(BATCH, width), f"width {width}"
        params = [p for p in model.parameters() if p.requires_grad]
        size, by_name = parameter_count(model), _by_name(model)
        cases.append(Case(
            FRAMEWORK, "gradient", UNPREPARED, "MLP", size, label,
            raw=lambda model=model, x=x, params=params: torch.autograd.grad(mse(model, x), params),
            ours=lambda model=model, x=x: ad.gradient(mse, Active(model), Constant(x), backend=backend),
            raw_as_ours=by_name, target=UNPREPARED_TARGET if width < 64 else None,
        ))
        cotangent = torch.ones(BATCH, 1)
        cases.append(Case(
            FRAMEWORK, "pullback", UNPREPARED, "MLP", size, label,
            raw=lambda model=model, x=x, params=params, ct=cotangent: torch.autograd.grad(model(x), params, ct),
            ours=lambda model=model, x=x, ct=cotangent: ad.pullback(
                forward, Active(model), Constant(x), cotangent=ct, backend=backend),
            raw_as_ours=by_name,
        ))
    return cases


def scaling_cases(mlp_widths) -> list[Case]:
    return [_gradient_case("MLP", mlp(w), _data(BATCH, w), f"width {w}", family=SCALING, width=w) for w in mlp_widths]



def saved_bytes(call) -> int:
    """Bytes of the tensors autograd saves for the backward pass while ``call()`` runs, each
    storage once: what the tape holds at its peak, the end of the forward pass."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return sum(storages.values())


def memory_case(width: int) -> tuple[int, int]:
    """(raw, ours): bytes saved for backward by `torch.autograd.grad` and by the prepared gradient
    of the MLP of ``width`` (the parameters themselves are saved by both: leaves are views)."""
    model, x = mlp(width), _data(BATCH, width)
    params = [p for p in model.parameters() if p.requires_grad]
    prepared = ad.prepare(ad.gradient, mse, Active(model), Constant(x))
    return (saved_bytes(lambda: torch.autograd.grad(mse(model, x), params)), saved_bytes(lambda: prepared(model, x)))
