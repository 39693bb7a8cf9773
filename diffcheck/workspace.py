"""The workspace: the one writer of a goldens root.

Goldens, candidate runs, forced and scored files, noise-floor replicas and the run
ledger are written here and nowhere else, and the ledger key (what makes two runs the
same experiment) is built here. It sits above the storage layer (files, manifest,
ledger) and the engine layer (whose code identity and model digest are part of a key),
and below the workflows, which decide *what* to run and *when* to write.

Every write goes through `diffcheck.storage.store.write_run` (atomic, two-phase, in the
manifest) or the ledger (SQLite transactions): what a killed command leaves is either
the old file or the new one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from diffcheck import cases as casesmod
from diffcheck.core import config
from diffcheck.core.errors import ConfigError, DataError, DiffcheckError
from diffcheck.core.types import Run, Verdict
from diffcheck.judging.floor import Floor, build_floor, factors, precision_spec
from diffcheck.storage import ledger as ledgermod
from diffcheck.storage import store

Echo = Callable[[str], None]


def goldens_root(root: str | Path | None = None) -> Path:
    """`root` (``--goldens``) if given, else $DIFFCHECK_GOLDENS, [tool.diffcheck] goldens, ./goldens."""
    return config.goldens_dir(root)


# -- the ledger -------------------------------------------------------------------------------


def ledger(root: Path) -> ledgermod.Ledger:
    return ledgermod.Ledger.open(root)


def ledger_key(case, *, goldens: dict[str, Run] | None = None, state: dict[str, Any] | None = None) -> str:
    """The identity of running `case` now: config, code, model, and the goldens it is replayed along."""
    from diffcheck.engines import models

    payload = {
        "config": casesmod.config_digest(case),
        "code": ledgermod._code_identity(state if state is not None else ledgermod.code_state()),
        "model": models.resolve_case(case).digest,
        "goldens": {ref: store.content_digest(run) for ref, run in sorted(goldens.items())} if goldens else None,
    }
    return ledgermod._digest(payload)


def record_run(root: Path, run: Run, *, path: Path, case, goldens: dict[str, Run] | None = None):
    """The ledger row of a run an engine executed for `case`."""
    state = ledgermod.code_state()
    return ledger(root).add(run, path=path, key=ledger_key(case, goldens=goldens, state=state), state=state,
                            config_digest=casesmod.config_digest(case), role=case.role)


def set_verdict(root: Path, run: Run | None, verdict: Verdict) -> None:
    ledger(root).set_verdict(run, verdict)


def engine_code(case) -> dict | None:
    """What code the case's engine runs (version, commit, dirty), or None when that cannot be known."""
    from diffcheck.engines import registry

    return registry.engine_class(case.engine.kind or "vllm").code_identity(dataclasses.asdict(case.engine))


# -- goldens ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoldenResult:
    case_id: str
    path: Path
    status: str  # "recorded" | "unchanged" | "up to date" | "updated"
    digest: str
    message: str = ""


def golden_path(root: Path, case) -> Path:
    return store.run_path(root, case.suite, case.id)


def load_golden(root: Path, suite: str, case_id: str) -> Run:
    path = store.run_path(root, suite, case_id)
    if not path.exists():
        raise DataError(f"{path}: no golden for '{case_id}'; record it with "
                        f"`diffcheck golden record {case_id} --suite {suite}`")
    return store.read_run(path)


def golden_up_to_date(path: Path, case) -> str | None:
    """The stored golden's digest if it was recorded from this exact config and model, else None."""
    if not path.exists():
        return None
    try:
        meta = store.read_meta(path)
    except DataError:
        return None  # unreadable (older schema, damaged): store_golden decides what to do
    from diffcheck.engines import models

    model = models.resolve_case(case)
    engine = engine_code(case)
    if engine is None:
        return None  # a server diffcheck did not start: what code it runs is not known here
    same = (
        meta.source.get("config_digest") == casesmod.config_digest(case)
        and meta.model.get("digest") == model.digest
        and meta.engine.get("version") == engine.get("version")
        and meta.engine.get("commit") == engine.get("commit")  # a vLLM source checkout moved on
        and not engine.get("dirty")
    )
    return stored_digest(path) if same else None


def stored_digest(path: Path) -> str:
    entry = store.manifest_entry(path)
    return entry["content_blake3"] if entry else store.content_digest(store.read_run(path))


def store_golden(root: Path, case, run: Run, *, update: bool = False) -> GoldenResult:
    """Write `run` as `case`'s golden; refuse to change an existing one without `update`."""
    path = golden_path(root, case)
    new_digest = store.content_digest(run)
    if path.exists():
        try:
            old_meta = store.read_meta(path)
            old_digest = stored_digest(path)
        except DataError as exc:
            if not update:
                raise DataError(f"{exc.message}; or pass --update to replace it") from None
            store.write_run(path, run)
            record_run(root, run, path=path, case=case)
            return GoldenResult(case.id, path, "updated", new_digest, "replaced an unreadable golden")
        if old_digest == new_digest:
            return GoldenResult(case.id, path, "unchanged", new_digest, "re-recorded: identical content digest")
        changed = _meta_delta(old_meta, run.meta)
        what = f"content {old_digest[:12]} -> {new_digest[:12]}" + (f"; config changed: {changed}" if changed else "")
        if not update:
            raise DiffcheckError(f"{path}: golden exists and would change ({what}); pass --update to overwrite")
        store.write_run(path, run)
        record_run(root, run, path=path, case=case)
        return GoldenResult(case.id, path, "updated", new_digest, what)
    store.write_run(path, run)
    record_run(root, run, path=path, case=case)
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


# -- candidate runs ---------------------------------------------------------------------------


def candidate_file(root: Path, case) -> Path:
    return store.run_path(root, case.suite, case.id, kind="generate", role="candidate")


def forced_file(root: Path, suite: str, case_id: str, reference_id: str) -> Path:
    return store.run_path(root, suite, case_id, kind="forced", reference=reference_id)


def scored_file(root: Path, suite: str, case_id: str, reference_id: str) -> Path:
    return store.run_path(root, suite, case_id, kind="scored", reference=reference_id)


def cached_candidate(case, references: list[str], goldens: dict[str, Run], *, root: Path,
                     mode: str) -> tuple[Run, dict[str, Run], list[str]] | None:
    """The ledger's identical run of `case` (same key) when its files are intact and its forced runs
    serve replay `mode`: (candidate, forced, the line that says so), else None."""
    from diffcheck.engines import replay as replaymod

    if engine_code(case) is None:
        return None  # a base_url server's code is not known: never reused
    run_file = candidate_file(root, case)
    forced_files = {r: forced_file(root, case.suite, case.id, r) for r in references}
    hit = ledger(root).lookup(ledger_key(case, goldens=goldens))
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


def store_candidate(case, cand: Run, forced: dict[str, Run], goldens: dict[str, Run], *, root: Path) -> None:
    """Write a candidate run and its forced runs beside the goldens and record it in the ledger."""
    run_file = candidate_file(root, case)
    store.write_run(run_file, cand)
    for ref_id, run in forced.items():
        store.write_run(forced_file(root, case.suite, case.id, ref_id), run)
    record_run(root, cand, path=run_file, case=case, goldens=goldens)


def _readable(path: Path) -> Run | None:
    """The run stored at `path`, or None when there is none or it cannot be read (it is then redone)."""
    if not path.exists():
        return None
    try:
        return store.read_run(path)
    except DataError:
        return None


def stored_score(root: Path, ref_id: str, candidate: Run) -> Run | None:
    """The reference's stored scoring of exactly this candidate (by content digest), or None."""
    scored = _readable(scored_file(root, candidate.meta.suite, candidate.meta.case_id, ref_id))
    return scored if scored is not None and scored.meta.source.get("scored_digest") == store.content_digest(candidate) \
        else None


def store_score(root: Path, ref_id: str, candidate: Run, scored: Run) -> Run:
    """Write the reference's scoring of `candidate`, keyed by the candidate's content digest."""
    path = scored_file(root, candidate.meta.suite, candidate.meta.case_id, ref_id)
    scored = dataclasses.replace(scored, meta=dataclasses.replace(
        scored.meta, source={**scored.meta.source, "scored_digest": store.content_digest(candidate)}))
    store.write_run(path, scored)
    return scored


# -- noise floors -----------------------------------------------------------------------------


def replica_path(root: Path, suite: str, reference_id: str, name: str) -> Path:
    base = store.run_path(root, suite, reference_id)  # validates the names
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"replica name {name!r} is not valid (letters, digits, '-', '_')")
    return base.with_name(f"{reference_id}.floor-{name}.parquet")


def replica_files(root: Path, suite: str, reference_id: str) -> dict[str, Path]:
    folder = store.run_path(root, suite, reference_id).parent
    prefix = f"{reference_id}.floor-"
    return {p.name[len(prefix):-len(".parquet")]: p for p in sorted(folder.glob(f"{prefix}*.parquet"))}


def replica_up_to_date(path: Path, golden: Run, perturbation: dict) -> bool:
    old = _readable(path)
    return old is not None and (old.meta.source.get("golden_digest") == store.content_digest(golden)
                                and old.meta.source.get("perturbation") == perturbation)


def store_replica(root: Path, suite: str, reference_id: str, name: str, run: Run, golden: Run, *,
                  perturbation: dict | None, description: str) -> Path:
    """Write a noise-floor replica of `reference_id`, tied to the golden it was forced along."""
    path = replica_path(root, suite, reference_id, name)
    digest = store.content_digest(golden)
    if perturbation is not None:  # recorded by `diffcheck calibrate`
        meta = dataclasses.replace(run.meta, case_id=f"{reference_id}.floor-{name}", source={
            **run.meta.source, "golden_digest": digest, "perturbation": perturbation, "description": description})
    else:  # a recorded run added with `calibrate --add`
        meta = dataclasses.replace(run.meta, source={**run.meta.source, "description": description,
                                                     "golden_digest": digest})
    store.write_run(path, dataclasses.replace(run, meta=meta))
    return path


def load_floor(root: Path, suite: str, reference_id: str, golden: Run, *,
               candidate: Run | None = None) -> tuple[Floor, list[str]]:
    """The reference's floor from its stored replicas, and notes on any left out.

    With `candidate`, a replica that varies a factor the candidate changes (`floor.factors`:
    a batch shape, a backend, a TP size, an environment variable) is left out: a floor never
    holds the factor under test, or a bug in that factor would be benign by construction."""
    replicas, notes = {}, []
    digest = store.content_digest(golden)
    spec = precision_spec(golden)
    changed = factors(candidate, golden) if candidate is not None else set()
    for name, path in replica_files(root, suite, reference_id).items():
        run = store.read_run(path)
        if run.meta.kind == "forced" and run.meta.source.get("golden_digest") != digest:
            notes.append(f"floor replica {path.name} was forced along an older golden of {reference_id}: "
                         f"left out (run `diffcheck calibrate {reference_id}`)")
            continue
        if precision_spec(run) != spec:  # a floor is keyed by (model, precision spec)
            notes.append(f"floor replica {path.name} has another precision spec than {reference_id} "
                         f"({precision_spec(run)} vs {spec}): left out")
            continue
        shared = sorted(factors(run, golden) & changed)
        if shared:
            notes.append(f"floor replica {path.name} varies {', '.join(shared)}, which {candidate.meta.case_id} "
                         "changes: left out (a floor never holds the factor under test)")
            continue
        replicas[name] = run
    floor = build_floor(golden, replicas)
    return dataclasses.replace(floor, notes=tuple(notes)), notes


# -- localize's captures ------------------------------------------------------------------------


def capture_path(root: Path, suite: str, case_id: str, reference_id: str) -> Path:
    """``<case>.taps-<ref>.npz``: the per-layer capture of `case_id` forced along golden `reference_id`
    (`case_id` may be a floor variant's, ``<ref>.floor-<name>``)."""
    base = store.run_path(root, suite, reference_id)  # validates the names
    return base.with_name(f"{case_id}.taps-{reference_id}.npz")


def load_capture(path: Path, key: dict, steps: tuple[int, ...]):
    """The stored capture at `path` when it was made with this `key` (configuration and golden digests)
    and holds every one of `steps`, cut to them; else None (missing, stale or unreadable)."""
    from diffcheck.judging.localize import Capture

    if not path.exists():
        return None
    try:
        arrays, meta = store.read_arrays(path)
    except DataError:
        return None
    stored = tuple(int(t) for t in meta.get("steps", ()))
    if meta.get("key") != key or not set(steps) <= set(stored):
        return None
    pick = [stored.index(t) for t in steps]
    return Capture(case_id=str(meta["case_id"]), n_layers=int(meta["n_layers"]), steps=tuple(steps),
                   norm=arrays["norm"][:, pick], proj=arrays["proj"][:, pick],
                   graph_steps=tuple(t for t in meta.get("graph_steps", ()) if t in steps))


def store_capture(path: Path, capture, key: dict, *, engine: dict | None = None,
                  hardware: dict | None = None) -> Path:
    """Write `capture` (a `judging.localize.Capture`) with the key it was made under, and the engine
    configuration and hardware it was made on (for whoever reads it later; not part of the key)."""
    meta = {"kind": "taps", "case_id": capture.case_id, "n_layers": capture.n_layers,
            "steps": list(capture.steps), "graph_steps": list(capture.graph_steps), "key": key,
            "engine": engine or {}, "hardware": hardware or {}}
    store.write_arrays(path, {"norm": capture.norm, "proj": capture.proj}, meta)
    return path
