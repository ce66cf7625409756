"""Testing kit: does a backend give the right derivatives on a catalogue of scenarios?

>>> import activity as ad
>>> from activity.testing import default_scenarios, test_differentiation
>>> report = test_differentiation([ad.AutoFiniteDifferences(step=0.05)], default_scenarios("numpy")[:2])
>>> report.counts()["pass"]
2
"""

from ._check import CheckReport, check
from ._compare import assert_tree_allclose
from ._default import default_scenarios
from ._plugin import Case, parametrize
from ._runner import Outcome, Report, UsageError, check_scenario, test_differentiation
from ._scenario import Scenario
from ._transforms import batchify, cachify, closurify, constantify


def nn_scenarios(framework: str, seed: int = 0) -> list[Scenario]:
    """The layers Flux and Lux test across AD backends, as gradient scenarios.

    Args:
        framework: ``"torch"``: torch.nn models (Linear chains, Conv, ConvTranspose,
            pooling, Maxout, skip connections, Bilinear, Layer/Batch/Group/InstanceNorm,
            Embedding, MultiheadAttention, RNN, LSTM, GRU, cells unrolled with explicit
            state). ``"jax"``: the same layers in Equinox or as plain JAX pytrees.
        seed: where every parameter and input comes from; no global RNG is read or reseeded.

    Returns:
        One `Scenario` per layer, named after it; their expected results come from the
        reference (float64 finite differences, unless `test_differentiation` is given another).

    Raises:
        ValueError: ``framework`` is neither.
        ModuleNotFoundError: the framework (or, for ``"jax"``, Equinox) is not installed; the
            message names the extra that installs it.

    >>> from activity.testing import nn_scenarios
    >>> [s.name for s in nn_scenarios("torch")][:3]
    ['linear', 'chain_tanh', 'chain_float64']
    """
    if framework == "torch":
        from ._nn_torch import nn_scenarios_torch

        return nn_scenarios_torch(seed)
    if framework == "jax":
        from ._nn_jax import nn_scenarios_jax

        return nn_scenarios_jax(seed)
    raise ValueError(f"nn_scenarios: framework must be 'torch' or 'jax', got {framework!r}.")


__all__ = [
    "check",
    "CheckReport",
    "assert_tree_allclose",
    "Scenario",
    "default_scenarios",
    "nn_scenarios",
    "constantify",
    "cachify",
    "closurify",
    "batchify",
    "test_differentiation",
    "check_scenario",
    "Report",
    "Outcome",
    "UsageError",
    "Case",
    "parametrize",
]
