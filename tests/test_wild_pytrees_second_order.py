"""Pytrees other libraries define, and `SecondOrder` with a finite-difference outer backend.

Part 1: Hugging Face ``ModelOutput`` (a dataclass that is an ``OrderedDict``,
registered with torch's pytree), types registered only with torch's pytree or
only with optree's global registry, and unregistered dataclasses that are
mappings or have their own ``__new__``: each round-trips through activity's
trees with its own type, keys and values, as aux, Constant and Active.

Part 2: ``SecondOrder(AutoFiniteDifferences(), AutoTorch())`` on a module
with BatchNorm buffers and a frozen parameter (eval and train mode), and
``SecondOrder(AutoFiniteDifferences(), AutoJAX())`` on a JAX function, for
every operator, against hand-written torch.autograd / analytic answers.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from optree.registry import __GLOBAL_NAMESPACE as OPTREE_GLOBAL
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput, CausalLMOutputWithCrossAttentions

import activity as ad
from activity import Active, Constant
from activity import _tree as tree

# ============================================================================ part 1: foreign pytrees


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _causal_lm() -> tuple[Any, list, list[str]]:
    """An output, its leaves in flatten order, their paths. None fields are not items."""
    loss, logits, h0, h1 = _randn(0), _randn(1, 2, 5), _randn(2, 2, 3), _randn(3, 2, 3)
    out = CausalLMOutputWithCrossAttentions(loss=loss, logits=logits, hidden_states=(h0, h1))
    return out, [loss, logits, h0, h1], ["['loss']", "['logits']", "['hidden_states'][0]", "['hidden_states'][1]"]


def _base_model() -> tuple[Any, list, list[str]]:
    last, attention = _randn(4, 2, 3), _randn(5, 1, 2, 2)
    out = BaseModelOutput(last_hidden_state=last, attentions=(attention,))
    return out, [last, attention], ["['last_hidden_state']", "['attentions'][0]"]


HF_OUTPUTS = {"CausalLMOutputWithCrossAttentions": _causal_lm, "BaseModelOutput": _base_model}


@pytest.mark.parametrize("name", list(HF_OUTPUTS))
def test_model_output_round_trips_with_its_type_keys_and_values(name):
    out, expected_leaves, expected_paths = HF_OUTPUTS[name]()
    leaves, spec = tree.flatten(out)
    assert len(leaves) == len(expected_leaves) and all(a is b for a, b in zip(leaves, expected_leaves))
    assert tree.leaf_paths(out) == expected_paths

    rebuilt = tree.unflatten(spec, [2 * leaf for leaf in leaves])
    assert type(rebuilt) is type(out)
    assert list(rebuilt.keys()) == list(out.keys())
    for key in out.keys():
        got, want = rebuilt[key], out[key]
        if isinstance(want, tuple):
            assert type(got) is tuple and len(got) == len(want)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, 2 * w)
        else:
            torch.testing.assert_close(got, 2 * want)
    # None fields stay None and stay out of the items, as torch's pytree keeps them.
    for field in dataclasses.fields(out):
        if getattr(out, field.name) is None:
            assert getattr(rebuilt, field.name) is None and field.name not in rebuilt


def test_model_output_structures_compare_and_hash_by_their_keys():
    """Prepared signatures compare structures and use them as cache keys."""
    first, _, _ = _causal_lm()
    hidden = (_randn(8, 1), _randn(7, 1))
    second = CausalLMOutputWithCrossAttentions(loss=_randn(9), logits=_randn(9, 2, 5), hidden_states=hidden)
    no_loss = CausalLMOutputWithCrossAttentions(logits=_randn(9, 2, 5), hidden_states=hidden)
    spec_1, spec_2, spec_3 = (tree.flatten(o)[1] for o in (first, second, no_loss))
    assert spec_1 == spec_2 and hash(spec_1) == hash(spec_2)
    assert spec_1 != spec_3


def _lm_loss(w, x):
    logits = x @ w
    loss = torch.logsumexp(logits, dim=-1).sum() + (logits**2).mean()
    return loss, logits


@pytest.mark.parametrize("backend", [ad.AutoTorch(), ad.AutoFiniteDifferences()], ids=repr)
def test_gradient_returns_a_model_output_aux_with_its_type(backend):
    w, x = _randn(10, 3, 4), _randn(11, 5, 3)

    def f(w, x):
        loss, logits = _lm_loss(w, x)
        return loss, CausalLMOutput(loss=loss, logits=logits)

    w_leaf = w.clone().requires_grad_()
    loss, logits = _lm_loss(w_leaf, x)
    (expected,) = torch.autograd.grad(loss, w_leaf)

    grad, aux = ad.gradient(f, Active(w), Constant(x), backend=backend, has_aux=True)
    (value, aux_too), grad_too = ad.value_and_gradient(f, Active(w), Constant(x), backend=backend, has_aux=True)
    for g in (grad, grad_too):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value.double(), loss.detach().double(), rtol=1e-6, atol=1e-6)
    for out in (aux, aux_too):
        assert type(out) is CausalLMOutput and list(out.keys()) == ["loss", "logits"]
        assert out.attentions is None and out.hidden_states is None
        torch.testing.assert_close(out.logits.detach().double(), logits.detach().double(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["loss"].detach().double(), loss.detach().double(), rtol=1e-6, atol=1e-6)


# f(w, out) = sum(w * last_hidden_state) + sum(w * hidden_states[1]): gradient last + hidden[1].
def _uses_output(w, out):
    assert type(out) is BaseModelOutput, type(out)
    assert list(out.keys()) == ["last_hidden_state", "hidden_states"] and out.attentions is None
    return (w * out.last_hidden_state).sum() + (w * out.hidden_states[1]).sum()


FRAMEWORKS = {
    "torch": (ad.AutoTorch(), lambda a: a),
    "jax": (ad.AutoJAX(), lambda a: jnp.asarray(a.numpy())),
    "numpy-FD": (ad.AutoFiniteDifferences(), lambda a: a.numpy().astype(np.float64)),
}


def _output_for(seed: int, to: Any) -> BaseModelOutput:
    return BaseModelOutput(
        last_hidden_state=to(_randn(seed, 2, 3)), hidden_states=(to(_randn(seed + 1, 2, 3)), to(_randn(seed + 2, 2, 3)))
    )


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_model_output_in_a_constant_reaches_f_with_its_type(framework):
    backend, to = FRAMEWORKS[framework]
    w = to(_randn(20, 2, 3))
    out = _output_for(30, to)
    expected = np.asarray(out.last_hidden_state) + np.asarray(out.hidden_states[1])
    grad = ad.gradient(_uses_output, Active(w), Constant(out), backend=backend)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-6)

    # Prepared on one output, called with another: the new values, never the preparation's.
    prepared = ad.prepare(ad.gradient, _uses_output, Active(w), Constant(_output_for(40, to)), backend=backend)
    grad = prepared(w, out)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-6)


def test_gradient_of_an_active_model_output_is_that_model_output():
    out = _output_for(50, lambda a: a)

    def f(out):
        return (out.last_hidden_state**2).sum() + (out.hidden_states[0] * out.hidden_states[1]).sum()

    grad = ad.gradient(f, Active(out), backend=ad.AutoTorch())
    assert type(grad) is BaseModelOutput and list(grad.keys()) == ["last_hidden_state", "hidden_states"]
    torch.testing.assert_close(grad.last_hidden_state, 2 * out.last_hidden_state)
    torch.testing.assert_close(grad.hidden_states[0], out.hidden_states[1])
    torch.testing.assert_close(grad.hidden_states[1], out.hidden_states[0])


def test_tiny_gpt2_output_as_aux_and_constant():
    """The real thing: a Hugging Face model's own output (with its DynamicCache) as aux and as a Constant."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=11, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))

    def f(m, ids):
        out = m(input_ids=ids, labels=ids)
        return out.loss, out

    expected_out = model(input_ids=ids, labels=ids)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    expected = torch.autograd.grad(expected_out.loss, [p for p in model.parameters() if p.requires_grad])
    grad, aux = ad.gradient(f, Active(model), Constant(ids), has_aux=True, backend=ad.AutoTorch())
    assert list(grad) == names
    for name, want in zip(names, expected):
        torch.testing.assert_close(grad[name], want)
    assert type(aux) is type(expected_out) and list(aux.keys()) == list(expected_out.keys())
    torch.testing.assert_close(aux.logits.detach(), expected_out.logits.detach())

    def g(m, ids, previous):
        assert type(previous) is type(expected_out)
        return m(input_ids=ids, labels=ids).loss * previous.loss

    grad = ad.gradient(g, Active(model), Constant(ids), Constant(aux), backend=ad.AutoTorch())
    scale = expected_out.loss.detach()
    for name, want in zip(names, expected):
        torch.testing.assert_close(grad[name], want * scale)


# ---------------------------------------------------------------------------- torch-only and optree-only types


@dataclasses.dataclass
class TorchPair:
    """Registered only with torch's pytree, which keeps ``tag`` in the context and drops
    ``note``: flattened field by field it would have four children, not two."""

    scale: Any
    offset: Any
    tag: str = "t"
    note: Any = None
    rebuilt = 0  # class attribute: how often torch's unflatten ran


def _pair_unflatten(values: Any, context: list) -> TorchPair:
    TorchPair.rebuilt += 1
    scale, offset = values
    return TorchPair(scale, offset, context[0])


torch_pytree.register_pytree_node(
    TorchPair,
    lambda p: ([p.scale, p.offset], [p.tag]),  # a list context: unhashable, as torch allows
    _pair_unflatten,
    flatten_with_keys_fn=lambda p: (
        [(torch_pytree.GetAttrKey("scale"), p.scale), (torch_pytree.GetAttrKey("offset"), p.offset)],
        [p.tag],
    ),
)


class TorchBox:
    """Registered only with torch's pytree, without keys: its paths are positions."""

    def __init__(self, items: list):
        self.items = list(items)


torch_pytree.register_pytree_node(TorchBox, lambda b: (b.items, None), lambda values, _: TorchBox(values))


def test_type_registered_only_with_torch_pytree_round_trips():
    scale, offset = _randn(60, 3), _randn(61, 3)
    pair = TorchPair(scale, offset, tag="mine", note="dropped by torch's flatten")
    leaves, spec = tree.flatten(pair)
    assert len(leaves) == 2 and leaves[0] is scale and leaves[1] is offset
    assert tree.leaf_paths(pair) == [".scale", ".offset"]

    before = TorchPair.rebuilt
    rebuilt = tree.unflatten(spec, [offset, scale])
    assert TorchPair.rebuilt == before + 1, "torch's own unflatten must rebuild the node"
    assert type(rebuilt) is TorchPair and rebuilt.tag == "mine" and rebuilt.note is None
    assert rebuilt.scale is offset and rebuilt.offset is scale

    other = tree.flatten(TorchPair(_randn(62, 3), _randn(63, 3), tag="mine"))[1]
    assert spec == other and hash(spec) == hash(other)
    assert spec != tree.flatten(TorchPair(scale, offset, tag="theirs"))[1]

    box = TorchBox([scale, (offset, "x")])
    leaves, spec = tree.flatten(box)
    assert len(leaves) == 3 and tree.leaf_paths(box) == ["[0]", "[1][0]", "[1][1]"]
    rebuilt = tree.unflatten(spec, leaves)
    assert type(rebuilt) is TorchBox and rebuilt.items[0] is scale and rebuilt.items[1] == (offset, "x")


def test_gradient_of_a_torch_pytree_active_is_that_type():
    scale, offset, x = _randn(64, 3), _randn(65, 3), _randn(66, 4, 3)

    def f(p):
        assert type(p) is TorchPair and p.tag == "mine"
        return torch.tanh(x * p.scale + p.offset).sum()

    s, o = scale.clone().requires_grad_(), offset.clone().requires_grad_()
    expected = torch.autograd.grad(torch.tanh(x * s + o).sum(), (s, o))
    grad = ad.gradient(f, Active(TorchPair(scale, offset, tag="mine")), backend=ad.AutoTorch())
    assert type(grad) is TorchPair
    torch.testing.assert_close(grad.scale, expected[0])
    torch.testing.assert_close(grad.offset, expected[1])


@dataclasses.dataclass
class OptreePair:
    """Registered only in optree's global namespace, keeping two of its three fields."""

    a: Any
    b: Any
    note: Any = None


optree.register_pytree_node(
    OptreePair,
    lambda p: ((p.a, p.b), None, ("a", "b")),
    lambda _, children: OptreePair(*children, note="rebuilt by optree"),
    namespace=OPTREE_GLOBAL,
)


def test_type_registered_only_with_optree_globally_round_trips():
    a, b = jnp.arange(3.0), jnp.ones(2)
    pair = OptreePair(a, b, note=np.zeros(7))  # fields-based flattening would make note a third leaf
    leaves, spec = tree.flatten(pair)
    assert len(leaves) == 2 and leaves[0] is a and leaves[1] is b
    rebuilt = tree.unflatten(spec, [b, a])
    assert type(rebuilt) is OptreePair and rebuilt.note == "rebuilt by optree"
    assert rebuilt.a is b and rebuilt.b is a
    paths = tree.leaf_paths(pair)
    assert len(paths) == 2 and paths[0] != paths[1]

    grad = ad.gradient(lambda p: jnp.sum(p.a**2) + jnp.sum(p.a[:2] * p.b), Active(pair), backend=ad.AutoJAX())
    assert type(grad) is OptreePair
    np.testing.assert_allclose(np.asarray(grad.a), [0.0 + 1.0, 2.0 + 1.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad.b), [0.0, 1.0], rtol=1e-6)


# ---------------------------------------------------------------------------- unregistered dataclasses


@dataclasses.dataclass
class Record(dict):
    """An unregistered dataclass that is a dict (like a ModelOutput torch does not know):
    its items are the non-None fields."""

    first: Any = None
    second: Any = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


@dataclasses.dataclass(frozen=True)
class Tagged:
    """An unregistered frozen dataclass whose ``__new__`` needs an argument."""

    value: Any
    label: str = "x"
    size: int = dataclasses.field(default=0, init=False)

    def __new__(cls, value: Any, label: str = "x"):
        return super().__new__(cls)


def test_unregistered_mapping_dataclass_round_trips_by_its_items():
    first = np.arange(3.0)
    record = Record(first=first)
    leaves, spec = tree.flatten(record)
    assert len(leaves) == 1 and leaves[0] is first and tree.leaf_paths(record) == ["['first']"]
    rebuilt = tree.unflatten(spec, [2 * first])
    assert type(rebuilt) is Record and list(rebuilt) == ["first"] and rebuilt.second is None
    np.testing.assert_array_equal(rebuilt["first"], 2 * first)
    np.testing.assert_array_equal(rebuilt.first, 2 * first)

    grad = ad.gradient(lambda r: np.sum(r["first"] ** 3), Active(record), backend=ad.AutoFiniteDifferences())
    assert type(grad) is Record
    np.testing.assert_allclose(grad["first"], 3 * first**2, rtol=1e-8, atol=1e-8)


def test_unregistered_mapping_dataclass_with_a_non_string_key_says_to_register_it():
    record = Record(first=np.ones(2))
    dict.__setitem__(record, 1, np.ones(2))
    with pytest.raises(TypeError, match=r"non-string key 1.*Register Record as a pytree node"):
        ad.gradient(lambda r: np.sum(r["first"]), Active(record), backend=ad.AutoFiniteDifferences())


def test_unregistered_dataclass_with_its_own_new_round_trips():
    value = np.linspace(0.5, 1.5, 3)
    tagged = Tagged(value, label="kept")
    leaves, spec = tree.flatten(tagged)
    assert tree.leaf_paths(tagged) == [".value", ".label", ".size"]
    rebuilt = tree.unflatten(spec, [2 * value, "kept", 0])
    assert type(rebuilt) is Tagged and rebuilt.label == "kept" and rebuilt.size == 0
    np.testing.assert_array_equal(rebuilt.value, 2 * value)

    grad = ad.gradient(lambda t: np.sum(np.log(t.value)), Active(tagged), backend=ad.AutoFiniteDifferences())
    assert type(grad) is Tagged and grad.label is None
    np.testing.assert_allclose(grad.value, 1 / value, rtol=1e-8, atol=1e-8)


# ============================================================================ part 2: SecondOrder(FD, ...)

FD_TORCH = ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoTorch())
FD_JAX = ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoJAX())
TORCH_TOL = dict(rtol=2e-5, atol=2e-6)  # float32 results of float64 finite differences, against float64 autograd


def _model(seed: int, training: bool) -> nn.Module:
    """Linear -> BatchNorm (non-trivial running statistics) -> tanh -> Linear with a frozen bias."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].running_mean.copy_(_randn(seed + 1, 4) * 0.5)
        model[1].running_var.copy_(_randn(seed + 2, 4).abs() + 0.5)
        model[1].weight.copy_(_randn(seed + 3, 4) * 0.3 + 1.0)
        model[1].bias.copy_(_randn(seed + 4, 4) * 0.3)
    model[3].bias.requires_grad_(False)
    return model.train(training)


def _scalar_loss(m, x):
    return (m(x) ** 2).sum() + m(x).sum()


def _outputs(m, x):
    return m(x).squeeze(-1)


def _shifted(a, m, x):
    return m(torch.sin(a * x)).squeeze(-1)  # not a plain scaling, which BatchNorm would cancel


class Reference:
    """Hand-written torch.autograd on a float64 copy of the model, through functional_call."""

    def __init__(self, model: nn.Module, x: torch.Tensor):
        self.model = copy.deepcopy(model).double()
        self.x = x.double()
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = tuple(dict(self.model.named_parameters())[n].detach().clone() for n in self.names)

    def state(self, params: tuple) -> dict:
        buffers = {k: b.clone() for k, b in self.model.named_buffers()}  # train mode writes into them
        return {**buffers, **dict(zip(self.names, params))}

    def module(self, params: tuple) -> Any:
        return lambda inp: torch.func.functional_call(self.model, self.state(params), (inp,))

    def of_params(self, f: Any) -> Any:
        return lambda *params: f(self.module(params), self.x)

    def as_dict(self, values: tuple) -> dict:
        return dict(zip(self.names, values))

    def tangent(self, seed: int) -> tuple:
        return tuple(_randn(seed + i, *p.shape) for i, p in enumerate(self.params))


def _leaves(params: tuple) -> tuple:
    return tuple(p.clone().requires_grad_() for p in params)


def _torch_cases(ref: Reference) -> dict:
    """operator name -> (call on FD_TORCH, expected result in float64)."""
    model_t = ref.tangent(100)
    tangent = ref.as_dict(tuple(t.float() for t in model_t))
    tangent64 = tuple(t.double() for t in model_t)
    cotangent = _randn(120, ref.x.shape[0])
    a = torch.tensor(0.7)
    loss_of, outputs_of = ref.of_params(_scalar_loss), ref.of_params(_outputs)

    def grad():
        params = _leaves(ref.params)
        return ref.as_dict(torch.autograd.grad(loss_of(*params), params))

    def hessian():
        rows = torch.autograd.functional.hessian(loss_of, ref.params)
        return {n: ref.as_dict(row) for n, row in zip(ref.names, rows)}

    def pullback():
        params = _leaves(ref.params)
        return ref.as_dict(torch.autograd.grad(outputs_of(*params), params, cotangent.double()))

    def shifted(a):
        return _shifted(a, ref.module(ref.params), ref.x)

    def second_derivative():
        first = lambda a: torch.autograd.functional.jacobian(shifted, a, create_graph=True)  # noqa: E731
        return torch.autograd.functional.jacobian(first, a.double())

    return {
        "gradient": (lambda m, x: ad.gradient(_scalar_loss, Active(m), Constant(x), backend=FD_TORCH), grad),
        "jacobian": (
            lambda m, x: ad.jacobian(_outputs, Active(m), Constant(x), backend=FD_TORCH),
            lambda: ref.as_dict(torch.autograd.functional.jacobian(outputs_of, ref.params)),
        ),
        "pushforward": (
            lambda m, x: ad.pushforward(_outputs, Active(m), Constant(x), tangent=tangent, backend=FD_TORCH),
            lambda: torch.autograd.functional.jvp(outputs_of, ref.params, tangent64)[1],
        ),
        "pullback": (
            lambda m, x: ad.pullback(_outputs, Active(m), Constant(x), cotangent=cotangent, backend=FD_TORCH),
            pullback,
        ),
        "hvp": (
            lambda m, x: ad.hvp(_scalar_loss, Active(m), Constant(x), tangent=tangent, backend=FD_TORCH),
            lambda: ref.as_dict(torch.autograd.functional.hvp(loss_of, ref.params, tangent64)[1]),
        ),
        "hessian": (lambda m, x: ad.hessian(_scalar_loss, Active(m), Constant(x), backend=FD_TORCH), hessian),
        # A Constant module: bound in float64 too, every parameter frozen.
        "derivative": (
            lambda m, x: ad.derivative(_shifted, Active(a), Constant(m), Constant(x), backend=FD_TORCH),
            lambda: torch.autograd.functional.jacobian(shifted, a.double()),
        ),
        "second_derivative": (
            lambda m, x: ad.second_derivative(_shifted, Active(a), Constant(m), Constant(x), backend=FD_TORCH),
            second_derivative,
        ),
    }


def _state_of(model: nn.Module) -> tuple:
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {n: p.requires_grad for n, p in model.named_parameters()},
        [m.training for m in model.modules()],
        [p.grad for p in model.parameters()],
    )


def _assert_unchanged(model: nn.Module, before: tuple) -> None:
    state, requires_grad, training, grads = _state_of(model)
    assert state.keys() == before[0].keys()
    for key, value in state.items():
        assert value.dtype == before[0][key].dtype and torch.equal(value, before[0][key]), f"{key} changed"
    assert requires_grad == before[1], "requires_grad flags changed"
    assert training == before[2], "training flags changed"
    assert all(g is None for g in grads), ".grad was written"


def _assert_float32_close(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (list(got), list(want))
        for key in want:
            _assert_float32_close(got[key], want[key])
        return
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got.double(), want.detach(), **TORCH_TOL)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "op", ["gradient", "jacobian", "pushforward", "pullback", "hvp", "hessian", "derivative", "second_derivative"]
)
def test_fd_over_torch_on_a_module_with_buffers_and_a_frozen_parameter(op, training):
    model = _model(0, training)
    x = _randn(7, 6, 3)
    ref = Reference(model, x)
    run, expected = _torch_cases(ref)[op]
    before = _state_of(model)
    got = run(model, x)
    _assert_unchanged(model, before)
    _assert_float32_close(got, expected())  # keys too: the frozen 3.bias has no entry


def test_fd_over_torch_prepared_uses_the_call_values():
    model, x = _model(1, True), _randn(8, 6, 3)
    ref = Reference(model, x)
    tangent = ref.as_dict(tuple(t.float() for t in ref.tangent(130)))
    prepared = ad.prepare(
        ad.hvp, _scalar_loss, Active(_model(2, True)), Constant(_randn(9, 6, 3)), backend=FD_TORCH, tangent=tangent
    )
    before = _state_of(model)
    got = prepared(model, x, tangent=tangent)
    _assert_unchanged(model, before)
    loss_of = ref.of_params(_scalar_loss)
    tangent64 = tuple(tangent[n].double() for n in ref.names)
    _assert_float32_close(got, ref.as_dict(torch.autograd.functional.hvp(loss_of, ref.params, tangent64)[1]))


# ---------------------------------------------------------------------------- FD over JAX
# s(x, c) = sum(sin(c x)) + |x|^4 / 4;  v(x, c) = sin(x) c + x[::-1]^2;  r(a, c) = a sin(a c)


def _s(x, c):
    return jnp.sum(jnp.sin(c * x)) + jnp.sum(x**2) ** 2 / 4


def _v(x, c):
    return jnp.sin(x) * c + x[::-1] ** 2


def _r(a, c):
    return a * jnp.sin(a * c)


def _jax_cases(x, c, t, ct, a):
    x, c, t, ct, a = (np.asarray(v, np.float64) for v in (x, c, t, ct, a))
    n = x.size
    grad = c * np.cos(c * x) + np.sum(x**2) * x
    hess = np.diag(-(c**2) * np.sin(c * x)) + np.sum(x**2) * np.eye(n) + 2 * np.outer(x, x)
    jac = np.diag(np.cos(x) * c) + np.fliplr(np.diag(2 * x[::-1]))
    return {
        "gradient": (lambda x, c: ad.gradient(_s, Active(x), Constant(c), backend=FD_JAX), grad),
        "jacobian": (lambda x, c: ad.jacobian(_v, Active(x), Constant(c), backend=FD_JAX), jac),
        "pushforward": (
            lambda x, c: ad.pushforward(_v, Active(x), Constant(c), tangent=f32(t), backend=FD_JAX),
            jac @ t,
        ),
        "pushforward-batch": (
            lambda x, c: ad.pushforward(_v, Active(x), Constant(c), tangents=[f32(t), f32(2 * t)], backend=FD_JAX),
            [jac @ t, jac @ (2 * t)],
        ),
        "pullback": (lambda x, c: ad.pullback(_v, Active(x), Constant(c), cotangent=f32(ct), backend=FD_JAX), ct @ jac),
        "hvp": (lambda x, c: ad.hvp(_s, Active(x), Constant(c), tangent=f32(t), backend=FD_JAX), hess @ t),
        "hessian": (lambda x, c: ad.hessian(_s, Active(x), Constant(c), backend=FD_JAX), hess),
        "derivative": (
            lambda x, c: ad.derivative(_r, Active(f32(a)), Constant(c), backend=FD_JAX),
            np.sin(a * c) + a * c * np.cos(a * c),
        ),
        "second_derivative": (
            lambda x, c: ad.second_derivative(_r, Active(f32(a)), Constant(c), backend=FD_JAX),
            2 * c * np.cos(a * c) - a * c**2 * np.sin(a * c),
        ),
    }


def f32(v):
    return jnp.asarray(v, jnp.float32)


JAX_OPERATORS = [
    "gradient", "jacobian", "pushforward", "pushforward-batch", "pullback", "hvp", "hessian", "derivative",
    "second_derivative",
]


@pytest.mark.parametrize("op", JAX_OPERATORS)
def test_fd_over_jax_every_operator(op, assert_tree_close, intact):
    rng = np.random.default_rng(5)
    x, c = f32(rng.uniform(-1, 1, 3)), f32(rng.uniform(0.5, 1.5, 3))
    t, ct, a = rng.normal(size=3), rng.normal(size=3), rng.uniform(0.3, 1.2)
    run, expected = _jax_cases(x, c, t, ct, a)[op]
    with intact(x, c):
        got = run(x, c)
    assert_tree_close(got, expected, rtol=2e-6, atol=2e-6, framework="jax", dtype=np.float32)


def test_fd_over_jax_hessian_matches_jax_hessian(assert_tree_close):
    x, c = f32([0.3, -0.2, 0.9]), f32([1.1, 0.7, 1.4])
    assert_tree_close(
        ad.hessian(_s, Active(x), Constant(c), backend=FD_JAX), np.asarray(jax.hessian(_s)(x, c)), rtol=1e-5, atol=1e-5
    )


def test_fd_over_jax_prepared_pushforward_uses_the_call_values(assert_tree_close):
    rng = np.random.default_rng(6)
    x, c, t = (f32(rng.uniform(-1, 1, 3)) for _ in range(3))
    zeros, ones = f32(np.zeros(3)), f32(np.ones(3))
    prepared = ad.prepare(ad.pushforward, _v, Active(zeros), Constant(ones), backend=FD_JAX, tangent=ones)
    x64, c64, t64 = (np.asarray(v, np.float64) for v in (x, c, t))
    jac = np.diag(np.cos(x64) * c64) + np.fliplr(np.diag(2 * x64[::-1]))
    assert_tree_close(prepared(x, c, tangent=t), jac @ t64, rtol=2e-6, atol=2e-6, framework="jax", dtype=np.float32)
