"""Operator names grouped by order (no imports: backends read these)."""

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
