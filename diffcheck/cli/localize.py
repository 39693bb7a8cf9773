"""`diffcheck localize CASE`: the first layer and op of a candidate that leaves the reference's noise floor."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, json_option, output_option, suite_option


@click.command(name="localize", epilog="""\b
Examples:
  diffcheck localize M --step 34            # the lost-head fault: which layer's attention
  diffcheck localize E --around 6 --json E.localize.json --html E.localize.html   # + the heatmap
""")
@click.argument("case_id")
@suite_option
@goldens_option
@click.option("--reference", "reference", default=None, metavar="REF",
              help="The reference to localize against (default: the case's first).")
@click.option("--step", "step", type=click.IntRange(min=0), default=None, metavar="T",
              help="The onset step (default: t* of the case's stored run).")
@click.option("--around", "around", type=click.IntRange(min=0), default=4, show_default=True, metavar="K",
              help="Steps captured before the onset (steps T-K..T).")
@json_option
@output_option("--html", help="Write the layer x op x step heatmap as a self-contained HTML page.")
@click.pass_context
def localize(ctx, case_id, suite, goldens, reference, step, around, json_path, html_path):
    """Teacher-force the reference, its floor replicas and CASE_ID along the reference's golden
    up to the onset step, capture per decoder layer and op (input layernorm, attention, post-attention
    layernorm, MLP, the residual stream) a norm and a 64-number fingerprint at steps T-K..T inside
    the engine, and name the first (step, layer, op) whose relative error leaves its own floor,
    and whether it inherited a bad input. vLLM offline engines, eager or under CUDA graphs (docs/localize.md).
    """
    from diffcheck import cases, workspace
    from diffcheck.cli.common import outputs, write_reports
    from diffcheck.core import progress
    from diffcheck.workflows import localize as loc

    requested = outputs("localize", json=json_path, html=html_path)
    s = cases.load_suite(suite)
    case = cases.get_case(s, case_id)
    root = workspace.goldens_root(goldens)
    verbose = ctx.obj.get("verbose", False)
    with progress.display(verbose=verbose) as shown:
        report = loc.localize(case, suite=s, root=root, reference=reference, step=step, around=around,
                              verbose=verbose, echo=shown.log)
    write_reports(requested, report)
    return 0
