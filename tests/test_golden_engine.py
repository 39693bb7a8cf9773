"""The golden life cycle with the real engine: record, up to date, unchanged, refuse, update."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diffcheck.workflows import record
from diffcheck.storage import store
from diffcheck.core.errors import DiffcheckError

pytestmark = pytest.mark.engine


def test_golden_life_cycle(tmp_path, smoke_suite, engine_pool):
    case = smoke_suite.cases["J"]
    first = record.record_golden(case, root=tmp_path, session=engine_pool, echo=lambda m: None)
    assert first.status == "recorded"
    assert first.path == store.run_path(tmp_path, "smoke", "J")

    again = record.record_golden(case, root=tmp_path, session=engine_pool, echo=lambda m: None)
    assert again.status == "up to date" and again.digest == first.digest

    forced = record.record_golden(case, root=tmp_path, session=engine_pool, force=True, echo=lambda m: None)
    assert forced.status == "unchanged" and forced.digest == first.digest

    checked = record.record_golden(case, root=tmp_path, session=engine_pool, check_determinism=True,
                                   echo=lambda m: None)
    assert checked.digest == first.digest

    # A golden whose content would change is refused without --update, and kept as it was.
    golden = store.read_run(first.path)
    ids = golden.steps.token_id.copy()
    ids[3] = (ids[3] + 1) % 1000
    other = dataclasses.replace(golden, steps=dataclasses.replace(golden.steps, token_id=ids))
    store.write_run(first.path, other)
    changed_digest = store.content_digest(store.read_run(first.path))
    with pytest.raises(DiffcheckError, match="--update"):
        record.record_golden(case, root=tmp_path, session=engine_pool, force=True, echo=lambda m: None)
    assert store.content_digest(store.read_run(first.path)) == changed_digest

    updated = record.record_golden(case, root=tmp_path, session=engine_pool, force=True, update=True,
                                   echo=lambda m: None)
    assert updated.status == "updated" and updated.digest == first.digest
    assert np.array_equal(store.read_run(first.path).steps.token_id, golden.steps.token_id)
