"""`diffcheck selftest --localize`: does `diffcheck localize` name where each labelled fault acts?

For each labelled case of the suite (``expect`` in its case file):

- a **fault** (its env selects a fault that acts: `diffcheck.cases.faults.expected_site` says
  where, from the catalogue's data and the case's fault spec, never from localize's output) is
  localized at the step where the fault first shows, and its row is ok when localize names
  exactly that step, layer and op, as the op's own departure (its inputs inside their floors);
- a fault that a case places in one layer (``DIFFCHECK_FAULT_LAYER``) is also run at three
  other layers, as derived cases (``<case>.layer<L>``: the case's env with that layer);
- a **benign** variant (a pass label, no acting fault) is localized at the same steps as the
  faults (so it shares the reference's captures), and its row is ok when localize names nothing;
- cases localize cannot run are rows with the reason: compiled engines (the taps' hooks do not
  run under torch.compile), other engine kinds, precision variants (judged against a budget,
  localize only against the floor), faults that need graphs this lane does not replay, and
  cases tagged slow or gpu unless named.

One `EngineSession(taps=True, switch_faults=True)` and one ``captures`` dict for the whole run, so
the reference and its floor replicas are started and captured once per captured window; each
candidate's engine is closed once its row is done, unless the next row's fault switches into it
(a fault and its layer variants in one eager configuration share one engine, as the self-test's
fault cases do). Localize forces only T + 1 tokens per sequence. Writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from diffcheck import cases as casesmod
from diffcheck.cases import faults as faultsmod
from diffcheck.core import progress
from diffcheck.core.types import fails
from diffcheck.report.selftest_localize import Row, SelftestLocalizeReport

Echo = Callable[[str], None]
N_LAYER_VARIANTS = 3


@dataclass(frozen=True)
class Item:
    """One planned row: the case to localize (a derived layer variant has its own id), what is expected."""

    case: Any
    fault: str  # the fault in words, from its spec ("none" for a benign variant)
    expected: faultsmod.ExpectedSite | None  # None: localize must name nothing
    variant_of: str | None = None  # the suite case a layer variant is derived from
    step: int | None = None  # the step localize runs at (set by `plan`)
    skip: str = ""  # why it is not run ("" : it is run)


def fault_label(spec: faultsmod.FaultSpec | None) -> str:
    """The fault of a spec in words: what it is, where it is placed, from which decode step."""
    if spec is None:
        return "none"
    parts = [spec.label]
    if faultsmod.layer_selectable(spec.info):
        parts.append("all layers" if spec.layer is None else f"layer {spec.layer}")
    parts.append(f"from decode step {spec.step}" if spec.info.takes_step else "from the first decode step")
    return ", ".join(parts)


def expects_pass(case) -> bool:
    exp = case.expect
    return exp is not None and (exp.verdict is None or not fails(exp.verdict))


def variant_layers(n_layers: int, taken: int | None, count: int = N_LAYER_VARIANTS) -> tuple[int, ...]:
    """`count` layers other than `taken` to place a per-layer fault in: the second, the middle and the
    last layer where the model has them, then the next ones up from layer 1."""
    order = [1, n_layers // 2, n_layers - 1] + list(range(n_layers))
    chosen: list[int] = []
    for layer in order:
        if 0 <= layer < n_layers and layer != taken and layer not in chosen:
            chosen.append(layer)
        if len(chosen) == count:
            break
    return tuple(chosen)


def with_layer(case, layer: int):
    """`case` with its fault placed in `layer` (its env's DIFFCHECK_FAULT_LAYER), under its own id."""
    return dataclasses.replace(case, id=f"{case.id}.layer{layer}",
                               env={**case.env, faultsmod.ENV_LAYER: str(layer)},
                               description=f"{case.id} with its fault in layer {layer}")


def _skip_reason(case, spec, *, named: bool) -> str:
    if not named and any(t in case.tags for t in casesmod.NOT_BY_DEFAULT):
        tag = next(t for t in case.tags if t in casesmod.NOT_BY_DEFAULT)
        return f"tagged {tag}: name it with --case {case.id}"
    if (case.engine.kind or "vllm") != "vllm":
        return f"engine.kind {case.engine.kind!r}: the taps need the vLLM offline engine"
    if case.engine.enforce_eager is not True:
        return ("compiled (enforce_eager is not true): the taps cannot run inside a torch.compile'd decoder, so a "
                "localization would not be of the engine its label is about")
    if spec is not None and spec.info.only_under is not None and not spec.fixed:
        return f"{spec.name} acts only under {spec.info.only_under} ({spec.info.lane} lane); eager here"
    if "precision" in case.tags:
        return ("precision variant: judged against a precision budget, localize only against the floor "
                "(it would name the first op the precision change touches)")
    if spec is None and not expects_pass(case):
        return "labelled failing but selects no fault: no expected site to check"
    return ""


def plan(labelled, *, n_layers: int | None, include=None, layers: tuple[int, ...] | None = None) -> list[Item]:
    """The rows of the self-test, in the suite's order, each fault case followed by its layer variants.

    `labelled`: the suite's labelled cases (`workflows.selftest.labelled_cases` with no tag
    excluded; tagged ones become skipped rows unless in `include`). `n_layers`: the model's
    decoder layers (only needed when a per-layer fault is run). `layers`: the layers of the
    variants (default `variant_layers`). Variants are derived once per fault name, from its first
    case. Benign rows run at the faults' most common step (so they share the reference's captures).
    """
    items: list[Item] = []
    varied: set[str] = set()
    for case in labelled:
        spec = faultsmod.parse_env(case.env)
        skip = _skip_reason(case, spec, named=bool(include and case.id in include))
        expected = faultsmod.expected_site(spec) if spec is not None else None
        items.append(Item(case=case, fault=fault_label(spec), expected=expected,
                          step=expected.step if expected and not skip else None, skip=skip))
        if skip or spec is None or expected is None or not faultsmod.layer_selectable(spec.info) \
                or spec.name in varied:
            continue
        varied.add(spec.name)
        if layers is None and n_layers is None:
            raise ValueError("a per-layer fault needs n_layers or layers")
        for layer in (layers if layers is not None else variant_layers(n_layers, expected.layer)):
            derived = with_layer(case, layer)
            dspec = faultsmod.parse_env(derived.env)
            dexp = faultsmod.expected_site(dspec)
            items.append(Item(case=derived, fault=fault_label(dspec), expected=dexp, variant_of=case.id,
                              step=dexp.step if dexp else None))
    steps = Counter(i.step for i in items if i.step is not None)
    common = steps.most_common(1)[0][0] if steps else faultsmod.DEFAULT_STEP + 1
    return [dataclasses.replace(i, step=common) if i.step is None and not i.skip else i for i in items]


def needs_layers(labelled, include=None) -> bool:
    """Whether `plan` will derive layer variants (so the model's layer count is needed)."""
    for case in labelled:
        spec = faultsmod.parse_env(case.env)
        if spec is not None and faultsmod.layer_selectable(spec.info) and not spec.fixed \
                and not _skip_reason(case, spec, named=bool(include and case.id in include)):
            return True
    return False


def _site(step: int, site: str) -> str:
    return f"step {step}, {site}"


def judge(item: Item, localization, *, seconds: float = 0.0, captured: dict | None = None) -> Row:
    """The row of one localized item: ok when localize named exactly the expected (step, layer, op) as
    the op's own departure, or, for a benign variant, nothing."""
    first = localization.first
    named = "nothing" if first is None else _site(first.step, first.site)
    if item.expected is None:
        ok = first is None
        note = ("" if ok else f"{first.ratio:.3g}x its margin; {localization.beyond_sites} sites beyond")
    else:
        ok = (first is not None and (first.step, first.layer, first.op)
              == (item.expected.step, item.expected.layer, item.expected.op) and not first.inherited)
        note = ("no site left its floor at these steps" if first is None else
                f"{first.ratio:.3g}x its margin, " + ("inherited a bad input" if first.inherited else "in this op"))
    return Row(case_id=item.case.id, variant_of=item.variant_of, fault=item.fault,
               expected="nothing" if item.expected is None else _site(item.expected.step, item.expected.site),
               named=named, step=item.step, ok=ok, note=note, seconds=seconds,
               steps=tuple(localization.steps), captured=dict(captured or {}))


def skipped(item: Item) -> Row:
    return Row(case_id=item.case.id, variant_of=item.variant_of, fault=item.fault,
               expected="nothing" if item.expected is None else _site(item.expected.step, item.expected.site),
               named="", step=None, ok=None, note=item.skip)


def failed(item: Item, message: str) -> Row:
    return Row(case_id=item.case.id, variant_of=item.variant_of, fault=item.fault,
               expected="nothing" if item.expected is None else _site(item.expected.step, item.expected.site),
               named="", step=item.step, ok=False, note=message)


def uncovered(items: list[Item]) -> tuple[str, ...]:
    """Catalogue faults no run row exercises, each with why (for the report)."""
    run = {faultsmod.parse_env(i.case.env).name for i in items
           if not i.skip and faultsmod.parse_env(i.case.env) is not None}
    notes = []
    for info in faultsmod.CATALOGUE:
        if info.name in run:
            continue
        if info.only_under is not None:
            notes.append(f"{info.name}: acts only under {info.only_under} ({info.lane} lane); not checked here")
        else:
            notes.append(f"{info.name}: no labelled case of this suite runs it")
    return tuple(notes)


def _num_layers(case) -> int:
    """The model's decoder layers, from its config.json."""
    import json

    from diffcheck.engines import models

    config = json.loads((models.resolve_case(case).path / "config.json").read_text())
    return int(config["num_hidden_layers"])


def run(suite, *, root: Path, include=None, layers: tuple[int, ...] | None = None, around: int | None = None,
        perturbations=None, session=None, verbose: bool = False, echo: Echo = print) -> SelftestLocalizeReport:
    """Plan the rows, localize each run row with one shared engine session and capture cache, judge them."""
    from diffcheck import workspace
    from diffcheck.core.errors import ConfigError, EngineError
    from diffcheck.engines import session as sessionmod
    from diffcheck.workflows import localize as loc
    from diffcheck.workflows import selftest as st

    labelled = st.labelled_cases(suite, include=include, exclude_tags=())
    if not labelled:
        raise ConfigError(f"{suite.path}: no labelled cases (add `expect = ...` to candidate cases)")
    n_layers = None
    if layers is None and needs_layers(labelled, include):
        n_layers = _num_layers(labelled[0])
    items = plan(labelled, n_layers=n_layers, include=include, layers=layers)
    todo = [i for i in items if not i.skip]
    # Before any engine starts: every reference golden is there and long enough for its row's step.
    for item in todo:
        ref_id = item.case.references[0]
        golden = workspace.load_golden(root, suite.name, ref_id)
        longest = max((s.n_tokens for s in golden.sequences), default=0)
        if item.step >= longest:
            raise ConfigError(f"case '{item.case.id}': localize at step {item.step} needs golden {ref_id} to have "
                              f"more than {item.step} steps (it has {longest} at most)")
    around = loc.AROUND if around is None else around
    rows: dict[int, Row] = {k: skipped(i) for k, i in enumerate(items) if i.skip}
    captures: dict = {}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if session is None:
            session = stack.enter_context(sessionmod.EngineSession(verbose=verbose, taps=True, switch_faults=True))
        n = 0
        for k, item in enumerate(items):
            if item.skip:
                continue
            n += 1
            progress.stage(f"selftest --localize: row {n} of {len(todo)}: {item.case.id}")
            echo(f"[{n}/{len(todo)}] {item.case.id} ({item.fault}): expected {rows_expected(item)}; "
                 f"localizing at step {item.step}")
            t1 = time.perf_counter()
            try:
                report = loc.localize(item.case, suite=suite, root=root, step=item.step, around=around,
                                      perturbations=perturbations, session=session, captures=captures,
                                      verbose=verbose, echo=echo)
                rows[k] = judge(item, report.localization, seconds=time.perf_counter() - t1,
                                captured=report.timings)
            except EngineError as exc:
                rows[k] = failed(item, f"engine failure: {exc}")
            finally:  # the candidate's engine: done with it, unless the next row's fault switches into it
                session.release(item.case, keep_for=next((i.case for i in items[k + 1:] if not i.skip), None))
            row = rows[k]
            echo(f"[{n}/{len(todo)}] {item.case.id}: named {row.named or '-'}: {'ok' if row.ok else 'NOT ok'}")
        progress.stage(None)
        progress.activity("selftest --localize: shutting the reference engines down")
    return SelftestLocalizeReport(suite=suite.name, rows=tuple(rows[k] for k in range(len(items))),
                                  around=around, notes=uncovered(items), seconds=time.perf_counter() - t0)


def rows_expected(item: Item) -> str:
    return "nothing" if item.expected is None else _site(item.expected.step, item.expected.site)
