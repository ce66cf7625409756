"""``python -m activity.testing``: run the catalogues on the installed backends, print the matrix.

    python -m activity.testing                          # default and nn catalogues, every framework
    python -m activity.testing --framework torch --scenarios nn --seed 3
    python -m activity.testing --bench                  # also time prepared gradients against raw calls

Exit status 1 when any backend fails any scenario it supports.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from typing import Any


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _catalogue(framework: str, kinds: list[str], seed: int, transforms: bool) -> list:
    from activity.testing import batchify, cachify, closurify, constantify, default_scenarios, nn_scenarios

    scenarios = []
    if "default" in kinds:
        base = default_scenarios(framework)
        scenarios += base
        if transforms:
            scenarios += constantify(base) + cachify(base) + closurify(base) + batchify(base)
    if "nn" in kinds and framework != "numpy":
        scenarios += nn_scenarios(framework, seed=seed)
    for s in scenarios:
        s.name = f"{framework}/{s.name}"
    return scenarios


def _backends(framework: str) -> list:
    import activity as ad

    return {"numpy": [ad.AutoFiniteDifferences()], "jax": [ad.AutoJAX()], "torch": [ad.AutoTorch()]}[framework]


def _time(fn: Any, repeat: int = 15, inner: int = 10) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _raw_gradient(scenario: Any) -> Any:
    """The hand-written call a user would make for a gradient scenario, or None."""
    values = [a.value for a in scenario.args]
    active = [i for i, a in enumerate(scenario.args) if a.kind == "active"]
    if scenario.framework == "jax":
        import jax

        raw = jax.jit(jax.grad(scenario.f, argnums=tuple(active)))
        return lambda: jax.block_until_ready(raw(*values))
    if scenario.framework == "torch":
        import torch

        params = []
        for i in active:
            value = values[i]
            params += [p for p in value.parameters() if p.requires_grad] if isinstance(value, torch.nn.Module) else []
        if not params:
            return None
        return lambda: torch.autograd.grad(scenario.f(*values), params)
    return None


def bench(scenarios: list) -> None:
    import activity as ad

    print("\n| scenario | raw (us) | prepared activity (us) | ratio |\n| --- | --- | --- | --- |")
    for s in scenarios:
        if s.op != "gradient" or s.framework == "numpy":
            continue
        raw = _raw_gradient(s)
        if raw is None:
            continue
        backend = _backends(s.framework)[0]
        prep = ad.prepare(ad.gradient, s.f, *s.args, backend=backend)
        values = [a.value for a in s.args]
        if s.framework == "jax":
            import jax

            ours = lambda prep=prep, values=values: jax.block_until_ready(prep(*values))  # noqa: E731
        else:
            ours = lambda prep=prep, values=values: prep(*values)  # noqa: E731
        t_raw, t_ours = _time(raw), _time(ours)
        print(f"| {s.name} | {t_raw * 1e6:.1f} | {t_ours * 1e6:.1f} | {t_ours / t_raw:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m activity.testing", description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default=None, help="comma-separated: numpy,jax,torch (default: installed ones)")
    parser.add_argument("--scenarios", default="default,nn", help="comma-separated: default,nn")
    parser.add_argument("--seed", type=int, default=0, help="seed of the nn catalogue")
    parser.add_argument("--select", default=None, help="only scenarios whose name contains this text")
    parser.add_argument("--transforms", action="store_true", help="add constantify/cachify/closurify/batchify variants")
    parser.add_argument("--bench", action="store_true", help="time prepared gradients against the raw backend calls")
    args = parser.parse_args(argv)

    from activity.testing import test_differentiation
    from activity.testing._runner import Report

    frameworks = args.framework.split(",") if args.framework else [
        f for f in ("numpy", "jax", "torch") if f == "numpy" or (_installed(f) and (f != "jax" or _installed("equinox")))
    ]
    kinds = args.scenarios.split(",")
    if "torch" in frameworks:
        import torch

        torch.set_num_threads(1)  # this process only: tiny tensors run fastest on one thread
    all_outcomes, backend_names, scenario_names, scenarios_run = [], [], [], []
    for framework in frameworks:
        scenarios = _catalogue(framework, kinds, args.seed, args.transforms)
        if args.select:
            scenarios = [s for s in scenarios if args.select in s.name]
        backends = _backends(framework)
        total, done = len(scenarios) * len(backends), [0]

        def progress(outcome: Any, total: int = total, done: list = done) -> None:
            done[0] += 1
            print(f"[{done[0]:>3}/{total}] {outcome.backend:<22} {outcome.scenario:<48} {outcome.status:<11} {outcome.seconds:6.2f}s", flush=True)

        report = test_differentiation(backends, scenarios, progress=progress, raise_on_failure=False)
        all_outcomes += report.outcomes
        backend_names += [b for b in report.backends if b not in backend_names]
        scenario_names += report.scenarios
        scenarios_run += scenarios
    report = Report(backend_names, scenario_names, all_outcomes)
    print("\nCompatibility matrix (pass / FAIL / unsupported), reference: AutoFiniteDifferences in float64\n")
    print(report.table())
    for failure in report.failures:
        print("\n" + failure.message)
    if args.bench:
        bench(scenarios_run)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
