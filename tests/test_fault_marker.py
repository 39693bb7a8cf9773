"""The marker file's reader and the per-rank check a tensor-parallel fault run must pass.

The lines are written by hand here, in the shape `runtime.write_marker` writes them
(tests/test_faults.py checks that shape from the writer's side), so the check is tested
against what it must accept and refuse, not against its own output.
"""

from __future__ import annotations

import json

import pytest

from diffcheck.core.errors import ConfigError
from diffcheck.faults import marker

DRIVER = 100


def acting(pid, rank, size, step=0):
    return {"event": "acting", "fault": "seq-lens-copy", "pid": pid, "tp_rank": rank, "tp_size": size, "step": step}


def patched(pid, rank=None, size=None):
    return {"event": "patched", "fault": "seq-lens-copy", "pid": pid, "tp_rank": rank, "tp_size": size}


def test_one_acting_line_per_rank_from_distinct_workers_passes():
    events = [patched(DRIVER), *(patched(200 + r) for r in range(4)), *(acting(200 + r, r, 4) for r in (2, 0, 3, 1))]
    assert marker.acting_ranks(events, 4, outsiders={DRIVER}) == []


def test_a_single_gpu_engine_without_a_group_counts_as_rank_0():
    assert marker.acting_ranks([acting(201, None, None)], 1) == []
    assert marker.acting_ranks([acting(201, 0, 1)], 1) == []


@pytest.mark.parametrize("events, expected", [
    ([acting(200, 0, 3), acting(201, 1, 3)], "rank 2: 0 acting lines"),
    ([acting(200, 0, 3), acting(201, 1, 3), acting(202, 1, 3)], "rank 1: 2 acting lines"),
    ([acting(200, 0, 3), acting(201, 1, 3), acting(200, 2, 3)], "several ranks acted in one process"),
    ([acting(200, 0, 3), acting(201, 1, 3), acting(DRIVER, 2, 3)], "outside the engine's workers"),
    ([acting(200, 0, 2), acting(201, 1, 2)], "tp_rank 0 of tp_size 2 (expected a rank in 0..2 of 3)"),
    ([acting(200, 0, 3), acting(201, 1, 3), acting(202, None, None)], "tp_rank None of tp_size None"),
    ([patched(200), patched(201), patched(202)], "rank 0: 0 acting lines"),
])
def test_a_missing_doubled_or_misplaced_rank_is_named(events, expected):
    problems = marker.acting_ranks(events, 3, outsiders={DRIVER})
    assert any(expected in p for p in problems), problems


def test_read_events_keeps_order_and_names_a_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    assert marker.read_events(path) == []  # the fault never wrote
    lines = [patched(200), acting(200, 0, 1)]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines) + "\n")
    assert marker.read_events(path) == lines
    path.write_text(json.dumps(lines[0]) + "\n{\"event\": \"act\n")
    with pytest.raises(ConfigError, match=r"m\.jsonl:2: not a JSON marker line"):
        marker.read_events(path)
