"""The terminal report: a rich table per case, and a close-up of one divergence.

Knows how to print verdicts for a human reading a terminal or a CI log; judges
nothing. `render_comparison` and `render_check` are the registry's renderers of
``diffcheck compare`` and ``diffcheck check``. Works on a plain non-tty console (no escape codes are written when the
output is not a terminal) and honours ``NO_COLOR`` (rich reads it). When this
module makes the console itself and the output is not a terminal, it uses a
wide fixed width (`CI_WIDTH`, or ``$COLUMNS``) so CI logs do not wrap the table.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from diffcheck.report import (
    SequenceTexts,
    case_baselines,
    config_delta_lines,
    printable,
    worst_sequence,
)
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict

CI_WIDTH = 160
EVIDENCE_WIDTH = 60

VERDICT_STYLES = {
    Verdict.IDENTICAL: "green",
    Verdict.BENIGN_DRIFT: "cyan",
    Verdict.WITHIN_BUDGET: "yellow",
    Verdict.INCONCLUSIVE: "bold blue",
    Verdict.DEGRADED: "bold dark_orange",
    Verdict.GIBBERISH: "bold red",
    Verdict.ERROR: "bold magenta",
}


def make_console(**kwargs) -> Console:
    """A console for reports: wide when writing to a non-terminal without $COLUMNS."""
    console = Console(**kwargs)
    if not console.is_terminal and "width" not in kwargs and not os.environ.get("COLUMNS"):
        console = Console(width=CI_WIDTH, **kwargs)
    return console


def verdict_text(verdict: Verdict) -> Text:
    return Text(verdict.name, style=VERDICT_STYLES[verdict])


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return fmt.format(value)
    return str(value)


def _truncate(text: str, width: int) -> str:
    text = printable(text).replace("\n", " ")
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _baseline_word(passed: bool | None) -> str:
    return "n/a" if passed is None else ("pass" if passed else "FAIL")


def case_table(case: CaseVerdict, *, evidence_width: int = EVIDENCE_WIDTH) -> Table:
    title = Text.assemble(
        (f"{case.candidate_id}", "bold"), " vs ", (f"{case.reference_id}", "bold"), ": ", verdict_text(case.verdict)
    )
    table = Table(title=title, title_justify="left", show_lines=False, pad_edge=False)
    table.add_column("seq", justify="right")
    table.add_column("prompt_id")
    table.add_column("t*", justify="right")
    table.add_column("verdict")
    table.add_column("onset", justify="right")
    table.add_column("evidence", overflow="fold", max_width=evidence_width)
    table.add_column("digit_ratio", justify="right")
    table.add_column("weird_runs", justify="right")
    table.add_column("tokens", justify="right")
    for sequence in case.sequences:
        quality = sequence.quality
        evidence = sequence.evidence[0] if sequence.evidence else ""
        table.add_row(
            str(sequence.index),
            printable(sequence.prompt_id),
            _num(sequence.t_star),
            verdict_text(sequence.verdict),
            _num(sequence.onset),
            _truncate(evidence, evidence_width),
            _num(quality.get("digit_ratio")),
            _num(quality.get("weird_runs")),
            _num(quality.get("token_count", sequence.candidate_len)),
        )
    return table


def case_footer(case: CaseVerdict) -> list[Text]:
    """The lines under a case's table: verdict vs the baselines, then the config delta."""
    baselines = case_baselines(case)
    line = Text.assemble(
        "case ",
        (case.candidate_id, "bold"),
        ": ",
        verdict_text(case.verdict),
        f"  |  exact match would say: {_baseline_word(baselines.get('exact_match'))}",
        f"  |  vLLM check_logprobs_close would say: {_baseline_word(baselines.get('check_logprobs_close'))}",
    )
    lines = [line]
    if case.error:
        lines.append(Text(f"  error: {printable(case.error)}", style=VERDICT_STYLES[Verdict.ERROR]))
    delta = config_delta_lines(case.config_delta)
    if delta:
        lines.append(Text("  config delta (reference -> candidate):"))
        lines += [Text(f"    {printable(d)}") for d in delta]
    else:
        lines.append(Text("  config delta: none recorded"))
    return lines


def render_table(
    verdicts: Iterable[CaseVerdict],
    console: Console | None = None,
    *,
    evidence_width: int = EVIDENCE_WIDTH,
) -> Console:
    """Print one table per case (a row per sequence) and its footer; returns the console."""
    console = console or make_console()
    for case in verdicts:
        if case.sequences:
            console.print(case_table(case, evidence_width=evidence_width))
        else:
            console.print(Text.assemble(f"{case.candidate_id} vs {case.reference_id}: ", verdict_text(case.verdict)))
        for line in case_footer(case):
            console.print(line)
        console.print()
    return console


def render_speed(speed: Mapping[str, Any] | None, console: Console | None = None) -> Console:
    """Print the runs' decode tokens/s and the candidate's speed-up (`speed.speed_summary`); nothing without."""
    from diffcheck.report.speed import speed_lines

    console = console or make_console()
    lines = speed_lines(speed)
    if lines:
        console.print(Text("speed", style="bold"))
        for line in lines:
            console.print(Text(printable(line)))
        console.print()
    return console


def _window(tokens: tuple[str, ...], start: int, stop: int) -> str:
    return printable("".join(tokens[max(start, 0) : max(stop, 0)]))


def render_divergence(
    sequence: SequenceVerdict | CaseVerdict,
    texts: SequenceTexts | tuple[list[str], list[str]] | None = None,
    *,
    console: Console | None = None,
    window: int = 12,
) -> Console:
    """Print where one sequence diverged: the step, both tokens, text around it.

    Given a `CaseVerdict`, shows its worst sequence. ``texts`` are that
    sequence's token strings (see `SequenceTexts`); without them only the
    numbers and evidence are printed. ``window`` is tokens (or, for whole
    texts, 4x as many characters) shown on each side of t*.
    """
    console = console or make_console()
    if isinstance(sequence, CaseVerdict):
        worst = worst_sequence(sequence)
        if worst is None:
            console.print(f"{sequence.candidate_id}: no sequences" + (f" ({sequence.error})" if sequence.error else ""))
            return console
        sequence = worst
    if texts is not None and not isinstance(texts, SequenceTexts):
        texts = SequenceTexts(*texts)

    header = Text.assemble(
        f"seq {sequence.index} ({printable(sequence.prompt_id)}): ",
        verdict_text(sequence.verdict),
        f"  t*={_num(sequence.t_star)}  onset={_num(sequence.onset)}"
        f"  shared prefix={sequence.shared_prefix}"
        f"  tokens reference={sequence.reference_len} candidate={sequence.candidate_len}",
    )
    console.print(header)
    if sequence.t_star is None:
        console.print("  the candidate's tokens are identical to the reference's")
    elif texts is not None:
        _print_text_window(console, sequence, texts, window=window)
    for item in sequence.evidence:
        console.print(Text(f"  - {printable(item)}"))
    return console


def _print_text_window(console: Console, sequence: SequenceVerdict, texts: SequenceTexts, *, window: int) -> None:
    split = texts.split(sequence.shared_prefix)
    if texts.tokenized:
        t = split.cut_step
        reference_token = split.reference_rest[0] if split.reference_rest else "<end>"
        candidate_token = split.candidate_rest[0] if split.candidate_rest else "<end>"
        console.print(f"  step {t}: reference token {printable(repr(reference_token))}, "
                      f"candidate token {printable(repr(candidate_token))}")
        before = _window(split.prefix, len(split.prefix) - window, len(split.prefix))
        reference_after = _window(split.reference_rest, 0, window)
        candidate_after = _window(split.candidate_rest, 0, window)
    else:
        chars = 4 * window
        prefix = "".join(split.prefix)
        before = printable(prefix[-chars:])
        reference_after = printable("".join(split.reference_rest)[:chars])
        candidate_after = printable("".join(split.candidate_rest)[:chars])
        console.print(f"  first differing character at offset {len(prefix)}")
    for label, after, style in (
        ("reference", reference_after, "green"),
        ("candidate", candidate_after, VERDICT_STYLES.get(sequence.verdict, "red")),
    ):
        line = Text(f"  {label:>9}: …")
        line.append(before.replace("\n", "⏎"), style="dim")
        line.append(after.replace("\n", "⏎"), style=style)
        line.append("…")
        # One line per side even in narrow logs: crop rather than wrap.
        console.print(line, no_wrap=True, overflow="ellipsis")


def plain_line(console: Console, line: str) -> None:
    """``line`` as it is, unwrapped and unstyled (what ``click.echo`` would print), on the console's stream."""
    console.file.write(line + "\n")
    console.file.flush()


def sequential_lines(case: CaseVerdict) -> list[str]:
    """The sequential extension of a case (``compare --until-decided``): the alpha rule, then per
    extended sequence its looks, tokens, verdict and the power reached; nothing without one."""
    ext = case.summary.get("sequential")
    if not ext:
        return []
    lines = [f"sequential extension against {case.reference_id}: {ext['rule']}: at most {ext['looks_planned']} "
             f"look(s) per sequence, each judged at alpha {ext['alpha']:g} / {ext['tests']} tests = "
             f"{ext['alpha_per_look']:.3g}; paths doubling up to {ext['max_tokens']} steps"]
    if ext.get("not_extended"):
        lines.append(f"  not extended: {ext['not_extended']}")
    for rec in ext.get("sequences", ()):
        looks = ", ".join(f"{lk['steps']}" for lk in rec["looks"])
        line = (f"  seq {rec['index']} ({rec['prompt_id']}): {rec['verdict']} after {len(rec['looks'])} look(s) "
                f"at {looks} steps ({rec['stopped']}); {rec['tokens']} tokens")
        power = rec.get("power_reached")
        if power:
            line += (f"; {power['steps']} steps find, with power {power['power']:.2f}, a mean KL of "
                     f"{power['kl']:.2g} or a mean loss of {power['loss']:.2g}")
        lines.append(line)
    tokens = ext.get("tokens") or {}
    if tokens:
        lines.append(f"  tokens spent: {tokens.get('reference_generated', 0)} generated by the reference, "
                     f"{tokens.get('candidate_forced', 0)} forced through the candidate")
    return lines


def render_comparison(result, console: Console) -> None:
    """The registry's renderer for ``diffcheck compare``: the tables, each divergence, a sequential
    extension's looks, speed, then the notes."""
    report = result.report
    render_table(report.verdicts, console)
    for case in report.verdicts:
        if case.verdict is not Verdict.IDENTICAL and case.sequences:
            render_divergence(case, report.texts_for(case, worst_sequence(case)), console=console)
    for case in report.verdicts:
        for line in sequential_lines(case):
            plain_line(console, printable(line))
    render_speed(report.speed, console=console)
    for line in result.notes:
        plain_line(console, line)


def render_check(result, console: Console) -> None:
    """The registry's renderer for ``diffcheck check``: the tables, what was left out, the goldens' moves, the sum."""
    render_table(result.verdicts, console)
    for case_id, why in result.skipped:
        plain_line(console, f"left out: {case_id}: {why}")
    if result.goldens:
        plain_line(console, f"goldens of suite {result.suite} (each reference re-run with today's engine against "
                            "its golden):")
        for move in result.goldens:
            plain_line(console, f"  {move.case_id:<6} {move.verdict.name:<13} {move.describe(result.suite_option)}")
        moved = [m for m in result.goldens if m.moved]
        if moved:
            benign = [m.case_id for m in moved if m.benign]
            bad = [m.case_id for m in moved if not m.benign]
            plain_line(console, f"moved: {', '.join(m.case_id for m in moved)}"
                                + (f"; benign: {', '.join(benign)}" if benign else "")
                                + (f"; NOT benign: {', '.join(bad)}" if bad else ""))
            if benign and not bad:
                plain_line(console, f"to accept the new engine's goldens: diffcheck golden record {' '.join(benign)} "
                                    f"--update --suite {result.suite_option}")
        else:
            plain_line(console, "no golden moved")
    plain_line(console, f"check: {len(result.verdicts)} comparisons, worst {result.verdict.name}, "
                        f"exit {result.exit_code}")


def print_meta(meta: Mapping[str, Any], console: Console | None = None) -> Console:
    """One ``key: value`` line per meta entry (used above the tables)."""
    console = console or make_console()
    for key, value in meta.items():
        console.print(Text(f"{key}: {printable(str(value))}", style="dim"))
    return console
