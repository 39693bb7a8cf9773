"""The report registry: every output format once, with what it renders and its file suffix.

A command asks for its outputs as ``{format: destination}``: a path, or ``"-"`` for
stdout (``{"terminal": "-", "json": "r.json"}``), and hands over its result (one of
`diffcheck.report.results`). `write_outputs` renders the result in each format, in
the order asked, and writes each file atomically (`atomic_write_text`): readers see
the old file or the whole new one.

The rules, the same for every command (docs/cli.md):

- A format that has no renderer for the result's kind is a usage error (exit 2),
  one line naming the option and the formats that do apply; `check_outputs` says it
  before any work is done.
- At most one output may go to stdout; when one does, the terminal report goes to
  stderr so stdout holds exactly that document (`stdout_taken`).
- Two outputs may not name the same file.

Adding a format = one module with a renderer per result kind it applies to, and one
`Format` entry below. A renderer is ``render(result) -> str``; the terminal's
(``console=True``) prints onto a rich console instead, ``render(result, console)``,
and when sent to a file it is rendered as plain text at the CI width. Renderers are
imported only when used (``rich`` only for the terminal).
"""

from __future__ import annotations

import importlib
import io
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from diffcheck.core.errors import ConfigError
from diffcheck.report import atomic_write_text

STDOUT = "-"

# The result kinds (`diffcheck.report.results`), as messages name them.
KINDS = {
    "comparison": "a comparison",
    "check": "a check",
    "matrix": "a matrix",
    "outcomes": "recorded outcomes, which hold no verdicts",
    "selftest": "a self-test",
    "kernels": "a kernel check",
    "data": "this command's output",
    "localize": "a localize",
    "selftest-localize": "a self-test of localize",
    "reduce": "a reduce",
}
_VERDICTS = ("comparison", "check", "matrix")  # kinds whose verdicts JUnit renders


@dataclass(frozen=True)
class Format:
    name: str  # the key of an output request
    title: str  # for messages
    suffix: str  # its files' suffix
    option: str | None  # the command-line option that asks for it (None: always shown)
    renders: Mapping[str, str]  # result kind -> "module:function"
    console: bool = False  # renders onto a rich console (the terminal), not into text

    def renderer(self, kind: str):
        module, _, name = self.renders[kind].partition(":")
        return getattr(importlib.import_module(f"diffcheck.report.{module}"), name)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("terminal", "terminal", ".txt", None, {
        "comparison": "terminal:render_comparison",
        "check": "terminal:render_check",
        "matrix": "matrix:render_terminal",
        "outcomes": "matrix:render_terminal",
        "selftest": "selftest:render_terminal",
        "kernels": "kernels:render_terminal",
        "localize": "localize:render_terminal",
        "selftest-localize": "selftest_localize:render_terminal",
        "reduce": "reduce:render_terminal",
    }, console=True),
    Format("json", "JSON", ".json", "--json", {
        "comparison": "json_report:render_json",
        "check": "json_report:render_json",
        "matrix": "matrix:render_json",
        "outcomes": "matrix:render_json",
        "selftest": "selftest:render_json",
        "kernels": "kernels:render_json",
        "localize": "localize:render_json",
        "selftest-localize": "selftest_localize:render_json",
        "data": "json_report:render_data",
        "reduce": "reduce:render_json",
    }),
    Format("junit", "JUnit XML", ".xml", "--junit", {kind: "junit:render_junit" for kind in _VERDICTS}),
    Format("html", "HTML", ".html", "--html", {"comparison": "html:render_report", "matrix": "html:render_report",
                                             "localize": "localize:render_html"}),
    Format("markdown", "Markdown", ".md", "--md", {"matrix": "matrix:render_markdown",
                                                  "outcomes": "matrix:render_markdown",
                                                  "reduce": "reduce:render_markdown"}),
)}


def _option(name: str) -> str:
    return FORMATS[name].option or name


def check_outputs(outputs: Mapping[str, Any], kind: str) -> dict[str, str]:
    """``outputs`` without the unrequested (None) entries, after checking them against `kind`.

    Raises `ConfigError` (exit 2) for a format that does not render `kind`, for more
    than one output on stdout and for two outputs to one file.
    """
    wanted = {name: os.fspath(dest) for name, dest in outputs.items() if dest is not None}
    for name in wanted:
        if name not in FORMATS:
            raise ValueError(f"no report format {name!r} (registered: {', '.join(FORMATS)})")
        fmt = FORMATS[name]
        if kind not in fmt.renders:
            valid = [f.option for f in FORMATS.values() if f.option and kind in f.renders]
            raise ConfigError(f"{_option(name)}: no {fmt.title} report of {KINDS[kind]}"
                              f" (valid here: {', '.join(valid) or 'none'})")
    on_stdout = [name for name, dest in wanted.items() if dest == STDOUT and not FORMATS[name].console]
    if len(on_stdout) > 1:
        raise ConfigError(f"{' and '.join(_option(n) for n in on_stdout)} {'both' if len(on_stdout) == 2 else 'all'} go to stdout ('-'): only one output "
                          "can; give the others a FILE")
    seen: dict[str, str] = {}
    for name, dest in wanted.items():
        if dest == STDOUT:
            continue
        key = os.path.realpath(dest)
        if key in seen:
            raise ConfigError(f"{_option(seen[key])} and {_option(name)} both write {dest}: give each its own FILE")
        seen[key] = name
    return wanted


def stdout_taken(outputs: Mapping[str, Any]) -> bool:
    """True when a document (not the terminal report) is requested on stdout."""
    return any(dest == STDOUT and not FORMATS[name].console for name, dest in outputs.items() if dest is not None)


def render(name: str, result) -> str:
    """`result` in format `name` as text (the terminal's as plain text at the CI width)."""
    fmt = FORMATS[name]
    renderer = fmt.renderer(result.kind)
    if not fmt.console:
        return renderer(result)
    from rich.console import Console

    from diffcheck.report.terminal import CI_WIDTH

    console = Console(file=io.StringIO(), width=CI_WIDTH, color_system=None, force_terminal=False)
    renderer(result, console)
    return console.file.getvalue()


def write_outputs(outputs: Mapping[str, Any], result, *, only: Iterable[str] | None = None) -> list[str]:
    """Render `result` in every requested format and write it; returns the files written, as given.

    ``outputs``: ``{format name: path, "-" for stdout, or None for not requested}``, in
    the order to write them. ``only``: write just these formats of the request now
    (a command that writes a file early and its terminal report later); stdout still
    goes to the one output the whole request gave it.
    """
    wanted = check_outputs(outputs, result.kind)
    taken = stdout_taken(wanted)
    written = []
    for name, dest in wanted.items():
        if only is not None and name not in only:
            continue
        fmt = FORMATS[name]
        if fmt.console and dest == STDOUT:
            from diffcheck.report.terminal import make_console

            fmt.renderer(result.kind)(result, make_console(stderr=taken))
        elif dest == STDOUT:
            sys.stdout.write(render(name, result))
            sys.stdout.flush()
        else:
            atomic_write_text(dest, render(name, result))
            written.append(dest)
    return written
