"""The pytest plugin (diffcheck.pytest_plugin): the llm_golden fixture in pytester projects.

The plugin loads through its ``pytest11`` entry point (the inner sessions run in a
subprocess with this venv), as it does for users. The failure paths are driven with synthetic
runs, which is where a known verdict can be produced. The example of docs/integration.md runs
as written on the real engine, in a new git repository with the wheel installed, in
tests/test_story.py.
"""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest

from diffcheck.storage import store
from factories import make_run

pytest_plugins = ["pytester"]

TOP_K = 5  # the synthetic runs' top-k

# -- failure paths, with synthetic runs (no engine) ---------------------------------------------------


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _runs():
    """A run and a damaged copy: the same tokens, each 3 nats less likely."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 64, 300)) * 2.0
    tokens = logits.argmax(-1)
    worse = logits.copy()
    np.put_along_axis(worse, tokens[..., None], np.take_along_axis(logits, tokens[..., None], -1) - 3.0, -1)
    good = make_run(list(tokens), distributions=list(_log_softmax(logits)), k=TOP_K)
    bad = make_run(list(tokens), distributions=list(_log_softmax(worse)), k=TOP_K)
    return good, bad


SYNTHETIC_TEST = """
    import os

    import pytest

    import diffcheck

    RUNS = %(runs)r


    def test_check(llm_golden):
        llm_golden.check(diffcheck.read_run(os.path.join(RUNS, os.environ["WHICH"] + ".parquet")))


    @pytest.mark.parametrize("label", ["a b"])
    def test_named(llm_golden, label):
        llm_golden.check(diffcheck.read_run(os.path.join(RUNS, "good.parquet")))
"""


@pytest.fixture
def synthetic(pytester, tmp_path):
    good, bad = _runs()
    runs = tmp_path / "runs"
    store.write_run(runs / "good.parquet", good)
    store.write_run(runs / "bad.parquet", bad)
    pytester.makepyfile(test_syn=textwrap.dedent(SYNTHETIC_TEST % {"runs": str(runs)}))
    pytester.runs = runs
    return pytester


def _run(pytester, monkeypatch, which, *args):
    monkeypatch.setenv("WHICH", which)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *args, timeout=300)


def test_missing_then_passing_then_failing_with_the_verdict(synthetic, monkeypatch):
    folder = synthetic.path / "test_syn"
    first = _run(synthetic, monkeypatch, "good")
    first.assert_outcomes(failed=2)
    assert len(re.findall(r"^llm_golden: no golden \S+; wrote it from this run", first.stdout.str(), re.M)) == 2
    assert sorted(p.name for p in folder.glob("*.parquet")) == ["test_check.parquet", "test_named_a_b_.parquet"]
    assert sorted(p.name for p in folder.iterdir()) == ["MANIFEST.json", "test_check.parquet", "test_named_a_b_.parquet"]

    _run(synthetic, monkeypatch, "good").assert_outcomes(passed=2)

    failed = _run(synthetic, monkeypatch, "bad")
    failed.assert_outcomes(failed=1, passed=1)
    out = failed.stdout.str()
    m = re.search(r"llm_golden: (DEGRADED|GIBBERISH) against golden (\S+)", out)
    assert m and m.group(2) == str(folder / "test_check.parquet"), out
    assert re.search(r"seq 0 \(prompt p0\): (DEGRADED|GIBBERISH)", out)  # the failing sequence ...
    assert re.search(r"\n\s+\S.*(KL|loss|nats|Δ)", out)  # ... and its evidence
    obtained = folder / "test_check.obtained.parquet"
    assert f"obtained run written to {obtained}" in out
    bad = store.read_run(synthetic.runs / "bad.parquet")
    assert store.read_run(obtained).steps.logprob.tolist() == bad.steps.logprob.tolist()
    assert store.read_run(folder / "test_check.parquet").steps.logprob.tolist() != bad.steps.logprob.tolist()


@pytest.mark.parametrize("flag", ["--diffcheck-update", "--force-regen"])
def test_update_replaces_the_golden(synthetic, monkeypatch, flag):
    golden = synthetic.path / "test_syn" / "test_check.parquet"
    _run(synthetic, monkeypatch, "good", "-k", "test_check").assert_outcomes(failed=1)  # written
    before = store.content_digest(store.read_run(golden))
    replaced = _run(synthetic, monkeypatch, "bad", "-k", "test_check", flag)
    replaced.assert_outcomes(failed=1)
    assert re.search(rf"replaced golden {re.escape(str(golden))} \(was: (DEGRADED|GIBBERISH)\)", replaced.stdout.str())
    after = store.content_digest(store.read_run(golden))
    assert after != before
    _run(synthetic, monkeypatch, "bad", "-k", "test_check").assert_outcomes(passed=1)  # the new golden
    _run(synthetic, monkeypatch, "bad", "-k", "test_check", flag).assert_outcomes(passed=1)  # passing: replaced, passes
    assert store.content_digest(store.read_run(golden)) == after


def test_bad_names_changed_prompts_and_reused_names(pytester, tmp_path, monkeypatch):
    good, _ = _runs()
    runs = tmp_path / "runs"
    store.write_run(runs / "good.parquet", good)
    store.write_run(runs / "other.parquet", make_run([[1, 2, 3]], k=TOP_K))
    pytester.makepyfile(test_bad=textwrap.dedent(f"""
        import os

        import pytest

        import diffcheck

        def run(name):
            return diffcheck.read_run(os.path.join({str(runs)!r}, name + ".parquet"))

        def test_bad_name(llm_golden):
            llm_golden.check(run("good"), name="../up")

        def test_prompts(llm_golden):
            llm_golden.check(run(os.environ["WHICH"]))

        def test_twice(llm_golden):
            try:
                llm_golden.check(run("good"), name="p")  # fails in the first session: no golden yet
            except pytest.fail.Exception:
                pass
            llm_golden.check(run("good"), name="p")
    """))
    _run(pytester, monkeypatch, "good").assert_outcomes(failed=3)
    result = _run(pytester, monkeypatch, "other")
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "test_bad.py: llm_golden.check(name='../up') is not a valid golden name (valid: letters, digits" in out
    golden = pytester.path / "test_bad" / "test_prompts.parquet"
    assert (f"llm_golden: cannot compare with golden {golden}: the golden holds 2 sequences, this run 1: "
            "the prompts changed") in out
    assert "llm_golden.check called twice with name 'p' in one test; give each check its own name=" in out
