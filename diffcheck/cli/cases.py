"""`diffcheck cases list|show|check`: inspect and validate case suites.

Knows how to present what `diffcheck.cases` resolves; validates nothing
itself. Heavy imports (rich, deepdiff) happen inside the commands so that
``--help`` stays fast.
"""

from __future__ import annotations

import json

import click

from diffcheck.cli.common import SUITE_DEFAULT_TEXT, default_suite, json_option, write_json_out

_SUITE_HELP = "Suite name (<cases>/<name>.toml, or shipped with diffcheck) or path to a suite file."


@click.group(name="cases", epilog="""\b
Examples:
  diffcheck cases list         # every suite's cases
  diffcheck cases show O       # O's resolved config and how it differs from J
""")
def cases():
    """Inspect and validate case suites (<cases>/<suite>.toml).

    The folder is $DIFFCHECK_CASES, else [tool.diffcheck] cases in the nearest
    pyproject.toml, else ./cases.
    """


@cases.command(name="list", epilog="""\b
Examples:
  diffcheck cases list
  diffcheck cases list --suite default
""")
@click.option("--suite", "-s", default=None, help="Only this suite (name or path). Default: every suite.")
def list_(suite):
    """List cases: id, role, references, tags, description."""
    from rich.console import Console
    from rich.table import Table

    from diffcheck import cases as lang
    from diffcheck.core.errors import ConfigError

    names = [suite] if suite else lang.list_suites()
    if not names:
        raise ConfigError(f"no suites in {lang.cases_dir()}/ (run `diffcheck init`, or set [tool.diffcheck] cases or DIFFCHECK_CASES)")
    console = Console()
    for name in names:
        loaded = lang.load_suite(name)
        table = Table(title=f"{loaded.name} ({lang.display_path(loaded.path)}): {loaded.description}",
                      title_justify="left")
        for column in ("id", "role", "references", "tags", "description"):
            table.add_column(column, overflow="fold", no_wrap=column == "id")
        for case in loaded.cases.values():
            table.add_row(case.id, case.role, ", ".join(case.references), ", ".join(case.tags), case.description)
        console.print(table)
    return 0


@cases.command(name="show", epilog="""\b
Examples:
  diffcheck cases show O            # O's resolved config and how it differs from J
  diffcheck cases show E --json -   # the same as JSON, on stdout
""")
@click.argument("case_id")
@click.option("--suite", "-s", default=default_suite, show_default=SUITE_DEFAULT_TEXT, help=_SUITE_HELP)
@json_option
def show(case_id, suite, json_path):
    """Show CASE_ID's resolved config and how it differs from its references."""
    from diffcheck import cases as lang
    from diffcheck.judging.tolerances import Tolerances

    loaded = lang.load_suite(suite)
    case = lang.get_case(loaded, case_id)
    resolved = lang.resolved_config(case)
    deltas = {ref: lang.config_delta(case, loaded.cases[ref]) for ref in case.references}
    facts = {
        "id": case.id,
        "suite": case.suite,
        "role": case.role,
        "description": case.description,
        "inherits": _chain(loaded, case),
        "references": list(case.references),
        "tags": list(case.tags),
        "prompts_file": lang.display_path(case.prompts_file),
        "expect": _expect(case.expect),
        "tolerances": case.tolerances,
        "min_effect": {**Tolerances().min_effect, **case.min_effect},  # the case's, the judge's defaults for the rest
        "digest": lang.config_digest(case),
    }
    if json_path:
        out = {**facts, "resolved": resolved,
               "deltas": {ref: {path: list(pair) for path, pair in d.items()} for ref, d in deltas.items()}}
        write_json_out(json_path, out)
        return 0
    _print_show(facts, resolved, deltas, case_id=case.id)
    return 0


@cases.command(name="check", epilog="""\b
Examples:
  diffcheck cases check                       # every suite in the cases folder
  diffcheck cases check cases/default.toml
""")
@click.argument("targets", nargs=-1, metavar="[PATH_OR_SUITE]...")
def check(targets):
    """Validate suite files (every suite in the cases folder when none is given).

    Prints "ok <path>: N cases" per valid suite and one error line per bad one;
    exits 2 if any suite is refused.
    """
    from diffcheck import cases as lang
    from diffcheck.core.errors import ConfigError

    names = list(targets) or lang.list_suites()
    if not names:
        raise ConfigError(f"no suites in {lang.cases_dir()}/ (run `diffcheck init`, or set [tool.diffcheck] cases or DIFFCHECK_CASES)")
    failed = 0
    for name in names:
        try:
            loaded = lang.load_suite(name)
        except ConfigError as exc:
            failed += 1
            click.echo(f"diffcheck: error: {exc.message}", err=True)
            continue
        click.echo(f"ok {lang.display_path(loaded.path)}: {len(loaded.cases)} cases")
    return 2 if failed else 0


def _chain(suite, case) -> list[str]:
    chain = [case.id]
    while suite.cases[chain[-1]].inherits:
        chain.append(suite.cases[chain[-1]].inherits)
    return chain[1:] + ["[defaults]"]


def _expect(expect) -> dict | None:
    if expect is None:
        return None
    out = {}
    if expect.verdict is not None:
        out["verdict"] = expect.verdict.name
    if expect.not_verdict:
        out["not_verdict"] = [v.name for v in expect.not_verdict]
    if expect.onset is not None:
        out["onset"] = expect.onset
        out["onset_tolerance"] = expect.onset_tolerance
    return out


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _as_toml(resolved: dict) -> str:
    """TOML-ish text of a resolved config: scalars first, then one section per table."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in resolved.items() if not isinstance(v, dict)]
    for key, table in resolved.items():
        if isinstance(table, dict) and table:  # an empty [env] says nothing
            lines += ["", f"[{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines)


def _print_show(facts: dict, resolved: dict, deltas: dict, *, case_id: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.syntax import Syntax
    from rich.table import Table

    from diffcheck.judging.tolerances import Tolerances

    console = Console()
    console.print(f"[bold]{escape(facts['id'])}[/] ({escape(facts['suite'])}, {facts['role']}): "
                  f"{escape(facts['description'])}", highlight=False)
    about = [
        ("inherits", " <- ".join([facts["id"]] + facts["inherits"])),
        ("references", ", ".join(facts["references"]) or "none"),
        ("tags", ", ".join(facts["tags"]) or "none"),
        ("prompts", f"{facts['prompts_file']} ({_plural(resolved['prompts']['count'], 'prompt')})"),
        ("expect", _toml_value(facts["expect"]) if facts["expect"] else "none"),
        ("tolerances", _toml_value(facts["tolerances"]) if facts["tolerances"] else "classifier defaults"),
        ("min_effect", _toml_value(facts["min_effect"]) +
         (" (the defaults)" if facts["min_effect"] == Tolerances().min_effect else "")),
        ("digest", facts["digest"]),
    ]
    for key, value in about:
        console.print(f"  {key:11s} {escape(value)}", highlight=False)
    console.print("\n[bold]resolved config[/]")
    console.print(Syntax(_as_toml(resolved), "toml", theme="ansi_dark", background_color="default"))
    for ref, delta in deltas.items():
        if not delta:
            console.print(f"\n[bold]difference from {escape(ref)}[/]: none (same resolved config)")
            continue
        table = Table(title=f"difference from {ref}", title_justify="left")
        table.add_column("key")
        table.add_column(f"{ref} (reference)", overflow="fold")
        table.add_column(f"{case_id} (candidate)" if facts["role"] == "candidate" else case_id, overflow="fold")
        for path, (ref_value, value) in delta.items():
            table.add_row(path, _cell(path, ref_value), _cell(path, value))
        console.print()
        console.print(table)
    if not deltas:
        console.print("\nno references: this case is a root reference")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _cell(path: str, value) -> str:
    if value is None:  # resolved configs leave out what the engine decides
        return "(engine default)" if path.startswith(("engine.", "sampling.")) else "(unset)"
    return _toml_value(value)
