"""The Python API (diffcheck.api, re-exported lazily from the package)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import diffcheck
from diffcheck.core.errors import ConfigError, DataError
from factories import make_run, write_suite

PUBLIC = ("record_golden", "compare", "compare_case", "read_run", "write_run", "Tolerances", "Verdict",
          "CaseVerdict", "Run", "Floor")


def _probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_diffcheck_is_light_and_names_load_on_first_use():
    probe = _probe(
        "import json, sys, diffcheck\n"
        "heavy = ('numpy', 'pyarrow', 'torch', 'vllm', 'diffcheck.api', 'diffcheck.core.types')\n"
        "before = [m for m in heavy if m in sys.modules]\n"
        "v = diffcheck.Verdict.DEGRADED\n"
        "print(json.dumps({'before': before, 'after': 'numpy' in sys.modules, 'all': sorted(diffcheck.__all__)}))\n")
    assert probe["before"] == []
    assert probe["after"] is True  # Verdict lives in diffcheck.core.types, which needs numpy
    assert set(PUBLIC) <= set(probe["all"])


def test_every_public_name_resolves_and_unknown_names_raise():
    from diffcheck import api
    from diffcheck.core import types
    from diffcheck.judging import classify, floor

    expected = {"record_golden": api.record_golden, "compare": api.compare, "compare_case": api.compare_case,
                "read_run": api.read_run, "write_run": api.write_run, "Tolerances": classify.Tolerances,
                "Floor": floor.Floor, "Verdict": types.Verdict, "CaseVerdict": types.CaseVerdict, "Run": types.Run}
    for name in PUBLIC:
        assert getattr(diffcheck, name) is expected[name]
        assert name in dir(diffcheck)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        diffcheck.nope  # noqa: B018


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _pair(shift: float, *, n: int = 96, seed: int = 0):
    """A reference and a candidate along the same tokens; the candidate's logit of each token
    is `shift` nats lower (a loss of about `shift` x (1 - p) nats per step)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((2, n, 300)) * 2.0
    ref_rows = _log_softmax(logits)
    tokens = ref_rows.argmax(-1)
    cand_logits = logits.copy()
    np.put_along_axis(cand_logits, tokens[..., None], np.take_along_axis(logits, tokens[..., None], -1) - shift, -1)
    ref = make_run(list(tokens), distributions=list(ref_rows), k=20, case_id="J")
    cand = make_run(list(tokens), distributions=list(_log_softmax(cand_logits)), k=20, case_id="O",
                    role="candidate")
    return ref, cand


def test_compare_runs_identical_passes_and_a_loss_fails():
    ref, same = _pair(0.0)
    verdict = diffcheck.compare(ref, same)
    assert verdict and verdict.verdict is diffcheck.Verdict.IDENTICAL
    assert (verdict.reference_id, verdict.candidate_id) == ("J", "O")
    _, worse = _pair(2.0)
    verdict = diffcheck.compare(ref, worse)
    assert not verdict and verdict.verdict in (diffcheck.Verdict.DEGRADED, diffcheck.Verdict.GIBBERISH)
    assert all(s.evidence for s in verdict.sequences)


def test_compare_takes_paths_and_tolerances(tmp_path):
    ref, cand = _pair(0.05)
    ref_path, cand_path = tmp_path / "t" / "J.parquet", tmp_path / "t" / "O.run.parquet"
    assert len(diffcheck.write_run(ref_path, ref)) == 64  # a blake3 hex digest
    diffcheck.write_run(cand_path, cand)
    assert diffcheck.read_run(ref_path).steps.token_id.tolist() == ref.steps.token_id.tolist()
    strict = diffcheck.compare(ref_path, str(cand_path))
    assert strict.verdict is diffcheck.Verdict.DEGRADED  # a steady loss of ~0.05 nats/step is beyond the minimum effect
    loose = diffcheck.compare(ref_path, cand_path, tolerances={"min_effect": {"loss": 0.5, "kl": 0.5}})
    assert loose and loose.verdict is diffcheck.Verdict.IDENTICAL
    assert diffcheck.compare(ref, cand, tolerances=diffcheck.Tolerances(min_effect_loss=0.5,
                                                                        min_effect_kl=0.5)).verdict is loose.verdict
    with pytest.raises(ConfigError, match="unknown tolerance 'nope'"):
        diffcheck.compare(ref, cand, tolerances={"nope": 1})
    with pytest.raises(ConfigError, match="reference_run must be a diffcheck Run or the path"):
        diffcheck.compare(42, cand)
    with pytest.raises(DataError, match="missing.parquet: not found"):
        diffcheck.compare(tmp_path / "missing.parquet", cand)


def test_compare_case_rejudges_a_recorded_run_without_an_engine(tmp_path):
    suite = write_suite(tmp_path / "cases", {"J": {"role": "reference", "description": "ref"},
                                             "O": {"inherits": "J", "role": "candidate", "references": ["J"]}},
                        name="api")
    ref, cand = _pair(0.0)
    root = tmp_path / "goldens"
    diffcheck.write_run(root / "api" / "J.parquet", ref)
    run_file = root / "api" / "O.run.parquet"
    diffcheck.write_run(run_file, cand)
    seen = []
    result = diffcheck.compare_case("O", suite=suite, goldens=root, run_file=run_file, echo=seen.append)
    assert [v.reference_id for v in result.verdicts] == ["J"]
    assert result.verdict is diffcheck.Verdict.IDENTICAL and result.candidate.n_tokens == cand.n_tokens
    assert any("O vs J" in line for line in seen)  # progress goes to echo, nothing is printed
    with pytest.raises(DataError, match="no golden for 'J'"):
        diffcheck.compare_case("O", suite=suite, goldens=tmp_path / "empty", run_file=run_file)
