"""The torch.nn catalogue: every model of Flux's cross-backend list and the extra Lux ones.

Every scenario is the gradient of a smooth loss with respect to ``Active(model)``
with ``Constant(input)``. References are float64 finite differences on a copy
of the model, so they must never flake: activations are smooth (tanh, gelu,
sigmoid), and where a layer has a kink (max pooling, Maxout) a constant offset
keeps the winning branch ahead by far more than any finite-difference step.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .._annotations import Active, Constant
from .._imports import optional
from ._scenario import Scenario


def nn_scenarios_torch(seed: int = 0) -> list[Scenario]:
    optional("torch", 'nn_scenarios("torch")')
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, dtype: Any = torch.float32) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator, dtype=dtype)

    def build(make: Callable[[], nn.Module]) -> nn.Module:
        # Construction draws from torch's global RNG: fork it so the user's stream is untouched,
        # then overwrite every parameter from this catalogue's own generator.
        with torch.random.fork_rng(devices=[]):
            model = make()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and ("norm" in name or name.endswith("bn.weight")):
                    p.copy_(1 + randn(*p.shape, scale=0.2, dtype=p.dtype))
                else:
                    fan_in = p.shape[1] * math.prod(p.shape[2:]) if p.dim() > 1 else p.shape[0]
                    p.copy_(randn(*p.shape, scale=1 / math.sqrt(fan_in), dtype=p.dtype))
        return model

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return (out**2).mean() + out.mean()  # type: ignore[no-any-return]

    scenarios: list[Scenario] = []

    def add(name: str, make: Callable[[], nn.Module], x: torch.Tensor, f: Any = loss, train: bool = True, **kw: Any) -> None:
        model = build(make).train(train)
        prep_model = build(make).train(train)
        prep_x = x + 0.5 if x.dtype.is_floating_point else x.flip(0)
        scenarios.append(
            Scenario("gradient", f, (Active(model), Constant(x)), prep_args=(Active(prep_model), Constant(prep_x)), name=name, **kw)
        )

    class Scale(nn.Module):
        def __init__(self, n: Any) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.bias = nn.Parameter(torch.zeros(n))

        def forward(self, x: Any) -> Any:
            return (self.weight * x + self.bias) ** 2

    class Maxout(nn.Module):
        """Max over three tanh branches; the offsets keep one branch ahead by at least 2."""

        def __init__(self) -> None:
            super().__init__()
            self.branches = nn.ModuleList(nn.Linear(5, 4) for _ in range(3))
            self.register_buffer("offset", torch.tensor([0.0, 2.5, 5.0]).reshape(3, 1, 1))

        def forward(self, x: Any) -> Any:
            return torch.stack([torch.tanh(b(x)) for b in self.branches]).add(self.offset).amax(0)  # type: ignore[arg-type]

    class Skip(nn.Module):
        def __init__(self, concat: Any) -> None:
            super().__init__()
            self.inner, self.concat = nn.Linear(2, 2), concat

        def forward(self, x: Any) -> Any:
            y = torch.tanh(self.inner(x))
            return torch.cat([y, x], -1) if self.concat else y + x

    class BilinearSelf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bilinear = nn.Bilinear(2, 2, 3)

        def forward(self, x: Any) -> Any:
            return self.bilinear(x, x)

    class ConvMaxPool(nn.Module):
        """Max pooling after a convolution; a fixed ramp makes each window's winner clear."""

        def __init__(self) -> None:
            super().__init__()
            self.conv, self.pool = nn.Conv2d(2, 2, 3, padding=1), nn.MaxPool2d(2)
            ramp = 3.0 * torch.arange(4.0).reshape(2, 2).repeat(2, 2)
            self.register_buffer("ramp", ramp)

        def forward(self, x: Any) -> Any:
            return self.pool(torch.tanh(self.conv(x)) + self.ramp)  # type: ignore[operator]

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, bias=False, batch_first=True)

        def forward(self, x: Any) -> Any:
            return self.mha(x, x, x)[0]

    class First(nn.Module):
        """A recurrent layer's output sequence (torch returns (output, state))."""

        def __init__(self, *layers: Any) -> None:
            super().__init__()
            self.layers = nn.ModuleList(layers)

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)[0]
            return x

    class Unrolled(nn.Module):
        """A recurrent cell iterated three steps with explicit state."""

        def __init__(self, cell: Any, lstm: Any = False) -> None:
            super().__init__()
            self.cell, self.lstm = cell, lstm

        def forward(self, x: Any) -> Any:
            state = None
            outputs = []
            for t in range(3):
                state = self.cell(x[:, t], state)
                outputs.append(state[0] if self.lstm else state)
            return torch.stack(outputs, 1)

    class ChainedCells(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.GRUCell(3, 4), nn.GRUCell(4, 2)

        def forward(self, x: Any) -> Any:
            h1 = h2 = None
            for t in range(3):
                h1 = self.first(x[:, t], h1)
                h2 = self.second(h1, h2)
            return h2

    def embedding_loss(model: Any, tokens: Any) -> Any:
        return loss(model, tokens)

    # Flux's cross-backend list
    add("linear", lambda: nn.Linear(2, 4), randn(3, 2))
    add("chain_tanh", lambda: nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)), randn(3, 2))
    add("chain_float64", lambda: nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2)).double(), randn(3, 2, dtype=torch.float64))
    add("scale", lambda: Scale(4), randn(3, 4))
    add("conv2d", lambda: nn.Conv2d(2, 3, 3), randn(1, 2, 3, 3))
    add("conv2d_chain", lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Conv2d(3, 1, 3), nn.Tanh()), randn(1, 2, 5, 5))
    add("conv2d_same_avgpool", lambda: nn.Sequential(nn.Conv2d(2, 2, 4, padding="same"), nn.AvgPool2d(5, padding=2)), randn(2, 2, 5, 5))
    add("maxout", Maxout, randn(2, 5))
    add("skipconnection_concat", lambda: Skip(True), randn(3, 2))
    add("bilinear", BilinearSelf, randn(1, 2))
    add("convtranspose2d", lambda: nn.ConvTranspose2d(3, 2, 3, stride=2), randn(1, 3, 5, 5, scale=0.5))
    add("layernorm", lambda: nn.LayerNorm(2), randn(10, 2))
    add("batchnorm1d_train", lambda: nn.BatchNorm1d(2), randn(10, 2))
    add("multihead_attention", Attention, randn(2, 4, 8))
    add("rnn", lambda: First(nn.RNN(3, 2, batch_first=True)), randn(2, 4, 3))
    add("lstm", lambda: First(nn.LSTM(3, 5, batch_first=True)), randn(2, 4, 3))
    add("gru", lambda: First(nn.GRU(3, 5, batch_first=True)), randn(2, 6, 3))
    add("rnn_stacked", lambda: First(nn.RNN(3, 4, batch_first=True), nn.RNN(4, 3, batch_first=True)), randn(2, 4, 3))
    add("lstm_stacked", lambda: First(nn.LSTM(3, 5, batch_first=True), nn.LSTM(5, 3, batch_first=True)), randn(2, 4, 3))
    # the extra Lux models
    add("linear_gelu_nobias", lambda: nn.Sequential(nn.Linear(3, 4, bias=False), nn.GELU()), randn(3, 3))
    add("conv2d_gelu_nobias", lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding="same", bias=False), nn.GELU()), randn(1, 2, 4, 4))
    add("conv2d_maxpool", ConvMaxPool, randn(1, 2, 4, 4))
    add("skipconnection_residual", lambda: Skip(False), randn(3, 2))
    add("batchnorm1d_eval", lambda: nn.BatchNorm1d(2), randn(10, 2), train=False)
    add("linear_batchnorm_train", lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), randn(6, 3))
    add("conv2d_batchnorm2d_train", lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3)), randn(2, 2, 4, 4))
    add("batchnorm1d_no_running_stats", lambda: nn.BatchNorm1d(3, track_running_stats=False), randn(5, 3))
    add("groupnorm", lambda: nn.GroupNorm(2, 4), randn(3, 4, 5))
    add("layernorm_3d", lambda: nn.LayerNorm((1, 1, 3)), randn(2, 1, 1, 3))
    add("instancenorm2d", lambda: nn.InstanceNorm2d(3, affine=True), randn(2, 3, 4, 4))
    add("embedding", lambda: nn.Sequential(nn.Embedding(10, 3), nn.Linear(3, 2)), torch.tensor([[1, 4, 7], [0, 9, 4]]), f=embedding_loss)
    add("rnn_cell_unrolled", lambda: Unrolled(nn.RNNCell(3, 4)), randn(2, 3, 3))
    add("lstm_cell_unrolled", lambda: Unrolled(nn.LSTMCell(3, 4), lstm=True), randn(2, 3, 3))
    add("gru_cell_unrolled", lambda: Unrolled(nn.GRUCell(3, 4)), randn(2, 3, 3))
    add("gru_cells_chained", ChainedCells, randn(2, 3, 3))
    return scenarios
