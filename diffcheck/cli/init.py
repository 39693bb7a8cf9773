"""`diffcheck init`: scaffold cases/ (a starter suite) and goldens/ in the current repository.

Where: the folder of the nearest pyproject.toml with ``[tool.diffcheck]`` (its
settings say where cases and goldens go), else the repository root (the nearest
folder with ``.git``), else the working directory. It writes only what is
missing, each file atomically, and never overwrites: a second run changes
nothing. Unless ``--no-config``, it adds a ``[tool.diffcheck]`` table to that
folder's pyproject.toml (creating the file if there is none), so every command
finds the project from any subfolder.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import click

from diffcheck.core.errors import ConfigError

PROMPTS_NAME = "starter.toml"

STARTER_SUITE = """\
# A starter suite written by `diffcheck init`: one reference and one candidate.
#
#   diffcheck model prepare smollm2-135m   # once: fetch and convert the model
#   diffcheck golden record                # record the reference J's golden
#   diffcheck compare S1                   # judge the candidate S1 against it
#
# J runs the model eagerly in fp32. S1 changes one engine setting (one sequence per
# batch) and must come out within J's noise. Add your own candidates below: inherit J,
# change what you want to test (engine = { enforce_eager = false } for the compiled
# path, kv_cache_dtype = "fp8" for an fp8 KV cache, ...), and name J as the reference.
# `diffcheck cases show S1` prints a case's resolved config; the case language is docs/cases.md.

[suite]
name = "@NAME@"
description = "starter: SmolLM2-135M on vLLM, an eager fp32 reference and one candidate"

[defaults]
model = "smollm2-135m"            # a known model id, or a path to a Hugging Face model folder
prompts = "prompts/@PROMPTS@"

[defaults.sampling]
max_tokens = 32
temperature = 0.7                 # real sampling, seeded: runs are reproducible
top_p = 0.95
top_k = 20
seed = 1234
logprobs = 20                     # top-k logprobs captured per step

[defaults.engine]
dtype = "float32"
kv_cache_memory_gib = 1
max_model_len = 1024
enable_prefix_caching = false

[cases.J]
role = "reference"
description = "eager fp32 reference"
engine = { enforce_eager = true }

[cases.S1]
inherits = "J"
role = "candidate"
references = ["J"]
description = "one sequence at a time (max_num_seqs = 1): must come out within J's noise"
engine = { max_num_seqs = 1 }
expect = { not_verdict = ["DEGRADED", "GIBBERISH"] }
"""

STARTER_PROMPTS = """\
# Prompts of the starter suite: short, so a comparison takes seconds on a CPU.
# Each [[prompt]] has an id and a text; chat = false sends the text without the chat template.

[[prompt]]
id = "retry-policy"
text = "Write a short design note about the retry policy of a message-queue consumer."

[[prompt]]
id = "write-ahead-log"
text = "Explain in two sentences how a write-ahead log makes a key-value store crash-safe."
"""


def project_root(start: Path) -> Path:
    """The nearest folder holding .git, else `start`."""
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return start


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def _config_table(root: Path, cases: Path, goldens: Path, suite: str) -> str:
    return (f'[tool.diffcheck]\ncases = "{_relative(cases, root)}"\ngoldens = "{_relative(goldens, root)}"\n'
            f'suite = "{suite}"\n')


def scaffold(start: Path, *, config: bool = True) -> list[tuple[str, Path]]:
    """Create what is missing; return (what happened, path) for each file and folder considered."""
    from diffcheck.core import config as cfg
    from diffcheck.storage.manifest import atomic_write

    start = start.absolute()
    settings = cfg.load(start)
    root = settings.pyproject.parent if settings.pyproject is not None else project_root(start)

    def place(key: str) -> Path:
        value = getattr(settings, key)
        if settings.sources[key] == "default":
            return root / value
        return value if value.is_absolute() else start / value

    cases, goldens = place("cases"), place("goldens")
    suite = settings.suite if not cfg.looks_like_path(settings.suite) else "default"
    files = [
        (cases / f"{suite}.toml", STARTER_SUITE.replace("@NAME@", suite).replace("@PROMPTS@", PROMPTS_NAME)),
        (cases / "prompts" / PROMPTS_NAME, STARTER_PROMPTS),
    ]
    done: list[tuple[str, Path]] = []
    for path, text in files:
        if path.exists():
            done.append(("exists", path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text.encode())
        done.append(("created", path))
    if goldens.is_dir():
        done.append(("exists", goldens))
    else:
        goldens.mkdir(parents=True)
        done.append(("created", goldens))
    if config:
        pyproject = root / cfg.PYPROJECT
        if settings.pyproject is not None:
            done.append(("exists", Path(f"{settings.pyproject} [tool.diffcheck]")))
        else:
            old = pyproject.read_text(encoding="utf-8") if pyproject.is_file() else ""
            sep = "" if not old else ("\n" if old.endswith("\n") else "\n\n")
            text = old + sep + _config_table(root, cases, goldens, suite)
            try:
                tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{pyproject}: cannot add [tool.diffcheck] ({exc}); add it by hand "
                                  "or pass --no-config") from None
            atomic_write(pyproject, text.encode())
            done.append(("updated" if old else "created", Path(f"{pyproject} [tool.diffcheck]")))
    return done


@click.command(name="init", epilog="""\b
Examples:
  diffcheck init                 # cases/default.toml (J, S1), goldens/, [tool.diffcheck]
  diffcheck init --no-config     # the same, pyproject.toml left alone
""")
@click.option("--no-config", is_flag=True, help="Do not add a [tool.diffcheck] table to pyproject.toml.")
def init(no_config):
    """Scaffold cases/ (a starter suite: reference J, candidate S1) and goldens/ here.

    Writes only what is missing and never overwrites. The starter suite uses the
    smollm2-135m model and a short prompts file; then run `diffcheck model prepare
    smollm2-135m`, `diffcheck golden record` and `diffcheck compare S1`.
    """
    for what, path in scaffold(Path.cwd(), config=not no_config):
        click.echo(f"{what:8s} {path}")
    click.echo("next: diffcheck model prepare smollm2-135m && diffcheck golden record && diffcheck compare S1")
    return 0
