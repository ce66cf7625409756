"""The finite-difference reference's own defects: copies, domains, parameters, precision."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Cache, Constant
from activity.backends._finite_differences import ReferencePrecisionWarning

FD = ad.AutoFiniteDifferences()


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_every_evaluation_of_f_gets_its_own_copies(framework):
    xp = np if framework == "numpy" else torch
    v, c = xp.asarray([1.0, 2.0, 4.0]), xp.asarray([1.0, 1.0, 1.0])
    if framework == "torch":
        v, c = v.double(), c.double()
    v0, c0 = np.array(v).copy(), np.array(c).copy()

    def f(v, c):
        v -= v.mean()  # numpy-style in-place updates of both inputs
        c *= 2
        return (v**2 * c).sum()

    g = ad.gradient(f, Active(v), Constant(c), backend=FD)
    np.testing.assert_array_equal(np.array(v), v0)  # the user's values are untouched
    np.testing.assert_array_equal(np.array(c), c0)
    # f = sum((v - mean v)^2 * 2 c0): d/dv = 4 c0 (v - mean v) (the mean's terms cancel for equal c0)
    np.testing.assert_allclose(np.array(g), 4 * (v0 - v0.mean()), rtol=1e-8)


def test_a_step_outside_fs_domain_that_raises_restarts_smaller():
    p, y = torch.tensor([0.95, 0.5], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    bce = lambda p, y: torch.nn.functional.binary_cross_entropy(p, y)  # noqa: E731  # raises outside [0, 1]
    got = ad.gradient(bce, Active(p), Constant(y), backend=FD)
    expected = torch.func.grad(lambda p: bce(p, y))(p)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


def test_f_raising_at_every_step_raises_its_own_error():
    def f(x):
        if abs(float(x.sum()) - 3.0) > 0:  # any perturbation raises: no step can succeed
            raise ValueError("outside the domain")
        return (x**2).sum()

    with pytest.raises(ValueError, match="outside the domain"):
        ad.gradient(f, Active(np.ones(3)), backend=FD)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(step=0), "step=0"),
        (dict(step=float("nan")), "step=nan"),
        (dict(shrink=1.0), "shrink=1.0"),
        (dict(max_steps=0), "max_steps=0"),
        (dict(max_steps=1), "max_steps=1"),
        (dict(retries=0), "retries=0"),
        (dict(retries=2.5), "retries=2.5"),
    ],
)
def test_parameters_are_validated_at_construction(options, match):
    with pytest.raises(ValueError, match=match):
        ad.AutoFiniteDifferences(**options)


def test_f_computing_in_float32_is_reported():
    x = torch.ones(3, dtype=torch.float64)
    with pytest.warns(ReferencePrecisionWarning, match="float32"):
        ad.gradient(lambda x: (x.float() ** 2).sum(), Active(x), backend=FD)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferencePrecisionWarning)
        ad.gradient(lambda x: (x**2).sum(), Active(x), backend=FD)  # float64 throughout: no warning


def test_a_cache_is_fresh_for_every_evaluation():
    def f(x, buffer):
        buffer += x  # accumulates if the same buffer were reused between evaluations
        return (buffer**2).sum()

    g = ad.gradient(f, Active(np.array([1.0, 2.0])), Cache(np.zeros(2)), backend=FD)
    np.testing.assert_allclose(g, [2.0, 4.0], rtol=1e-8)
