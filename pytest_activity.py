"""pytest plugin of `activity`: run a test once per backend x scenario, with readable ids.

    import pytest
    import activity as ad
    from activity.testing import nn_scenarios

    @pytest.mark.differentiation(backends=[ad.AutoTorch()], scenarios=lambda: nn_scenarios("torch"),
                                 broken={("AutoTorch", "lstm"): "issue #12"})
    def test_gradients(activity_case):
        activity_case.check()          # ids like AutoTorch-gradient-lstm

Installed as a ``pytest11`` entry point, so pytest loads it in every project:
loading it imports nothing (not even ``activity``); the catalogues are built
only for tests that carry the marker. A marker that would check nothing (no
``activity_case`` argument, a misspelt keyword, no case for a backend, a
stale ``broken=``/``skip=`` key) is a collection error that says what to do.
"""

MARKER = (
    "differentiation(backends, scenarios, reference=None, prepared=True, rtol=None, atol=None, broken=None, skip=None): "
    "parametrize the test's `activity_case` argument over backends x scenarios (activity)"
)


def pytest_configure(config):
    config.addinivalue_line("markers", MARKER)


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("differentiation")
    if marker is None:
        return
    import pytest

    name = metafunc.definition.name
    if "activity_case" not in metafunc.fixturenames:
        pytest.fail(
            f"{name} is marked @pytest.mark.differentiation but takes no `activity_case` argument, so it would run "
            f"once and check nothing: write `def {name}(activity_case): activity_case.check()`.",
            pytrace=False,
        )
    from activity.testing._plugin import UsageError, marker_arguments, pytest_params

    try:
        params, ids = pytest_params(**marker_arguments(marker.args, marker.kwargs, name))
    except UsageError as error:
        message = str(error) if str(error).startswith(name) else f"{name}: {error}"
    else:
        metafunc.parametrize("activity_case", params, ids=ids)
        return
    pytest.fail(message, pytrace=False)  # outside the except: the message alone, no chained traceback
