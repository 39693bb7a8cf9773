"""Reading a fault's marker file: which processes patched the fault in and where it acted.

A fault run with ``DIFFCHECK_FAULT_MARKER=FILE`` appends one JSON line per event
(`runtime.write_marker`): ``patched`` when a process installs the fault, ``acting`` the
first time it changes something, each with the process id and, once vLLM's
tensor-parallel group exists, ``tp_rank`` and ``tp_size``. Under tensor parallelism every
rank runs its own copy of the model code, so a fault meant to hit the engine must act in
every rank: `acting_ranks` says whether it did. Pure: no vLLM import.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffcheck.core.errors import ConfigError


def read_events(path: Path) -> list[dict]:
    """The marker file's events in order; none when it does not exist (the fault never wrote)."""
    path = Path(path)
    if not path.exists():
        return []
    events = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not a JSON marker line ({exc.msg})") from None
    return events


def acting_ranks(events: list[dict], tp_size: int, *, outsiders: set[int] = frozenset()) -> list[str]:
    """What is wrong with `events` for a fault that must act once in each of `tp_size` ranks ([] = nothing).

    Every acting line must come from a process outside `outsiders` (the driver), carry a
    rank in 0..tp_size-1 and the group size `tp_size` (a TP1 engine may carry no rank: it
    counts as rank 0), and each rank must act exactly once.
    """
    problems: list[str] = []
    acting = [e for e in events if e.get("event") == "acting"]
    seen: dict[int, list[dict]] = {}
    for e in acting:
        rank, size = e.get("tp_rank"), e.get("tp_size")
        if rank is None and tp_size == 1:
            rank, size = 0, 1
        if e.get("pid") in outsiders:
            problems.append(f"acting line from pid {e.get('pid')}, a process outside the engine's workers")
        if rank is None or size != tp_size or not 0 <= int(rank) < tp_size:
            problems.append(f"acting line with tp_rank {e.get('tp_rank')} of tp_size {e.get('tp_size')} "
                            f"(expected a rank in 0..{tp_size - 1} of {tp_size})")
            continue
        seen.setdefault(int(rank), []).append(e)
    for rank in range(tp_size):
        lines = seen.get(rank, [])
        if len(lines) != 1:
            problems.append(f"rank {rank}: {len(lines)} acting lines (expected 1)")
    pids = [e.get("pid") for lines in seen.values() for e in lines]
    if len(set(pids)) != len(pids):
        problems.append(f"several ranks acted in one process: pids {sorted(pids)}")
    return problems
