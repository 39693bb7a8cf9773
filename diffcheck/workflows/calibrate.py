"""The noise floor of a reference: record replicas, load them back.

Knows cases, engines (lazily), the golden store and `judging.floor`. A replica is
the reference's own configuration under one harmless perturbation, teacher-forced
along the reference's golden: every step is then a same-context comparison with
the golden. Replicas are stored beside the goldens as ordinary forced runs,
``<suite>/<ref>.floor-<name>.parquet``, content-hashed and in the manifest; a
replica forced along an older golden is stale and left out (and said so).

A recorded run from elsewhere can join a floor too (`add_replica`): e.g. on a GPU
the same reference under another attention backend, or the same configuration
recorded on another machine. A generate replica counts its steps before t*.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diffcheck.core.errors import ConfigError, DataError
from diffcheck.judging.floor import Floor, build_floor, precision_spec
from diffcheck.storage import store
from diffcheck.core.types import Run

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Perturbation:
    name: str
    description: str
    engine: dict  # overrides of the reference's engine table


# Harmless for any correct engine: a fresh process, and other batch shapes (every
# prompt meets other batch neighbours and other kernel tilings). The unbatched and
# 2-per-batch shapes stay out: the default suite judges F and S2 against the floor.
PERTURBATIONS = (
    Perturbation("restart", "a fresh engine with the same configuration", {}),
    Perturbation("batch3", "at most 3 sequences per batch", {"max_num_seqs": 3}),
    Perturbation("batch5", "at most 5 sequences per batch", {"max_num_seqs": 5}),
)


def perturbations_for(suite, reference_id: str, *, exclude_tags=("slow", "gpu")) -> tuple[Perturbation, ...]:
    """The default perturbations, plus one per tensor-parallel size that a candidate of the
    suite judged against this reference runs at: parallelism changes the reduction order,
    so a TP candidate is judged against a floor that covers its TP size too.

    Candidates tagged with an `exclude_tags` tag the reference does not carry are left out
    (a slow TP case on the CPU lane; GPU cases of a CPU reference); a GPU reference's GPU
    candidates count."""
    ref = suite.cases[reference_id]
    own = ref.engine.tensor_parallel_size or 1
    excluded = set(exclude_tags) - set(ref.tags)
    sizes = sorted({c.engine.tensor_parallel_size or 1 for c in suite.cases.values()
                    if reference_id in c.references and not excluded & set(c.tags)} - {own})
    return PERTURBATIONS + tuple(Perturbation(f"tp{n}", f"tensor parallel {n}", {"tensor_parallel_size": n})
                                 for n in sizes)


def replica_path(root: Path, suite: str, reference_id: str, name: str) -> Path:
    base = store.run_path(root, suite, reference_id)  # validates the names
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"replica name {name!r} is not valid (letters, digits, '-', '_')")
    return base.with_name(f"{reference_id}.floor-{name}.parquet")


def replica_files(root: Path, suite: str, reference_id: str) -> dict[str, Path]:
    folder = store.run_path(root, suite, reference_id).parent
    prefix = f"{reference_id}.floor-"
    return {p.name[len(prefix):-len(".parquet")]: p for p in sorted(folder.glob(f"{prefix}*.parquet"))}


def load_floor(root: Path, suite: str, reference_id: str, golden: Run) -> tuple[Floor, list[str]]:
    """The reference's floor from its stored replicas, and notes on any left out."""
    replicas, notes = {}, []
    digest = store.content_digest(golden)
    spec = precision_spec(golden)
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
        replicas[name] = run
    floor = build_floor(golden, replicas)
    return dataclasses.replace(floor, notes=tuple(notes)), notes


def calibrate(case, *, root: Path, golden: Run, perturbations=PERTURBATIONS, verbose: bool = False,
              echo: Echo = print) -> Floor:
    """Record every replica of `case` (a reference) along its golden, then the floor."""
    from diffcheck.core import progress
    from diffcheck.workflows.runner import open_engine

    digest = store.content_digest(golden)
    for k, p in enumerate(perturbations, 1):
        path = replica_path(root, case.suite, case.id, p.name)
        if path.exists():
            try:
                old = store.read_run(path)
                if old.meta.source.get("golden_digest") == digest and old.meta.source.get("perturbation") == p.engine:
                    echo(f"{case.id}: floor replica {k}/{len(perturbations)} ({p.name}) up to date")
                    continue
            except DataError:
                pass
        replica_case = dataclasses.replace(case, engine=dataclasses.replace(case.engine, **p.engine))
        progress.stage(f"{case.id}: floor replica {k} of {len(perturbations)} ({p.name})")
        echo(f"{case.id}: floor replica {k}/{len(perturbations)}: {p.description}; starting engine")
        with open_engine(replica_case, verbose=verbose) as engine:
            echo(f"{case.id}: forcing {golden.n_tokens} steps along the golden ({p.name})")
            run = engine.force(golden, progress=progress.task(f"{case.id}: forcing along the golden ({p.name})"))
            progress.activity(f"{case.id}: shutting the engine down")
        meta = dataclasses.replace(run.meta, case_id=f"{case.id}.floor-{p.name}", source={
            **run.meta.source, "golden_digest": digest, "perturbation": p.engine, "description": p.description})
        store.write_run(path, dataclasses.replace(run, meta=meta))
    floor, notes = load_floor(root, case.suite, case.id, golden)
    for note in notes:
        echo(note)
    return floor


def add_replica(root: Path, suite: str, reference_id: str, name: str, run: Run, *, description: str) -> Path:
    """Store a recorded run (generate or forced) as a floor replica of `reference_id`."""
    if run.meta.kind not in ("generate", "forced"):
        raise DataError(f"a floor replica must be a generate or forced run, not {run.meta.kind!r}")
    path = replica_path(root, suite, reference_id, name)
    golden = store.read_run(store.run_path(root, suite, reference_id))
    meta = dataclasses.replace(run.meta, source={**run.meta.source, "description": description,
                                                 "golden_digest": store.content_digest(golden)})
    store.write_run(path, dataclasses.replace(run, meta=meta))
    return path
