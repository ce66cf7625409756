"""Operator names, grouped (no imports: backends read these)."""

OPERATORS = (
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
)

SECOND_ORDER = frozenset(
    {
        "second_derivative",
        "value_derivative_and_second_derivative",
        "hessian",
        "value_gradient_and_hessian",
        "hvp",
        "gradient_and_hvp",
    }
)
