"""``diffcheck matrix --ray [ADDRESS]``: the engine work of a matrix as Ray tasks; the driver alone writes.

`RayExecutor` runs the matrix's jobs (`diffcheck.workflows.executors`) as Ray tasks,
one per case, with its resources: ``num_gpus`` = TP x PP when the cluster has GPUs,
else ``num_cpus`` = TP x PP x ``--cpus-per-rank``. A task starts the engine, generates
(and, for a candidate, teacher-forces along each golden and has the reference engine
score a candidate that diverged), and returns the `Run` objects. Workers write nothing:
the matrix's driver stores what comes back, exactly as it stores the sequential
executor's results, and judges it from the stored files.

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
from diffcheck.workflows import executors

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
    """What a local, loopback-only cluster needs in the environment before ray is imported.

    ``RAY_worker_niceness=0``: Ray starts its workers at niceness 15 by default, so an engine in a
    task of a local cluster got almost no CPU beside any other busy process (the Ray matrix test took
    409 s instead of 76 s beside one CPU hog and a second test worker). Workers of a cluster that
    diffcheck starts run at the driver's priority, as the sequential matrix's engines do."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}


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
    """A reference's golden run (`executors.golden_job`)."""
    return executors.golden_job(case, verbose)


def candidate_task(case, ref_cases: dict, goldens: dict, verbose: bool = False):
    """`executors.candidate_job` on a worker, scoring included (the driver may hold no engine)."""
    import ray

    # Goldens come as object refs (put once, shared by every task); refs nested in a dict are not
    # resolved by Ray itself.
    goldens = {r: ray.get(g) if isinstance(g, ray.ObjectRef) else g for r, g in goldens.items()}
    return executors.candidate_job(case, ref_cases, goldens, verbose)


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


# -- the executor ---------------------------------------------------------------------------------------


class RayExecutor:
    """The matrix's jobs as Ray tasks, each with its resources; results as each task finishes."""

    def __init__(self, address: str = LOCAL, *, echo: Echo = print, verbose: bool = False,
                 cpus_per_rank: float = 1.0):
        self.echo, self.verbose, self.cpus_per_rank = echo, verbose, cpus_per_rank
        t0 = time.perf_counter()
        self.ray = connect(address)
        echo(f"ray: connected in {time.perf_counter() - t0:.1f}s; cluster {self.ray.cluster_resources()}")
        self.gpu = self.ray.cluster_resources().get("GPU", 0) > 0
        self._golden = self.ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)(golden_task)
        self._candidate = self.ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)(candidate_task)
        self._goldens_put: dict[str, Any] = {}

    def _options(self, job, name: str) -> dict:
        opts = resources(job.case, gpu=self.gpu, cpus_per_rank=self.cpus_per_rank)
        self.echo(f"{job.label} sent as a Ray task ({opts})")
        return {"name": name, **opts}

    def goldens(self, jobs):
        pending = {self._golden.options(**self._options(j, f"diffcheck-golden-{j.case.id}")).remote(
            j.case, self.verbose): j.case for j in jobs}
        yield from self._results(pending)

    def candidates(self, jobs):
        pending = {}
        for j in jobs:
            for r, g in j.goldens.items():
                if r not in self._goldens_put:
                    self._goldens_put[r] = self.ray.put(g)
            task = self._candidate.options(**self._options(j, f"diffcheck-case-{j.case.id}")).remote(
                j.case, j.ref_cases, {r: self._goldens_put[r] for r in j.goldens}, self.verbose)
            pending[task] = j.case
        for case, result, error in self._results(pending):
            if result is not None:
                self.echo(f"{case.id}: returned by its Ray task after {result.seconds:.1f}s; stored by the driver")
            yield case, result, error

    def _results(self, pending: dict):
        for ref, case in _as_completed(self.ray, pending):
            try:
                yield case, self.ray.get(ref), None
            except Exception as exc:  # a task's failure is the case's ERROR, never the driver's crash
                message, _ = _error_text(exc)
                yield case, None, message


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
