"""pytest plugin of `activity`: run a test once per backend x scenario, with readable ids.

    import pytest
    import activity as ad
    from activity.testing import nn_scenarios

    @pytest.mark.differentiation(backends=[ad.AutoTorch()], scenarios=lambda: nn_scenarios("torch"))
    def test_gradients(activity_case):
        activity_case.check()          # ids like AutoTorch-gradient-lstm

Installed as a ``pytest11`` entry point, so pytest loads it in every project:
loading it imports nothing (not even ``activity``); the catalogues are built
only for tests that carry the marker.
"""

MARKER = (
    "differentiation(backends, scenarios, reference=None, prepared=True, rtol=None, atol=None): "
    "parametrize the test's `activity_case` argument over backends x scenarios (activity)"
)


def pytest_configure(config):
    config.addinivalue_line("markers", MARKER)


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("differentiation")
    if marker is None or "activity_case" not in metafunc.fixturenames:
        return
    from activity.testing._plugin import cases

    params, ids = cases(*marker.args, **marker.kwargs)
    metafunc.parametrize("activity_case", params, ids=ids)
