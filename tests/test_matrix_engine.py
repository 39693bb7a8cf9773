"""`diffcheck matrix` on the real engine: Ctrl-C and resume, Ray with a killed worker, and
`diffcheck bisect` over a git history of the installed vLLM itself.

All three share one tiny suite (2 short prompts, 16 tokens; J the eager reference, S1 one
sequence at a time, E the stale-metadata fault from decode step 8) and the goldens of one
sequential matrix (the session fixture `sequential_matrix`), so each engine start is paid
once. At most one engine runs at a time. Ray and the engine are required: a missing one
fails these tests, never skips them.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from factories import write_suite

ROOT = Path(__file__).resolve().parent.parent
MATRIX_CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "S1": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "one sequence at a time",
           "engine": {"max_num_seqs": 1}},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "stale decode metadata from step 8",
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8"}},
}
pytestmark = pytest.mark.engine
EVENTUALLY_S = 300  # how long processes may take to go after Ctrl-C before the test calls them left over


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "diffcheck.cli", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200")
    env.pop("PYTHONPATH", None)
    return env


def _group_survivors(pgid: int) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid:
                out.append(p.info["pid"])
        except (ProcessLookupError, PermissionError):
            continue
    return out


@pytest.fixture(scope="session")
def sequential_matrix(tmp_path_factory):
    """The tiny matrix run sequentially: interrupted by SIGINT while E's engine starts, then run again."""
    from diffcheck.storage import ledger

    folder = tmp_path_factory.mktemp("matrix")
    suite = write_suite(folder / "cases", MATRIX_CASES, name="mtx", description="matrix tests on the real engine",
                        prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
                        sampling={"max_tokens": 16, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234,
                                  "logprobs": 20},
                        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
                                "kv_cache_memory_gib": 1})
    goldens = folder / "goldens"
    cmd = _cli("matrix", "--suite", str(suite), "--goldens", str(goldens))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    first: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            first.append(line)
            if "E: starting candidate engine" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    interrupted = started.wait(timeout=420)
    if interrupted:
        time.sleep(3)  # the engine is starting: Ctrl-C lands mid-case
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
    try:
        rc_first = proc.wait(timeout=EVENTUALLY_S)  # a hang guard, as below
    except subprocess.TimeoutExpired:
        rc_first = None  # hung after Ctrl-C: the test fails on it
    reader.join(timeout=10)
    deadline = time.monotonic() + EVENTUALLY_S  # a hang guard: vLLM's engine process shuts down after its client
    while _group_survivors(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    survivors = _group_survivors(proc.pid)
    for pid in survivors:  # ours: left by the interrupted run
        os.kill(pid, signal.SIGKILL)
    led = ledger.Ledger.open(goldens)
    before = led.entries()
    reports = folder / "reports"
    second = subprocess.run(cmd + ["--md", str(reports / "matrix.md"), "--json", str(reports / "matrix.json"),
                                   "--junit", str(reports / "matrix.xml"), "--html", str(reports / "matrix.html")],
                            capture_output=True, text=True, env=_env(), timeout=900)
    return {"reports": reports, "suite": suite, "goldens": goldens, "first": "".join(first), "rc_first": rc_first,
            "interrupted": interrupted, "survivors": survivors, "before": before,
            "after": led.entries(), "second": second}


def test_an_interrupted_matrix_resumes_without_repeating_a_finished_run(sequential_matrix):
    m = sequential_matrix
    assert m["interrupted"], "E's engine never started:\n" + m["first"][-3000:]
    assert m["rc_first"] == 130, m["first"][-3000:]
    assert not m["survivors"], f"processes left running after Ctrl-C: {m['survivors']}"
    before, after = m["before"], m["after"]
    assert [e.case_id for e in before] == ["J", "S1"]  # the finished runs, in the ledger
    second = m["second"]
    assert second.returncode == 1, second.stdout + second.stderr[-3000:]  # E regresses
    assert "S1: reused run from" in second.stderr and "J: golden up to date" in second.stderr
    new = after[len(before):]
    assert [e.case_id for e in new] == ["E"]  # only the interrupted case ran again
    assert not {e.key for e in new} & {e.key for e in before}, "a finished run was repeated"
    assert len({e.key for e in after}) == len(after)
    assert "case 3 of 3: E" in second.stderr
    # the table and the narrowing of this real CPU matrix
    out = second.stdout
    assert "IDENTICAL" in out and ("DEGRADED" in out or "GIBBERISH" in out)
    assert "narrowing: 1 bad (E), 2 clean (J, S1)" in out
    assert "DIFFCHECK_FAULT=stale-decode-metadata" in out.split("main cause:", 1)[1]


def test_the_resumed_matrix_writes_every_report(sequential_matrix):
    import json
    import xml.etree.ElementTree as ET

    reports = sequential_matrix["reports"]
    page = (reports / "matrix.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) >= {"J", "S1", "E"} and "| golden |" in rows["J"] and "| IDENTICAL |" in rows["S1"]
    assert "## Narrowing" in page
    doc = json.loads((reports / "matrix.json").read_text())
    assert doc["schema"] == "diffcheck.matrix" and set(doc["reports"]) == {"S1", "E"}  # a golden is not compared
    for cid in ("S1", "E"):
        report = doc["reports"][cid]
        assert [c["candidate_id"] for c in report["cases"]] == [cid]
        assert report["verdict"] in rows[cid]
    assert {r["case"]: r["verdict"] for r in doc["rows"]}["J"] == "golden"
    suites = [s.get("name") for s in ET.parse(reports / "matrix.xml").getroot().iter("testsuite")]
    assert sorted(name.split(" vs ")[0] for name in suites) == ["E", "S1"]
    assert (reports / "matrix.html").read_text().lstrip().lower().startswith("<!doctype html")


# -- Ray ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for this module, started the way `diffcheck matrix --ray` starts it; it stops
    with the module, not at the end of the session (its idle processes would take CPU from later tests)."""
    from diffcheck.workflows import matrix_ray

    try:
        ray = matrix_ray.connect("local", num_cpus=2)
    except Exception as exc:  # Ray missing or failing to start is a failure here, never a skip
        pytest.fail(f"cannot start a local Ray cluster ({type(exc).__name__}: {exc}); make install installs "
                    "diffcheck[ray]")
    yield ray
    ray.shutdown()


def test_a_local_cluster_listens_on_loopback_only(ray_cluster):
    from diffcheck.workflows import matrix_ray

    assert ray_cluster.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    listening = matrix_ray.listening_addresses(matrix_ray.ray_pids())
    assert len(listening) >= 3, listening  # gcs, raylet, workers...: the check saw them
    exposed = [x for x in listening if x[1] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not exposed, f"listening beyond loopback: {exposed}"
    # the same from the kernel's table: no socket of ours on 0.0.0.0 or ::
    import psutil

    wild = [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
            and c.pid in matrix_ray.ray_pids() and c.laddr.ip in ("0.0.0.0", "::")]
    assert not wild, wild


def test_a_local_clusters_workers_run_at_the_drivers_priority(ray_cluster):
    """Ray's default worker niceness (15) starved engines in tasks beside any busy process."""

    def niceness():
        return os.getpriority(os.PRIO_PROCESS, 0)

    task = ray_cluster.remote(niceness).options(num_cpus=0.5)
    assert ray_cluster.get(task.remote(), timeout=120) == niceness()


def test_a_task_that_dies_twice_is_an_error_not_a_verdict(ray_cluster, tmp_path):
    from diffcheck.workflows import matrix_ray

    marker = tmp_path / "attempts"

    def die(path):
        with open(path, "a") as f:
            f.write("x")
        os.kill(os.getpid(), signal.SIGKILL)

    task = ray_cluster.remote(max_retries=matrix_ray.TASK_RETRIES, retry_exceptions=False)(die)
    with pytest.raises(Exception) as err:
        ray_cluster.get(task.options(num_cpus=0.5).remote(str(marker)), timeout=120)
    assert marker.read_text() == "xx"  # tried, retried once, then given up
    message, died = matrix_ray._error_text(err.value)
    assert died and message.startswith("Ray task died 2 times")


def _kill_worker_once(name: str, killed: list, stop: threading.Event) -> None:
    """Kill the Ray worker running task `name` (and its engine process) once its engine is up."""
    import psutil

    seen: dict[int, float] = {}
    while not stop.is_set():
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if cmd.startswith("ray::") and name in cmd:
                try:
                    children = p.children(recursive=True)
                except psutil.NoSuchProcess:
                    continue
                first = seen.setdefault(p.pid, time.monotonic())
                # the task is mid-way: its engine's processes are up, or it has run a second (an in-process
                # engine starts in a few seconds and has none)
                if children or time.monotonic() - first > 1:
                    for proc in [p, *children]:  # the worker first: Ray must see it die
                        try:
                            proc.kill()
                        except psutil.NoSuchProcess:
                            pass
                    killed.append(p.pid)
                    return
        time.sleep(0.5)


def test_ray_matrix_survives_a_killed_worker_and_equals_the_sequential_run(sequential_matrix, ray_cluster,
                                                                             tmp_path):
    from diffcheck import cases
    from diffcheck.workflows import matrix as mx
    from diffcheck.storage import ledger, store

    suite = cases.load_suite(sequential_matrix["suite"])
    root = tmp_path / "goldens"
    killed, stop = [], threading.Event()
    killer = threading.Thread(target=_kill_worker_once, args=("diffcheck-case-S1", killed, stop), daemon=True)
    killer.start()
    try:
        result = mx.run_matrix(suite, ["J", "S1"], root=root, echo=print, ray="local", cpus_per_rank=2)
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed, "the S1 task's worker was never seen running (nothing was killed)"
    assert result.comparisons["S1"].verdict.name == "IDENTICAL"
    seq = sequential_matrix["goldens"] / "mtx"
    for name in ("J.parquet", "S1.run.parquet", "S1.forced-J.parquet"):
        ours, theirs = store.read_run(root / "mtx" / name), store.read_run(seq / name)
        assert store.content_digest(ours) == store.content_digest(theirs), name
    entries = ledger.Ledger.open(root).entries()
    assert [e.case_id for e in entries] == ["J", "S1"]  # the driver wrote each run once
    assert entries[1].verdict.name == "IDENTICAL"


# -- bisect over vLLM's own code -------------------------------------------------------------------------

VLLM = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "vllm"
BUG = '''        # Decode metadata buffers persist from decode step 4 on, as a FULL decode graph binds
        # them at capture; they are not refreshed from the current batch after that.
        if max_query_len == 1:
            self._decode_steps = getattr(self, "_decode_steps", 0) + 1
            if self._decode_steps == 4:
                self._persistent = (seq_lens.clone(), block_table_tensor.clone(), query_start_loc.clone(), max_seq_len)
            elif self._decode_steps > 4 and self._persistent[0].shape[0] == num_reqs:
                seq_lens, block_table_tensor, query_start_loc, max_seq_len = self._persistent
        else:
            self._decode_steps = 0
'''
ANCHOR = "        block_table_tensor = common_attn_metadata.block_table_tensor\n"
HARMLESS = ["vllm/envs.py", "vllm/sampling_params.py", "vllm/outputs.py", "vllm/logger.py", "vllm/v1/outputs.py",
            "vllm/utils/__init__.py"]


def _copy_vllm(dest: Path) -> None:
    """vLLM's installed tree, compiled extensions hard-linked (never edited), everything else copied."""
    def copy(src, dst):
        if src.endswith(".so"):
            try:
                os.link(src, dst)
                return dst
            except OSError:
                pass
        return shutil.copy2(src, dst)

    shutil.copytree(VLLM, dest / "vllm", copy_function=copy, symlinks=True)


def build_vllm_repo(repo: Path) -> dict[str, str]:
    """8 commits of vLLM's own files: c3 breaks `import vllm` (c4 repairs it), c5 makes decode
    metadata stale from step 4 in CPUAttentionMetadataBuilder.build; the rest add comments."""
    from test_ledger import git, init_repo

    init_repo(repo)
    _copy_vllm(repo)
    (repo / ".gitignore").write_text("__pycache__/\n*.so\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "vllm 0.32.0 as installed")
    shas = {"c0": git(repo, "rev-parse", "HEAD")}
    init = repo / "vllm" / "__init__.py"
    attn = repo / "vllm" / "v1" / "attention" / "backends" / "cpu_attn.py"
    for i in range(1, 8):
        if i == 3:
            init.write_text(init.read_text() + "\nfrom vllm import _half_finished_refactor  # noqa\n")
            subject = "half-finished refactor (breaks import vllm)"
        elif i == 4:
            init.write_text(init.read_text().replace("\nfrom vllm import _half_finished_refactor  # noqa\n", "\n"))
            subject = "finish the refactor"
        elif i == 5:
            text = attn.read_text()
            assert text.count(ANCHOR) == 1, "cpu_attn.py changed: the bug's anchor line is gone"
            attn.write_text(text.replace(ANCHOR, ANCHOR + BUG))
            subject = "cpu attention: keep decode metadata buffers across steps"
        else:
            path = repo / HARMLESS[i % len(HARMLESS)]
            path.write_text(path.read_text() + f"\n# harmless change {i}\n")
            subject = f"harmless change {i}"
        git(repo, "commit", "-qam", subject)
        shas[f"c{i}"] = git(repo, "rev-parse", "HEAD")
    return shas


def test_bisect_names_the_vllm_commit_that_broke_decode_metadata(sequential_matrix, tmp_path, capsys):
    from diffcheck.cli import main
    from diffcheck.workflows import bisect as bisecting
    from diffcheck.storage import ledger

    assert VLLM.is_dir(), f"{VLLM}: the installed vLLM tree is missing"
    repo = tmp_path / "vllm-src"
    shas = build_vllm_repo(repo)
    goldens = sequential_matrix["goldens"]
    led = ledger.Ledger.open(goldens)
    runs_before = led.engine_runs("S1")
    before = (bisecting.repo_state(repo), bisecting.bisect_in_progress(repo))
    args = ["bisect", "S1", "--repo", str(repo), "--good", shas["c0"], "--bad", shas["c7"],
            "--suite", str(sequential_matrix["suite"]), "--goldens", str(goldens)]
    assert main(args) == 0
    out = capsys.readouterr().out
    print(out)  # docs/ledger-and-bisect.md's session comes from here (pytest -s)
    assert f"first bad commit: {shas['c5']} cpu attention: keep decode metadata buffers across steps" in out
    runs = led.engine_runs("S1") - runs_before
    assert 1 <= runs <= math.ceil(math.log2(8)) + 1, out
    assert f"{shas['c3'][:10]} half-finished refactor" in out  # the first midpoint: visited ...
    broken = next(line for line in out.splitlines() if line.startswith(f"bisect: {shas['c3'][:10]}"))
    assert "-> skip" in broken  # ... and skipped, never blamed
    # the engine imported the copy: the ledger names its commits
    new = led.entries(case_id="S1")[-runs:]
    assert {e.engine_commit for e in new} <= set(shas.values()) and all(e.engine_commit for e in new)
    assert (bisecting.repo_state(repo), bisecting.bisect_in_progress(repo)) == before
