"""Per-step timing of a BatchGenerator, for the engine-overhead benchmark and the
step profiler (scripts/profile_engine_steps.py).

The H200 host's speed moves by up to a third between runs a second apart, so two
whole runs compare the machine as much as the code. Inside one run, the model's
step (`next()`) and what the loop does around it slow down together; their ratio
is what the engine adds, measured under the same conditions.
"""

from __future__ import annotations

import statistics
import time


class TimedNext:
    """Wraps a BatchGenerator's next(), recording per call: (wall, thread CPU, time
    since the previous call ended, prompt responses, generated tokens, whether it
    is the first call of an engine burst)."""

    def __init__(self, step, records: list):
        self.step, self.records, self.last_end = step, records, None
        self.new_burst = False  # set by the step profiler's burst marker

    def __call__(self):
        tic, cpu = time.perf_counter(), time.thread_time()
        result = self.step()
        wall, cpu = time.perf_counter() - tic, time.thread_time() - cpu
        between = tic - self.last_end if self.last_end is not None else 0.0
        self.records.append((wall, cpu, between, len(result[0]), len(result[1]), self.new_burst))
        self.last_end, self.new_burst = time.perf_counter(), False
        return result


def time_next(gen, records: list) -> None:
    """Record `gen`'s next() calls into `records` (once per generator)."""
    if not isinstance(gen.next, TimedNext):
        gen.next = TimedNext(gen.next, records)


def full_decode_steps(records: list[tuple], batch: int) -> dict:
    """Microseconds over the steps that decoded the whole batch and prefilled
    nothing: the same model work in the engine and in the bare loop. `between`: the
    loop's time from one next() to the next, all it does outside the model step."""
    full = [n for n in records[1:] if n[3] == 0 and n[4] == batch]
    if not full:
        return {}
    wall, cpu, between = ([n[i] * 1e6 for n in full] for i in range(3))
    row = {"steps": len(full), "next": statistics.mean(wall), "next_median": statistics.median(wall),
           "next_cpu": statistics.mean(cpu), "between": statistics.mean(between),
           "between_median": statistics.median(between), "between_max": max(between)}
    # The engine's between, split into the steps inside a burst and the first step
    # of each burst (the hand-off): shares of the mean, they add up to it
    inside = sum(n[2] * 1e6 for n in full if not n[5])
    if any(n[5] for n in full):
        row["between_in_bursts"] = inside / len(full)
        row["between_handoffs"] = (sum(between) - inside) / len(full)
    return row


def step_accounted_ratio(bare: dict, engine: dict) -> float:
    """Engine ÷ bare decode throughput from one pair's full-step timings, both
    sides under the engine run's conditions. The engine's step is what it measured:
    its next() plus its between. The bare loop's is the same model step plus the
    bare loop's between, where the model step is the engine's next() less all of
    its event loop thread's CPU per scheduler step (`main_cpu`): that thread holds
    the GIL the worker needs, so it may have stretched next(), never by more than
    it ran.

    An estimate, with known leanings. It charges the engine for its event loop's
    whole CPU, and for all of its between even where that overlapped device work
    (a device-bound step hides it), both against the engine. It cannot see a cost
    the engine adds inside next() by other means: the worker thread itself is one,
    which `bench engine --bare-in-thread` measures (none found on the H200)."""
    return (engine["next"] - engine.get("main_cpu", 0.0) + bare["between"]) / (engine["next"] + engine["between"])
