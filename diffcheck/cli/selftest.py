"""`diffcheck selftest`: run the labelled cases and print the confusion table, baselines included."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, output_option, suite_option


@click.command(name="selftest", epilog="""\b
Examples:
  diffcheck selftest --case E --case M --json reports/selftest.json
  diffcheck selftest --localize                             # does localize name where each fault acts?
""")
@suite_option
@goldens_option
@click.option("--case", "case_ids", multiple=True, help="Only these labelled cases (repeatable).")
@click.option("--strict", is_flag=True, help="WITHIN_BUDGET (a precision cost) counts as flagged too.")
@click.option("--localize", "localize", is_flag=True,
              help="Check `diffcheck localize` instead: each fault named at the layer, op and step its spec "
                   "says (per-layer faults also at three other layers), each benign variant named nothing.")
@output_option("--json", help="Write outcomes as JSON.")
@click.pass_context
def selftest(ctx, suite, goldens, case_ids, strict, localize, json_path):
    """Judge every labelled case (expect = ... in the case file); exit 1 if any expectation fails.

    Missing reference goldens are recorded first (with --localize they must exist). Cases
    tagged slow or gpu are left out unless named with --case.
    """
    if localize:
        return _selftest_localize(ctx, suite, goldens, case_ids, strict, json_path)
    import time

    from diffcheck import cases
    from diffcheck.cli.common import outputs, write_reports
    from diffcheck.core import progress
    from diffcheck import workspace
    from diffcheck.engines import session as sessionmod
    from diffcheck.workflows import compare as comparemod
    from diffcheck.workflows import record, selftest as st
    from diffcheck.storage import store
    from diffcheck.report.results import SelftestReport

    requested = outputs("selftest", json=json_path)
    s = cases.load_suite(suite)
    root = workspace.goldens_root(goldens)
    chosen = st.labelled_cases(s, include=set(case_ids) or None)
    if not chosen:
        from diffcheck.core.errors import ConfigError

        raise ConfigError(f"{s.path}: no labelled cases (add `expect = ...` to candidate cases)")
    verbose = ctx.obj.get("verbose", False)
    refs = sorted({r for c in chosen for r in c.references})
    outcomes = []
    t0 = time.perf_counter()
    # The references' engines (goldens, scoring) in `pool`; the candidates' in `kept`, one at a time, kept
    # for the next case of its configuration, fault cases switching their fault into it.
    with progress.display(verbose=verbose) as shown, sessionmod.EngineSession(verbose=verbose) as pool, \
            sessionmod.EngineSession(verbose=verbose, switch_faults=True) as kept:
        echo = shown.log
        missing = [ref for ref in refs if not store.run_path(root, s.name, ref).exists()]
        for n, ref in enumerate(missing, 1):
            shown.stage(f"selftest: recording golden {n} of {len(missing)}: {ref}")
            record.record_golden(cases.get_case(s, ref), root=root, verbose=verbose, echo=echo, session=pool)
        judged = {}
        for n, case in enumerate(st.in_engine_order(chosen), 1):
            shown.stage(f"selftest: case {n} of {len(chosen)}: {case.id}")
            echo(f"[{n}/{len(chosen)}] {case.id}: {case.description}")
            judged[case.id] = comparemod.compare(s, case.id, root=root, verbose=verbose, echo=echo, session=pool,
                                                 candidate_session=kept)
        for case in chosen:
            outcomes.extend(st.outcome(case, v, strict=strict) for v in judged[case.id].verdicts)
        shown.stage(None)
        shown.activity("selftest: shutting the reference engines down")
    failed = [o for o in outcomes if not o.passed]
    write_reports(requested, SelftestReport(suite=s.name, outcomes=tuple(outcomes), confusion=st.confusion(outcomes),
                                            classes=st.CLASSES, seconds=time.perf_counter() - t0))
    return 1 if failed else 0


def _selftest_localize(ctx, suite, goldens, case_ids, strict, json_path):
    """`selftest --localize` (docs/localize.md): one row per labelled case and layer variant; exit 1 if any fails."""
    from diffcheck import cases, workspace
    from diffcheck.cli.common import outputs, write_reports
    from diffcheck.core import progress
    from diffcheck.core.errors import ConfigError
    from diffcheck.workflows import selftest_localize as stl

    if strict:
        raise ConfigError("--strict: applies to verdicts; selftest --localize judges none (valid: leave it out)")
    requested = outputs("selftest-localize", json=json_path)
    s = cases.load_suite(suite)
    root = workspace.goldens_root(goldens)
    verbose = ctx.obj.get("verbose", False)
    with progress.display(verbose=verbose) as shown:
        report = stl.run(s, root=root, include=set(case_ids) or None, verbose=verbose, echo=shown.log)
    write_reports(requested, report)
    return 1 if report.failed else 0
