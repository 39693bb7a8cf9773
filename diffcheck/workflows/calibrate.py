"""The noise floor of a reference: which replicas, and recording them.

Engines run through `diffcheck.engines.session`, files are written and floors loaded by
`diffcheck.workspace` (`load_floor`, `replica_path`). A replica is
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

from diffcheck import workspace
from diffcheck.core import progress
from diffcheck.core.errors import DataError
from diffcheck.core.types import Run
from diffcheck.engines import session
from diffcheck.judging.floor import Floor

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Perturbation:
    name: str
    description: str
    engine: dict  # overrides of the reference's engine table


# Harmless for any correct engine: a fresh process, and other batch shapes (every
# prompt meets other batch neighbours and other kernel tilings). The unbatched and
# 2-per-batch shapes stay out: the default suite judges F and S2 against the floor.
# No tensor-parallel replica: a TP candidate is judged against its reference's own
# parallelism, and a replica that varies what a candidate changes is left out of that
# candidate's floor anyway (`workspace.load_floor`).
PERTURBATIONS = (
    Perturbation("restart", "a fresh engine with the same configuration", {}),
    Perturbation("batch3", "at most 3 sequences per batch", {"max_num_seqs": 3}),
    Perturbation("batch5", "at most 5 sequences per batch", {"max_num_seqs": 5}),
)


def calibrate(case, *, root: Path, golden: Run, perturbations=PERTURBATIONS, verbose: bool = False,
              echo: Echo = print) -> Floor:
    """Record every replica of `case` (a reference) along its golden, then the floor."""
    for k, p in enumerate(perturbations, 1):
        path = workspace.replica_path(root, case.suite, case.id, p.name)
        if workspace.replica_up_to_date(path, golden, p.engine):
            echo(f"{case.id}: floor replica {k}/{len(perturbations)} ({p.name}) up to date")
            continue
        replica_case = dataclasses.replace(case, engine=dataclasses.replace(case.engine, **p.engine))
        progress.stage(f"{case.id}: floor replica {k} of {len(perturbations)} ({p.name})")
        echo(f"{case.id}: floor replica {k}/{len(perturbations)}: {p.description}; starting engine")
        echo(f"{case.id}: forcing {golden.n_tokens} steps along the golden ({p.name})")
        run = session.force(replica_case, golden, verbose=verbose, label=f" ({p.name})")
        workspace.store_replica(root, case.suite, case.id, p.name, run, golden, perturbation=p.engine, description=p.description)
    floor, notes = workspace.load_floor(root, case.suite, case.id, golden)
    for note in notes:
        echo(note)
    return floor


def add_replica(root: Path, suite: str, reference_id: str, name: str, run: Run, *, description: str) -> Path:
    """Store a recorded run (generate or forced) as a floor replica of `reference_id`."""
    if run.meta.kind not in ("generate", "forced"):
        raise DataError(f"a floor replica must be a generate or forced run, not {run.meta.kind!r}")
    golden = workspace.load_golden(root, suite, reference_id)
    return workspace.store_replica(root, suite, reference_id, name, run, golden, perturbation=None,
                                   description=description)
