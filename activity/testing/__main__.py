"""``python -m activity.testing``: run the catalogues on the installed backends, print the matrix.

    python -m activity.testing                          # default and nn catalogues, every installed framework
    python -m activity.testing --framework torch --scenarios nn --seed 3
    python -m activity.testing --select lstm,gru        # only scenarios whose name contains one of these
    python -m activity.testing --bench                  # time prepared gradients against raw calls (no check)
    python -m activity.testing --list                   # print the scenario names

Exit status: 0 when every case that ran passed; 1 when a backend failed a
scenario it supports (or a benchmark could not run); 2 when the run would
check nothing (no scenario selected, every framework missing) or the
arguments are wrong. A framework or catalogue that cannot run is named, with
the reason and the command that installs what it needs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import numpy as np

from .._imports import install_command, is_installed

FRAMEWORKS = ("numpy", "jax", "torch")
CATALOGUES = ("default", "nn")
OK, FAILED, NOTHING = 0, 1, 2


def _catalogue(framework: str, kinds: list[str], seed: int, transforms: bool, notes: list[str]) -> list[Any]:
    """The scenarios of ``kinds`` for ``framework``, named ``framework/name``; what cannot be built goes to ``notes``."""
    from activity.testing import batchify, cachify, closurify, constantify, default_scenarios, nn_scenarios

    scenarios = []
    if "default" in kinds:
        base = default_scenarios(framework)
        scenarios += base
        if transforms:
            scenarios += constantify(base) + cachify(base) + closurify(base) + batchify(base)
    if "nn" in kinds and framework != "numpy":
        try:
            scenarios += nn_scenarios(framework, seed=seed)
        except ImportError as error:
            missing = getattr(error, "name", None) or "a package"
            why = "is not installed" if not is_installed(missing) else f"cannot be imported ({type(error).__name__}: {error})"
            notes.append(f"skipped the {framework} nn catalogue: {missing} {why}; install it with `{install_command(missing)}`")
    for s in scenarios:
        s.name = f"{framework}/{s.name}"
    return scenarios


def _backends(framework: str) -> list[Any]:
    import activity as ad

    backend = {"numpy": ad.AutoFiniteDifferences, "jax": ad.AutoJAX, "torch": ad.AutoTorch}[framework]
    return [backend()]  # only the framework asked for: constructing another needs it installed


def _time(fn: Any, repeat: int = 15, inner: int = 10) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _loss(scenario: Any) -> Any:
    """``f``, returning only the value where it also returns aux."""
    f = scenario.f
    if scenario.options.get("has_aux", False):
        return lambda *values: f(*values)[0]
    return f


def _raw_jax(scenario: Any, values: list[Any], active: set[Any]) -> Any:
    """``jax.jit(jax.grad(...))`` over the floating leaves of the Active arguments; other array leaves are
    arguments too (not baked into the compiled function), non-array leaves (names, Python numbers, Equinox's
    functions) are closed over, as ``eqx.filter_jit`` would."""
    import jax
    import jax.numpy as jnp

    f, flat = _loss(scenario), [jax.tree_util.tree_flatten(v) for v in values]
    diff: list[Any]
    rest: list[Any]
    diff, rest, slots = [], [], []
    for i, (leaves, _) in enumerate(flat):
        arg_slots = []
        for leaf in leaves:
            is_array = isinstance(leaf, (jax.Array, np.ndarray))
            if is_array and i in active and jnp.issubdtype(leaf.dtype, jnp.inexact):
                arg_slots.append(("diff", len(diff)))
                diff.append(leaf)
            elif is_array:
                arg_slots.append(("rest", len(rest)))
                rest.append(leaf)
            else:
                arg_slots.append(("static", leaf))
        slots.append(arg_slots)
    if not diff:
        return None

    def loss(diff: list[Any], rest: list[Any]) -> Any:
        args = []
        for (_, treedef), arg_slots in zip(flat, slots):
            leaves = [diff[k] if kind == "diff" else rest[k] if kind == "rest" else k for kind, k in arg_slots]
            args.append(jax.tree_util.tree_unflatten(treedef, leaves))
        return f(*args)

    raw = jax.jit(jax.grad(loss))
    return lambda: jax.block_until_ready(raw(diff, rest))  # type: ignore[no-untyped-call]


def _raw_torch(scenario: Any, values: list[Any], active: set[Any]) -> Any:
    """``torch.autograd.grad`` with respect to the Active modules' parameters and floating tensors."""
    import torch
    from torch.utils import _pytree

    wrt: list[Any]
    f, args, wrt = _loss(scenario), [], []
    for i, value in enumerate(values):
        if i in active and isinstance(value, torch.nn.Module):
            wrt += [p for p in value.parameters() if p.requires_grad]
            args.append(value)
        elif i in active:
            leaves, spec = _pytree.tree_flatten(value)
            leaves = [
                leaf.detach().clone().requires_grad_(True) if torch.is_tensor(leaf) and leaf.is_floating_point() else leaf
                for leaf in leaves
            ]
            wrt += [leaf for leaf in leaves if torch.is_tensor(leaf) and leaf.requires_grad]
            args.append(_pytree.tree_unflatten(leaves, spec))
        else:
            args.append(value)
    if not wrt:
        return None
    return lambda: torch.autograd.grad(f(*args), wrt, allow_unused=True)


def _raw_gradient(scenario: Any) -> Any:
    """The hand-written call a user would make for a gradient scenario, or None."""
    values = copy.deepcopy([a.value for a in scenario.args])  # a train-mode layer must not touch the scenario's
    active = {i for i, a in enumerate(scenario.args) if a.kind == "active"}
    if scenario.framework == "jax":
        return _raw_jax(scenario, values, active)
    if scenario.framework == "torch":
        return _raw_torch(scenario, values, active)
    return None


def bench(scenarios: list[Any], repeat: int = 15, out: Any = None) -> tuple[int, int]:
    """Print the prepared gradient's time against the raw call for every JAX and torch gradient scenario.

    Returns (rows timed, rows that could not be timed).
    """
    import activity as ad

    out = out or sys.stdout
    timed, errors = 0, 0
    print("\n| scenario | raw (us) | prepared activity (us) | ratio |\n| --- | --- | --- | --- |", file=out, flush=True)
    for s in scenarios:
        if s.op != "gradient" or s.framework == "numpy":
            continue
        try:
            raw = _raw_gradient(s)
            if raw is None:
                continue
            backend = _backends(s.framework)[0]
            prep = ad.prepare(ad.gradient, s.f, *s.args, backend=backend, **s.options)
            if s.framework == "jax":
                import jax

                ours = lambda prep=prep, s=s: jax.block_until_ready(prep(*s.args))  # type: ignore[no-untyped-call]  # noqa: E731
            else:
                ours = lambda prep=prep, s=s: prep(*s.args)  # noqa: E731
            t_raw, t_ours = _time(raw, repeat), _time(ours, repeat)
        except Exception as error:  # noqa: BLE001 - one scenario's problem, reported in its row
            errors += 1
            print(f"| {s.name} | error: {type(error).__name__}: {str(error).splitlines()[0][:200]} | | |", file=out, flush=True)
            continue
        timed += 1
        print(f"| {s.name} | {t_raw * 1e6:.1f} | {t_ours * 1e6:.1f} | {t_ours / t_raw:.2f} |", file=out, flush=True)
    return timed, errors


def _names(text: str, choices: tuple[str, ...], option: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in choices]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"{option}: {', '.join(map(repr, wrong)) or 'nothing'} is not one of {', '.join(choices)}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m activity.testing",
        description=__doc__.splitlines()[0],
        epilog="Exit status: 0 all passed, 1 a backend failed, 2 nothing checked or wrong arguments.",
    )
    parser.add_argument(
        "--framework",
        type=lambda text: _names(text, FRAMEWORKS, "--framework"),
        default=None,
        help="comma-separated: numpy,jax,torch (default: the installed ones)",
    )
    parser.add_argument(
        "--scenarios",
        type=lambda text: _names(text, CATALOGUES, "--scenarios"),
        default=list(CATALOGUES),
        help="comma-separated catalogues: default,nn",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the nn catalogue")
    parser.add_argument("--select", default=None, help="comma-separated: only scenarios whose name contains one of these")
    parser.add_argument("--transforms", action="store_true", help="add constantify/cachify/closurify/batchify variants")
    parser.add_argument("--bench", action="store_true", help="time prepared gradients against the raw backend calls (no correctness run)")
    parser.add_argument("--repeat", type=int, default=15, help="--bench: timing samples per scenario (median taken)")
    parser.add_argument("--list", action="store_true", help="print the selected scenario names and exit")
    return parser


def _frameworks(requested: list[str] | None, notes: list[str]) -> tuple[list[str], list[str]]:
    """The frameworks to run, and errors for requested ones that are missing."""
    errors = []
    chosen = []
    for framework in requested or FRAMEWORKS:
        if framework == "numpy" or is_installed(framework):
            chosen.append(framework)
        elif requested:
            errors.append(f"--framework {framework}: {framework} is not installed; install it with `{install_command(framework)}`")
        else:
            notes.append(f"skipped {framework}: not installed; install it with `{install_command(framework)}`")
    return chosen, errors


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    notes: list[str] = []
    frameworks, errors = _frameworks(args.framework, notes)
    if errors:
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        return NOTHING
    for note in notes:
        print(note, flush=True)
    if "torch" in frameworks:
        import torch

        torch.set_num_threads(1)  # this process only: tiny tensors run fastest on one thread
    catalogues: dict[str, list[Any]] = {}
    for framework in frameworks:
        before = len(notes)
        scenarios = _catalogue(framework, args.scenarios, args.seed, args.transforms, notes)
        for note in notes[before:]:
            print(note, flush=True)
        everything = len(scenarios)
        if args.select:
            wanted = [w for w in args.select.split(",") if w]
            scenarios = [s for s in scenarios if any(w in s.name for w in wanted)]
        catalogues[framework] = scenarios
        if everything and not scenarios:
            notes.append(f"{framework}: none of its {everything} scenarios matches --select {args.select!r}")
    selected = [s for scenarios in catalogues.values() for s in scenarios]
    if not selected:
        _nothing(args, frameworks, notes)
        return NOTHING
    if args.list:
        print("\n".join(s.name for s in selected))
        return OK
    if args.bench:
        timed, failed = bench(selected, repeat=args.repeat)
        if not timed and not failed:
            print(
                "\nerror: nothing to time: --bench times the gradient scenarios of jax and torch, and none was selected "
                "(numpy has no raw baseline).",
                file=sys.stderr,
            )
            return NOTHING
        _print_notes(notes)
        return FAILED if failed else OK
    return _check(catalogues, notes)


def _check(catalogues: dict[str, list[Any]], notes: list[str]) -> int:
    from activity.testing import test_differentiation
    from activity.testing._runner import Report

    all_outcomes, backend_names, scenario_names = [], [], []
    for framework, scenarios in catalogues.items():
        if not scenarios:
            continue
        backends = _backends(framework)
        total, done = len(scenarios) * len(backends), [0]

        def progress(outcome: Any, total: int = total, done: list[Any] = done) -> None:
            done[0] += 1
            print(
                f"[{done[0]:>3}/{total}] {outcome.backend:<22} {outcome.scenario:<48} {outcome.status:<11} {outcome.seconds:6.2f}s",
                flush=True,
            )

        report = test_differentiation(backends, scenarios, progress=progress, raise_on_failure=False)
        all_outcomes += report.outcomes
        backend_names += [b for b in report.backends if b not in backend_names]
        scenario_names += report.scenarios
    report = Report(backend_names, scenario_names, all_outcomes)
    print("\nCompatibility matrix (pass / FAIL / unsupported / n/a), reference: each scenario's result, else AutoFiniteDifferences in float64\n")
    print(report.table())
    for failure in report.failures:
        print("\n" + failure.message)
    _print_notes(notes)
    if not report.checked:
        print("\nerror: nothing was checked: every selected case is unsupported or not applicable.", file=sys.stderr)
        return NOTHING
    return FAILED if report.failures else OK


def _print_notes(notes: list[str]) -> None:
    if notes:
        print("\nNot run:\n" + "\n".join(f"  {note}" for note in notes))


def _nothing(args: Any, frameworks: list[str], notes: list[str]) -> None:
    lines = ["error: nothing to check: no scenario was selected."]
    lines += [f"  {note}" for note in notes]
    if args.select:
        lines.append(f"  --select {args.select!r} matches no scenario name of {', '.join(args.scenarios)} in {', '.join(frameworks)}.")
        lines.append("  Names look like numpy/gradient-vector_to_scalar or torch/lstm; print them with --list.")
    if args.scenarios == ["nn"] and frameworks == ["numpy"]:
        lines.append("  numpy has no nn catalogue: use --framework torch or jax.")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
