"""Kill anywhere: writers of the golden store SIGKILLed at random moments leave a consistent folder.

The store's promise (diffcheck.storage.store): a writer killed at any point leaves every
file verifying against MANIFEST.json, the manifest listing exactly the files present, and
no lock file beside the goldens once the next write is done; concurrent writers serialize.
`consistent` checks one folder after a kill:

- every ``*.parquet`` verifies (`store.verify_folder`);
- the manifest lists exactly the files present: each name with a committed entry is there,
  and each file there has an entry (a committed one, or the pending one of a first write);
- what a killed writer may leave is only its own and unheld: a ``<file>.lock`` that no one
  holds, holding that writer's pid (or nothing, killed before it wrote it), and temp files
  named with its pid.

Without an engine: two processes writing into one folder at once, and a writer killed at
random moments of its writes. With the engine (marker ``engine``): ``diffcheck golden
record`` SIGKILLed alone (not its process group, as the OOM killer or ``kill -9`` would)
while its engine, whose engine core and worker are processes of their own, generates:
none of those processes is left, and the folder is `consistent`. The matrix, reduce and
bisect tests interrupt the real engine with Ctrl-C (``test_matrix_engine.py``,
``test_reduce_engine.py``, ``test_bisect.py``).

Every trial's seed is printed (``pytest -s`` or ``-rP`` shows it) and named in any failure.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diffcheck.storage import store
from factories import make_run

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SEED = int(os.environ.get("DIFFCHECK_KILL_SEED", "20251203"))  # set it to replay a failure
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.tmp\Z")


def _held(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # also releases the probe's own flock
    return False


def leftovers(folder: Path) -> list[str]:
    """Lock and temp files in `folder` (names)."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".lock") or _TEMP.match(p.name))


def consistent(folder: Path, killed: set[int], where: str) -> None:
    """Assert the store's promise after a kill (see the module docstring); `where` names the trial."""
    results = store.verify_folder(folder)
    bad = [r.message for r in results if not r.ok]
    assert not bad, f"{where}: {folder} does not verify after the kill: {bad}"
    manifest = json.loads((folder / store.MANIFEST).read_text())
    present = {p.name for p in folder.glob("*.parquet")}
    committed = {n for n, e in manifest.items() if set(e) - {"pending"}}
    assert committed <= present, f"{where}: listed in {store.MANIFEST} but missing: {sorted(committed - present)}"
    assert present <= set(manifest), f"{where}: files the manifest does not list: {sorted(present - set(manifest))}"
    for name in leftovers(folder):
        path = folder / name
        if name.endswith(".lock"):
            assert not _held(path), f"{where}: {name} is still held after the kill"
            content = path.read_text().strip()
            assert content == "" or int(content) in killed, \
                f"{where}: {name} was left by pid {content}, which was not killed (killed: {sorted(killed)})"
        else:
            assert int(_TEMP.match(name)["pid"]) in killed, f"{where}: temp file {name} of a writer not killed"


def _kill_group(proc: subprocess.Popen) -> None:
    with_group = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        with_group = False
    proc.wait(timeout=60)
    if with_group:  # the engine's own processes die with the group: wait until none is left
        while True:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)


# -- the store alone: concurrent writers, killed writers ------------------------------------------

WRITER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {tests!r})
    from factories import make_run
    from diffcheck.core.errors import LockedError
    from diffcheck.storage import store

    folder, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    written = {{}}
    print("ready", flush=True)
    sys.stdin.readline()  # both writers start together
    for i in range(n):
        for name in (f"{{who}}-{{i}}", f"shared-{{i % 4}}"):
            run = make_run(lengths=(3, 2), k=3, seed=i + 1000 * (who == "b"), case_id=name)
            while True:
                try:
                    written.setdefault(name + ".parquet", []).append(store.write_run(f"{{folder}}/{{name}}.parquet", run))
                    break
                except LockedError:  # the other writer holds that file: try again
                    time.sleep(0.001)
    print(json.dumps(written), flush=True)
""")


def test_concurrent_writers_serialize_and_leave_no_lock_files(tmp_path):
    folder = tmp_path / "goldens" / "t"
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=str(TESTS)))
    n = 40
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), who, str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT) for who in ("a", "b")]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    written = [json.loads(out) for out, _ in outs]
    manifest = json.loads((folder / store.MANIFEST).read_text())
    present = {p.name for p in folder.glob("*.parquet")}
    expected = {f"{who}-{i}.parquet" for who in "ab" for i in range(n)} | {f"shared-{j}.parquet" for j in range(4)}
    assert present == expected and set(manifest) == present  # no update of the manifest was lost
    assert not [n for n, e in manifest.items() if "pending" in e]
    assert all(r.ok for r in store.verify_folder(folder)), [r.message for r in store.verify_folder(folder) if not r.ok]
    for name in present:
        digests = {d for w in written for d in w.get(name, [])}
        assert store.content_digest(store.read_run(folder / name)) in digests
    assert leftovers(folder) == []


KILLED_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from factories import make_run
    from diffcheck.storage import store

    folder = sys.argv[1]
    runs = [make_run(lengths=(40, 7), k=8, seed=s, case_id="J") for s in range(3)]
    print("ready", flush=True)
    i = 0
    while True:  # new files, and the golden J rewritten (a committed entry beside a pending one)
        store.write_run(f"{{folder}}/k{{i % 7}}.parquet", runs[i % 3])
        store.write_run(f"{{folder}}/J.parquet", runs[i % 3])
        i += 1
""")


def test_a_writer_killed_at_random_moments_leaves_a_consistent_folder(tmp_path):
    folder = tmp_path / "goldens" / "t"
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER.format(tests=str(TESTS)))
    rng = random.Random(SEED)
    killed: set[int] = set()
    print(f"kill-anywhere (store): seed {SEED}")
    for trial in range(12):
        delay = rng.uniform(0.0, 0.4)
        where = f"seed {SEED}, trial {trial}, kill after {delay:.3f}s"
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT, start_new_session=True)
        assert proc.stdout.readline().strip() == "ready", where
        time.sleep(delay)
        _kill_group(proc)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, where
        killed.add(proc.pid)
        if (folder / store.MANIFEST).exists():
            consistent(folder, killed, where)
    # The next write takes over what the killed writers left, and leaves nothing.
    store.write_run(folder / "after.parquet", make_run(lengths=(3,), case_id="after"))
    assert leftovers(folder) == [], f"seed {SEED}: left after the next write: {leftovers(folder)}"
    assert all(r.ok for r in store.verify_folder(folder))


# -- the engine's own processes end with a SIGKILLed diffcheck -----------------------------------------

EVENTUALLY_S = 300  # bounds a wait for processes that must end (never a measure of speed)


@pytest.mark.engine
def test_a_sigkilled_diffcheck_leaves_no_engine_process(tmp_path):
    """vLLM's engine core does not watch its parent: before diffcheck's engine processes died with
    it (diffcheck.core.lifeline), this left the engine core and its worker running under init."""
    import psutil

    from factories import write_suite

    suite = write_suite(
        tmp_path / "cases",
        {"MP": {"role": "reference", "description": "engine core and worker in processes of their own",
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}},
        name="lifeline", description="a SIGKILLed diffcheck", prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
        sampling={"max_tokens": 400, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1, "logprobs": 20},
        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1})
    goldens = tmp_path / "goldens"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, "-m", "diffcheck.cli", "golden", "record", "MP", "--suite", str(suite),
                             "--goldens", str(goldens)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**env, "COLUMNS": "200"}, start_new_session=True)
    said = []
    try:
        for line in proc.stdout:  # the engine is up and generating: its core and worker exist
            said.append(line)
            if "engine up in" in line:
                break
        engine_procs = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(p.name() for p in engine_procs)
        assert any("EngineCore" in n for n in names) and any("Worker" in n for n in names), (names, "".join(said))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        gone, alive = psutil.wait_procs(engine_procs, timeout=EVENTUALLY_S)
        assert not alive, f"left after diffcheck was SIGKILLed: {[(p.pid, p.name()) for p in alive]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()
    folder = goldens / "lifeline"
    if (folder / store.MANIFEST).exists():
        consistent(folder, {proc.pid}, "golden record SIGKILLed while generating")
