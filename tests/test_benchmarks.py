"""The benchmark harness (`benchmarks/`): its cases compute what the raw calls compute, its
timer and report are right. No test here asserts anything about how fast a call is."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks/` is a top-level package of the repository, not installed
    sys.path.insert(0, str(ROOT))

pytest.importorskip("jax")
pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import _closure, _report  # noqa: E402
from benchmarks._case import PREPARED, SCALING, UNPREPARED, Case  # noqa: E402
from benchmarks._timing import Timing, alternate, calls_for  # noqa: E402


@pytest.fixture(scope="module")
def cases():
    return bench_main.build_cases(bench_main.QUICK)


def test_cases_cover_every_operator_framework_and_family(cases):
    kinds = {(c.framework, c.operator, c.family) for c in cases}
    for framework in ("jax", "torch"):
        for operator in ("gradient", "pullback", "pushforward", "jacobian", "hessian", "hvp"):
            assert (framework, operator, PREPARED) in kinds
        assert (framework, "gradient", UNPREPARED) in kinds
        assert (framework, "pullback", UNPREPARED) in kinds
        assert (framework, "gradient", SCALING) in kinds
        assert {c.model for c in cases if c.framework == framework} >= {"MLP", "CNN", "LSTM"}
    assert {c.model for c in cases if c.framework == "jax"} >= {"Equinox MLP"}
    assert {c.model for c in cases if c.framework == "torch"} >= {
        "ResNet block (BatchNorm, train)", "GPT-2 (tiny, HF)", "LLaMA (tiny, HF)"}
    # hvp against both hand-written products, on the MLPs, f(v) and GPT-2
    double_backward = {c.model for c in cases if c.operator == "hvp" and c.raw_name and "double backward" in c.raw_name}
    assert double_backward >= {"MLP", "sum tanh(A v)^2", "GPT-2 (tiny, HF)"}


def test_every_case_returns_what_its_raw_call_returns(cases):
    failures = []
    for case in cases:
        try:
            assert case.check() >= 1
        except Exception as error:  # noqa: BLE001 - collect every broken case, not only the first
            failures.append(f"{case.name}: {type(error).__name__}: {error}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_wrong_raw_result_makes_the_check_fail(cases, framework):
    case = next(c for c in cases if c.framework == framework and c.operator == "gradient" and c.family == PREPARED)
    wrong = attrs.evolve(case, raw_as_ours=lambda raw: {k: 1.01 * v for k, v in case.raw_as_ours(raw).items()})
    with pytest.raises(AssertionError, match="differ"):
        wrong.check()


def test_closure_loop_compiles_per_batch_and_constant_once():
    params, batches = _closure.mlp_params(4), _closure.make_batches(4, 5)
    _, closure_traces = _closure.closure_loop(params, batches)
    _, constant_traces = _closure.constant_loop(params, batches)
    assert (closure_traces, constant_traces) == (5, 1)
    _closure.same_gradients(width=4, batches=3)


def test_closure_run_reports_the_counts():
    result = _closure.run(width=4, batches=4, repeats=1)
    assert (result.batches, result.closure_traces, result.constant_traces) == (4, 4, 1)
    assert result.speedup == result.closure_s / result.constant_s


def test_saved_bytes_counts_what_the_tape_saves_once_per_storage():
    import torch

    from benchmarks._cases_torch import memory_case, saved_bytes

    w = torch.ones(10, requires_grad=True)
    assert saved_bytes(lambda: torch.tanh(w)) == 10 * 4  # tanh saves its float32 output
    assert saved_bytes(lambda: torch.tanh(w) + torch.tanh(w)) == 2 * 10 * 4  # two outputs, two storages
    assert saved_bytes(lambda: w * w) == 10 * 4  # w saved twice, one storage
    raw, ours = memory_case(4)
    assert raw > 0 and ours > 0


def test_report_shows_the_memory_ratio_and_its_target():
    memory = _report.Memory(1024, raw_bytes=1000, ours_bytes=1100)
    rows = _report.target_rows([], None, memory)
    assert rows == [["torch prepared gradient, memory saved for backward, MLP width 1024", "ratio <= 1.05",
                     "1.100", "", "**not met**"]]
    text = _report.markdown([], None, {}, seconds=1, rounds=1, quick=True, memory=memory)
    assert "## Memory" in text and "| ratio | 1.100 |" in text


def test_an_operator_with_two_targets_gets_a_row_per_target_naming_its_models():
    timing = Timing(100e-6, 101e-6, 1, (100e-6,), (101e-6,))
    plain = _fake_case("jax", "gradient", PREPARED, 10, 1.05)
    equinox = attrs.evolve(_fake_case("jax", "gradient", PREPARED, 10, 1.02), model="Equinox MLP")
    rows = _report.target_rows([_report.Measurement(plain, timing), _report.Measurement(equinox, timing)], None)
    assert [row[:2] for row in rows] == [
        ["prepared jax gradient (MLP), every size", "ratio <= 1.05"],
        ["prepared jax gradient (Equinox MLP), every size", "ratio <= 1.02"],
    ]


def test_one_model_under_two_targets_is_named_with_its_sizes_and_unprepared_rows_say_so():
    timing = Timing(100e-6, 108e-6, 1, (100e-6,), (108e-6,))
    small = attrs.evolve(_fake_case("torch", "gradient", PREPARED, 10, 1.10), size_label="width 8")
    wide = attrs.evolve(_fake_case("torch", "gradient", PREPARED, 10, 1.05), size_label="width 64")
    cnn = attrs.evolve(_fake_case("torch", "gradient", PREPARED, 10, 1.05), model="CNN", size_label="16x16 images")
    loose = attrs.evolve(_fake_case("torch", "gradient", UNPREPARED, 10, 1.30), size_label="width 8")
    rows = _report.target_rows([_report.Measurement(c, timing) for c in (small, wide, cnn, loose)], None)
    assert [row[:2] + row[3:] for row in rows] == [
        ["prepared torch gradient (MLP width 8)", "ratio <= 1.1", "1 of 1", "met"],
        ["prepared torch gradient (MLP width 64, CNN)", "ratio <= 1.05", "0 of 2", "**not met**"],
        ["unprepared torch gradient, width 8", "ratio <= 1.3", "1 of 1", "met"],
    ]


class FakeClock:
    """A clock that only moves when a fake function says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def function(self, *costs):
        """A function whose successive calls take ``costs`` seconds (cycling)."""
        calls = iter(range(10**9))

        def fn():
            self.now += costs[next(calls) % len(costs)]

        return fn


def test_alternate_reports_medians_of_the_blocks_and_their_ratio():
    clock = FakeClock()
    # a round's two batches of a side average: raw (5+1)/2, (3+7)/2, (1+1)/2; ours twice that
    raw, ours = clock.function(5, 1, 3, 7, 1, 1), clock.function(10, 2, 6, 14, 2, 2)
    timing = alternate(raw, ours, rounds=3, calls=1, warmup=0, clock=clock)
    assert timing.raw_rounds == (3, 5, 1) and timing.ours_rounds == (6, 10, 2)
    assert (timing.raw_s, timing.ours_s, timing.ratio) == (3, 6, 2)
    assert (timing.raw_us, timing.ours_us) == (3e6, 6e6)


def test_alternate_runs_abba_blocks_after_warming_both_up():
    order = []
    clock = FakeClock()
    raw_cost, ours_cost = clock.function(1), clock.function(1)
    raw = lambda: (order.append("raw"), raw_cost())  # noqa: E731
    ours = lambda: (order.append("ours"), ours_cost())  # noqa: E731
    alternate(raw, ours, rounds=2, calls=2, warmup=1, clock=clock)
    assert order == ["raw", "ours"] + (["raw"] * 2 + ["ours"] * 4 + ["raw"] * 2) * 2


def test_alternate_averages_a_round_over_its_calls_and_picks_the_slower_sides_count():
    clock = FakeClock()
    raw, ours = clock.function(2), clock.function(5)
    assert calls_for(raw, 10, clock) == 5
    timing = alternate(raw, ours, rounds=4, round_s=20, warmup=0, clock=clock)
    assert timing.calls_per_round == 2  # 2 calls of the slower side fill a batch, half a 20 s round
    assert (timing.raw_s, timing.ours_s, timing.ratio) == (2, 5, 2.5)


def _fake_case(framework, operator, family, size, target=None):
    return Case(framework, operator, family, "MLP", size, f"width {size}", raw=lambda: 1.0, ours=lambda: 1.0, target=target)


def test_report_writes_the_tables_targets_and_a_png(tmp_path):
    timing = lambda raw, ours: Timing(raw, ours, 1, (raw,), (ours,))  # noqa: E731
    measurements = [
        _report.Measurement(_fake_case("jax", "gradient", PREPARED, 10, 1.05), timing(100e-6, 101e-6)),
        _report.Measurement(_fake_case("jax", "gradient", PREPARED, 1000, 1.05), timing(200e-6, 300e-6)),
        _report.Measurement(_fake_case("torch", "jacobian", PREPARED, 8, 1.2), error="RuntimeError: boom"),
        _report.Measurement(_fake_case("torch", "gradient", UNPREPARED, 10), timing(1e-3, 2e-3)),
        _report.Measurement(_fake_case("torch", "gradient", SCALING, 1000, 1.05), timing(1e-3, 1e-3)),
    ]
    closure = _closure.ClosureResult(batches=50, width=64, closure_s=10.0, constant_s=0.25,
                                     closure_traces=50, constant_traces=1)
    text = _report.markdown(measurements, closure, {"date": "2026-01-01", "CPUs": "2"}, seconds=12, rounds=3, quick=False)
    output = tmp_path / "docs" / "benchmarks.md"
    plot = _report.write(text, measurements, output)

    page = output.read_text()
    assert "| jax | gradient | MLP | width 10 | 10 | `jax.jit(jax.grad(f))` | 100.0 | 101.0 | +1.0 | 1.010 | <= 1.05: met |" in page
    assert "| jax | gradient | MLP | width 1000 | 1,000 | `jax.jit(jax.grad(f))` | 200.0 | 300.0 | +100.0 | 1.500 | <= 1.05: **not met** |" in page
    assert "| torch | jacobian | MLP | width 8 | 8 | `torch.func.jacrev` | - | - | - | error: RuntimeError: boom | <= 1.2: **not met** |" in page
    assert "| torch | gradient | MLP | width 10 | 10 | `torch.autograd.grad` | 1,000.0 | 2,000.0 | +1,000.0 | 2.000 |" in page
    assert "| prepared jax gradient, every size | ratio <= 1.05 | worst 1.500 (MLP, width 1000) | 1 of 2 | **not met** |" in page
    assert "| prepared torch gradient, every size | ratio <= 1.05 | worst 1.000 (MLP, width 1000) | 1 of 1 | met |" in page
    assert "| prepared torch jacobian, every size | ratio <= 1.2 | errors | 0 of 1 | **not met** |" in page
    assert "| closure vs Constant, 50 batches | speedup >= 20x | 40.0x |  | met |" in page
    assert "| one `ad.prepare(ad.gradient, loss, Active(p), Constant(x0))` | 0.250 | 1 |" in page
    assert "| 2026-01-01 |" in page and "![" in page and _report.PLOT_NAME in page
    assert plot == output.parent / "assets" / "benchmarks.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_runs_end_to_end_on_a_few_cases(tmp_path, monkeypatch, cases, capsys):
    few = [c for c in cases if c.operator == "gradient" and c.family == PREPARED and c.model == "MLP"][:2]
    monkeypatch.setattr(bench_main, "build_cases", lambda sizes: few)
    monkeypatch.setattr(bench_main, "QUICK", attrs.evolve(bench_main.QUICK, closure_batches=2, rounds=1))
    output = tmp_path / "page.md"
    assert bench_main.main(["--quick", "--output", str(output)]) == 0
    page = output.read_text()
    assert "`--quick` run" in page
    assert "closure vs Constant, 2 batches" in page
    assert (tmp_path / "assets" / "benchmarks.png").is_file()
    assert "wrote" in capsys.readouterr().out


def test_a_jax_call_is_timed_bare_only_where_its_result_is_ready_when_it_returns():
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks._cases_jax import blocked

    square = jax.jit(lambda x: {"y": x**2, "mask": None})
    before = jax.config.read("jax_cpu_enable_async_dispatch")
    try:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        bare = blocked(square, jnp.arange(3.0))
        assert isinstance(bare, functools.partial)  # no walk over the result is timed
        assert bare()["y"].is_ready()
        # a result without arrays cannot be seen ready: it is blocked on
        assert not isinstance(blocked(lambda: {"mask": None}), functools.partial)
        jax.config.update("jax_cpu_enable_async_dispatch", True)
        assert not isinstance(blocked(square, jnp.arange(3.0)), functools.partial)
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", before)
