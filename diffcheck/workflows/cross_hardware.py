"""Cross-hardware scoring: a recorded run whose golden came from a GPU this machine lacks.

The reference's model scores the run on this machine's CPU in float32 (`sessionmod.on_this_cpu`),
and so the golden's own tokens: the judge reads the candidate's scored NLL against that baseline,
never against the GPU's (`classify.compare_runs`, ``scored_reference``). Both scored runs say so in
their meta (``source["cross_hardware"]``), and so do the output and the report's summary. Used by
`workflows.compare` (``compare --run``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from diffcheck import workspace
from diffcheck.core.errors import DiffcheckError
from diffcheck.core.types import Run
from diffcheck.engines import session as sessionmod
from diffcheck.storage import store

Echo = Callable[[str], None]

CROSS_HARDWARE = "cross_hardware"  # the key of a scored run's meta.source that says it came from other hardware


def recorded_elsewhere(golden: Run) -> str | None:
    """The GPU `golden` was recorded on, where this machine has none (its reference engine cannot run
    here as recorded); None where it can."""
    gpu = golden.meta.hardware.get("gpu_name")
    if not gpu:
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return str(gpu)


def score_here(ref_case, golden: Run, candidate: Run, *, gpu: str, root: Path,
                session: sessionmod.EngineSession, echo: Echo = print) -> tuple[Run, Run]:
    """Cross-hardware scoring: reference `ref_case`'s model on this machine's CPU in float32
    (`sessionmod.on_this_cpu`, one engine in `session`) scores the candidate's tokens and the golden's
    own, each stamped with where it came from and stored like any scored run (`store_here`).

    The NLL of a text moves by hundredths of a nat per token between a GPU's bf16 and a CPU's
    float32; garbage scores about 3 nats per token and text about 1, so the scoring still tells one
    from the other. It does not carry finer decisions: the judge sets the scored NLL only against
    the golden's NLL from this same engine (`classify.compare_runs`, ``scored_reference``), and the
    floor decision never reads it. An engine failure is an EngineError (the comparison's ERROR)."""
    r = ref_case.id
    local = sessionmod.on_this_cpu(ref_case)
    echo(f"{candidate.meta.case_id}: golden {r} was recorded on {gpu}, which this machine lacks: scoring the run "
         f"and the golden's own tokens with {r}'s model on this machine's CPU (float32, eager)")
    out = []
    for run in (candidate, golden):
        s = sessionmod.score(local, run, session=session, echo=echo, key=f"{r}/cpu-float32")
        stamp = {"golden_hardware": gpu, "dtype": "float32", "scored": "golden" if run is golden else "candidate"}
        s = dataclasses.replace(s, meta=dataclasses.replace(s.meta, source={**s.meta.source, CROSS_HARDWARE: stamp}))
        out.append(store_here(root, r, run, s, echo=echo))
    return out[0], out[1]


def store_here(root: Path, r: str, run: Run, scored: Run, *, echo: Echo = print) -> Run:
    """`workspace.store_score`, except over a stored scoring that did not come from other hardware (one
    recorded with its run, e.g. on the GPU): that one is left as it is and this one kept in memory."""
    path = workspace.scored_file(root, run.meta.suite, run.meta.case_id, r)
    if path.exists():
        try:
            meta = store.read_meta(path)
        except DiffcheckError:
            meta = None
        if meta is not None and CROSS_HARDWARE not in meta.source:
            echo(f"{run.meta.case_id}: {path} holds a scoring made on {hardware_name(meta.hardware)}: left as it "
                 "is; this machine's scoring is used for this comparison only")
            source = {**scored.meta.source, "scored_digest": store.content_digest(run)}
            return dataclasses.replace(scored, meta=dataclasses.replace(scored.meta, source=source))
    return workspace.store_score(root, r, run, scored)


def stored_pair(root: Path, folder: Path, r: str, candidate: Run, golden: Run) -> tuple[Run, Run] | None:
    """A stored cross-hardware scoring of `candidate` and of `golden` by reference `r`'s model from one
    engine (same model, hardware and dtype), beside the run or in the workspace; None where there is none."""
    def found(run: Run) -> list[Run]:
        out = []
        paths = {store.run_path(folder.parent, folder.name, run.meta.case_id, kind="scored", reference=r),
                 workspace.scored_file(root, run.meta.suite, run.meta.case_id, r)}
        for path in sorted(p for p in paths if p.exists()):
            try:
                s = store.read_run(path)
            except DiffcheckError:
                continue
            if CROSS_HARDWARE in s.meta.source and s.meta.source.get("scored_digest") == store.content_digest(run):
                out.append(s)
        return out

    for c in found(candidate):
        for g in found(golden):
            if _scorer(c) == _scorer(g):
                return c, g
    return None


def _scorer(run: Run) -> tuple:
    """What a scored run's numbers depend on: the model, the hardware, the dtype."""
    hw = run.meta.hardware
    return (run.meta.model.get("digest"), hw.get("gpu_name"), hw.get("cpu_model"), hw.get("machine"),
            run.meta.source.get(CROSS_HARDWARE, {}).get("dtype"))


def hardware_name(hw: dict) -> str:
    return str(hw.get("gpu_name") or hw.get("cpu_model") or hw.get("machine") or "unknown hardware")


def note(scored: Run, golden: Run) -> str:
    """Where a cross-hardware scoring came from, for the output and the report: e.g. "scored on this
    machine's CPU (float32) for a golden recorded on NVIDIA H200"."""
    from diffcheck.engines.base import hardware

    stamp = scored.meta.source.get(CROSS_HARDWARE, {})
    hw = scored.meta.hardware
    if hw.get("gpu_name"):
        where = str(hw["gpu_name"])
    elif hw.get("cpu_model") and hw.get("cpu_model") == hardware().get("cpu_model"):
        where = "this machine's CPU"
    else:
        where = f"a CPU ({hardware_name(hw)})"
    note = (f"scored on {where} ({stamp.get('dtype', 'float32')}) for a golden recorded on "
            f"{stamp.get('golden_hardware') or hardware_name(golden.meta.hardware)}")
    here, there = scored.meta.model.get("digest"), golden.meta.model.get("digest")
    if here and there and here != there:
        note += f"; model digest {here[:12]} for the scoring, {there[:12]} in the golden"
    return note
