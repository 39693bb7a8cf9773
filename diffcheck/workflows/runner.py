"""Orchestration: cases -> engines -> stored runs -> verdicts.

Longer than 400 lines because the golden life cycle and the candidate's run (ledger reuse, engine, storage) share their helpers; splitting them is the next clean-up.

This is the only module that joins the engine side to the pure side. It knows
the golden life cycle (record, skip when up to date, refuse to overwrite
without ``update``), which engines a comparison needs (the candidate for
generation and forced replay, the reference for scoring), and where every run
is written. Engines are imported lazily, so the pure side never pays for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from diffcheck import cases as casesmod
from diffcheck.core import progress
from diffcheck.storage import store
from diffcheck.core.errors import ConfigError, DataError, DiffcheckError, EngineError
from diffcheck.workflows.calibrate import load_floor
from diffcheck.core.types import CaseVerdict, Run, Verdict

Echo = Callable[[str], None]


def goldens_root(root: str | Path | None = None) -> Path:
    """`root` (``--goldens``) if given, else $DIFFCHECK_GOLDENS, [tool.diffcheck] goldens, ./goldens."""
    from diffcheck.core import config

    return config.goldens_dir(root)


def open_engine(case, *, verbose: bool = False):
    """Start the engine the case's ``engine.kind`` names (`diffcheck.engines.registry`)."""
    from diffcheck.engines import models, registry

    engine_class = registry.engine_class(case.engine.kind or "vllm")
    model = models.resolve_case(case)
    prompts = casesmod.load_prompts(case)
    progress.activity(f"{case.id}: starting the engine")
    extra, shown = {}, progress.current()  # the phases arrive on the engine's log-tailing thread
    if "on_phase" in inspect.signature(engine_class).parameters:  # start-up phases, where the engine has them
        extra["on_phase"] = lambda phase: shown.activity(f"{case.id}: engine start: {phase}")
    return engine_class(case, model, prompts=prompts, verbose=verbose, **extra)


def _with_config(run: Run, case) -> Run:
    source = {**run.meta.source, "config_digest": casesmod.config_digest(case)}
    return dataclasses.replace(run, meta=dataclasses.replace(run.meta, source=source))


def _ledger(root: Path):
    from diffcheck.storage import ledger

    return ledger.Ledger.open(root)


# -- goldens -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoldenResult:
    case_id: str
    path: Path
    status: str  # "recorded" | "unchanged" | "up to date" | "updated"
    digest: str
    message: str = ""


def golden_up_to_date(path: Path, case) -> str | None:
    """The stored golden's digest if it was recorded from this exact config and model, else None."""
    if not path.exists():
        return None
    try:
        meta = store.read_meta(path)
    except DataError:
        return None  # unreadable (older schema, damaged): record_golden decides what to do
    from diffcheck.engines import models

    from diffcheck.storage.identity import vllm_source_state  # does not import vllm

    model = models.resolve_case(case)
    from diffcheck.engines import registry

    engine = registry.engine_class(case.engine.kind or "vllm").code_identity(dataclasses.asdict(case.engine))
    if engine is None:
        return None  # a server diffcheck did not start: what code it runs is not known here
    same = (
        meta.source.get("config_digest") == casesmod.config_digest(case)
        and meta.model.get("digest") == model.digest
        and meta.engine.get("version") == engine.get("version")
        and meta.engine.get("commit") == engine.get("commit")  # a vLLM source checkout moved on
        and not engine.get("dirty")
    )
    return _stored_digest(path) if same else None


def _stored_digest(path: Path) -> str:
    entry = store.manifest_entry(path)
    return entry["content_blake3"] if entry else store.content_digest(store.read_run(path))


def record_golden(case, *, root: Path, update: bool = False, force: bool = False,
                  check_determinism: bool = False, verbose: bool = False, echo: Echo = print,
                  pool: EnginePool | None = None) -> GoldenResult:
    """Record `case`'s golden unless an identical one exists; refuse to change one without `update`."""
    path = store.run_path(root, case.suite, case.id)
    if not force and not check_determinism:
        digest = golden_up_to_date(path, case)
        if digest:
            return GoldenResult(case.id, path, "up to date", digest,
                                "same config, engine version and model as recorded; --force re-records")
    with contextlib.ExitStack() as stack:
        if pool is not None:
            engine = pool.get(case, echo)
        else:
            echo(f"{case.id}: starting engine ({case.description or case.role})")
            engine = stack.enter_context(open_engine(case, verbose=verbose))
        echo(f"{case.id}: engine up in {engine.timings['startup_s']:.1f}s; generating {len(engine.prompts)} prompts")
        run = _with_config(engine.generate(progress=progress.task(f"{case.id}: generating")), case)
        echo(f"{case.id}: {run.n_tokens} tokens in {engine.timings['generate_s']:.1f}s")
        if check_determinism:
            echo(f"{case.id}: generating again to check determinism")
            again = _with_config(engine.generate(progress=progress.task(f"{case.id}: generating again")), case)
            a, b = store.content_digest(run), store.content_digest(again)
            if a != b:
                raise DataError(f"case '{case.id}' is not reproducible: two recordings differ "
                                f"(content {a[:12]} vs {b[:12]}); a reference must be deterministic")
        if pool is None:
            progress.activity(f"{case.id}: shutting the engine down")
    new_digest = store.content_digest(run)
    if path.exists():
        try:
            old_meta = store.read_meta(path)
            old_digest = _stored_digest(path)
        except DataError as exc:
            if not update:
                raise DataError(f"{exc.message}; or pass --update to replace it") from None
            store.write_run(path, run)
            _ledger(root).add(run, path=path, case=case)
            return GoldenResult(case.id, path, "updated", new_digest, "replaced an unreadable golden")
        if old_digest == new_digest:
            return GoldenResult(case.id, path, "unchanged", new_digest, "re-recorded: identical content digest")
        changed = _meta_delta(old_meta, run.meta)
        what = f"content {old_digest[:12]} -> {new_digest[:12]}" + (f"; config changed: {changed}" if changed else "")
        if not update:
            raise DiffcheckError(f"{path}: golden exists and would change ({what}); pass --update to overwrite")
        store.write_run(path, run)
        _ledger(root).add(run, path=path, case=case)
        return GoldenResult(case.id, path, "updated", new_digest, what)
    store.write_run(path, run)
    _ledger(root).add(run, path=path, case=case)
    return GoldenResult(case.id, path, "recorded", new_digest)


def _meta_delta(old, new) -> dict:
    from deepdiff import DeepDiff

    keys = ("engine", "sampling", "model", "env")
    a = {k: getattr(old, k) for k in keys}
    b = {k: getattr(new, k) for k in keys}
    for side in (a, b):
        side["engine"] = {k: v for k, v in side["engine"].items() if k not in ("path",)}
    diff = DeepDiff(a, b, ignore_order=True, verbose_level=2)
    out = {}
    for kind in ("values_changed", "type_changes"):
        for where, change in diff.get(kind, {}).items():
            out[where.replace("root", "")] = (change.get("old_value"), change.get("new_value"))
    for kind in ("dictionary_item_added", "dictionary_item_removed"):
        for where in diff.get(kind, {}):
            out[str(where).replace("root", "")] = kind.split("_")[-1]
    return out


def load_golden(root: Path, suite: str, case_id: str) -> Run:
    path = store.run_path(root, suite, case_id)
    if not path.exists():
        raise DataError(f"{path}: no golden for '{case_id}'; record it with "
                        f"`diffcheck golden record {case_id} --suite {suite}`")
    return store.read_run(path)


# -- candidate runs and comparisons --------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    verdicts: tuple[CaseVerdict, ...]
    candidate: Run | None
    goldens: dict[str, Run]
    reused: tuple[str, ...] = ()  # what was reused instead of run again, for the output
    forced: dict[str, Run] = dataclasses.field(default_factory=dict)  # reference id -> forced run, where one exists

    @property
    def verdict(self) -> Verdict:
        return Verdict.worst(v.verdict for v in self.verdicts)


def _differs(golden: Run, candidate: Run) -> bool:
    import numpy as np

    if len(golden.sequences) != len(candidate.sequences):
        return True
    if [s.n_tokens for s in golden.sequences] != [s.n_tokens for s in candidate.sequences]:
        return True
    return not np.array_equal(golden.steps.token_id, candidate.steps.token_id)


def run_candidate(case, references: list[str], goldens: dict[str, Run], *, root: Path, verbose: bool = False,
                  force: bool = False, echo: Echo = print,
                  replay: str | None = None) -> tuple[Run, dict[str, Run], list[str]]:
    """Generate the candidate and teacher-force it along each golden: one engine start.

    An identical earlier run (same config digest, engine, model, goldens, replay mode) is
    reused from the ledger instead of run again, unless ``force`` (``force`` is about the
    ledger; the replay mode is ``replay``).

    Forced replay runs only where it is needed (`diffcheck.engines.replay`): a sequence
    whose sampled tokens equal the golden's has walked the golden's path already, and its
    forced rows are its own generate rows (reused); a sequence that diverged at t* is
    replayed from t* only, with prompt + the shared prefix as its prompt, and its rows
    before t* are its generate rows. The row at t* then comes from a prefill of the last
    prefix token, not from a decode step. ``replay="full"`` (CLI ``--replay full``, case
    tag ``replay-full``; automatic for faults that count decode steps) replays every
    sequence from step 0, for when the decode path at t* matters. ``meta.source`` of each
    forced run says which sequences were replayed (from which step) and which reused.
    """
    from diffcheck.engines import replay as replaymod

    mode, why = replaymod.mode_for(case, replay)
    references = candidate_references(case, references)
    if not force:
        hit = cached_candidate(case, references, goldens, root=root, mode=mode)
        if hit is not None:
            return hit
    echo(f"{case.id}: starting candidate engine ({case.description or 'candidate'})")
    cand, forced = generate_candidate(case, references, goldens, mode=mode, why=why, verbose=verbose, echo=echo)
    store_candidate(case, cand, forced, goldens, root=root)
    return cand, forced, []


def candidate_references(case, references: list[str]) -> list[str]:
    """The references a candidate is forced along: none where its engine cannot force."""
    from diffcheck.engines import registry

    return [] if "forced_replay" in registry.missing(case) else list(references)


def cached_candidate(case, references: list[str], goldens: dict[str, Run], *, root: Path,
                     mode: str) -> tuple[Run, dict[str, Run], list[str]] | None:
    """The ledger's identical run of `case` (same key) when its files are intact and its forced runs
    serve replay `mode`: (candidate, forced, the line that says so), else None."""
    from diffcheck.engines import registry
    from diffcheck.engines import replay as replaymod
    from diffcheck.storage import ledger

    if registry.engine_class(case.engine.kind or "vllm").code_identity(dataclasses.asdict(case.engine)) is None:
        return None  # a base_url server's code is not known: never reused
    run_file = store.run_path(root, case.suite, case.id, kind="generate", role="candidate")
    forced_files = {r: store.run_path(root, case.suite, case.id, kind="forced", reference=r) for r in references}
    hit = _ledger(root).lookup(ledger.key_for(case, goldens=goldens))
    if hit is None or not run_file.exists() or not all(p.exists() for p in forced_files.values()):
        return None
    try:
        cand = store.read_run(run_file)
        if store.content_digest(cand) != hit.content_digest:
            return None
        forced = {r: store.read_run(p) for r, p in forced_files.items()}
    except DataError:
        return None
    if not all(replaymod.serves(f, mode) for f in forced.values()):
        return None
    modes = sorted({replaymod.forced_meta_mode(f) for f in forced.values()})
    return cand, forced, [f"{case.id}: reused run from {hit.created} (same config, engine, model; "
                          f"{'/'.join(modes)} replay; --force reruns)"]


def generate_candidate(case, references: list[str], goldens: dict[str, Run], *, mode: str, why: str = "",
                       verbose: bool = False, echo: Echo = print) -> tuple[Run, dict[str, Run]]:
    """The engine half of `run_candidate`: one engine start, generate, force along each golden.
    Writes nothing (a Ray task runs it on a worker; the driver stores what it returns)."""
    from diffcheck.engines import replay as replaymod

    with open_engine(case, verbose=verbose) as engine:
        echo(f"{case.id}: engine up in {engine.timings['startup_s']:.1f}s; generating {len(engine.prompts)} prompts")
        cand = _with_config(engine.generate(progress=progress.task(f"{case.id}: generating")), case)
        if cand.meta.role != "candidate":  # a reference re-run against its own golden: a run, never a golden
            cand = dataclasses.replace(cand, meta=dataclasses.replace(cand.meta, role="candidate"))
        echo(f"{case.id}: {cand.n_tokens} tokens in {engine.timings['generate_s']:.1f}s")
        forced = {}
        for ref_id in references:
            golden = goldens[ref_id]
            todo = replaymod.plan(golden, cand, mode)
            echo(f"{case.id}: forced decode replay along golden {ref_id} ({todo.describe()}; {engine.mechanism}"
                 + (f"; full because {why}" if mode == "full" and why != "requested" else "") + ")")
            part = engine.force(golden, starts=todo.starts, progress=progress.task(
                f"{case.id}: forced replay along {ref_id}")) if todo.replayed else None
            run = replaymod.assemble(golden, cand, todo, part, reference_id=ref_id, mechanism=engine.mechanism)
            forced[ref_id] = _with_config(run, case)
        progress.activity(f"{case.id}: shutting the engine down")
    return cand, forced


def store_candidate(case, cand: Run, forced: dict[str, Run], goldens: dict[str, Run], *, root: Path) -> None:
    """Write a candidate run and its forced runs beside the goldens and record it in the ledger."""
    from diffcheck.storage import ledger

    run_file = store.run_path(root, case.suite, case.id, kind="generate", role="candidate")
    store.write_run(run_file, cand)
    for ref_id, run in forced.items():
        store.write_run(store.run_path(root, case.suite, case.id, kind="forced", reference=ref_id), run)
    _ledger(root).add(cand, path=run_file, case=case, key=ledger.key_for(case, goldens=goldens))


class EnginePool:
    """Reference engines kept open across comparisons (selftest, tests): one start per reference."""

    def __init__(self, *, verbose: bool = False):
        self.verbose = verbose
        self.engines: dict[str, Any] = {}

    def get(self, case, echo: Echo = print):
        if case.id not in self.engines:
            echo(f"starting reference engine {case.id} (kept open for scoring)")
            self.engines[case.id] = open_engine(case, verbose=self.verbose)
        return self.engines[case.id]

    def close(self) -> None:
        """Close every engine, the last one opened first; a failing close does not keep the others open."""
        failures = []
        while self.engines:
            _, engine = self.engines.popitem()  # dicts pop the last inserted first
            try:
                engine.close()
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def score_candidate(ref_case, candidate: Run, *, root: Path, verbose: bool = False, echo: Echo = print,
                    pool: EnginePool | None = None) -> Run:
    """The reference engine's logprobs of the candidate's tokens (prefill scoring), cached by content."""
    path = store.run_path(root, candidate.meta.suite, candidate.meta.case_id, kind="scored", reference=ref_case.id)
    digest = store.content_digest(candidate)
    if path.exists():
        try:
            scored = store.read_run(path)
            if scored.meta.source.get("scored_digest") == digest:
                return scored
        except DataError:
            pass
    if pool is not None:
        scored = pool.get(ref_case, echo).score(candidate, progress=progress.task(
            f"{ref_case.id}: scoring {candidate.meta.case_id}'s text"))
    else:
        echo(f"{candidate.meta.case_id}: starting reference engine {ref_case.id} to score the candidate's text")
        with open_engine(ref_case, verbose=verbose) as engine:
            scored = engine.score(candidate, progress=progress.task(f"{ref_case.id}: scoring "
                                                                    f"{candidate.meta.case_id}'s text"))
            progress.activity(f"{ref_case.id}: shutting the engine down")
    scored = dataclasses.replace(scored, meta=dataclasses.replace(
        scored.meta, source={**scored.meta.source, "scored_digest": digest}))
    store.write_run(path, scored)
    return scored


def compare(suite, case_id: str, *, root: Path, run_file: Path | None = None, verbose: bool = False,
            force: bool = False, echo: Echo = print, pool: EnginePool | None = None,
            tests: int | None = None, replay: str | None = None, own_golden: bool | None = None) -> Comparison:
    """Judge candidate `case_id` against each of its references' goldens and noise floors.

    `own_golden`: a reference case is also judged against its own stored golden (default:
    exactly when it has no references): a fresh run with today's code and engine, stored as
    ``<case>.run.parquet`` (candidate role, never over the golden), forced along the
    golden, judged against the golden's floor. No scoring there: the engine that would
    score is the one being checked.

    `run_file`: judge that recorded run (and the forced/scored files beside it)
    instead of running the engine; a missing scored file is computed with the local
    reference engine when the golden was recorded on hardware like this one, and the
    signals the verdict had are always stated. `tests`: how many sequences the whole
    command judges (multiple-testing correction); default, this comparison's.
    `replay`: the forced-replay mode (`run_candidate`; default partial).
    """
    from diffcheck.judging import classify

    case = casesmod.get_case(suite, case_id)
    references = list(case.references)
    if own_golden is None:
        own_golden = case.role == "reference" and not references
    if own_golden:
        if case.role != "reference":
            raise ConfigError(f"{casesmod.display_path(case.source)}: case '{case_id}' is a {case.role}: only a "
                              "reference has a golden of its own to be judged against")
        references = [case.id] + [r for r in references if r != case.id]
    if not references:
        raise DiffcheckError(f"case '{case_id}' has no references to compare against (it is a {case.role})")
    goldens = {r: load_golden(root, suite.name, r) for r in references}
    tolerances = classify.Tolerances.from_dict(case.tolerances or {},
                                               source=f"{case.source}: [cases.{case.id}.tolerances]")
    reused: list[str] = []
    if run_file is not None:
        # Offline re-judging: only recorded files, never an engine.
        candidate = store.read_run(Path(run_file))
        folder = Path(run_file).parent
        forced, scored = {}, {}
        for r in references:
            fp = store.run_path(folder.parent, folder.name, case.id, kind="forced", reference=r)
            sp = store.run_path(folder.parent, folder.name, case.id, kind="scored", reference=r)
            if fp.exists():
                forced[r] = store.read_run(fp)
            if sp.exists():
                scored[r] = store.read_run(sp)
            elif r != case.id and _differs(goldens[r], candidate):
                local = _local_engine_note(goldens[r])
                if local is None:
                    try:
                        scored[r] = score_candidate(casesmod.get_case(suite, r), candidate, root=root,
                                                    verbose=verbose, echo=echo, pool=pool)
                    except EngineError as exc:
                        echo(f"{case.id}: reference scoring failed ({exc.message}); judged without it")
                else:
                    echo(f"{case.id}: no scored file beside {run_file} and {local}: judged without scoring")
    else:
        try:
            candidate, forced, reused = run_candidate(case, references, goldens, root=root, verbose=verbose,
                                                      force=force, echo=echo, replay=replay)
        except EngineError as exc:
            verdicts = tuple(classify.error_verdict(case.id, r, exc.message) for r in references)
            return Comparison(verdicts=verdicts, candidate=None, goldens=goldens)
        scored = {}
        for r in references:
            if r != case.id and _differs(goldens[r], candidate):
                try:
                    scored[r] = score_candidate(casesmod.get_case(suite, r), candidate, root=root,
                                                verbose=verbose, echo=echo, pool=pool)
                except EngineError as exc:
                    echo(f"{case.id}: reference scoring failed ({exc.message}); judging without it")
    tok = load_tokenizer(case)
    token_text = (lambda t: tok.decode([int(t)])) if tok is not None else None
    verdicts = []
    n_tests = tests or sum(len(candidate.sequences) for _ in references)
    for r in references:
        floor, notes = load_floor(root, suite.name, r, goldens[r])
        for note in notes:
            echo(note)
        signals = ["generate"] + [name for name, have in (("forced replay", r in forced), ("scoring", r in scored))
                                  if have]
        lacking = _unavailable_signals(case, casesmod.get_case(suite, r))
        if r == case.id:
            lacking = lacking + ["no scoring (own golden: the engine that would score is the one being checked)"]
        echo(f"{case.id} vs {r}: signals: {', '.join(signals + lacking)}; {floor.describe()}")
        v = classify.compare_runs(goldens[r], candidate, forced=forced.get(r), scored=scored.get(r),
                                  tolerances=tolerances, candidate_id=case.id, reference_id=r,
                                  token_text=token_text, floor=floor, tests=n_tests)
        delta = casesmod.config_delta(case, casesmod.get_case(suite, r))
        summary = {**v.summary, "signals": {**v.summary.get("signals", {}), "unavailable": lacking}}
        verdicts.append(dataclasses.replace(with_quality(v, candidate), config_delta=delta, summary=summary))
    _ledger(root).set_verdict(candidate, Verdict.worst(v.verdict for v in verdicts))
    return Comparison(verdicts=tuple(verdicts), candidate=candidate, goldens=goldens, reused=tuple(reused),
                      forced=dict(forced))


def _unavailable_signals(case, ref_case) -> list[str]:
    """What the engines could not give this comparison: the candidate's forced replay, the reference's scoring."""
    from diffcheck.engines import registry

    return registry.unavailable(case, ("forced_replay",)) + registry.unavailable(ref_case, ("prompt_scoring",))


def _local_engine_note(golden: Run) -> str | None:
    """Why the local engine cannot stand in for the golden's reference engine, or None if it can."""
    gpu = golden.meta.hardware.get("gpu_name")
    if not gpu:
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return f"the golden was recorded on {gpu} and this machine has no GPU"


def with_quality(verdict: CaseVerdict, candidate: Run) -> CaseVerdict:
    """Fill in the seed's text metrics the classifier skipped (identical sequences), for reports."""
    from diffcheck.judging.quality import text_metrics

    seqs = tuple(s if s.quality else dataclasses.replace(
        s, quality=text_metrics(candidate.sequences[s.index].text, candidate.sequences[s.index].n_tokens))
        for s in verdict.sequences)
    return dataclasses.replace(verdict, sequences=seqs)


def load_tokenizer(case) -> Any | None:
    """The model's tokenizer (transformers), for token strings in evidence and reports."""
    return _tokenizer(case.model)


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Any | None:
    try:
        from diffcheck.engines import models
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(models.resolve(model).path))
    except Exception:  # evidence and reports fall back to token ids; judging never needs it
        return None
