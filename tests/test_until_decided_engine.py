"""`compare --until-decided` on the real vLLM CPU engine (issue 21).

One prompt, a golden of 8 tokens, and a candidate with faint attention noise from the first
decode step (`attn-noise` at strength 0.01: its forced path differs from the reference's at
every step, by far less than the margins). 8 steps cannot show that it is inside the floor
(fewer than min_steps = 16), so a plain comparison is INCONCLUSIVE (exit 4). Extended look
after look (the reference regenerating further, its first 8 tokens checked against the golden,
the candidate forced along the longer path), it is decided within a budget of 64 steps.

Needs vLLM and the prepared model: it fails, never skips, without them."""

from __future__ import annotations

import json
from pathlib import Path

from factories import write_suite

ROOT = Path(__file__).resolve().parent.parent
PROMPT = {"id": "retry-policy", "text": "Write a short design note about the retry policy of a message-queue "
                                        "consumer. Include the problem, the chosen backoff strategy, and the risks."}
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "A": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "faint attention noise",
          "env": {"DIFFCHECK_FAULT": "attn-noise", "DIFFCHECK_FAULT_SCALE": "0.01", "DIFFCHECK_FAULT_STEP": "0"}},
}


def test_an_inconclusive_candidate_is_decided_by_extending_its_path(tmp_path, capsys):
    from diffcheck import cli as climod

    suite = write_suite(tmp_path / "cases", CASES, name="ud", prompts=[PROMPT],
                        sampling={"max_tokens": 8, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234,
                                  "logprobs": 20},
                        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
                                "kv_cache_memory_gib": 1})
    common = ["--suite", str(suite), "--goldens", str(tmp_path / "goldens")]
    assert climod.main(["golden", "record", "J"] + common) == 0
    capsys.readouterr()

    report = tmp_path / "A.json"
    rc = climod.main(["compare", "A", "--until-decided", "--max-tokens", "64", "--json", str(report)] + common)
    out = capsys.readouterr().out
    case = json.loads(report.read_text())["cases"][0]
    s = case["sequences"][0]
    ext = s["stats"]["sequential"]
    steps = [lk["steps"] for lk in ext["looks"]]
    verdicts = [lk["verdict"] for lk in ext["looks"]]
    # the first look is the plain comparison's 8 steps, undecided; each further look doubles the path
    assert steps[0] == 8 and verdicts[0] == "INCONCLUSIVE", ext
    assert steps == [8, 16, 32, 64][:len(steps)] and len(steps) >= 2, ext
    # decided before the budget ran out, and a pass: the candidate's tokens are the reference's and its
    # forced path is shown within the margins on the longer path
    assert s["verdict"] == "IDENTICAL" and verdicts[-1] == "IDENTICAL" and rc == 0, (rc, ext, s["evidence"])
    assert all(v == "INCONCLUSIVE" for v in verdicts[:-1])
    assert len(s["series"]["forced_kl"]) == steps[-1] and s["stats"]["effects"]["loss"]["n_steps"] == steps[-1]
    assert s["reference_len"] == 8 and s["candidate_len"] == 8 and s["t_star"] is None
    assert max(s["series"]["forced_kl"]) > 0  # not bitwise the reference's: the decision was a test, not a look
    # the power reached, at 0.95: effects below the margins (KL 1e-3, loss 0.02) would have been found
    power = ext["power_reached"]
    assert power["power"] == 0.95 and power["steps"] == steps[-1] and 0 < power["kl"] < 1e-3 and 0 < power["loss"] < 0.02
    # tokens: the reference regenerates from step 0 at each look, and the fault counts decode steps, so the
    # candidate is forced from step 0 too
    assert ext["tokens"] == 2 * sum(steps[1:])
    rule = case["summary"]["sequential"]
    assert rule["rule"] == "Bonferroni over the planned looks" and rule["looks_planned"] == 4
    # one sequence x (KL, loss, far step) x 4 planned looks (`decision.family`)
    assert rule["tests"] == 12 and abs(rule["alpha_per_look"] - 0.05 / 12) < 1e-12
    assert "sequential extension against J: Bonferroni over the planned looks" in out
    assert f"IDENTICAL after {len(steps)} look(s) at {', '.join(map(str, steps))} steps" in out

    # the same candidate without extension: the ledger's run judged again (no engine), on 8 steps
    plain = tmp_path / "plain.json"
    rc = climod.main(["compare", "A", "--json", str(plain)] + common)
    s = json.loads(plain.read_text())["cases"][0]["sequences"][0]
    assert rc == 4 and s["verdict"] == "INCONCLUSIVE", s["evidence"]
    assert "8 steps, fewer than the 16 an equivalence needs" in s["evidence"][0]
    assert "sequential" not in s["stats"]
