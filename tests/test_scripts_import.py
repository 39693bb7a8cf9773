"""The scripts outside the package (bench/, tools/) import only names diffcheck has.

They run rarely (benchmarks, the GPU lane), so a moved module would otherwise break them
silently. Every ``from diffcheck... import name`` in them, at any depth, must resolve.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for d in ("bench", "tools") for p in (ROOT / d).rglob("*.py"))


def diffcheck_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every import of diffcheck in the file; name None for `import x`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] in ("diffcheck", "diffcheck_kernels"):
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "diffcheck"]
    return found


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"bench/measured.py", "bench/bench_replay.py", "tools/fault_smoke.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_diffcheck_import_resolves(path):
    missing = []
    for line, module, name in diffcheck_imports(path):
        mod = importlib.import_module(module)
        if name is not None and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: from {module} import {name}")
    assert not missing, missing
