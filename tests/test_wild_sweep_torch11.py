"""Round 11 of the PyTorch sweep: tensordict (TensorDict as Active and Constant, TensorDictParams,
TensorDictModule), torchrl losses (ClipPPOLoss), torchmetrics metrics inside a model and as a Constant,
a counter on a parameter-free submodule, closures over a module, and as guards Hugging Face T5 with
labels and Mixtral with its router loss, a diffusers UNet2DConditionModel with gradient checkpointing,
zuko flows, torchsde and a torch.export'ed program. Each is compared with torch.autograd.grad (or a
double backward) on an independent copy of the user's objects, and the user's objects are checked
unchanged.

Also tried and fine, not kept: ViT, CLIP (output_hidden_states), Whisper, Wav2Vec2 (CTC has no second
order: a clear error), ViT with gradient checkpointing (reentrant checkpointing is torch's own error:
it refuses torch.autograd.grad), UNet2DModel, spectral_norm/weight_norm parametrizations in train mode,
QAT fake quantization, torch.fx, torch.func.stack_module_state ensembles, nn.TransformerEncoder with
nested tensors (gradient, pushforward, jacobian, under no_grad and inference_mode), torchrl DDPGLoss
with target networks, a LightningModule's training_step with torchmetrics."""

from __future__ import annotations

import copy

import pytest
import torch
import torchmetrics
import torchsde
import transformers
import zuko
from diffusers import UNet2DConditionModel
from tensordict import TensorDict, tensorclass
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictParams
from torch import nn
from torchrl.modules import IndependentNormal, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss

import activity as ad
from activity import Active, Constant

from _sweeps import CLOSE, assert_close_dicts, built, generator, randn, raw_gradient, raw_gradient_of, trainable, untouched

transformers.logging.set_verbosity_error()


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


def _hvp_of(loss, twin, tangent, *args):
    """torch's double backward on ``twin`` (a copy of the user's model the caller made)."""
    names, params = zip(*trainable(twin))
    grads = torch.autograd.grad(loss(twin, *args), params, create_graph=True)
    return dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names])))


def _tangent_for(model):
    return {n: torch.randn(p.shape, generator=generator(k), dtype=p.dtype) for k, (n, p) in enumerate(trainable(model))}


# ------------------------------------------------------------------ tensordict


def test_a_tensordict_is_an_active_pytree_and_a_constant_batch_of_a_prepared_call():
    params = TensorDict({"w": randn(3, 4), "b": randn(4, seed=1), "nested": {"s": randn(2, seed=2)}}, batch_size=[])

    def loss(p, batch):
        return (batch["x"] @ p["w"] + p["b"]).tanh().pow(2).sum() * batch["scale"].sum() + p["nested", "s"].pow(2).sum()

    def batch(seed):
        return TensorDict({"x": randn(5, 3, seed=seed), "scale": randn(5, seed=seed + 1)}, batch_size=[5])

    def want(b):
        leaves = params.clone().apply(lambda t: t.detach().requires_grad_())
        keys = ("w", "b", ("nested", "s"))
        return dict(zip(keys, torch.autograd.grad(loss(leaves, b), [leaves[k] for k in keys])))

    intact = untouched(Active(params), Constant(batch(3)))
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(batch(3)))
    for got, b in ((ad.gradient(loss, Active(params), Constant(batch(3))), batch(3)), (prepared(params, batch(5)), batch(5))):
        assert isinstance(got, TensorDict)
        for key, value in want(b).items():
            torch.testing.assert_close(got[key], value, **CLOSE)
    assert intact()


class _Scaled(nn.Module):
    """A layer whose gain vectors live in a TensorDictParams: its forward reads them from the
    TensorDict it holds, not from its parameter slots."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.gains = TensorDictParams(TensorDict({"a": randn(3, seed=4), "b": randn(3, seed=5)}, []))

    def forward(self, x):
        return (self.lin(x) * self.gains["a"]).sin().sum() + self.gains["b"].pow(2).sum()


def _call(m, x):
    return m(x)


def test_a_tensordictparams_is_differentiated_through_the_tensordict_it_reads():
    """The view gave the module its differentiated tensors in the parameter slots, but left the
    TensorDict the forward reads holding the user's parameters: gains.a and gains.b came back exactly
    zero beside a right lin gradient (and with nothing else Active, a "does not depend" error)."""
    model, x = _seeded(_Scaled), randn(4, 3, seed=6)
    twin = _seeded(_Scaled)  # (a deep copy of the user's model would do too: tensordict copies its own)
    want = raw_gradient_of(_call, twin, x)
    tangent = _tangent_for(model)
    intact = untouched(Active(model), Constant(x))
    prepared = ad.prepare(ad.gradient, _call, Active(model), Constant(x))
    for got in (ad.gradient(_call, Active(model), Constant(x)), prepared(model, x), prepared(model, x)):
        assert_close_dicts(got, want, **CLOSE)
    assert want["gains.a"].abs().min() > 0
    assert_close_dicts(ad.hvp(_call, Active(model), Constant(x), tangent=tangent), _hvp_of(_call, twin, tangent, x), **CLOSE)
    jvp = sum((want[n] * tangent[n]).sum() for n in want)  # the directional derivative, from torch's gradient
    torch.testing.assert_close(ad.pushforward(_call, Active(model), Constant(x), tangent=tangent), jvp, **CLOSE)
    assert intact()


@tensorclass
class _Gains:
    a: torch.Tensor
    b: torch.Tensor


class _HeldInATensorclass(nn.Module):
    """Parameters registered as usual and read through a tensorclass attribute that holds them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.a, self.b = nn.Parameter(randn(3, seed=4)), nn.Parameter(randn(3, seed=5))
        self.gains = _Gains(a=self.a, b=self.b, batch_size=[])

    def forward(self, x):
        return (self.lin(x) * self.gains.a).sin().sum() + self.gains.b.pow(2).sum()


def test_parameters_read_through_a_tensorclass_attribute_are_differentiated():
    """The view rebuilt the tensorclass (a dataclass) but not the TensorDict inside it, which kept
    the user's parameters: a and b came back wrong (only their other uses counted), silently."""
    model, twin, x = _seeded(_HeldInATensorclass), _seeded(_HeldInATensorclass), randn(4, 3, seed=6)
    intact = untouched(Active(model), Constant(x))
    assert_close_dicts(ad.gradient(_call, Active(model), Constant(x)), raw_gradient_of(_call, twin, x), **CLOSE)
    assert intact()


def _ppo_loss():
    actor_net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=IndependentNormal,
        return_log_prob=True,
    )
    critic = ValueOperator(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), in_keys=["observation"])
    return ClipPPOLoss(actor, critic, entropy_coeff=0.01).double()


def _rollout(seed, size=6):
    r = lambda *shape: torch.randn(*shape, generator=generator(seed + len(shape)), dtype=torch.float64)  # noqa: E731
    return TensorDict(
        {"observation": r(size, 4), "action": r(size, 2, 1)[..., 0], "action_log_prob": r(size),
         "advantage": r(size, 1, 1)[..., 0], "value_target": r(size, 1, 1, 1)[..., 0, 0]},
        batch_size=[size],
    )


def _ppo_total(loss_module, rollout):
    out = loss_module(rollout.clone())
    return out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]


def test_a_torchrl_ppo_loss_module_is_differentiated_in_its_tensordictparams():
    """torchrl keeps the actor's and the critic's parameters in TensorDictParams and calls the
    networks with them: activity raised "f's output does not depend on the Active argument(s)"."""
    loss_module = _seeded(_ppo_loss)
    rollouts = [_rollout(1), _rollout(2)]
    intact = untouched(Active(loss_module), Constant(rollouts[0]))
    prepared = ad.prepare(ad.gradient, _ppo_total, Active(loss_module), Constant(rollouts[0]))
    for rollout in rollouts:
        want = raw_gradient(_ppo_total, loss_module, rollout)
        assert_close_dicts(prepared(loss_module, rollout), want, **CLOSE)
        assert all(v.abs().max() > 0 for v in want.values())
    actor_only = ad.gradient(_ppo_total, Active(loss_module, where={"actor_network_params": True, "critic_network_params": False}), Constant(rollouts[0]))
    assert_close_dicts(actor_only, {n: v for n, v in raw_gradient(_ppo_total, loss_module, rollouts[0]).items() if n.startswith("actor")}, **CLOSE)
    assert intact()


# ------------------------------------------------------------------ what f sets on a view


class _Counted(nn.Module):
    """A parameter-free submodule that counts its calls, as an ODE vector field's nfe counter does."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.tanh()


def test_a_counter_on_a_parameter_free_submodule_stays_where_it_was():
    """A submodule without parameters or buffers was run as it is, not viewed: its counter moved
    on the user's module (1 after a gradient), where the same counter on a module with parameters
    stayed at 0, as the docs promise."""
    model = nn.Sequential(nn.Linear(2, 2, dtype=torch.float64), _Counted())
    x = randn(3, 2)
    want = raw_gradient(lambda m, x: m(x).sum(), model, x)
    prepared = ad.prepare(ad.gradient, lambda m, x: m(x).sum(), Active(model), Constant(x))
    assert_close_dicts(ad.gradient(lambda m, x: m(x).sum(), Active(model), Constant(x)), want, **CLOSE)
    assert_close_dicts(prepared(model, x), want, **CLOSE)
    ad.gradient(lambda x, counted: counted(x).sum(), Active(x), Constant(model[1]))  # a Constant module, also
    assert model[1].calls == 0


class _Scored(nn.Module):
    """A regression head with the torchmetrics metrics a LightningModule keeps beside it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        self.mse = torchmetrics.MeanSquaredError().double()
        self.pearson = torchmetrics.PearsonCorrCoef(num_outputs=2).double()

    def training_step(self, batch):
        x, y = batch
        prediction = self.net(x)
        return self.mse(prediction, y) + self.pearson(prediction, y).sum()


def _step(model, batch):
    return model.training_step(batch)


def _scored_batch(seed):
    return randn(6, 3, seed=seed), randn(6, 2, seed=seed + 1)


def test_a_model_holding_torchmetrics_metrics_is_differentiated_and_its_metric_states_kept():
    """torchmetrics wraps each Metric's update and compute in a closure over the metric: any
    module holding a Metric was refused ("a function that reaches a module ... through a
    closure"). The view now holds copies of those closures over its own metrics."""
    model = _seeded(_Scored)
    twin = _seeded(_Scored)
    batches = [_scored_batch(1), _scored_batch(3)]
    tangent = _tangent_for(model)
    intact = untouched(Active(model), Constant(batches[0]))
    prepared = ad.prepare(ad.gradient, _step, Active(model), Constant(batches[0]))
    for batch in batches:
        want = raw_gradient_of(_step, twin, batch)
        assert_close_dicts(prepared(model, batch), want, **CLOSE)
    got = ad.hvp(_step, Active(model), Constant(batches[0]), tangent=tangent)
    assert_close_dicts(got, _hvp_of(_step, _seeded(_Scored), tangent, batches[0]), **CLOSE)
    assert intact()
    assert model.mse._update_count == model.pearson._update_count == 0 and int(model.mse.total) == 0


def test_a_torchmetrics_metric_passed_as_constant_keeps_its_states():
    """A Constant module without buffers ran as it is: calling the metric inside f left its
    update count at 1 and its total at 8 on the user's metric."""
    metric = torchmetrics.MeanSquaredError().double()
    prediction, target = randn(8), randn(8, seed=1)
    got = ad.gradient(lambda p, m, t: m(p, t), Active(prediction), Constant(metric), Constant(target))
    torch.testing.assert_close(got, 2 * (prediction - target) / 8, **CLOSE)
    assert metric._update_count == 0 and int(metric.total) == 0 and float(metric.sum_squared_error) == 0


def test_a_forward_closing_over_a_parameter_free_module_runs_on_the_view():
    """A closure over the module is followed into the view, which is a copy: what the wrapped
    forward sets on the module is the view's."""

    def wrapped(module):
        original = module.forward

        def forward(x):
            module.seen = x.shape[0]  # set through the closure, on the view
            return original(x) * 2

        module.forward = forward
        return module

    model, twin = wrapped(nn.Sequential(nn.Linear(2, 2, dtype=torch.float64), nn.Tanh())), nn.Sequential(nn.Linear(2, 2, dtype=torch.float64), nn.Tanh())
    twin.load_state_dict(model.state_dict())
    x = randn(3, 2)
    want = raw_gradient_of(lambda m, x: 2 * m(x).sum(), twin, x)
    assert_close_dicts(ad.gradient(lambda m, x: m(x).sum(), Active(model), Constant(x)), want, **CLOSE)
    assert not hasattr(model, "seen")


# ------------------------------------------------------------------ guards: libraries that work


def test_t5_with_labels_and_mixtral_with_its_router_loss_match_torch():
    t5 = built(transformers.T5ForConditionalGeneration, transformers.T5Config, vocab_size=32, d_model=16, d_kv=4, d_ff=32,
               num_layers=1, num_decoder_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0)

    def t5_batch(seed):
        return {"input_ids": torch.randint(1, 32, (2, 6), generator=generator(seed)),
                "labels": torch.randint(1, 32, (2, 4), generator=generator(seed + 9))}

    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
                                            max_position_embeddings=16)
        mixtral = transformers.MixtralForCausalLM(config).eval()  # float32: its grouped matmul takes no float64
    ids = torch.randint(0, 32, (2, 6), generator=generator(3))
    loss = lambda m, batch: m(**batch).loss  # noqa: E731
    for model, batches, tolerances in ((t5, [t5_batch(1), t5_batch(2)], CLOSE), (mixtral, [{"input_ids": ids, "labels": ids}], dict(rtol=1e-4, atol=1e-6))):
        intact = untouched(Active(model), Constant(batches[0]))
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(batches[0]))
        for batch in batches:
            assert_close_dicts(prepared(model, batch), raw_gradient(loss, model, batch), **tolerances)
        assert intact()
    with torch.no_grad():
        assert float(mixtral(input_ids=ids, labels=ids).aux_loss) > 0  # the router loss is in the loss


def test_a_diffusers_conditional_unet_with_gradient_checkpointing_matches_torch():
    unet = _seeded(lambda: UNet2DConditionModel(
        sample_size=8, in_channels=2, out_channels=2, layers_per_block=1, block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=6, attention_head_dim=4).double())
    unet.enable_gradient_checkpointing()
    unet.train()
    batch = {"noisy": randn(2, 2, 8, 8, seed=1), "noise": randn(2, 2, 8, 8, seed=2), "t": torch.tensor([3, 7]), "context": randn(2, 3, 6, seed=3)}

    def denoising(m, b):
        return (m(b["noisy"], b["t"], encoder_hidden_states=b["context"]).sample - b["noise"]).pow(2).mean()

    intact = untouched(Active(unet), Constant(batch))
    assert_close_dicts(ad.gradient(denoising, Active(unet), Constant(batch)), raw_gradient(denoising, unet, batch), **CLOSE)
    assert intact()


def test_zuko_flow_log_likelihood_and_a_torchsde_solve_match_torch():
    flow = _seeded(lambda: zuko.flows.NSF(3, 2, transforms=1, hidden_features=[8]).double())
    data = {"x": randn(4, 3, seed=1), "c": randn(4, 2, seed=2)}
    nll = lambda m, b: -m(b["c"]).log_prob(b["x"]).mean()  # noqa: E731
    tangent = _tangent_for(flow)
    assert_close_dicts(ad.gradient(nll, Active(flow), Constant(data)), raw_gradient(nll, flow, data), **CLOSE)
    assert_close_dicts(ad.hvp(nll, Active(flow), Constant(data), tangent=tangent), _hvp_of(nll, copy.deepcopy(flow), tangent, data), **CLOSE)

    class SDE(nn.Module):
        noise_type, sde_type = "diagonal", "ito"

        def __init__(self):
            super().__init__()
            self.drift, self.sigma = nn.Linear(3, 3, dtype=torch.float64), nn.Parameter(torch.full((3,), 0.3, dtype=torch.float64))

        def f(self, t, y):
            return torch.tanh(self.drift(y))

        def g(self, t, y):
            return self.sigma * torch.sigmoid(y)

    sde, ts = _seeded(SDE), torch.linspace(0, 1, 4, dtype=torch.float64)

    def path_loss(m, y0):
        bm = torchsde.BrownianInterval(t0=0.0, t1=1.0, size=(2, 3), dtype=torch.float64, entropy=7)  # the same path each call
        return torchsde.sdeint(m, y0, ts, bm=bm, dt=0.1, method="euler").pow(2).sum()

    y0 = randn(2, 3, seed=3)
    intact = untouched(Active(sde), Constant(y0))
    assert_close_dicts(ad.gradient(path_loss, Active(sde), Constant(y0)), raw_gradient(path_loss, sde, y0), **CLOSE)
    assert intact()


def test_an_exported_program_module_in_train_mode_matches_torch():
    model = _seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double().train())
    xs = [randn(5, 4, seed=s) for s in (1, 2)]
    exported = torch.export.export(model, (xs[0],)).module()
    squared = lambda m, x: m(x).pow(2).sum()  # noqa: E731
    intact = untouched(Active(exported), Constant(xs[0]))
    prepared = ad.prepare(ad.gradient, squared, Active(exported), Constant(xs[0]))
    for x in xs:  # the exported module updates its BatchNorm statistics in place: on the view's copies
        assert_close_dicts(prepared(exported, x), raw_gradient(squared, exported, x), **CLOSE)
    assert intact()


@pytest.mark.parametrize("kind", ["Active", "Constant"])
def test_a_tensordict_module_sequence_takes_new_tensordicts(kind):
    net = _seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double())
    module = TensorDictModule(net, in_keys=["obs"], out_keys=["value"])

    def loss(m, td):
        return m(td.clone())["value"].pow(2).sum()

    tds = [TensorDict({"obs": randn(5, 3, seed=s)}, batch_size=[5]) for s in (1, 2)]
    if kind == "Active":
        prepared = ad.prepare(ad.gradient, loss, Active(module), Constant(tds[0]))
        for td in tds:
            assert_close_dicts(prepared(module, td), raw_gradient(loss, module, td), **CLOSE)
            assert list(td.keys()) == ["obs"]
    else:
        x = randn(3, seed=9)
        shifted = lambda x, m, td: loss(m, td.apply(lambda t: t + x))  # noqa: E731
        prepared = ad.prepare(ad.gradient, shifted, Active(x), Constant(module), Constant(tds[0]))
        for td in tds:
            leaf = x.clone().requires_grad_()
            torch.testing.assert_close(prepared(x, module, td), torch.autograd.grad(shifted(leaf, module, td), leaf)[0], **CLOSE)
