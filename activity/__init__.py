"""activity: differentiate functions of several annotated arguments.

Each argument of ``f`` is ``Active`` (differentiated), ``Constant`` (data) or
``Cache`` (scratch space); one call works the same on JAX, PyTorch and finite
differences.

>>> import jax.numpy as jnp
>>> import activity as ad
>>> loss = lambda w, x: jnp.sum((x @ w) ** 2)
>>> ad.gradient(loss, ad.Active(jnp.ones(2)), ad.Constant(jnp.eye(2)))
Array([2., 2.], dtype=float32)
"""

from ._annotations import Active, Cache, Constant
from ._errors import PreparationMismatchError, UnsupportedError
from ._operators import (
    derivative,
    gradient,
    gradient_and_hvp,
    hessian,
    hvp,
    jacobian,
    pullback,
    pushforward,
    second_derivative,
    value_and_derivative,
    value_and_gradient,
    value_and_jacobian,
    value_and_pullback,
    value_and_pushforward,
    value_derivative_and_second_derivative,
    value_gradient_and_hessian,
)
from ._preparation import Prepared, prepare
from .backends import AutoFiniteDifferences, AutoJAX, AutoTorch, Backend, SecondOrder
from ._mixing import differentiate_with

__version__ = "0.2.0.dev0"

__all__ = [
    "Active",
    "Constant",
    "Cache",
    "UnsupportedError",
    "PreparationMismatchError",
    "prepare",
    "Prepared",
    "Backend",
    "AutoJAX",
    "AutoTorch",
    "AutoFiniteDifferences",
    "SecondOrder",
    "derivative",
    "value_and_derivative",
    "second_derivative",
    "value_derivative_and_second_derivative",
    "gradient",
    "value_and_gradient",
    "jacobian",
    "value_and_jacobian",
    "pushforward",
    "value_and_pushforward",
    "pullback",
    "value_and_pullback",
    "hessian",
    "value_gradient_and_hessian",
    "hvp",
    "gradient_and_hvp",
    "differentiate_with",
]
