"""``diffcheck matrix --ray [ADDRESS]``: the engine work of a matrix as Ray tasks; the driver alone writes.

Each case is one Ray task with its resources: ``num_gpus`` = TP x PP when the cluster
has GPUs, else ``num_cpus`` = TP x PP x ``--cpus-per-rank``. A task starts the engine,
generates (and, for a candidate, teacher-forces along each golden and has the
reference engine score a candidate that diverged), and returns the `Run` objects.
Workers write nothing: goldens, runs, the manifest and the SQLite ledger are written by
the driver, from the runs the tasks return, with the same functions as a sequential
matrix; a candidate the ledger already holds is not sent at all. Judging runs on the
driver (`runner.compare` on the stored files: no engine).

A task that dies (its worker killed, its node lost) is retried once by Ray
(``max_retries=1``); dying again, the case is reported ERROR, never a verdict. An
engine failure inside a task (an `EngineError`) is not retried: it is ERROR at once,
as in a sequential matrix.

Security: ``--ray`` without an address starts a local cluster that listens on
127.0.0.1 only: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from resolving
127.0.0.1 to the machine's external address (which it does on Linux so that other
nodes could join), ``_node_ip_address="127.0.0.1"``, and no dashboard. Nothing else can
join such a cluster. A multi-node cluster (``--ray HOST:PORT``) is the operator's: its
ports must be reachable only on a private network (docs/matrix.md says how).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from diffcheck.core.errors import DiffcheckError, EngineError

Echo = Callable[[str], None]
LOCAL = "local"
TASK_RETRIES = 1
LOOPBACK = "127.0.0.1"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise DiffcheckError("--ray needs Ray: pip install 'diffcheck[ray]'") from None
    return ray


def local_cluster_env() -> dict[str, str]:
    """What a local, loopback-only cluster needs in the environment before ray is imported."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def connect(address: str = LOCAL, *, num_cpus: int | None = None, object_store_mb: int = 128) -> Any:
    """Start (``local``) or join (``HOST:PORT``, ``auto``) a Ray cluster; returns the ray module.

    A cluster already connected in this process is kept (tests start one per session).
    """
    if address == LOCAL:
        for k, v in local_cluster_env().items():
            os.environ.setdefault(k, v)
    ray = _import_ray()
    if ray.is_initialized():
        return ray
    if address == LOCAL:
        try:  # ray imported before the variable was set computed it already
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        except (ImportError, AttributeError):
            pass
        ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=num_cpus or os.cpu_count(),
                 object_store_memory=object_store_mb * 1024 * 1024, log_to_driver=False,
                 configure_logging=False)
        gcs = ray.get_runtime_context().gcs_address
        if not gcs.startswith(f"{LOOPBACK}:"):
            ray.shutdown()
            raise DiffcheckError(f"--ray: the local Ray cluster came up on {gcs}, not on {LOOPBACK}; refusing to use "
                                 "it (this Ray does not honour RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)")
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return ray


def resources(case, *, gpu: bool, cpus_per_rank: float = 1.0) -> dict[str, float]:
    """What one case's task reserves: its TP x PP ranks as GPUs, or as CPUs on a CPU cluster."""
    pp = int((case.engine.extra or {}).get("pipeline_parallel_size", 1) or 1)
    ranks = int(case.engine.tensor_parallel_size or 1) * pp
    if gpu:
        return {"num_gpus": float(ranks), "num_cpus": 1.0}
    return {"num_cpus": float(ranks) * cpus_per_rank}


# -- the tasks (run on workers: no file, no ledger is written there) ----------------------------------


def golden_task(case, verbose: bool = False):
    """Generate a reference's golden run; returns the Run."""
    from diffcheck.workflows import runner

    with runner.open_engine(case, verbose=verbose) as engine:
        run = runner._with_config(engine.generate(), case)
    return run


def candidate_task(case, ref_cases: dict, goldens: dict, verbose: bool = False):
    """Generate the candidate, force it along each golden, score it where it diverged.

    Returns (candidate, {ref: forced}, {ref: scored}, seconds)."""
    import ray

    from diffcheck.engines import replay as replaymod
    from diffcheck.workflows import runner

    t0 = time.perf_counter()
    # Goldens come as object refs (put once, shared by every task); refs nested in a dict are not
    # resolved by Ray itself.
    goldens = {r: ray.get(g) if isinstance(g, ray.ObjectRef) else g for r, g in goldens.items()}
    mode, why = replaymod.mode_for(case, None)
    references = runner.candidate_references(case, list(ref_cases))
    cand, forced = runner.generate_candidate(case, references, goldens, mode=mode, why=why, verbose=verbose,
                                             echo=lambda _: None)
    scored = {}
    for ref_id, ref_case in ref_cases.items():
        if runner._differs(goldens[ref_id], cand):
            with runner.open_engine(ref_case, verbose=verbose) as engine:
                scored[ref_id] = engine.score(cand)
    return cand, forced, scored, time.perf_counter() - t0


def _error_text(exc: BaseException) -> tuple[str, bool]:
    """(one line, whether the task died rather than failed)."""
    ray = _import_ray()
    cause = exc
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, EngineError):
        return cause.message, False
    died = isinstance(exc, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                            ray.exceptions.TaskCancelledError, ray.exceptions.ObjectLostError))
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1][:300]
    if died:
        return (f"Ray task died {TASK_RETRIES + 1} times ({type(exc).__name__}: {first}); "
                "never a verdict: rerun the matrix to try again"), True
    return f"{type(cause).__name__}: {first}", False


# -- the driver -----------------------------------------------------------------------------------------


class _Returned:
    """What a Ray task returned, in the shape `runner.record_golden` and `runner.score_candidate` take
    from an `EnginePool`: the runner then stores it exactly as it stores a local engine's run."""

    def __init__(self, run=None, scored=None, seconds: float = 0.0):
        self.run, self.scored = run, scored
        self.timings = {"startup_s": 0.0, "generate_s": seconds}
        self.prompts = run.sequences if run is not None else ()

    def generate(self, **_):
        return self.run

    def score(self, candidate, **_):
        return self.scored


class _ReturnedPool:
    def __init__(self, engine: _Returned):
        self.engine = engine

    def get(self, case, echo=None):
        return self.engine


def run(suite, p, *, root: Path, address: str = LOCAL, echo: Echo = print, force: bool = False,
        verbose: bool = False, cpus_per_rank: float = 1.0):
    """The goldens, then the candidates, as Ray tasks; returns (comparisons, golden errors) like a
    sequential matrix."""
    from diffcheck.workflows import matrix as mx
    from diffcheck.engines import replay as replaymod
    from diffcheck.workflows import runner
    from diffcheck.storage import store

    t0 = time.perf_counter()
    ray = connect(address)
    echo(f"ray: connected in {time.perf_counter() - t0:.1f}s; cluster {ray.cluster_resources()}")
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    remote_golden = ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)(golden_task)
    remote_candidate = ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)(candidate_task)
    n, k = p.steps, 0

    golden_errors: dict[str, str] = {}
    pending = {}
    for case in p.references:
        k += 1
        path = store.run_path(root, suite.name, case.id)
        if runner.golden_up_to_date(path, case):
            echo(f"case {k} of {n}: golden {case.id} up to date")
            continue
        opts = resources(case, gpu=gpu, cpus_per_rank=cpus_per_rank)
        echo(f"case {k} of {n}: golden {case.id} sent as a Ray task ({opts})")
        pending[remote_golden.options(name=f"diffcheck-golden-{case.id}", **opts).remote(case, verbose)] = case
    for ref, case in _as_completed(ray, pending):
        try:
            run_obj = ray.get(ref)
        except Exception as exc:  # a task's failure is the case's ERROR, never the driver's crash
            golden_errors[case.id], _ = _error_text(exc)
            echo(f"{case.id}: golden failed: {golden_errors[case.id]}")
            continue
        res = runner.record_golden(case, root=root, echo=lambda _: None, pool=_ReturnedPool(_Returned(run_obj)))
        echo(f"{case.id}: golden {res.status} (from a Ray task)")

    comparisons: dict[str, Any] = {}
    tests = p.tests
    pending = {}
    goldens_ref: dict[str, Any] = {}
    for case in p.compared:
        k += 1
        missing = [r for r in case.references if r in golden_errors]
        if missing:
            comparisons[case.id] = mx.error_comparison(case, f"golden {missing[0]} failed: {golden_errors[missing[0]]}")
            continue
        goldens = {r: runner.load_golden(root, suite.name, r) for r in case.references}
        mode, _ = replaymod.mode_for(case, None)
        refs_forced = runner.candidate_references(case, list(case.references))
        if not force and runner.cached_candidate(case, refs_forced, goldens, root=root, mode=mode) is not None:
            echo(f"case {k} of {n}: {case.id} in the ledger: not sent")
            comparisons[case.id] = None  # judged below from the stored files
            continue
        for r, g in goldens.items():
            if r not in goldens_ref:
                goldens_ref[r] = ray.put(g)
        opts = resources(case, gpu=gpu, cpus_per_rank=cpus_per_rank)
        echo(f"case {k} of {n}: {case.id} sent as a Ray task ({opts})")
        refs = {r: suite.cases[r] for r in case.references}
        task = remote_candidate.options(name=f"diffcheck-case-{case.id}", **opts).remote(
            case, refs, {r: goldens_ref[r] for r in case.references}, verbose)
        pending[task] = case
    for ref, case in _as_completed(ray, pending):
        try:
            cand, forced, scored, seconds = ray.get(ref)
        except Exception as exc:
            message, _ = _error_text(exc)
            echo(f"{case.id}: {message}")
            comparisons[case.id] = mx.error_comparison(case, message)
            continue
        goldens = {r: runner.load_golden(root, suite.name, r) for r in case.references}
        runner.store_candidate(case, cand, forced, goldens, root=root)
        for r, sc in scored.items():
            runner.score_candidate(suite.cases[r], cand, root=root, echo=lambda _: None,
                                   pool=_ReturnedPool(_Returned(scored=sc)))
        echo(f"{case.id}: returned by its Ray task after {seconds:.1f}s; stored by the driver")
        comparisons[case.id] = None
    for case in p.compared:
        if comparisons.get(case.id) is None:
            run_file = store.run_path(root, suite.name, case.id, kind="generate", role="candidate")
            comparisons[case.id] = runner.compare(suite, case.id, root=root, run_file=run_file, tests=tests,
                                                  echo=echo, verbose=verbose)
            echo(f"{case.id}: {comparisons[case.id].verdict.name}")
    return {c.id: comparisons[c.id] for c in p.compared}, golden_errors


def _as_completed(ray, pending: dict):
    """(object ref, case) as each task finishes."""
    left = list(pending)
    while left:
        done, left = ray.wait(left, num_returns=1)
        yield done[0], pending[done[0]]


def listening_addresses(pids: set[int] | None = None) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every listening TCP socket (of `pids` when given), from psutil."""
    import psutil

    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and (pids is None or conn.pid in pids):
            out.append((conn.pid, conn.laddr.ip, conn.laddr.port))
    return out


def ray_pids() -> set[int]:
    """This process and every process of the local Ray cluster it started (its descendants)."""
    import psutil

    me = psutil.Process()
    return {me.pid} | {c.pid for c in me.children(recursive=True)}
