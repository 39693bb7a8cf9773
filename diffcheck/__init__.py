"""diffcheck: golden-output differential testing for LLM inference engines.

The Python API (`diffcheck.api`), importable from here::

    import diffcheck

    verdict = diffcheck.compare(diffcheck.read_run("J.parquet"), candidate_run)
    assert verdict, str(verdict)

- `record_golden`, `compare_case`: cases of a suite, as the CLI runs them;
- `compare`: two runs (no engine), returns a `CaseVerdict`;
- `read_run`, `write_run`: golden-format Parquet files;
- `Run`, `Verdict`, `CaseVerdict`, `Tolerances`, `Floor`: the data they take and give.

Names load on first use (module ``__getattr__``), so ``import diffcheck`` stays light:
no numpy, pyarrow, torch or vLLM until a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from diffcheck.core import __version__  # noqa: E402,F401 (one place: diffcheck.core)

# name -> the module that defines it
_LAZY = {
    "record_golden": "diffcheck.api",
    "compare": "diffcheck.api",
    "compare_case": "diffcheck.api",
    "read_run": "diffcheck.api",
    "write_run": "diffcheck.api",
    "Tolerances": "diffcheck.judging.classify",
    "Floor": "diffcheck.judging.floor",
    "Verdict": "diffcheck.core.types",
    "CaseVerdict": "diffcheck.core.types",
    "Run": "diffcheck.core.types",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from diffcheck.api import compare, compare_case, read_run, record_golden, write_run
    from diffcheck.judging.classify import Tolerances
    from diffcheck.judging.floor import Floor
    from diffcheck.core.types import CaseVerdict, Run, Verdict


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
