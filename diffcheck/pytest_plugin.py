"""pytest plugin: the ``llm_golden`` fixture, golden outputs of an LLM judged by diffcheck's verdict.

Installed with diffcheck (entry point ``pytest11``: ``diffcheck``), in the spirit of
pytest-regressions' ``data_regression``::

    def test_my_engine_change(llm_golden):
        llm = vllm.LLM(model=..., dtype="float32")
        outputs = llm.generate(prompts, vllm.SamplingParams(max_tokens=16, logprobs=20, seed=0))
        llm_golden.check(outputs)

``llm_golden.check(outputs, *, name=None)`` takes a list of ``vllm.RequestOutput`` (generated
with ``logprobs=K``) or a `diffcheck.core.types.Run`, and compares it with the golden stored
beside the test file, ``<test_dir>/<test_file_stem>/<name>.parquet`` (``name`` defaults to the
test's name, with anything but letters, digits, ``_ . -`` replaced by ``_``). The judge is
`diffcheck.compare` without a noise floor (margins are the minimum effect of interest); what passes is
`diffcheck.core.types`'s decision: IDENTICAL, BENIGN_DRIFT, WITHIN_BUDGET.

- No golden yet: it is written and the test fails saying so (commit it; the next run passes).
- A failing verdict: the test fails with the verdict and the first evidence lines, and the
  obtained run is written beside the golden as ``<name>.obtained.parquet``
  (``diffcheck.compare(golden, obtained)`` re-judges it; ``diffcheck golden export`` turns it
  into plain numbers).
- ``--diffcheck-update`` (alias ``--force-regen``, pytest-regressions' spelling; when
  pytest-regressions is installed its own ``--force-regen`` does the same) writes missing
  goldens and replaces existing ones. A test whose golden was missing or failed still fails,
  saying what was written; one that passed has its golden replaced and passes.

Goldens are diffcheck run files: the folder's MANIFEST.json holds their blake3 digests, so a
golden edited by hand is refused with one line naming it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
EVIDENCE_LINES = 3  # per failing sequence
FAILING_SEQUENCES = 3  # shown in a failure message


def pytest_addoption(parser: pytest.Parser) -> None:
    import importlib.util

    group = parser.getgroup("diffcheck", "diffcheck golden outputs (the llm_golden fixture)")
    group.addoption("--diffcheck-update", action="store_true", dest="diffcheck_update", default=False,
                    help="llm_golden: write missing goldens and replace existing ones.")
    if importlib.util.find_spec("pytest_regressions") is None:  # else its --force-regen serves (same dest)
        group.addoption("--force-regen", action="store_true", dest="force_regen", default=False,
                        help="llm_golden: alias of --diffcheck-update (pytest-regressions' spelling).")


def golden_name(node_name: str) -> str:
    """A test's node name as a golden file name: other characters than letters, digits, _ . - become _."""
    name = _BAD_CHARS.sub("_", node_name)
    return name if _NAME.match(name) else f"t{name}"


class LLMGolden:
    """The ``llm_golden`` fixture: compare LLM outputs with a golden stored beside the test file."""

    def __init__(self, request: pytest.FixtureRequest):
        self.folder: Path = request.path.parent / request.path.stem
        self.default_name = golden_name(request.node.name)
        self.test_file = request.path
        config = request.config
        self.update = bool(config.getoption("diffcheck_update") or config.getoption("force_regen", default=False))
        self._used: set[str] = set()

    def path(self, name: str | None = None) -> Path:
        """Where the golden called `name` (default: the test's name) lives."""
        return self.folder / f"{self._name(name)}.parquet"

    def _name(self, name: str | None) -> str:
        if name is None:
            return self.default_name
        if not isinstance(name, str) or not _NAME.match(name):
            from diffcheck.core.errors import ConfigError

            raise ConfigError(f"{self.test_file}: llm_golden.check(name={name!r}) is not a valid golden name "
                              "(valid: letters, digits, '_', '.', '-', starting with a letter or digit)")
        return name

    def check(self, outputs: Any, *, name: str | None = None) -> None:
        """Judge `outputs` (vLLM RequestOutputs with logprobs, or a diffcheck Run) against the golden.

        Fails the test on a missing golden (written now), or on a verdict that does not pass
        (the obtained run is written beside the golden); see the module docstring.
        """
        from diffcheck import api
        from diffcheck.core.errors import DiffcheckError
        from diffcheck.core.types import passes
        from diffcheck.storage import store
        from diffcheck.core.types import Run

        key = self._name(name)
        if key in self._used:
            from diffcheck.core.errors import ConfigError

            raise ConfigError(f"{self.test_file}: llm_golden.check called twice with name {key!r} in one test; "
                              "give each check its own name=")
        self._used.add(key)
        golden_path = self.folder / f"{key}.parquet"
        obtained_path = self.folder / f"{key}.obtained.parquet"
        suite = self.test_file.stem
        if isinstance(outputs, Run):
            if outputs.meta.kind != "generate":
                from diffcheck.core.errors import ConfigError

                raise ConfigError(f"{self.test_file}: llm_golden.check takes a generated run (kind 'generate'), "
                                  f"got a {outputs.meta.kind!r} run")
            run = outputs
        else:
            run = api.run_from_vllm(outputs)
        # compared as stored: both sides carry the store's logprob rounding
        obtained = store.quantize(_named(run, suite=suite, case_id=f"{key}.obtained", role="candidate"))
        as_golden = _named(run, suite=suite, case_id=key, role="reference")

        if not golden_path.exists():
            store.write_run(golden_path, as_golden)
            pytest.fail(f"llm_golden: no golden {golden_path}; wrote it from this run "
                        f"({len(run.sequences)} sequences, {run.n_tokens} tokens). Commit it; the next run compares "
                        "against it.", pytrace=False)

        try:
            golden = store.read_run(golden_path)
            problem = _prompts_differ(golden, obtained)
            verdict = None if problem else api.compare(golden, obtained)
        except DiffcheckError as exc:
            problem = exc.message
            verdict = None
        ok = verdict is not None and passes(verdict.verdict)
        if self.update:
            store.write_run(golden_path, as_golden)
            if ok:
                return
            what = verdict.verdict.name if verdict is not None else problem
            pytest.fail(f"llm_golden: replaced golden {golden_path} (was: {what}) as asked by --diffcheck-update",
                        pytrace=False)
        if ok:
            return
        store.write_run(obtained_path, _named(run, suite=suite, case_id=f"{key}.obtained", role="candidate"))
        hint = (f"obtained run written to {obtained_path}; if the change is intended, rerun with "
                "--diffcheck-update to replace the golden")
        if verdict is None:
            pytest.fail(f"llm_golden: cannot compare with golden {golden_path}: {problem}\n{hint}", pytrace=False)
        pytest.fail(f"llm_golden: {verdict.verdict.name} against golden {golden_path}\n{describe(verdict)}\n{hint}",
                    pytrace=False)


def _named(run, *, suite: str, case_id: str, role: str):
    return dataclasses.replace(run, meta=dataclasses.replace(run.meta, suite=suite, case_id=case_id, role=role))


def _prompts_differ(golden, obtained) -> str | None:
    """Why the two runs are not runs of the same prompts, or None."""
    if len(golden.sequences) != len(obtained.sequences):
        return (f"the golden holds {len(golden.sequences)} sequences, this run {len(obtained.sequences)}: "
                "the prompts changed")
    for i, (g, o) in enumerate(zip(golden.sequences, obtained.sequences)):
        if g.prompt_id != o.prompt_id or g.prompt_token_ids != o.prompt_token_ids:
            return f"sequence {i}: its prompt differs from the golden's (prompt id {g.prompt_id!r}): the prompts changed"
    return None


def describe(verdict) -> str:
    """The verdict line and the first evidence lines of the worst failing sequences."""
    from diffcheck.core.types import passes

    lines = [str(verdict)]
    bad = sorted((s for s in verdict.sequences if not passes(s.verdict)), key=lambda s: -s.verdict.value)
    for s in bad[:FAILING_SEQUENCES]:
        where = f"t*={s.t_star}" if s.t_star is not None else "same tokens"
        onset = f", onset {s.onset}" if s.onset is not None else ""
        lines.append(f"  seq {s.index} (prompt {s.prompt_id}): {s.verdict.name} ({where}{onset})")
        lines += [f"    {e}" for e in s.evidence[:EVIDENCE_LINES]]
    if len(bad) > FAILING_SEQUENCES:
        lines.append(f"  ... and {len(bad) - FAILING_SEQUENCES} more failing sequences")
    return "\n".join(lines)


@pytest.fixture
def llm_golden(request: pytest.FixtureRequest) -> LLMGolden:
    """Compare LLM outputs with a golden beside the test file: ``llm_golden.check(outputs)``."""
    return LLMGolden(request)
