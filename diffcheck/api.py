"""diffcheck's Python API: record goldens, compare runs or cases, read, write and export runs.

Everything here is re-exported from the package (``diffcheck.compare`` ...), lazily:
``import diffcheck`` imports none of numpy, pyarrow, torch or vLLM. The CLI and the
pytest plugin (`diffcheck.pytest_plugin`) are built on these functions.

Comparing two recorded runs needs no engine and no suite::

    import diffcheck

    golden = diffcheck.read_run("goldens/default/J.parquet")
    verdict = diffcheck.compare(golden, "goldens/default/O.run.parquet")
    if not verdict:                      # a CaseVerdict is truthy when it passes
        print(verdict)                   # "O vs J: DEGRADED (seq 2 t*=17)"
        print(verdict.sequences[2].evidence[0])

Cases of a suite (engines, ledger, floors, as ``diffcheck golden record`` and
``diffcheck compare`` run them)::

    diffcheck.record_golden("J")                         # the project's default suite
    result = diffcheck.compare_case("S1", suite="default")
    result.verdict, result.verdicts                      # worst verdict, one CaseVerdict per reference

Two more: `run_from_vllm` turns ``vllm.LLM.generate`` results into a `Run`, and `export_run`
writes a run's logprobs as plain numbers (Parquet lists or CSV columns) for other tools.

What passes is `diffcheck.core.types`'s decision (IDENTICAL, BENIGN_DRIFT and
WITHIN_BUDGET pass); errors are `diffcheck.core.errors.DiffcheckError`s with one-line messages.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from diffcheck.core.errors import ConfigError

if TYPE_CHECKING:
    from diffcheck.cases import Case, Suite
    from diffcheck.judging.classify import Tolerances
    from diffcheck.judging.floor import Floor
    from diffcheck.workflows.compare import Comparison
    from diffcheck.workspace import GoldenResult
    from diffcheck.core.types import CaseVerdict, Run

PathLike = str | os.PathLike
Echo = Callable[[str], None]


def _quiet(_: str) -> None:
    """The default progress callback: a library prints nothing."""


def read_run(path: PathLike, *, verify: bool = True) -> Run:
    """Read a run file (a golden, a recorded run, a forced or scored run), checked against its
    folder's MANIFEST.json unless ``verify=False``. Raises `DataError` naming the file."""
    from diffcheck.storage import store

    return store.read_run(path, verify=verify)


def write_run(path: PathLike, run: Run) -> str:
    """Write `run` atomically as a golden-format Parquet file, record it in the folder's
    MANIFEST.json, and return its content digest (blake3)."""
    from diffcheck.storage import store

    return store.write_run(path, run)


def _run(value: Run | PathLike, what: str) -> Run:
    from diffcheck.core.types import Run

    if isinstance(value, Run):
        return value
    if isinstance(value, (str, os.PathLike)):
        return read_run(value)
    raise ConfigError(f"compare: {what} must be a diffcheck Run or the path of a run file, got {type(value).__name__}")


def compare(reference_run: Run | PathLike, candidate_run: Run | PathLike, *, forced: Run | PathLike | None = None,
            scored: Run | PathLike | None = None, floor: Floor | None = None,
            tolerances: Tolerances | Mapping[str, Any] | None = None) -> CaseVerdict:
    """Judge `candidate_run` against `reference_run`, sequence by sequence; no engine runs.

    Each argument is a `Run` or the path of a run file. `forced`: the candidate teacher-forced
    along the reference (kind ``forced``); `scored`: the reference's logprobs of the candidate's
    tokens (kind ``scored``); both sharpen the verdict past the first divergence. `floor`: the
    reference's noise floor (`diffcheck.Floor`, e.g. from `diffcheck.judging.floor.build_floor`);
    without one, margins are the minimum effect of interest. `tolerances`: a `Tolerances` or a dict
    of its fields (as in a case's ``[tolerances]`` table; ``min_effect`` as in a case:
    ``{"min_effect": {"kl": 1e-3, "loss": 0.02}}``).

    Returns one `CaseVerdict`: truthy when it passes (`diffcheck.core.types`), its worst
    sequence's verdict in ``.verdict``, per-sequence t*, onset, evidence and statistics in
    ``.sequences``.
    """
    from diffcheck.judging import classify
    from diffcheck.judging.quality import with_quality

    reference, candidate = _run(reference_run, "reference_run"), _run(candidate_run, "candidate_run")
    if tolerances is None:
        tol = classify.Tolerances()
    elif isinstance(tolerances, classify.Tolerances):
        tol = tolerances
    elif isinstance(tolerances, Mapping):
        tol = classify.Tolerances.from_dict(dict(tolerances), source="compare(tolerances=...)")
    else:
        raise ConfigError(f"compare: tolerances must be a Tolerances or a dict of its fields, "
                          f"got {type(tolerances).__name__}")
    verdict = classify.compare_runs(
        reference, candidate,
        forced=_run(forced, "forced") if forced is not None else None,
        scored=_run(scored, "scored") if scored is not None else None,
        tolerances=tol, floor=floor,
        candidate_id=candidate.meta.case_id, reference_id=reference.meta.case_id,
    )
    return with_quality(verdict, candidate)


def _suite(suite: str | PathLike | Suite | None) -> Suite:
    from diffcheck import cases

    if isinstance(suite, cases.Suite):
        return suite
    return cases.load_suite(suite)


def compare_case(case_id: str, *, suite: str | PathLike | Suite | None = None, goldens: PathLike | None = None,
                 run_file: PathLike | None = None, force: bool = False, verbose: bool = False,
                 echo: Echo | None = None, replay: str | None = None,
                 own_golden: bool | None = None) -> Comparison:
    """Run candidate `case_id` of `suite` and judge it against each of its references' goldens and
    noise floors, as ``diffcheck compare`` does (ledger reuse, forced replay, reference scoring).

    `suite`: a name, a path or a loaded `Suite` (default: the project's, `diffcheck.core.config`);
    `goldens`: the goldens root (default: the project's); `run_file`: judge that recorded run
    instead of starting an engine; `force`: run again even if the ledger holds an identical run;
    `echo`: a progress callback (default: silent); `replay`: ``"partial"`` (forced replay only
    where the candidate left the golden's path, from its t*) or ``"full"`` (every sequence from
    step 0), default per case (`diffcheck.engines.replay.mode_for`). Returns a `Comparison`: ``.verdicts`` (one
    `CaseVerdict` per reference), ``.verdict`` (the worst), ``.candidate`` and ``.goldens``.
    An engine failure is an ERROR verdict, not an exception. A reference case is judged against
    its own stored golden (a fresh run with today's engine; `own_golden`, default: when it has
    no references), the regression check of the engine itself.
    """
    from diffcheck.workflows import compare as comparemod
    from diffcheck.workflows import record
    from diffcheck import workspace

    return comparemod.compare(_suite(suite), case_id, root=workspace.goldens_root(goldens),
                          run_file=Path(run_file) if run_file is not None else None, verbose=verbose,
                          force=force, echo=echo or _quiet, replay=replay, own_golden=own_golden)


def record_golden(case: str | Case, *, suite: str | PathLike | Suite | None = None,
                  goldens: PathLike | None = None, update: bool = False, force: bool = False,
                  check_determinism: bool = False, verbose: bool = False, echo: Echo | None = None) -> GoldenResult:
    """Record reference `case`'s golden (an id of `suite`, or a loaded `Case`), as
    ``diffcheck golden record`` does.

    An up-to-date golden (same config, engine and model) is left alone unless `force`; one
    whose content would change is refused unless `update`. `check_determinism` generates
    twice and refuses a reference that is not reproducible. Returns a `GoldenResult`
    (``.status``: recorded, unchanged, up to date or updated; ``.path``; ``.digest``).
    """
    from diffcheck import cases
    from diffcheck.workflows import compare as comparemod
    from diffcheck.workflows import record
    from diffcheck import workspace

    resolved = case if isinstance(case, cases.Case) else cases.get_case(_suite(suite), case)
    return record.record_golden(resolved, root=workspace.goldens_root(goldens), update=update, force=force,
                                check_determinism=check_determinism, verbose=verbose, echo=echo or _quiet)


def run_from_vllm(outputs: Any, *, case_id: str = "vllm", suite: str = "", role: str = "candidate") -> Run:
    """vLLM's ``LLM.generate`` results (a list of ``vllm.RequestOutput``) as a diffcheck `Run`.

    One sequence per completion, in order: prompt ``i`` (completion ``j`` when ``n > 1``) gets
    the prompt id ``"i"`` (``"i.j"``). Each step keeps the generated token, its logprob and the
    top-k list vLLM returned; the requests must ask for them (``SamplingParams(logprobs=K)``,
    K >= 1; diffcheck's suites use 20). K is the smallest number of entries at any step (vLLM
    returns the top K plus the sampled token when that falls outside them).
    """
    import datetime
    import sys

    from diffcheck.core import __version__
    from diffcheck.engines.vllm_outputs import concat, steps_from_logprobs  # the offline engine's own conversion
    from diffcheck.core.types import Run, RunMeta, SequenceInfo

    if isinstance(outputs, (str, bytes)) or not hasattr(outputs, "__iter__"):
        raise ConfigError(f"expected a list of vllm.RequestOutput (LLM.generate's result), got {type(outputs).__name__}")
    completions = []
    for i, out in enumerate(outputs):
        if not hasattr(out, "outputs") or not hasattr(out, "prompt_token_ids"):
            raise ConfigError(f"output {i}: expected a vllm.RequestOutput, got {type(out).__name__}")
        for j, comp in enumerate(out.outputs):
            pid = str(i) if len(out.outputs) == 1 else f"{i}.{j}"
            if comp.token_ids and comp.logprobs is None:
                raise ConfigError(f"output {i}: no logprobs; generate with SamplingParams(logprobs=K), K >= 1 "
                                  "(diffcheck's suites use 20)")
            completions.append((pid, out, comp))
    sizes = [len(entry) for _, _, comp in completions for entry in (comp.logprobs or ()) if entry]
    k = max(1, min(sizes)) if sizes else 1
    parts, seqs = [], []
    for pid, out, comp in completions:
        tokens = [int(t) for t in comp.token_ids]
        parts.append(steps_from_logprobs(tokens, comp.logprobs, k))
        seqs.append(SequenceInfo(prompt_id=pid, prompt_token_ids=tuple(int(t) for t in out.prompt_token_ids or ()),
                                 text=comp.text, finish_reason=str(comp.finish_reason), n_tokens=len(tokens)))
    vllm = sys.modules.get("vllm")
    engine = {"name": "vllm", "version": getattr(vllm, "__version__", None)} if vllm is not None else {}
    meta = RunMeta(suite=suite, case_id=case_id, role=role, kind="generate", engine=engine,
                   sampling={"logprobs": k},
                   created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   diffcheck_version=__version__)
    return Run(meta=meta, sequences=tuple(seqs), steps=concat(parts, k))


EXPORT_FORMATS = ("parquet", "csv")


def export_run(run: Run | PathLike, out: PathLike, *, format: str = "parquet") -> Path:  # noqa: A002
    """Write a run's steps as plain numbers for other tools, atomically; return `out`.

    One row per generated token, in sequence then step order: ``seq``, ``prompt_id``, ``step``,
    ``token_id``, ``logprob`` (float32 nats; empty where vLLM gave none), then the top-k:

    - ``parquet``: ``topk_ids`` (list<int32>) and ``topk_logprobs`` (list<float32>), rank order,
      without the padding of short lists; the schema metadata names the source run
      (``diffcheck.suite``, ``diffcheck.case_id``, ``diffcheck.kind``, ``diffcheck.content_blake3``).
    - ``csv``: ``top1_id, top1_logprob, ..., topK_id, topK_logprob``; empty cells where a list is
      shorter than K. Each logprob is written so that it reads back as the same float32.

    The values are the stored ones: what `read_run` returns, no further rounding.
    """
    import numpy as np

    from diffcheck.storage import store
    from diffcheck.storage.manifest import atomic_write

    if format not in EXPORT_FORMATS:
        raise ConfigError(f"export format {format!r} is not valid (valid: {', '.join(EXPORT_FORMATS)})")
    source = _run(run, "run")
    out = Path(out)
    if isinstance(run, (str, os.PathLike)) and Path(run).resolve() == out.resolve():
        raise ConfigError(f"{out}: the export would overwrite the run it reads; pass another --out")
    st = source.steps
    prompt_ids = np.repeat(np.array([s.prompt_id for s in source.sequences], dtype=object),
                           [s.n_tokens for s in source.sequences])
    present = st.topk_ids >= 0  # -1 pads a short top-k list
    logprob = st.logprob.astype(np.float32)
    if format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        counts = present.sum(1)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        table = pa.table({
            "seq": pa.array(st.seq, pa.int32()),
            "prompt_id": pa.array(prompt_ids.tolist(), pa.string()),
            "step": pa.array(st.step, pa.int32()),
            "token_id": pa.array(st.token_id, pa.int32()),
            "logprob": pa.array(logprob, pa.float32(), mask=np.isnan(logprob)),
            "topk_ids": pa.ListArray.from_arrays(offsets, pa.array(st.topk_ids[present], pa.int32())),
            "topk_logprobs": pa.ListArray.from_arrays(offsets, pa.array(st.topk_logprobs[present], pa.float32())),
        })
        table = table.replace_schema_metadata({
            "diffcheck.suite": source.meta.suite, "diffcheck.case_id": source.meta.case_id,
            "diffcheck.kind": source.meta.kind, "diffcheck.content_blake3": store.content_digest(source)})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        data = buf.getvalue()
    else:
        def number(value: np.float32) -> str:
            return "" if np.isnan(value) else repr(float(value))  # float32 -> float64 is exact

        k = st.k
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["seq", "prompt_id", "step", "token_id", "logprob"]
                        + [f"top{j + 1}_{what}" for j in range(k) for what in ("id", "logprob")])
        for i in range(len(st)):
            row = [int(st.seq[i]), prompt_ids[i], int(st.step[i]), int(st.token_id[i]), number(logprob[i])]
            for j in range(k):
                row += ([int(st.topk_ids[i, j]), number(st.topk_logprobs[i, j])] if present[i, j] else ["", ""])
            writer.writerow(row)
        data = text.getvalue().encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, data)
    return out
