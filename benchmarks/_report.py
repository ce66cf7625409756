"""The benchmark page: markdown tables with short explanations, and one PNG of the ratios."""

from __future__ import annotations

import datetime
import os
import platform
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import attrs

from ._case import PREPARED, SCALING, UNPREPARED, Case
from ._closure import CLOSURE_TARGET, ClosureResult
from ._timing import Timing

PLOT_NAME = "assets/benchmarks.png"


@attrs.frozen
class Measurement:
    """A case with its timing, or the error that stopped it (shown, never dropped)."""

    case: Case
    timing: Timing | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.timing is None else self.timing.ratio

    @property
    def met(self) -> bool | None:
        """Whether the target holds: None without a target, False on error."""
        if self.case.target is None:
            return None
        return self.ratio is not None and self.ratio <= self.case.target


@attrs.frozen
class Memory:
    """Bytes autograd saves for the backward pass of the prepared gradient and of the raw call."""

    width: int
    raw_bytes: int
    ours_bytes: int
    target: float = 1.05

    @property
    def ratio(self) -> float:
        return self.ours_bytes / self.raw_bytes


def environment() -> dict[str, str]:
    import jax
    import numpy
    import torch

    return {
        "date": datetime.date.today().isoformat(),
        "CPUs": str(os.cpu_count()),
        "machine": f"{platform.system()} {platform.machine()}",
        "Python": platform.python_version(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch threads": str(torch.get_num_threads()),
    }


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "(no target)"}[met]


def _cells(m: Measurement) -> list[str]:
    if m.timing is None:
        return ["-", "-", "-", f"error: {m.error}"]
    t = m.timing
    return [f"{t.raw_us:,.1f}", f"{t.ours_us:,.1f}", f"{t.ours_us - t.raw_us:+,.1f}", f"{t.ratio:.3f}"]


def _target_cell(m: Measurement) -> str:
    if m.case.target is None:
        return ""
    return f"<= {m.case.target:g}: {_verdict(m.met)}"


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


RAW_NAMES = {
    ("jax", "gradient", PREPARED): "`jax.jit(jax.grad(f))`",
    ("jax", "pullback", PREPARED): "`jax.jit` of `jax.vjp`",
    ("jax", "pushforward", PREPARED): "`jax.jit` of `jax.jvp`",
    ("jax", "jacobian", PREPARED): "`jax.jit(jax.jacrev(f))`",
    ("jax", "hessian", PREPARED): "`jax.jit(jax.hessian(f))`",
    ("jax", "hvp", PREPARED): "`jax.jit` of `jax.jvp(jax.grad(f))`",
    ("jax", "gradient", UNPREPARED): "`jax.grad(f)` (eager)",
    ("jax", "pullback", UNPREPARED): "`jax.vjp` (eager)",
    ("torch", "gradient", PREPARED): "`torch.autograd.grad`",
    ("torch", "pullback", PREPARED): "`torch.autograd.grad(out, params, ct)`",
    ("torch", "pushforward", PREPARED): "`torch.func.jvp`",
    ("torch", "jacobian", PREPARED): "`torch.func.jacrev`",
    ("torch", "hessian", PREPARED): "`torch.func.hessian`",
    ("torch", "hvp", PREPARED): "`torch.func.jvp(torch.func.grad(f))`",
    ("torch", "gradient", UNPREPARED): "`torch.autograd.grad`",
    ("torch", "pullback", UNPREPARED): "`torch.autograd.grad(out, params, ct)`",
}


def _raw_name(case: Case) -> str:
    if case.raw_name:
        return case.raw_name
    family = UNPREPARED if case.family == UNPREPARED else PREPARED  # scaling times the prepared call
    return RAW_NAMES.get((case.framework, case.operator, family), "")


def measurement_table(measurements: list[Measurement], *, targets: bool = True) -> str:
    header = ["framework", "operator", "model", "size", "parameters / inputs", "raw", "raw (us)", "activity (us)", "extra (us)", "ratio"]
    if targets:
        header.append("target")
    rows = []
    for m in measurements:
        c = m.case
        row = [c.framework, c.operator, c.model, c.size_label, f"{c.size:,}",
               _raw_name(c), *_cells(m)]
        if targets:
            row.append(_target_cell(m))
        rows.append(row)
    return _table(header, rows)


def target_rows(
    measurements: list[Measurement], closure: ClosureResult | None, memory: Memory | None = None
) -> list[list[str]]:
    """One row per (framework, operator) with a target: its worst ratio over every size and model."""
    groups: dict[tuple[str, str, str, float], list[Measurement]] = defaultdict(list)
    for m in measurements:
        if m.case.target is not None and m.case.family in (PREPARED, SCALING, UNPREPARED):
            family = UNPREPARED if m.case.family == UNPREPARED else PREPARED
            groups[(family, m.case.framework, m.case.operator, m.case.target)].append(m)
    # An operator with cases of two targets (Equinox gradients, the width-8 torch MLP) gets a
    # row per target, naming its models (and the size, where it is one).
    rows = []
    for (family, framework, operator, target), group in groups.items():
        errors = [m for m in group if m.timing is None]
        timed = [m for m in group if m.timing is not None]
        worst = max(timed, key=lambda m: m.ratio, default=None)
        failing = [m for m in group if not m.met]
        measured = "errors" if worst is None else f"worst {worst.ratio:.3f} ({worst.case.model}, {worst.case.size_label})"
        if errors and worst is not None:
            measured += f"; {len(errors)} case(s) failed to run"
        models, what = "", "every size"
        siblings = [g for k, g in groups.items() if k[:3] == (family, framework, operator) and g is not group]
        if siblings:
            shared = {m.case.model for g in siblings for m in g}  # a model under two targets: named with its sizes
            sized = [m for m in group if m.case.model in shared]
            names = dict.fromkeys(
                (f"{m.case.model} {m.case.size_label}" if len(sized) <= 2 else f"{m.case.model} (other sizes)")
                if m.case.model in shared else m.case.model
                for m in group
            )
            models = " (" + ", ".join(names) + ")"
            what = "every size" if not shared & {m.case.model for m in group} else ""
        elif family == UNPREPARED and len({m.case.size_label for m in group}) == 1:
            what = group[0].case.size_label
        rows.append([
            f"{family} {framework} {operator}{models}" + (f", {what}" if what else ""), f"ratio <= {target:g}", measured,
            f"{len(group) - len(failing)} of {len(group)}", _verdict(not failing),
        ])
    if closure is not None:
        rows.append([
            f"closure vs Constant, {closure.batches} batches", f"speedup >= {CLOSURE_TARGET:g}x",
            f"{closure.speedup:.1f}x", "", _verdict(closure.speedup >= CLOSURE_TARGET),
        ])
    if memory is not None:
        rows.append([
            f"torch prepared gradient, memory saved for backward, MLP width {memory.width}",
            f"ratio <= {memory.target:g}", f"{memory.ratio:.3f}", "", _verdict(memory.ratio <= memory.target),
        ])
    return rows


def overhead_summary(measurements: list[Measurement]) -> str:
    """The median time a prepared first-order call adds, per framework: a fixed cost per call."""
    import statistics

    parts = []
    for framework in sorted({m.case.framework for m in measurements}):
        extras = [m.timing.ours_us - m.timing.raw_us for m in measurements
                  if m.timing is not None and m.case.framework == framework
                  and m.case.family in (PREPARED, SCALING) and m.case.operator in FIRST_ORDER]
        if extras:
            parts.append(f"{framework} {statistics.median(extras):+.1f} us")
    if not parts:
        return ""
    return ("Median time a prepared gradient, pullback or pushforward adds per call, over all sizes: "
            + ", ".join(parts) + ". It hardly depends on the size of the model, so it weighs on "
            "calls of a few hundred microseconds and fades on larger ones; that is why the ratios "
            "fall as the models grow.")


WHERE_THE_TIME_GOES = """## Where the remaining time goes

**JAX.** A prepared JAX operator is one `jax.jit` of the whole call: the checks of the
arguments and their split into differentiated and constant leaves are traced with the
derivative, so JAX's C++ dispatch checks shapes and dtypes and finds the compiled code,
as it does for the raw `jax.jit(jax.grad(f))`. A strict prepared call without keyword
arguments for `f` is that dispatch and nothing else: the prepared object's `__call__` is a
`jax.jit` dispatch of its own, whose cache-miss handler is activity's (a call of another
signature, or with annotated arguments, reaches the checked path with the caller's own
arguments). Where the result is not what JAX would give back (a dict whose keys JAX
sorts, a mask's `None`), its arrays leave the compiled call as a flat tuple, and the
structure JAX's dispatch rebuilds in C++ after each call is one built from the result,
its dict keys in the argument's order. No Python frame of activity's runs on such a call.
What a row still shows is noise, and, on `pullback`, `pushforward` and `hvp`, the keyword by
which a prepared call takes its tangent or cotangent: JAX's C++ dispatch takes an argument
by keyword about 0.7 us more slowly than by position, which the raw side uses. On the
8 us `hvp` of a vector that alone is 9 %; it stays while the prepared call's signature is
`f`'s arguments followed by named tangents. A result holding other containers (a namedtuple, a custom node), a model
with non-array leaves (an Equinox module) and `f` calling back into Python keep one frame
of activity's. The masked-gradient rows compare two prepared calls whose results are
rebuilt differently (a nested structure with `None` against a two-key dict).

**PyTorch.** A prepared torch `gradient`, a `pullback` of one cotangent and an `hvp` of
one tangent run straight on the autograd tape; every other operator runs its pipeline,
past the prepared object's general dispatch. Before `f` runs, the arguments are checked
against the prepared signature by a split made once at `prepare`: a module by its
description (every submodule, parameter and buffer slot holds the same object, each
tensor has the prepared shape, dtype, device and `requires_grad`, no instance attribute
was added or redirected: a few C-level passes, no walk, no names), a tensor by its type,
shape, dtype and device. A difference sends the call to the checked path, which
describes the module again or says what changed. Three things used to cost more than the
forward and backward passes of a small model, and are gone:

- *Fresh tape leaves and a new view of the module on every call.* The view (a structural
  copy whose parameters are the differentiated tensors, so a Constant or tied use of a
  parameter is never differentiated, and buffers, flags and `.grad` of the user's module
  never change) is now built once per prepared signature with tape leaves that alias the
  parameters (`detach()`: the same storage, so optimizer steps are seen), and re-pointed
  per call: each copied submodule's `__dict__` is copied again from the user's module
  (`train()`/`eval()`, attributes), its own slots put back, its buffer copies overwritten
  with the user's buffers (BatchNorm statistics start from the user's, which never change).
  A parameter given new storage (`p.data = ...`) gets new leaves; a view that `f` kept a
  reference to is left alone and another one made. An RNN's weight references point at the
  view's weights, so its forward no longer rebuilds them on every call.
- *The argument handling of `torch.autograd.grad`.* Plain tensors whose cotangents
  activity has checked go straight to the autograd engine, as `torch.autograd.grad` does
  after that handling (a tensor subclass takes the public call); this is why a small
  prepared Hessian-vector product costs no more than the hand-written double backward.
- *`torch.func.jvp` for one tangent.* Forward mode of one tangent runs on dual tensors
  (`torch.autograd.forward_ad`), the same forward-mode rules without the transform's
  wrapping of every input and output: about a third of the time on the small MLPs. Where
  `f` runs a tape operator on a dual tensor (an AutoTorch gradient inside `f`), or an
  operation has no forward-mode rule, it is redone by `torch.func.jvp` or on the tape.

What remains is the check of the module and the re-pointing of the view, a few
microseconds per module and per tensor of Python, and one read of torch's hook counter
around `f` (a hook `f` registers on the view is taken off again; writes `f` makes to the
parameters outside the tape are looked for on the first call only): it weighs on the
width-8 MLP step and fades from width 256 on. The raw call does none of it: it reuses a parameter list made
once, so a layer replaced between calls, or a parameter frozen with
`requires_grad_(False)`, silently gets a stale or wrong gradient. Unprepared torch
gradients keep the checked split of the last call of the same operator and argument kinds
(dropped with the module). A Hessian-vector product of one tangent is a double backward
on the tape, faster than `torch.func.jvp(torch.func.grad(f))` on every model here (on
dual tensors too: forward over the tape's backward pass measured 1.8x the double
backward on the width-64 MLP); where a gradient comes back without a graph (`f` linear
in that leaf, or a `@once_differentiable` backward) forward over reverse decides.

**Equinox.** A prepared JAX call whose arguments hold static leaves (an Equinox module's
activation functions) is one `jax.jit` over their array leaves: JAX flattens each
argument, its structure and static leaves are compared with the prepared ones, the
arrays go to the compiled code. That is what `eqx.filter_jit` does, with JAX's flatten
instead of `eqx.partition`.

**Jacobians and Hessians** are batched: reverse-mode Jacobians `vmap` over
`torch.func.vjp` (as `torch.func.jacrev` does) or `jax.vjp`, forward-mode ones over
`jvp`, Hessians are forward over reverse; no Python loop over columns. On torch the
reverse-mode Jacobian runs `f` once on the tape and pulls the output basis back with
`vmap` over the backward pass. On the first call of a prepared operator one more
backward pass, of a weighted sum of the basis, checks torch's batching rules on this `f`
(some are wrong in torch 2.13: `cdist`'s pulls back the first row for every row); the
verdict is kept, so later calls pay nothing for it (a wrong rule: one row at a time from
then on). Unprepared calls check every time. The torch
Hessian comes out faster than `torch.func.hessian` (`jacfwd(jacrev(f))`, a `vmap`
nested in a `vmap`): `activity` pushes the basis through one `vmap` of a
forward-over-reverse product of `torch.func.grad`. We measured this, not analysed it."""


def closure_table(closure: ClosureResult) -> str:
    return _table(
        ["", "total (s)", "traces / compilations"],
        [
            ["fresh `jax.jit(jax.grad(lambda p: loss(p, x)))` per batch", f"{closure.closure_s:.3f}", str(closure.closure_traces)],
            ["one `ad.prepare(ad.gradient, loss, Active(p), Constant(x0))`", f"{closure.constant_s:.3f}", str(closure.constant_traces)],
            ["speedup", f"{closure.speedup:.1f}x", ""],
        ],
    )


# Colour by operator, line style by framework, so jax and torch lines of one operator pair up.
OPERATOR_COLOURS = {"gradient": "tab:blue", "pullback": "tab:orange", "pushforward": "tab:green",
                    "jacobian": "tab:red", "hessian": "tab:purple", "hvp": "tab:brown"}
FRAMEWORK_STYLES = {"jax": "-", "torch": "--"}
FIRST_ORDER = ("gradient", "pullback", "pushforward")
COARSE_RATIO_TICKS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
RATIO_TICKS = (0.1, 0.2, 0.5, 0.8, 0.9, 0.95, 1, 1.05, 1.1, 1.2, 1.5, 2, 3, 5, 10, 20, 50, 100)


def write_plot(measurements: list[Measurement], path: Path) -> None:
    """Ratio against size, log-log: one panel per kind of case, one line per framework/operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [
        ("prepared, first order, MLPs", "MLP parameters",
         lambda c: c.family == PREPARED and c.operator in FIRST_ORDER and c.model.startswith("MLP")),
        ("prepared, second order and dense, f(v)", "input length n",
         lambda c: c.family == PREPARED and c.operator not in FIRST_ORDER and c.size_label.startswith("n ")),
        ("unprepared, against the raw eager call", "MLP parameters", lambda c: c.family == UNPREPARED),
        ("prepared gradient, scaling", "MLP parameters", lambda c: c.family == SCALING),
    ]
    with plt.rc_context({"font.size": 13, "axes.titlesize": 14, "axes.labelsize": 13, "legend.fontsize": 11}):
        fig, axes = plt.subplots(2, 2, figsize=(15, 11))
        for ax, (title, xlabel, selected) in zip(axes.flat, panels):
            lines: dict[tuple[str, str, str], list[tuple[int, float]]] = defaultdict(list)
            for m in measurements:
                if selected(m.case) and m.ratio is not None:
                    lines[(m.case.framework, m.case.operator, m.case.raw_name or "")].append((m.case.size, m.ratio))
            for (framework, operator, raw_name), points in sorted(lines.items()):
                points.sort()
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="s" if raw_name else "o",
                        color=OPERATOR_COLOURS.get(operator), linestyle=FRAMEWORK_STYLES.get(framework, ":"),
                        label=f"{framework} {operator}" + (" vs double backward" if "double backward" in raw_name else ""))
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.axhline(1.05, color="grey", linewidth=0.8, linestyle=":")
            ax.set_xscale("log")
            # Log ratios: a 20x outlier must not flatten the differences of a few percent.
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            ticks = RATIO_TICKS if high / low < 4 else COARSE_RATIO_TICKS  # fine ticks would overlap
            ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([t for t in ticks if low <= t <= high]))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("time ratio activity / raw")
            if lines:
                ax.legend()
        fig.suptitle("activity / raw (1.0: no overhead; dotted: 1.05). Solid: JAX, dashed: PyTorch.\n"
                     "CNN, LSTM, ResNet block, Hugging Face and Equinox models: tables only.")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
        plt.close(fig)


def markdown(
    measurements: list[Measurement],
    closure: ClosureResult | None,
    env: dict[str, str],
    *,
    seconds: float,
    rounds: int,
    quick: bool,
    round_s: float = 0.02,
    closure_repeats: int = 1,
    memory: Memory | None = None,
) -> str:
    by_family = lambda family: [m for m in measurements if m.case.family == family]  # noqa: E731
    prepared = by_family(PREPARED)
    sections = [
        "# Benchmarks",
        "This page is generated by the benchmark harness in `benchmarks/`; regenerate it with",
        "```bash\nmake bench                        # or: .venv/bin/python -m benchmarks\n"
        ".venv/bin/python -m benchmarks --quick   # tiny sizes, few rounds: checks the harness runs\n```",
        "Every number below comes from one run on the machine described here; timings on "
        "other machines differ." + (" **This is a `--quick` run: tiny sizes and few rounds, not meaningful timings.**" if quick else ""),
        "## Machine and versions",
        _table(["", "value"], [[k, v] for k, v in env.items()]),
        f"The whole run took {seconds:.0f} s. PyTorch runs with `torch.set_num_threads(1)`, "
        "so a ratio compares single-threaded work on both sides. JAX runs with synchronous CPU "
        "dispatch (`jax_cpu_enable_async_dispatch=False`): a call computes its result before it "
        "returns. With the default asynchronous dispatch a timed call must block on its result, "
        "and that wait is a hand-over between threads of "
        "25 to 75 us, in two modes that a round falls into on either side, which moved the "
        "small JAX rows by +-10 % between runs; synchronous calls repeat to 0.1 %, so a ratio "
        "shows activity's own cost at its full weight. "
        "The harness runs with glibc's `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` "
        "raised (it sets them itself), so freed memory stays mapped: otherwise a call of "
        "10 ms takes 12 or 18 ms on either side depending on whether its pages were still "
        "mapped. Python's cyclic garbage collector is paused during the timed rounds, as "
        "`timeit` does.",
        "## How it is measured",
        "Each case pairs an `activity` call with the hand-written call it replaces, on the same "
        "function, parameters and data, in the same process. After a warm-up of both (which "
        "includes compilation), the harness runs rounds of: *N calls of raw, N calls of ours, N calls "
        f"of ours, N calls of raw* (an ABBA block), with N chosen so one round takes about {round_s * 1e3:g} ms, "
        "and a side's time in a round is the mean of its two batches. Alternating spreads slow drifts "
        "of the machine evenly over both sides; in each block both sides have one batch that follows "
        "the other side (its caches left cold, its memory freed) and one that follows itself, and a "
        f"linear drift within the block cancels. Over {rounds} rounds it reports the median time "
        "per call of each side in microseconds and the ratio of the medians, activity / raw "
        "(1.0: no overhead); *extra* is the difference of the medians, the time `activity` "
        "adds per call. A JAX call's time is its computation: before timing, the harness checks "
        "that both sides' arrays are ready when the call returns (under synchronous dispatch they are), "
        "and otherwise times `jax.block_until_ready` of the result; a call is never timed together "
        "with a walk over its result, whose containers differ between sides (a mask's `None` "
        "leaves). Before timing, "
        "each case checks that both calls return the same result (`tests/test_benchmarks.py` "
        "does the same at tiny sizes). On this 2-core machine the ratio of a call of about "
        "100 us moves by a few percent from one run to the next, so a verdict at 1.05 on "
        "the smallest sizes can flip between runs; the *extra* column is steadier.",
        "## Targets",
        _table(["target", "limit", "measured", "cases within", "status"], target_rows(measurements, closure, memory)),
        "Prepared calls should cost what the raw compiled call costs (ratio <= 1.05): every JAX "
        "operator, Jacobians, Hessians and Hessian-vector products included. On torch the targets are "
        "those of the performance issue: the MLP gradient and pullback below width 64 (about 80 us, where "
        "a few microseconds of checks are 5 %) may cost 1.10, the pushforward is held to 1.05 from "
        "width 64 on, the Jacobian to 1.10 of `torch.func.jacrev`, the Hessian to 1.0 of "
        "`torch.func.hessian`, a Hessian-vector product to 1.0 of the faster hand-written one, "
        "and an unprepared gradient at width 8 to 1.30. A target is *met* only "
        "when every size meets it; a case that failed to run does not meet it.",
        overhead_summary(measurements),
        WHERE_THE_TIME_GOES,
        f"![Ratio activity / raw against problem size]({PLOT_NAME})",
        "## Prepared operators against the raw compiled call",
        "`ad.prepare(op, f, Active(p), Constant(x))` called as `prepared(p, x)` (with "
        "`tangent=` or `cotangent=` where the operator takes one). The MLPs have two `tanh` "
        "hidden layers of the given width on inputs of that width, batch 32 (JAX: a dict of "
        "arrays; torch: `nn.Sequential`, and a dict of tensors for `torch.func.jvp`). The CNN "
        "takes 16x16 images (two 3x3 convolutions, a linear head); the LSTM runs 10 steps "
        "(`nn.LSTM` on torch, a `lax.scan` cell on JAX). Jacobian, hessian and hvp "
        "differentiate functions of a vector of length n.",
        measurement_table(prepared),
        "## Without `prepare`",
        "`ad.gradient(f, Active(p), Constant(x), backend=...)` called afresh each time, against "
        "the raw call without compilation: eager `jax.grad(f)(p, x)` and `jax.vjp`, and the same "
        "`torch.autograd.grad` as above. This is what a user pays for not preparing: on JAX "
        "the unprepared call runs eagerly, op by op, like `jax.grad`; on both it inspects "
        "the arguments again on every call. There is no target; see [Preparation](preparation.md).",
        measurement_table(by_family(UNPREPARED), targets=False),
    ]
    if closure is not None:
        sections += [
            "## Closure against Constant under `jax.jit`",
            f"A training-style loop over {closure.batches} new batches of data (MLP width "
            f"{closure.width}, batch 32). Closure-based code builds `jax.jit(jax.grad(lambda p: "
            "loss(p, x)))` for each batch: a new function, so JAX traces and compiles it again. "
            "With `Constant(x)`, one prepared gradient takes each batch as an argument and "
            "compiles once. Totals include preparation and compilation; each loop ran "
            f"{closure_repeats} time(s), alternately, and the table gives the median total. Traces are counted by a "
            "counter incremented inside the loss, whose Python body runs only when JAX traces it. "
            "See [Why not closures](why-not-closures.md).",
            closure_table(closure),
        ]
    from . import _cases_mixing

    sections += [_cases_mixing.SECTION, measurement_table(by_family(_cases_mixing.MIXING))]
    if memory is not None:
        sections += [
            "## Memory",
            f"What autograd saves for the backward pass (each storage once, counted with "
            f"`torch.autograd.graph.saved_tensors_hooks`) during one prepared gradient of the MLP of "
            f"width {memory.width} and during the raw `torch.autograd.grad`: the memory the tape holds at "
            "its peak, the end of the forward pass. The differentiated leaves are views of the "
            "parameters (`detach()`), so nothing is copied.",
            _table(["", "bytes"], [["raw", f"{memory.raw_bytes:,}"], ["activity", f"{memory.ours_bytes:,}"],
                                   ["ratio", f"{memory.ratio:.3f}"]]),
        ]
    sections += [
        "## Scaling with the number of parameters",
        "The prepared gradient against the raw compiled call (`jax.jit(jax.grad(f))`, "
        "`torch.autograd.grad`) for MLPs whose widths give about 1e3 to 1e6 parameters. Both "
        "times grow alike with the size of the model, so the ratio stays flat or falls towards "
        "1.0: what `activity` adds per call does not grow with the model.",
        measurement_table(by_family(SCALING)),
        "## Against the raw backend calls, per scenario",
        "`python -m activity.testing --bench` also times prepared gradients against the raw "
        "backend calls on the scenario catalogues (see [Testing](testing.md#the-command-line)).",
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def write(markdown_text: str, measurements: list[Measurement], output: Path) -> Path:
    """Writes the page to ``output`` and the plot beside it; returns the plot's path."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(markdown_text)
    plot = output.parent / PLOT_NAME
    write_plot(measurements, plot)
    return plot
