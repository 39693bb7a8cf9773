"""Where a project keeps its cases and goldens, and which suite is its default.

The one place that resolves them; `diffcheck.cases` (suite lookup),
`diffcheck.workspace.goldens_root` and the CLI's ``--suite`` default ask
it. Each setting comes from the first of these that has it (as ruff and pytest
do; a flag wins over the environment, which wins over the file):

1. a command-line flag (``--suite``, ``--goldens``), passed in by the caller;
2. the environment: ``DIFFCHECK_CASES``, ``DIFFCHECK_GOLDENS``, ``DIFFCHECK_SUITE``
   (used as given: relative paths are relative to the working directory);
3. ``[tool.diffcheck]`` in the nearest ``pyproject.toml`` that has that table,
   searching from the working directory up to the filesystem root; its paths are
   relative to that file's folder, so a command works from any subfolder;
4. the defaults: ``./cases``, ``./goldens``, suite ``default``.

The table takes three keys::

    [tool.diffcheck]
    cases = "cases"       # folder of suite files (<name>.toml) and their prompts
    goldens = "goldens"   # goldens root: <goldens>/<suite>/<case>.parquet
    suite = "default"     # the suite commands use when --suite is not given

Any other key, or a value that is not a non-empty string, is refused with one
`ConfigError` line naming the pyproject.toml and the key.

Suites by name: ``<cases>/<name>.toml`` when the project has it, else the suite of
that name shipped with diffcheck (``default``, ``gpu-h200``, ``flash-v100-quality``:
the repository's ``cases/`` folder, installed as the data package
``diffcheck_suites``). A path (``*.toml`` or anything with a slash) is used as is.

Imports nothing beyond the standard library, so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from diffcheck.core.errors import ConfigError

PYPROJECT = "pyproject.toml"
TABLE = "tool.diffcheck"
KEYS = ("cases", "goldens", "suite")
ENV = {"cases": "DIFFCHECK_CASES", "goldens": "DIFFCHECK_GOLDENS", "suite": "DIFFCHECK_SUITE"}
DEFAULTS = {"cases": "cases", "goldens": "goldens", "suite": "default"}
SHIPPED_PACKAGE = "diffcheck_suites"


@dataclass(frozen=True)
class Settings:
    """A project's resolved settings, and where each came from.

    ``sources`` maps each key to ``"default"``, the pyproject.toml path, ``"$DIFFCHECK_..."``
    or ``"flag"``; ``pyproject`` is the file whose ``[tool.diffcheck]`` was read, if any.
    """

    cases: Path
    goldens: Path
    suite: str
    pyproject: Path | None = None
    sources: dict[str, str] = field(default_factory=dict)


def find_pyproject(start: str | Path | None = None) -> tuple[Path, dict] | None:
    """The nearest pyproject.toml (from `start`, default the working directory, upwards) with a
    ``[tool.diffcheck]`` table, and that table; None when there is none."""
    here = Path(start) if start is not None else Path.cwd()
    here = here.absolute()
    for folder in (here, *here.parents):
        path = folder / PYPROJECT
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read ({exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        table = data.get("tool", {}).get("diffcheck") if isinstance(data.get("tool"), dict) else None
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{TABLE}] must be a table with keys {', '.join(KEYS)}")
        return path, table
    return None


def _check(path: Path, table: dict) -> dict[str, str]:
    for key, value in table.items():
        if key not in KEYS:
            raise ConfigError(f"{path}: [{TABLE}] unknown key '{key}' (valid: {', '.join(KEYS)})")
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{path}: [{TABLE}] {key} must be a non-empty string "
                              f"({'a folder path' if key != 'suite' else 'a suite name or a .toml path'}), "
                              f"got {value!r}")
    return dict(table)


def looks_like_path(suite: str) -> bool:
    """A suite value that names a file rather than a suite: ``*.toml`` or anything with a slash."""
    return suite.endswith(".toml") or os.sep in suite or "/" in suite


def load(start: str | Path | None = None, *, environ: dict[str, str] | None = None,
         cases: str | Path | None = None, goldens: str | Path | None = None,
         suite: str | None = None) -> Settings:
    """Resolve every setting: flags (the keyword arguments) > environment > pyproject.toml > defaults."""
    env = os.environ if environ is None else environ
    found = find_pyproject(start)
    values: dict[str, str | Path] = dict(DEFAULTS)
    sources = {key: "default" for key in KEYS}
    pyproject = None
    if found is not None:
        pyproject, table = found
        for key, value in _check(pyproject, table).items():
            if key == "suite" and not looks_like_path(value):
                values[key] = value
            else:  # paths in the file are relative to the file's folder
                values[key] = pyproject.parent / Path(value).expanduser()
            sources[key] = str(pyproject)
    for key, var in ENV.items():
        if env.get(var):
            values[key] = env[var]
            sources[key] = f"${var}"
    for key, flag in (("cases", cases), ("goldens", goldens), ("suite", suite)):
        if flag is not None and str(flag) != "":
            values[key] = flag
            sources[key] = "flag"
    return Settings(cases=Path(values["cases"]), goldens=Path(values["goldens"]), suite=str(values["suite"]),
                    pyproject=pyproject, sources=sources)


def cases_dir() -> Path:
    """The project's folder of suite files."""
    return load().cases


def goldens_dir(flag: str | Path | None = None) -> Path:
    """The goldens root: `flag` (``--goldens``) if given, else the project's."""
    return load(goldens=flag).goldens


def default_suite(flag: str | None = None) -> str:
    """The suite to use: `flag` (``--suite``) if given, else the project's default."""
    return load(suite=flag).suite


# -- suites shipped with diffcheck ---------------------------------------------------------------


def shipped_suites_dir() -> Path | None:
    """The folder of the suites installed with diffcheck (package ``diffcheck_suites``), if any."""
    try:
        spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        folder = Path(location)
        if folder.is_dir():
            return folder
    return None


def shipped_suites() -> list[str]:
    """Names of the suites shipped with diffcheck, sorted."""
    folder = shipped_suites_dir()
    return sorted(p.stem for p in folder.glob("*.toml")) if folder is not None else []


def suite_file(name: str, folder: str | Path | None = None) -> Path | None:
    """Where suite `name` lives: ``<folder>/<name>.toml`` (default folder: the project's cases),
    else the shipped suite of that name; None when neither exists."""
    folder = Path(folder) if folder is not None else cases_dir()
    own = folder / f"{name}.toml"
    if own.is_file():
        return own
    shipped = shipped_suites_dir()
    if shipped is not None and (shipped / f"{name}.toml").is_file():
        return shipped / f"{name}.toml"
    return None
