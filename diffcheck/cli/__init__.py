"""The `diffcheck` command line: a click group whose subcommands load lazily.

Knows only the map from command name to ``module:attribute``. Nothing heavy
(torch, vllm, pyarrow) is imported until a command actually runs, so ``--help``
of every command stays fast. User errors (`DiffcheckError`) print one line,
``diffcheck: error: ...``, and exit with their code; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading

import click

from diffcheck import __version__
from diffcheck.core.errors import EXIT_BISECT_SKIP, EXIT_ENGINE, EXIT_INCONCLUSIVE, EXIT_PASS, EXIT_REGRESSION, EXIT_USAGE, DiffcheckError

COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("diffcheck.cli.init", "Scaffold cases/ (a starter suite) and goldens/ in this repository."),
    "cases": ("diffcheck.cli.cases", "Inspect and validate case suites."),
    "model": ("diffcheck.cli.model", "Prepare models (registry package -> safetensors)."),
    "golden": ("diffcheck.cli.golden", "Record, verify and show reference goldens."),
    "calibrate": ("diffcheck.cli.calibrate", "Measure each reference's noise floor (replicas along its golden)."),
    "run": ("diffcheck.cli.run", "Record one case's run beside the goldens."),
    "compare": ("diffcheck.cli.compare", "Judge a candidate against its reference goldens."),
    "check": ("diffcheck.cli.check", "The whole suite for CI: references against their goldens, candidates "
                                     "against their references; one exit code."),
    "matrix": ("diffcheck.cli.matrix", "Run a suite's whole matrix and narrow the cause."),
    "selftest": ("diffcheck.cli.selftest", "Prove the verdicts on labelled faulty and benign cases."),
    "ledger": ("diffcheck.cli.ledger", "List recorded runs, grouped by identical output."),
    "bisect": ("diffcheck.cli.bisect", "Find the commit that broke a case (git bisect run)."),
    "reduce": ("diffcheck.cli.reduce", "Shrink a failing case to a minimal reproducer and bug report."),
    "kernels": ("diffcheck.cli.kernels", "Kernel-level decode-attention checks, graph replay included."),
    "localize": ("diffcheck.cli.localize", "Which layer and op first leaves the noise floor."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module_name, short = COMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # keep the rest of the CLI usable (Polygraphy's placeholder)
            reason = f"{type(exc).__name__}: {exc}"

            @click.command(name=name, help=f"{short} [unavailable: {reason}]")
            def unavailable():
                raise DiffcheckError(f"command '{name}' is unavailable: {reason}")

            return unavailable
        return getattr(module, name)

    def format_commands(self, ctx, formatter):
        # Short help from the map, so listing commands imports none of them.
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


# The exit codes from diffcheck.core.errors; which verdicts pass is the policy's (diffcheck.core.types, which
# imports numpy, so --help points to its table in docs/verdicts.md instead of asking it).
HELP = f"""Golden-output differential testing for LLM inference engines.

Exit codes: {EXIT_PASS} pass, {EXIT_REGRESSION} regression found, {EXIT_USAGE} usage/config/data error,
{EXIT_ENGINE} engine failure, {EXIT_INCONCLUSIVE} inconclusive (the evidence decided nothing; 0 with
--allow-inconclusive; both {EXIT_BISECT_SKIP} instead with --bisect-codes), 130 interrupted. Which verdicts
pass, with and without --strict: docs/verdicts.md.
"""


@click.group(cls=LazyGroup, help=HELP, context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Examples:
  diffcheck init          # a starter suite and goldens/ in this repository
  diffcheck compare O     # judge case O of the default suite against its reference
""")
@click.version_option(__version__, prog_name="diffcheck")
@click.option("-v", "--verbose", is_flag=True, help="Full logs and tracebacks from the engine.")
@click.pass_context
def cli(ctx, verbose):
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose


GLOBAL_FLAGS = ("-v", "--verbose")


def _globals_first(argv: list[str]) -> list[str]:
    """Global options may stand anywhere (``diffcheck compare O -v``): move them before the
    subcommand, where click reads them. Everything after a ``--`` is left alone."""
    end = argv.index("--") if "--" in argv else len(argv)
    flags = [a for a in argv[:end] if a in GLOBAL_FLAGS]
    rest = [a for a in argv[:end] if a not in GLOBAL_FLAGS]
    return flags + rest + argv[end:]


def main(argv=None) -> int:
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        # Started with SIGINT ignored (a shell without job control starts background jobs so): Python then
        # raises no KeyboardInterrupt, and a Ctrl-C or kill -INT would let the run finish and exit 0.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = _globals_first(list(sys.argv[1:] if argv is None else argv))
    try:
        rv = cli.main(args=argv, prog_name="diffcheck", standalone_mode=False)
    except DiffcheckError as exc:
        click.echo(f"diffcheck: error: {exc.message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("diffcheck: aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return 2 if isinstance(exc, click.UsageError) else exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return rv if isinstance(rv, int) else 0


