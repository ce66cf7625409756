"""`python -m benchmarks`: time `activity` against the raw backend calls and write docs/benchmarks.md.

`--quick` runs tiny sizes and few rounds (seconds; for tests and for checking the
harness), `--output` chooses the markdown file (the PNG goes to `assets/` beside it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]


@attrs.frozen
class Sizes:
    mlp_widths: tuple[int, ...]
    vector_sizes: tuple[int, ...]
    unprepared_widths: tuple[int, ...]
    # MLP widths w giving 2 w^2 + 4 w + 1 parameters of about 1e3, 1e4, 1e5, 1e6.
    scaling_widths: tuple[int, ...]
    closure_batches: int
    closure_repeats: int
    rounds: int
    round_s: float


FULL = Sizes(
    mlp_widths=(8, 64, 256, 1024), vector_sizes=(8, 64, 256), unprepared_widths=(8, 1024),
    scaling_widths=(22, 70, 223, 706), closure_batches=50, closure_repeats=3, rounds=41, round_s=0.02,
)
QUICK = Sizes(
    mlp_widths=(4, 8), vector_sizes=(4, 8), unprepared_widths=(4,),
    scaling_widths=(4, 8), closure_batches=5, closure_repeats=1, rounds=3, round_s=0.001,
)


def build_cases(sizes: Sizes, frameworks=("jax", "torch")):
    """Every case, grouped by family; the builders compile and prepare, so this takes a while."""
    from . import _cases_jax, _cases_torch

    modules = {"jax": _cases_jax, "torch": _cases_torch}
    cases = []
    for framework in frameworks:
        module = modules[framework]
        cases += module.prepared_cases(sizes.mlp_widths, sizes.vector_sizes)
        cases += module.unprepared_cases(sizes.unprepared_widths)
        cases += module.scaling_cases(sizes.scaling_widths)
    if "jax" in frameworks and "torch" in frameworks:
        from . import _cases_mixing

        cases += _cases_mixing.cases((sizes.mlp_widths[0], sizes.mlp_widths[-1]))
    from ._cases_masks import mask_cases

    cases += mask_cases(tuple(frameworks), sizes.mlp_widths)
    return cases


def measure(case, sizes: Sizes):
    from ._report import Measurement
    from ._timing import alternate

    try:
        case.check()
        timing = alternate(case.raw, case.ours, rounds=sizes.rounds, round_s=sizes.round_s)
    except Exception as error:  # noqa: BLE001 - a broken case is reported on the page, not hidden
        return Measurement(case, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
    return Measurement(case, timing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (seconds, not meaningful timings)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="markdown page to write; the plot goes to assets/benchmarks.png beside it")
    args = parser.parse_args(argv)

    import torch

    # One thread: a ratio then compares the same single-threaded work on both sides.
    torch.set_num_threads(1)
    import jax

    # Every timed JAX call blocks on its result. With JAX's default asynchronous CPU dispatch
    # that wait is a hand-over between threads, which takes 25 to 75 us in two modes a round
    # falls into on either side; with synchronous dispatch the same calls repeat to 0.1 %,
    # and the ratio shows the cost of activity's own work at its full weight.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    from . import _closure, _report

    sizes = QUICK if args.quick else FULL
    start = time.perf_counter()
    measurements = []
    for case in build_cases(sizes):
        m = measure(case, sizes)
        measurements.append(m)
        status = f"ratio {m.ratio:.3f}" if m.timing else m.error
        print(f"{time.perf_counter() - start:6.1f}s  {case.name}: {status}", flush=True)
    closure = _closure.run(batches=sizes.closure_batches, repeats=sizes.closure_repeats)
    print(f"{time.perf_counter() - start:6.1f}s  closure vs Constant: {closure.speedup:.1f}x "
          f"({closure.closure_traces} vs {closure.constant_traces} traces)", flush=True)
    from ._cases_torch import memory_case

    memory = _report.Memory(max(sizes.mlp_widths), *memory_case(max(sizes.mlp_widths)))
    print(f"{time.perf_counter() - start:6.1f}s  memory saved for backward, MLP width {memory.width}: "
          f"ratio {memory.ratio:.3f}", flush=True)

    seconds = time.perf_counter() - start
    text = _report.markdown(measurements, closure, _report.environment(), seconds=seconds,
                            rounds=sizes.rounds, round_s=sizes.round_s, closure_repeats=sizes.closure_repeats, quick=args.quick,
                            memory=memory)
    plot = _report.write(text, measurements, args.output)
    print()
    print(_report.measurement_table(measurements))
    print()
    print(_report.closure_table(closure))
    print()
    print(_report._table(["target", "limit", "measured", "cases within", "status"],
                         _report.target_rows(measurements, closure, memory)))
    print(f"\nwrote {args.output} and {plot} in {seconds:.0f} s")
    return 0


# glibc hands large freed blocks back to the system and maps them afresh on the next call:
# a 10 ms Hessian-vector product then takes 12 or 18 ms depending on whether its pages were
# still mapped, on either side. Keeping freed memory in the process makes rounds repeat to
# about 1 %; both sides run under the same setting, as they do with one torch thread.
_STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


if __name__ == "__main__":
    if sys.platform.startswith("linux") and any(key not in os.environ for key in _STEADY_MALLOC):
        # glibc reads these when the process starts: run the harness again with them set
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *sys.argv[1:]], {**os.environ, **_STEADY_MALLOC})
    sys.exit(main())
