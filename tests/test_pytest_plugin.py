"""The pytest plugin (diffcheck.pytest_plugin): the llm_golden fixture in pytester projects.

The plugin loads through its ``pytest11`` entry point (the inner sessions run in a
subprocess with this venv), as it does for users. The real-engine test runs the example of
docs/integration.md as written (the model path filled in) in a new git repository: one
engine for the session, two prompts, 32 tokens. The failure paths are driven with synthetic
runs, which is where a known verdict can be produced.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from diffcheck.storage import store
from factories import make_run

pytest_plugins = ["pytester"]

TOP_K = 5  # the synthetic runs' top-k
DOCS = Path(__file__).resolve().parents[1] / "docs" / "integration.md"
MODEL_IN_DOCS = "/path/to/model"

# What vLLM returned, for the outer test to hold the golden against: the inner project's own
# conftest.py records every LLM.generate (the example itself stays as the docs write it).
RECORDER = """
    import json

    import vllm

    _generate = vllm.LLM.generate


    def _recorded(self, *args, **kwargs):
        outputs = _generate(self, *args, **kwargs)
        dump = [{"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                 "text": o.outputs[0].text,
                 "logprobs": [{str(t): [lp.logprob, lp.rank] for t, lp in step.items()}
                              for step in o.outputs[0].logprobs]} for o in outputs]
        with open("vllm_outputs.json", "w") as f:
            json.dump(dump, f)
        return outputs


    vllm.LLM.generate = _recorded
"""


def docs_example() -> str:
    """The pytest example of docs/integration.md's llm_golden section, as written there."""
    text = DOCS.read_text()
    section = text[text.index("## The pytest fixture `llm_golden`"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block and block.group(1).count(MODEL_IN_DOCS) == 1, "the docs' example names one model path"
    return block.group(1)


@pytest.fixture(scope="module")
def model_path() -> str:
    """The prepared model, resolved before pytester moves HOME (where the model cache lives)."""
    from diffcheck.engines import models

    return str(models.resolve("smollm2-135m").path)


@pytest.mark.engine
def test_the_docs_example_in_a_new_repository(model_path, pytester, monkeypatch):
    """docs/integration.md's example, model path filled in, in a new git repository, run twice.

    Its first run writes the golden and fails saying so; the second passes. Neither leaves a
    lock file or any other file than the golden and its manifest in the test's folder (what
    a user commits), and neither ends with vLLM logging into closed streams.
    """
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the example must set what it needs
    repo = pytester.path
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    tests = repo / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(textwrap.dedent(RECORDER))
    (tests / "test_llm.py").write_text(docs_example().replace(MODEL_IN_DOCS, model_path))
    golden_path = tests / "test_llm" / "test_generation.parquet"

    first = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "tests", timeout=540)
    shown = first.stdout.str() + first.stderr.str()
    assert first.parseoutcomes().get("failed") == 1 and "passed" not in first.parseoutcomes(), shown
    dump = json.loads((repo / "vllm_outputs.json").read_text())
    n_tokens = sum(len(d["token_ids"]) for d in dump)
    first.stdout.fnmatch_lines([f"llm_golden: no golden {golden_path}; wrote it from this run "
                                f"(2 sequences, {n_tokens} tokens)*"])
    second = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "tests", timeout=540)
    second.assert_outcomes(passed=1)
    for run in (first, second):
        out = run.stdout.str() + run.stderr.str()
        assert "Logging error" not in out and "I/O operation on closed file" not in out, out[-4000:]
    new = subprocess.run(["git", "-C", str(repo), "ls-files", "--others", "--exclude-standard", "tests/test_llm"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert sorted(new) == ["tests/test_llm/MANIFEST.json", "tests/test_llm/test_generation.parquet"], new
    assert not list(repo.rglob("*.lock")), list(repo.rglob("*.lock"))
    assert not (tests / "test_llm" / "test_generation.obtained.parquet").exists()

    # The golden holds exactly what vLLM returned (logprobs within the codec's bound: 2^-7 + 2^-11 of |logprob|).
    golden = store.read_run(golden_path)
    k = 20  # the example's logprobs=20
    assert [s.prompt_id for s in golden.sequences] == ["0", "1"]
    assert golden.steps.k == k
    for i, want in enumerate(dump):
        seq = golden.sequence(i)
        assert seq.info.prompt_token_ids == tuple(want["prompt_token_ids"]) and seq.info.text == want["text"]
        assert seq.token_id.tolist() == want["token_ids"] and 0 < len(want["token_ids"]) <= 32
        for t, step in enumerate(want["logprobs"]):
            own = step[str(want["token_ids"][t])][0]
            assert abs(seq.logprob[t] - own) <= (2 ** -7 + 2 ** -11) * abs(own) + 1e-6
            ranked = sorted((rank, int(tid), lp) for tid, (lp, rank) in step.items() if rank <= k)
            assert seq.topk_ids[t].tolist() == [tid for _, tid, _ in ranked]
            assert np.allclose(seq.topk_logprobs[t], [lp for _, _, lp in ranked], rtol=2 ** -7 + 2 ** -11, atol=1e-6)


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
