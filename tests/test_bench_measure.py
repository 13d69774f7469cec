"""The benchmark's timing helper: the forwards a ratio compares are timed in alternating blocks."""

from __future__ import annotations

import time

from bench.measure import timed_alternating


def test_alternating_blocks_give_each_function_its_runs_and_time():
    calls = []

    def recorder(name, seconds):
        def fn():
            calls.append(name)
            time.sleep(seconds)
        return fn

    result = timed_alternating({"a": recorder("a", 0.001), "b": recorder("b", 0.003)}, repeats=5, rounds=5,
                               warmup=1, min_seconds=0.05)
    assert calls[:2] == ["a", "b"]  # the warm-ups
    blocks = [calls[2]]
    for name in calls[3:]:
        if name != blocks[-1]:
            blocks.append(name)
    # Round by round a, b then b, a: runs of one name alternate, at least once per round.
    assert len(blocks) >= 6 and blocks == ["a", "b"] * (len(blocks) // 2) + ["a"] * (len(blocks) % 2)
    for name, seconds in (("a", 0.001), ("b", 0.003)):
        assert result[name]["runs"] >= 5 and result[name]["runs"] * seconds >= 0.05 * 0.9
        assert seconds * 1e3 <= result[name]["min_ms"] <= result[name]["median_ms"]
