"""One module per operator, each written once over the backend primitives."""

from .derivative import derivative, value_and_derivative
from .gradient import gradient, value_and_gradient
from .hessian import hessian, value_gradient_and_hessian
from .hvp import gradient_and_hvp, hvp
from .jacobian import jacobian, value_and_jacobian
from .pullback import pullback, value_and_pullback
from .pushforward import pushforward, value_and_pushforward
from .second_derivative import second_derivative, value_derivative_and_second_derivative

__all__ = [
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
]
