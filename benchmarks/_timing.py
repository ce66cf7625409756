"""Alternating timer: a raw call and ours, round after round, in one process.

Timing both sides in alternation (rather than all raw runs, then all of ours)
spreads slow drifts of the machine (frequency scaling, another process waking
up, the allocator warming) evenly over both, so the ratio stays meaningful on a
noisy 2-core box. A round is one ABBA block, raw, ours, ours, raw, and a side's
time in it is the mean of its two batches: each side has one batch that follows
the other side (the caches it left cold, the memory it freed) and one that
follows itself, so both pay alike for the switch, every round, and a linear
drift within the round cancels. Medians over rounds discard the occasional
stalled round.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import attrs

Clock = Callable[[], float]


@attrs.frozen
class Timing:
    """Median seconds per call of each side over the rounds, and the per-round samples."""

    raw_s: float
    ours_s: float
    calls_per_round: int
    raw_rounds: tuple[float, ...]
    ours_rounds: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return self.ours_s / self.raw_s

    @property
    def raw_us(self) -> float:
        return self.raw_s * 1e6

    @property
    def ours_us(self) -> float:
        return self.ours_s * 1e6


def seconds_per_call(fn: Callable[[], object], calls: int, clock: Clock) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def calls_for(fn: Callable[[], object], round_s: float, clock: Clock, max_calls: int = 10_000) -> int:
    """How many calls of ``fn`` fill about ``round_s`` seconds (at least one).

    Batching calls keeps the clock's resolution and the loop's own cost
    negligible for microsecond-scale calls, while slow calls still get one
    call per round and so many rounds within the time budget.
    """
    one = max(seconds_per_call(fn, 1, clock), 1e-9)
    calls = max(1, min(max_calls, int(round_s / one)))
    if calls > 1:  # one call is a poor estimate for fast functions: measure a batch
        per_call = max(seconds_per_call(fn, calls, clock), 1e-9)
        calls = max(1, min(max_calls, int(round_s / per_call)))
    return calls


def alternate(
    raw: Callable[[], object],
    ours: Callable[[], object],
    *,
    rounds: int,
    calls: int | None = None,
    round_s: float = 0.01,
    warmup: int = 3,
    clock: Clock = time.perf_counter,
) -> Timing:
    """Time ``rounds`` ABBA blocks of ``calls`` calls per batch: raw, ours, ours, raw.

    ``calls=None`` picks the count from the slower side so that one batch takes
    about half of ``round_s`` (a side runs two batches a round); both sides then
    run the same number of calls per batch.
    The first ``warmup`` calls of each side (compilation, caches, lazy
    initialisation) are not timed.
    """
    for fn in (raw, ours):
        for _ in range(warmup):
            fn()
    if calls is None:
        calls = min(calls_for(raw, round_s / 2, clock), calls_for(ours, round_s / 2, clock))
    raw_rounds, ours_rounds = [], []
    # The cyclic garbage collector paused while the rounds run, as `timeit` does: a collection
    # walks every object of this process, which holds every case's models at once, and lands
    # on whichever side happens to allocate when it is due.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            raw_first = seconds_per_call(raw, calls, clock)
            ours_first = seconds_per_call(ours, calls, clock)
            ours_second = seconds_per_call(ours, calls, clock)
            raw_second = seconds_per_call(raw, calls, clock)
            raw_rounds.append((raw_first + raw_second) / 2)
            ours_rounds.append((ours_first + ours_second) / 2)
    finally:
        if collecting:
            gc.enable()
    return Timing(
        raw_s=statistics.median(raw_rounds),
        ours_s=statistics.median(ours_rounds),
        calls_per_round=calls,
        raw_rounds=tuple(raw_rounds),
        ours_rounds=tuple(ours_rounds),
    )
