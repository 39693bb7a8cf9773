"""`diffcheck localize`: which layer and op of a candidate first leaves the reference's noise floor.

What runs (docs/localize.md):

1. The onset step T: `--step`, else the first divergence t* of the candidate's stored run
   against the reference's golden (`workspace.candidate_file`, written by `diffcheck run` /
   `compare`).
2. The reference, each of its floor replicas (calibrate's perturbations: a fresh engine, other
   batch shapes) and the candidate, each one engine opened with the taps
   (`engines.session.EngineSession(taps=True)`), are teacher-forced along the golden's first
   T + 1 tokens; the taps bring back, at steps T-K..T, per decoder layer and op, a norm and a
   64-number projection of each captured token's row (`diffcheck.engines.taps`).
3. `diffcheck.judging.localize`: per-site floors from the replicas, the first site beyond in
   model order, inherited or not, the five worst others.

Each capture is stored beside the goldens (`workspace.capture_path`: ``<case>.taps-<ref>.npz``, in the
manifest) with the configuration and golden digests it was made under; a later localize with the same
key reuses it instead of starting that engine, so a reference and its floor are captured once, and a
capture recorded on a GPU is re-judged anywhere. `captures` (a dict the caller may share) also keeps
them in memory across calls.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from diffcheck import workspace
from diffcheck.core import progress
from diffcheck.core.errors import ConfigError
from diffcheck.engines import session as sessionmod
from diffcheck.engines.base import hardware
from diffcheck.judging import localize as L
from diffcheck.report.localize import LocalizeReport

Echo = Callable[[str], None]
AROUND = 4  # steps captured before the onset


def onset_step(case, golden, *, root: Path, step: int | None) -> tuple[int, str]:
    """The step to localize at, and where it came from."""
    if step is not None:
        if step < 0:
            raise ConfigError(f"--step {step}: must be a step index >= 0")
        return int(step), "--step"
    from diffcheck.core.errors import DataError
    from diffcheck.judging.align import first_divergence
    from diffcheck.storage import store

    path = workspace.candidate_file(root, case)
    if not path.exists():
        raise ConfigError(f"case '{case.id}': no stored run at {path} to take the onset from; run "
                          f"`diffcheck run {case.id}` first or pass --step T")
    try:
        run = store.read_run(path)
    except DataError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    found = [first_divergence(golden.sequence(i).token_id, run.sequence(i).token_id)
             for i in range(min(len(golden.sequences), len(run.sequences)))]
    found = [t for t in found if t is not None]
    if not found:
        raise ConfigError(f"case '{case.id}': its stored run {path.name} equals the golden token for token; "
                          "pass --step T to localize anyway")
    return int(min(found)), f"t* of the stored run {path.name}"


def _variant(case, name: str, engine: dict):
    """`case` under a floor perturbation, as its own engine configuration (its own session key)."""
    return dataclasses.replace(case, id=f"{case.id}.floor-{name}",
                               engine=dataclasses.replace(case.engine, **engine))


def tappable(case):
    """`case` as the taps can run it, and a note on what changed (None: nothing). A torch.compile'd
    decoder is traced without Python hooks, so a case that would compile runs with ``compile_mode = 0``;
    its CUDA-graph mode stays as the case sets it, and the graphs record the taps (engines/taps.py)."""
    engine = case.engine
    if engine.enforce_eager or engine.compile_mode == 0:
        return case, None
    graphs = engine.cudagraph_mode or "vLLM's default"
    note = (f"{case.id}: captured with torch.compile off (compile_mode 0; the taps cannot run inside a compiled "
            f"decoder), CUDA-graph mode {graphs} kept: a fault that needs torch.compile to show is not seen here")
    return dataclasses.replace(case, engine=dataclasses.replace(engine, compile_mode=0)), note


def localize(case, *, suite, root: Path, reference: str | None = None, step: int | None = None,
             around: int = AROUND, perturbations=None, session: sessionmod.EngineSession | None = None,
             captures: dict | None = None, verbose: bool = False, echo: Echo = print) -> LocalizeReport:
    """Localize `case` (a candidate) against `reference` (default: its first) and the reference's floor."""
    import contextlib

    from diffcheck import cases as casesmod
    from diffcheck.engines import taps
    from diffcheck.storage import store
    from diffcheck.workflows import calibrate

    if around < 0:
        raise ConfigError(f"--around {around}: must be >= 0")
    ref_id = reference or (case.references[0] if case.references else None)
    if ref_id is None:
        raise ConfigError(f"case '{case.id}' has no references; pass --reference ID")
    ref_case = casesmod.get_case(suite, ref_id)
    if ref_case.role != "reference":
        raise ConfigError(f"--reference {ref_id}: case '{ref_id}' is a {ref_case.role}, not a reference")
    golden = workspace.load_golden(root, suite.name, ref_id)
    t, source = onset_step(case, golden, root=root, step=step)
    longest = max((s.n_tokens for s in golden.sequences), default=0)
    if t >= longest:
        raise ConfigError(f"--step {t}: golden {ref_id} has {longest} steps at most (valid: 0..{longest - 1})")
    steps = tuple(range(max(0, t - around), t + 1))
    if perturbations is None:  # the calibrate replicas, less any that vary what the candidate changes
        changed = {key.split(".", 1)[1] for key in casesmod.config_delta(case, ref_case) if key.startswith("engine.")}
        perturbations = tuple(p for p in calibrate.PERTURBATIONS if not set(p.engine) & changed)
    captures = {} if captures is None else captures
    digest = store.content_digest(golden)
    timings: dict[str, float] = {}
    notes: list[str] = []

    with contextlib.ExitStack() as stack:
        if session is None:
            # one engine at a time: each is used once here, and on a GPU a second engine at vLLM's memory
            # fraction does not start beside the first
            session = stack.enter_context(sessionmod.EngineSession(verbose=verbose, taps=True, exclusive=True))

        def capture(which) -> L.Capture:
            which, note = tappable(which)
            if note and note not in notes:
                notes.append(note)
            key = (which.id, casesmod.config_digest(which), digest, steps)
            if key not in captures:
                path = workspace.capture_path(root, suite.name, which.id, ref_id)
                stored_key = {"config": key[1], "golden": digest}
                captures[key] = workspace.load_capture(path, stored_key, steps)
                if captures[key] is not None:
                    echo(f"{which.id}: stored capture {path.name}")
                    timings[which.id] = 0.0
                    return captures[key]
                engine = session.get(which, echo)
                echo(f"{which.id}: capturing steps {steps[0]}..{steps[-1]} along golden {ref_id}")
                t0 = time.perf_counter()
                captures[key] = taps.capture(engine, golden, steps,
                                             progress=progress.task(f"{which.id}: forced replay with taps"))
                timings[which.id] = time.perf_counter() - t0
                workspace.store_capture(path, captures[key], stored_key, engine=dataclasses.asdict(which.engine),
                                        hardware=hardware())
            return captures[key]

        progress.stage(f"{case.id}: reference {ref_id}")
        ref = capture(ref_case)
        replicas = []
        for k, p in enumerate(perturbations, 1):
            progress.stage(f"{case.id}: floor replica {k} of {len(perturbations)} ({p.name})")
            replicas.append(capture(_variant(ref_case, p.name, p.engine)))
        progress.stage(f"{case.id}: candidate")
        cand = capture(case)
    floors = L.site_floors(ref, replicas)
    result = L.localize(ref, cand, floors, floor_replicas=tuple(p.name for p in perturbations))
    result = dataclasses.replace(result, notes=tuple(notes) + result.notes)
    return LocalizeReport(localization=result, step=t, around=around, onset_source=source, timings=timings)
