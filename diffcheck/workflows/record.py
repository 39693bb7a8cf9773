"""``diffcheck golden record``: a reference's golden, recorded once.

The life cycle: skip when a golden recorded from the exact config, engine code and
model exists (unless ``force``); generate (twice with ``check_determinism``, and
refuse a reference that is not reproducible); store, refusing to change an existing
golden without ``update`` (`diffcheck.workspace.store_golden`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from diffcheck import workspace
from diffcheck.core.errors import DataError
from diffcheck.engines import session as sessionmod
from diffcheck.storage import store
from diffcheck.workspace import GoldenResult

Echo = Callable[[str], None]


def record_golden(case, *, root: Path, update: bool = False, force: bool = False,
                  check_determinism: bool = False, verbose: bool = False, echo: Echo = print,
                  session: sessionmod.EngineSession | None = None) -> GoldenResult:
    """Record `case`'s golden unless an identical one exists; refuse to change one without `update`."""
    path = workspace.golden_path(root, case)
    if not force and not check_determinism:
        digest = workspace.golden_up_to_date(path, case)
        if digest:
            return GoldenResult(case.id, path, "up to date", digest,
                                "same config, engine version and model as recorded; --force re-records")
    if check_determinism:
        run, again = sessionmod.generate(case, session=session, verbose=verbose, echo=echo, again=True)
        a, b = store.content_digest(run), store.content_digest(again)
        if a != b:
            raise DataError(f"case '{case.id}' is not reproducible: two recordings differ "
                            f"(content {a[:12]} vs {b[:12]}); a reference must be deterministic")
    else:
        run = sessionmod.generate(case, session=session, verbose=verbose, echo=echo)
    return workspace.store_golden(root, case, run, update=update)
