"""Round 10 of the PyTorch sweep: torch_geometric graphs, gpytorch, pyro, e3nn, x-transformers and
torch.distributions, each against torch.autograd.grad (or torch.func) on the user's own objects or copies."""

from __future__ import annotations

import copy

import e3nn.o3 as o3
import gpytorch
import pyro
import pyro.distributions as pyro_dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch.distributions import MultivariateNormal
from torch_geometric.data import Batch, Data, HeteroData
from torch_geometric.nn import GATConv, GCNConv, HeteroConv, MessagePassing, SAGEConv, global_mean_pool
from torch_geometric.utils import softmax
from x_transformers import Decoder, TransformerWrapper

import activity as ad
from activity import Active, Constant
from activity.testing._intact import Snapshot

from _sweeps import CLOSE, assert_close_dicts, assert_trees, generator, randn, raw_gradient, trainable, untouched


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


def _hvp_of(loss, model, tangent, *args):
    """torch's double backward on a copy of ``model``, zeros where a parameter is unused twice."""
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    grads = torch.autograd.grad(loss(twin, *args), params, create_graph=True)
    hv = torch.autograd.grad(grads, params, [tangent[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(p) if v is None else v for n, v, p in zip(names, hv, params)}


def _tangent_for(model):
    return {n: torch.randn(p.shape, generator=generator(k), dtype=p.dtype) for k, (n, p) in enumerate(trainable(model))}


# ------------------------------------------------------------------ torch_geometric


class _Attention(MessagePassing):
    """A message passing layer of its own: softmax attention over each node's incoming edges."""

    def __init__(self, width, aggr):
        super().__init__(aggr=aggr)
        self.lin = torch.nn.Linear(width, width)
        self.att = torch.nn.Parameter(torch.linspace(-1, 1, 2 * width))

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=self.lin(x))

    def message(self, x_i, x_j, index, ptr, size_i):
        weights = softmax((torch.cat([x_i, x_j], -1) * self.att).sum(-1), index, ptr, size_i)
        return x_j * weights.unsqueeze(-1)


class _GraphNet(torch.nn.Module):
    def __init__(self, aggr):
        super().__init__()
        self.gcn, self.gat = GCNConv(3, 4), GATConv(4, 4, heads=2, concat=False)
        self.sage, self.att = SAGEConv(4, 4, aggr="max"), _Attention(4, aggr)

    def forward(self, data):
        h = self.gcn(data.x, data.edge_index).tanh()
        h = self.gat(h, data.edge_index).tanh()
        h = self.sage(h, data.edge_index).tanh()
        return global_mean_pool(self.att(h, data.edge_index), data.batch).pow(2).sum()


def _graph(nodes, edges, seed):
    g = generator(seed)
    return Data(x=torch.randn(nodes, 3, generator=g, dtype=torch.float64), edge_index=torch.randint(0, nodes, (2, edges), generator=g))


def _graphs(*sizes, seed):
    return Batch.from_data_list([_graph(n, e, seed + k) for k, (n, e) in enumerate(sizes)])


def _graph_loss(model, data):
    return model(data)


@pytest.mark.parametrize("aggr", ["add", "mean", "max"])
def test_a_graph_batch_as_a_constant_prepares_once_for_new_graphs_of_its_sizes_and_names_the_size_that_changed(aggr):
    model = _seeded(lambda: _GraphNet(aggr).double().eval())
    first, same_sizes, other_sizes = _graphs((5, 12), (4, 9), seed=1), _graphs((5, 12), (4, 9), seed=7), _graphs((6, 14), (4, 7), seed=3)
    intact = untouched(Active(model), Constant(first), Constant(same_sizes))
    assert_close_dicts(ad.gradient(_graph_loss, Active(model), Constant(first)), raw_gradient(_graph_loss, model, first), **CLOSE)
    prepared = ad.prepare(ad.gradient, _graph_loss, Active(model), Constant(first))
    for data in (first, same_sizes):  # a Data compares by identity: a new graph was refused as another constant
        assert_close_dicts(prepared(model, data), raw_gradient(_graph_loss, model, data), **CLOSE)
    with pytest.raises(ad.PreparationMismatchError, match=r"at \.x: expected a torch tensor of shape \(9, 3\)"):
        prepared(model, other_sizes)
    relaxed = ad.prepare(ad.gradient, _graph_loss, Active(model), Constant(first), strict=False)
    assert_close_dicts(relaxed(model, other_sizes), raw_gradient(_graph_loss, model, other_sizes), **CLOSE)
    assert intact()


def test_hvp_and_pullback_of_graph_convolutions_and_the_gradient_for_the_node_features_of_a_batch():
    model = _seeded(lambda: _GraphNet("add").double().eval())
    data, later = _graphs((5, 12), (4, 9), seed=1), _graphs((5, 12), (4, 9), seed=7)
    tangent = _tangent_for(model)
    assert_close_dicts(ad.hvp(_graph_loss, Active(model), Constant(data), tangent=tangent), _hvp_of(_graph_loss, model, tangent, data), **CLOSE)

    def node_features(model, data):
        return model.gat(model.gcn(data.x, data.edge_index), data.edge_index)

    cotangent = randn(9, 4, seed=5)
    twin = copy.deepcopy(model)
    names, params = zip(*trainable(twin))
    want = torch.autograd.grad(node_features(twin, data), params, cotangent, allow_unused=True)
    want = {n: torch.zeros_like(p) if w is None else w for n, w, p in zip(names, want, params)}
    assert_close_dicts(ad.pullback(node_features, Active(model), Constant(data), cotangent=cotangent), want, **CLOSE)

    # The batch itself Active: f unbatches it (to_data_list reads the Batch's slices), the result is a Batch
    def per_graph(data, model):
        return sum(model(Batch.from_data_list([g])) * (k + 1) for k, g in enumerate(data.to_data_list())) + data.num_graphs

    def raw(data):
        x = data.x.clone().requires_grad_()
        copied = copy.copy(data)
        copied.x = x
        return torch.autograd.grad(per_graph(copied, model), x)[0]

    intact = untouched(Active(data), Constant(model))
    got = ad.gradient(per_graph, Active(data), Constant(model))
    assert type(got) is type(data) and got.edge_index is None and got.batch is None
    torch.testing.assert_close(got.x, raw(data), **CLOSE)
    prepared = ad.prepare(ad.gradient, per_graph, Active(data), Constant(model))
    for batch in (data, later):
        torch.testing.assert_close(prepared(batch, model).x, raw(batch), **CLOSE)
    reference = ad.gradient(per_graph, Active(data), Constant(model), backend=ad.AutoFiniteDifferences())
    torch.testing.assert_close(reference.x, raw(data), rtol=1e-6, atol=1e-8)
    assert intact()


def _hetero_graph(papers, authors, edges, seed):
    g = generator(seed)
    data = HeteroData()
    data["paper"].x = torch.randn(papers, 3, generator=g, dtype=torch.float64)
    data["author"].x = torch.randn(authors, 2, generator=g, dtype=torch.float64)
    writer, paper = torch.randint(0, authors, (edges,), generator=g), torch.randint(0, papers, (edges,), generator=g)
    data["author", "writes", "paper"].edge_index = torch.stack([writer, paper])
    data["paper", "written_by", "author"].edge_index = torch.stack([paper, writer])
    data.y = torch.randn(papers, generator=g, dtype=torch.float64)
    return data


class _HeteroNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = HeteroConv({("author", "writes", "paper"): SAGEConv((2, 3), 4),
                                ("paper", "written_by", "author"): GATConv((3, 2), 4, add_self_loops=False)})
        self.head = torch.nn.Linear(4, 1)

    def forward(self, data):
        h = self.conv(data.x_dict, data.edge_index_dict)
        return (self.head(h["paper"].tanh()).squeeze(-1) - data.y).pow(2).mean() + h["author"].pow(2).mean()


def test_a_hetero_graph_as_a_constant_prepares_once_for_new_graphs_and_as_an_active_gets_a_graph_of_gradients():
    model = _seeded(lambda: _HeteroNet().double())
    first, same_sizes, more_edges = _hetero_graph(5, 3, 8, seed=1), _hetero_graph(5, 3, 8, seed=2), _hetero_graph(5, 3, 9, seed=3)
    intact = untouched(Active(model), Constant(first), Constant(same_sizes))
    prepared = ad.prepare(ad.gradient, _graph_loss, Active(model), Constant(first))
    for data in (first, same_sizes):  # a HeteroData compared by identity: every new graph was refused
        assert_close_dicts(prepared(model, data), raw_gradient(_graph_loss, model, data), **CLOSE)
    with pytest.raises(ad.PreparationMismatchError, match=r"at \['author', 'writes', 'paper'\]\.edge_index: expected a torch tensor of shape \(2, 8\)"):
        prepared(model, more_edges)

    # The graph itself Active: a HeteroData of gradients, None at the integer edges
    def per_graph(data, model):
        return sum(model(graph) * (k + 1) for k, graph in enumerate(data.to_data_list()))

    def raw(data):
        copied = copy.copy(data)
        papers, authors = data["paper"].x.clone().requires_grad_(), data["author"].x.clone().requires_grad_()
        copied["paper"].x, copied["author"].x = papers, authors
        return torch.autograd.grad(per_graph(copied, model), (papers, authors))

    batch, later = Batch.from_data_list([first, same_sizes]), Batch.from_data_list([same_sizes, first])
    got = ad.gradient(per_graph, Active(batch), Constant(model))
    assert type(got) is type(batch) and got["author", "writes", "paper"].edge_index is None
    for want, have in zip(raw(batch), (got["paper"].x, got["author"].x)):
        torch.testing.assert_close(have, want, **CLOSE)
    prepared = ad.prepare(ad.gradient, per_graph, Active(batch), Constant(model))
    for data in (batch, later):
        got = prepared(data, model)
        for want, have in zip(raw(data), (got["paper"].x, got["author"].x)):
            torch.testing.assert_close(have, want, **CLOSE)
    reference = ad.gradient(per_graph, Active(batch), Constant(model), backend=ad.AutoFiniteDifferences())
    torch.testing.assert_close(reference["paper"].x, raw(batch)[0], rtol=1e-6, atol=1e-8)
    assert intact()


# ------------------------------------------------------------------ gpytorch


class _ExactGP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean = gpytorch.means.ConstantMean()
        self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))


def _negative_mll(model, x, y):
    return -gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)(model(x), y)


def _gp(points=12):
    x = randn(points, 1, seed=1)
    y = torch.sin(3 * x[:, 0]) + 0.1 * randn(points, seed=2)
    model = _seeded(lambda: _ExactGP(x, y, gpytorch.likelihoods.GaussianLikelihood()).double())
    return model, x, y


def test_an_exact_gp_marginal_likelihood_gradient_prepared_on_new_training_data_and_its_hvp():
    model, x, y = _gp()
    model.train()
    intact = untouched(Active(model), Constant(x), Constant(y))
    got = ad.gradient(_negative_mll, Active(model), Constant(x), Constant(y))
    assert list(got) == ["likelihood.noise_covar.raw_noise", "mean.raw_constant", "cov.raw_outputscale", "cov.base_kernel.raw_lengthscale"]
    assert_close_dicts(got, raw_gradient(_negative_mll, model, x, y), **CLOSE)
    prepared = ad.prepare(ad.gradient, _negative_mll, Active(model), Constant(x), Constant(y))
    x2 = randn(12, 1, seed=3)
    y2 = torch.cos(3 * x2[:, 0])
    for a, b in ((x, y), (x2, y2)):
        model.set_train_data(a, b, strict=False)  # an ExactGP in train mode refuses any other inputs
        assert_close_dicts(prepared(model, a, b), raw_gradient(_negative_mll, model, a, b), **CLOSE)
    model.set_train_data(x, y)
    tangent = _tangent_for(model)
    hvp = ad.hvp(_negative_mll, Active(model), Constant(x), Constant(y), tangent=tangent)
    assert_close_dicts(hvp, _hvp_of(_negative_mll, model, tangent, x, y), **CLOSE)
    assert intact() and model.training and model.likelihood.training


def test_gp_predictions_in_eval_mode_with_and_without_the_users_prediction_cache_and_conjugate_gradients_draw_like_eager():
    model, x, y = _gp()
    model.eval()
    test_x = randn(5, 1, seed=4)

    def predictive(model, xs):
        out = model.likelihood(model(xs))
        return out.mean.pow(2).sum() + out.variance.sum()

    def raw(model):
        twin = copy.deepcopy(model)
        names, params = zip(*trainable(twin))
        grads = torch.autograd.grad(predictive(twin, test_x), params, allow_unused=True)
        return {n: torch.zeros_like(p) if g is None else g for n, g, p in zip(names, grads, params)}

    intact = untouched(Active(model), Constant(test_x))
    assert_close_dicts(ad.gradient(predictive, Active(model), Constant(test_x)), raw(model), **CLOSE)
    assert model.prediction_strategy is None  # no cache built from the tape's leaves left on the user's model
    prepared = ad.prepare(ad.gradient, predictive, Active(model), Constant(test_x))
    assert_close_dicts(prepared(model, test_x), raw(model), **CLOSE)
    assert intact() and model.prediction_strategy is None

    # The user's own cache (holding the user's kernel and likelihood): the view computed the
    # predictive covariance from the user's parameters, losing the derivative through them
    with torch.no_grad():
        predictive(model, test_x)
    cache = model.prediction_strategy
    names, params = zip(*trainable(model))
    own = dict(zip(names, torch.autograd.grad(predictive(model, test_x), params)))  # the user's forward, its cache
    assert_close_dicts(own, raw(model), **CLOSE)
    for call in (lambda: ad.gradient(predictive, Active(model), Constant(test_x)), lambda: prepared(model, test_x)):
        assert_close_dicts(call(), own, **CLOSE)
    assert model.prediction_strategy is cache
    with torch.no_grad():
        model.cov.raw_outputscale.add_(0.5)  # a step in eval mode: the cache goes stale, a fresh forward is followed
    fresh = copy.deepcopy(model)
    fresh.prediction_strategy = None
    assert_close_dicts(prepared(model, test_x), raw(fresh), **CLOSE)
    assert model.prediction_strategy is cache
    with torch.no_grad():
        model.cov.raw_outputscale.sub_(0.5)

    # Without Cholesky, linear_operator draws its probe vectors from torch's global RNG
    model.train()

    def stochastic(model, x, y):
        with gpytorch.settings.max_cholesky_size(0), gpytorch.settings.num_trace_samples(4):
            return _negative_mll(model, x, y)

    torch.manual_seed(5)
    want = raw_gradient(stochastic, model, x, y)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    assert_close_dicts(ad.gradient(stochastic, Active(model), Constant(x), Constant(y)), want, **CLOSE)
    assert torch.equal(torch.get_rng_state(), after)
    # its backward is not differentiable: an error that says so, never a number
    with pytest.raises(RuntimeError, match="setup_context") as error:
        ad.hvp(stochastic, Active(model), Constant(x), Constant(y), tangent=_tangent_for(model))
    assert "no second-order derivative can be taken" in "".join(error.value.__notes__)


# ------------------------------------------------------------------ pyro


class _Regression(PyroModule):
    def __init__(self, bayesian=False):
        super().__init__()
        self.lin = PyroModule[torch.nn.Linear](2, 1).double()
        if bayesian:
            self.lin.weight = PyroSample(pyro_dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([1, 2]).to_event(2))
        self.sigma = PyroParam(torch.tensor(0.5, dtype=torch.float64), constraint=pyro_dist.constraints.positive)

    def forward(self, x, y=None):
        mean = self.lin(x).squeeze(-1)  # outside the plate: a sampled weight is one for all points
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", pyro_dist.Normal(mean, self.sigma), obs=y)


def _negative_log_joint(model, x, y):
    return -poutine.trace(model).get_trace(x, y).log_prob_sum()


def _own_gradient(loss, model, *args):
    """torch.autograd.grad on the user's own module: pyro swaps the param store's tensor into a deep
    copy (the store is keyed by name), so a copy is no independent answer once the store holds it."""
    names, params = zip(*trainable(model))
    return dict(zip(names, torch.autograd.grad(loss(model, *args), params)))


@pytest.fixture
def param_store():
    pyro.clear_param_store()
    yield pyro.get_param_store()
    pyro.clear_param_store()


def test_a_pyro_module_is_differentiated_in_its_own_parameters_whatever_the_param_store_holds(param_store):
    model = _seeded(_Regression)
    x, y = randn(8, 2, seed=1), randn(8, seed=2)
    want = _own_gradient(_negative_log_joint, model, x, y)
    param_store.clear()
    old = dict(model.named_parameters())
    # an empty store: f's pyro.param statements would leave the view's tensors in it, which the
    # user's next forward then put into the user's module in place of its own parameters
    assert_close_dicts(ad.gradient(_negative_log_joint, Active(model), Constant(x), Constant(y)), want, **CLOSE)
    assert dict(param_store.items()) == {}
    _negative_log_joint(model, x, y)
    assert all(p is old[n] for n, p in model.named_parameters())
    # the store holding the user's parameters (after any eager forward): it swapped them into the
    # view, in place of the tape's leaves (a zero gradient for sigma)
    held = dict(param_store._params)
    intact = untouched(Active(model), Constant(x), Constant(y))
    for backend in (None, ad.AutoFiniteDifferences()):
        got = ad.gradient(_negative_log_joint, Active(model), Constant(x), Constant(y), backend=backend)
        assert_close_dicts(got, want, **(CLOSE if backend is None else dict(rtol=1e-6, atol=1e-8)))
    prepared = ad.prepare(ad.gradient, _negative_log_joint, Active(model), Constant(x), Constant(y))
    for a, b in ((x, y), (randn(8, 2, seed=3), randn(8, seed=4))):
        assert_close_dicts(prepared(model, a, b), _own_gradient(_negative_log_joint, model, a, b), **CLOSE)
    names, params = zip(*trainable(model))
    grads = torch.autograd.grad(_negative_log_joint(model, x, y), params, create_graph=True)
    tangent = _tangent_for(model)
    want_hvp = dict(zip(names, torch.autograd.grad(grads, params, [tangent[n] for n in names])))
    for hvp in (
        ad.hvp(_negative_log_joint, Active(model), Constant(x), Constant(y), tangent=tangent),  # on the tape
        ad.hvp(_negative_log_joint, Active(model), Constant(x), Constant(y), tangents=[tangent, tangent])[1],  # torch.func
    ):
        assert_close_dicts(hvp, want_hvp, **CLOSE)
    assert intact() and param_store._params == held
    assert all(param_store._params[n] is p for n, p in held.items())


def test_the_elbo_of_an_auto_normal_guide_draws_like_eager_and_leaves_the_param_store(param_store):
    model = _seeded(lambda: _Regression(bayesian=True))
    guide = AutoNormal(model)
    x, y = randn(8, 2, seed=1), randn(8, seed=2)
    with torch.random.fork_rng():
        guide(x, y)  # creates its parameters, in the store too
    elbo = Trace_ELBO()

    def loss(guide, model, x, y):
        return elbo.differentiable_loss(model, guide, x, y)

    held = dict(param_store._params)
    prepared = ad.prepare(ad.gradient, loss, Active(guide), Constant(model), Constant(x), Constant(y))
    for a, b in ((x, y), (randn(8, 2, seed=3), randn(8, seed=4))):
        torch.manual_seed(2)
        want = _own_gradient(loss, guide, model, a, b)
        after = torch.get_rng_state()
        torch.manual_seed(2)
        got = ad.gradient(loss, Active(guide), Constant(model), Constant(a), Constant(b))
        assert torch.equal(torch.get_rng_state(), after)
        assert_close_dicts(got, want, **CLOSE)
        torch.manual_seed(2)
        assert_close_dicts(prepared(guide, model, a, b), want, **CLOSE)
        assert torch.equal(torch.get_rng_state(), after)
    assert param_store._params == held and all(param_store._params[n] is p for n, p in held.items())


def test_rsample_and_log_prob_of_pyro_and_torch_distributions_draw_like_one_eager_forward():
    def reparameterized(p):
        d = pyro_dist.Normal(p["loc"], p["scale"])
        z = d.rsample((4,))
        return (z.pow(2) + d.log_prob(z)).sum()

    tril = torch.tril(randn(3, 3, seed=5))
    tril.diagonal().copy_(tril.diagonal().abs() + 0.5)

    def multivariate(p, x):
        d = MultivariateNormal(p["loc"], scale_tril=p["scale_tril"])
        return -(d.log_prob(x).sum() + d.rsample((4,)).pow(2).sum())

    cases = [
        (reparameterized, {"loc": randn(3, seed=1), "scale": randn(3, seed=2).exp()}, ()),
        (multivariate, {"loc": randn(3, seed=2), "scale_tril": tril}, (randn(5, 3, seed=3),)),
    ]
    for f, params, data in cases:
        def eager(*values):
            return f(dict(zip(params, values)), *data)

        args = (Active(params), *map(Constant, data))
        tangent = {k: torch.ones_like(v) for k, v in params.items()}
        torch.manual_seed(3)
        leaves = [v.clone().requires_grad_() for v in params.values()]
        grads = torch.autograd.grad(eager(*leaves), leaves, create_graph=True)
        want = dict(zip(params, (g.detach() for g in grads)))
        want_hvp = dict(zip(params, torch.autograd.grad(grads, leaves, list(tangent.values()))))
        after = torch.get_rng_state()
        torch.manual_seed(3)
        want_jvp = torch.func.jvp(eager, tuple(params.values()), tuple(tangent.values()))[1]
        torch.manual_seed(3)
        want_hessian = torch.autograd.functional.hessian(eager, tuple(params.values()))
        for op, kwargs, expected in (
            (ad.gradient, {}, want),
            (ad.hvp, {"tangent": tangent}, want_hvp),
            (ad.pushforward, {"tangent": tangent}, want_jvp),
            (ad.hessian, {}, {a: {b: want_hessian[i][j] for j, b in enumerate(params)} for i, a in enumerate(params)}),
        ):
            torch.manual_seed(3)
            assert_trees(op(f, *args, **kwargs), expected, rtol=1e-6, atol=1e-8)
            assert torch.equal(torch.get_rng_state(), after), op.__name__
        prepared = ad.prepare(ad.gradient, f, *args)
        torch.manual_seed(3)
        assert_trees(prepared(params, *data), want, rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------ e3nn and x-transformers


def test_e3nn_tensor_products_differentiated_in_positions_and_in_weights():
    irreps_sh = o3.Irreps.spherical_harmonics(2)
    net = _seeded(lambda: torch.nn.ModuleDict({
        "tp": o3.FullyConnectedTensorProduct("2x0e + 1x1o", irreps_sh, "2x0e + 1x1o"),
        "lin": o3.Linear("2x0e + 1x1o", "1x0e + 1x1o"),
    }).double())

    def energy(positions, net, features):
        sh = o3.spherical_harmonics(irreps_sh, positions - positions.roll(1, 0), normalize=True, normalization="component")
        return net["lin"](net["tp"](features, sh)).pow(2).sum()

    positions, features = randn(4, 3, seed=1), randn(4, 5, seed=2)

    def raw(p):
        p = p.clone().requires_grad_()
        return torch.autograd.grad(energy(p, net, features), p)[0]

    intact = untouched(Active(positions), Constant(net), Constant(features))
    torch.testing.assert_close(ad.gradient(energy, Active(positions), Constant(net), Constant(features)), raw(positions))
    prepared = ad.prepare(ad.gradient, energy, Active(positions), Constant(net), Constant(features))
    for p in (positions, randn(4, 3, seed=3)):
        torch.testing.assert_close(prepared(p, net, features), raw(p))
    tangent = randn(4, 3, seed=9)
    p = positions.clone().requires_grad_()
    grad = torch.autograd.grad(energy(p, net, features), p, create_graph=True)[0]
    hvp = ad.hvp(energy, Active(positions), Constant(net), Constant(features), tangent=tangent)
    torch.testing.assert_close(hvp, torch.autograd.grad(grad, p, tangent)[0])
    jvp = ad.pushforward(energy, Active(positions), Constant(net), Constant(features), tangent=tangent)
    torch.testing.assert_close(jvp, torch.func.jvp(lambda q: energy(q, net, features), (positions,), (tangent,))[1])

    def by_weights(net, positions, features):
        return energy(positions, net, features)

    assert [n for n, _ in trainable(net)] == ["tp.weight", "lin.weight"]  # the codegen'd modules' constants are buffers
    got = ad.gradient(by_weights, Active(net), Constant(positions), Constant(features))
    assert_close_dicts(got, raw_gradient(by_weights, net, positions, features), **CLOSE)
    assert intact()


@pytest.mark.parametrize("train", [False, True])
def test_an_x_transformers_language_model_loss_with_dropout_and_rotary_embeddings(train):
    lm = _seeded(lambda: TransformerWrapper(
        num_tokens=11, max_seq_len=8,
        attn_layers=Decoder(dim=8, depth=1, heads=2, attn_dropout=0.1, ff_dropout=0.1, rotary_pos_emb=True),
    ).double()).train(train)

    def lm_loss(model, ids):
        return F.cross_entropy(model(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1))

    ids, later = (torch.randint(0, 11, (2, 8), generator=generator(seed)) for seed in (1, 2))
    snapshot = Snapshot((Active(lm), Constant(ids)))
    prepared = ad.prepare(ad.gradient, lm_loss, Active(lm), Constant(ids))
    for batch in (ids, later):
        torch.manual_seed(4)
        want = raw_gradient(lm_loss, lm, batch)
        after = torch.get_rng_state()
        for call in (lambda: ad.gradient(lm_loss, Active(lm), Constant(batch)), lambda: prepared(lm, batch)):
            torch.manual_seed(4)
            assert_close_dicts(call(), want, **CLOSE)
            assert torch.equal(torch.get_rng_state(), after)
    assert [c for c in snapshot.changes() if "RNG" not in c] == []
    if not train:
        tangent = _tangent_for(lm)
        assert_close_dicts(ad.hvp(lm_loss, Active(lm), Constant(ids), tangent=tangent), _hvp_of(lm_loss, lm, tangent, ids), **CLOSE)
