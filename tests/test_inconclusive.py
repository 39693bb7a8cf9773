"""INCONCLUSIVE: a pass must be shown, not assumed (issue 21).

The policy (exit codes, severity, --allow-inconclusive), the equivalence decision on
synthetic arrays whose answer is known analytically, and the committed H200 recordings
re-judged with and without their forced/scored files (labels from the suite's `expect`)."""

from __future__ import annotations

from click.testing import CliRunner
import numpy as np

from diffcheck.core.errors import EXIT_BISECT_SKIP, EXIT_ENGINE, EXIT_INCONCLUSIVE, EXIT_PASS, EXIT_REGRESSION
from diffcheck.core.types import Verdict, describe, exit_code, fails, passes

# ---------------------------------------------------------------- the policy


def test_inconclusive_is_not_a_pass_and_has_its_own_exit_code():
    v = Verdict.INCONCLUSIVE
    assert not passes(v) and not passes(v, strict=True) and fails(v)
    assert exit_code(v) == EXIT_INCONCLUSIVE == 4
    assert EXIT_INCONCLUSIVE not in (EXIT_PASS, EXIT_REGRESSION, EXIT_ENGINE, 2)
    assert exit_code(v, bisect_codes=True) == EXIT_BISECT_SKIP == 125  # git bisect's skip: not judged


def test_allow_inconclusive_accepts_it_and_nothing_else():
    v = Verdict.INCONCLUSIVE
    assert passes(v, allow_inconclusive=True) and not fails(v, allow_inconclusive=True)
    assert exit_code(v, allow_inconclusive=True) == EXIT_PASS
    assert exit_code(v, allow_inconclusive=True, bisect_codes=True) == EXIT_PASS
    for other in (Verdict.DEGRADED, Verdict.GIBBERISH):
        assert exit_code(other, allow_inconclusive=True) == EXIT_REGRESSION
    assert exit_code(Verdict.ERROR, allow_inconclusive=True) == EXIT_ENGINE
    assert exit_code(Verdict.WITHIN_BUDGET, strict=True, allow_inconclusive=True) == EXIT_REGRESSION


def test_severity_degraded_outranks_inconclusive_which_outranks_passes():
    assert Verdict.worst([Verdict.DEGRADED, Verdict.INCONCLUSIVE]) is Verdict.DEGRADED
    assert Verdict.worst([Verdict.INCONCLUSIVE, Verdict.DEGRADED]) is Verdict.DEGRADED
    for ok in (Verdict.IDENTICAL, Verdict.BENIGN_DRIFT, Verdict.WITHIN_BUDGET):
        assert Verdict.worst([ok, Verdict.INCONCLUSIVE, ok]) is Verdict.INCONCLUSIVE
    assert Verdict.worst([Verdict.INCONCLUSIVE, Verdict.GIBBERISH]) is Verdict.GIBBERISH


def test_describe_states_the_inconclusive_code():
    assert "4 on INCONCLUSIVE" in describe() and "125" in describe()
    assert "INCONCLUSIVE" in describe(allow_inconclusive=True).split(";")[0]


def test_the_commands_take_allow_inconclusive():
    from diffcheck.cli import cli

    for command in ("compare", "check", "matrix"):
        result = CliRunner().invoke(cli, [command, "--help"])
        assert "--allow-inconclusive" in result.output, (command, result.output)


# ---------------------------------------------------------------- the decision, on known arrays

import math  # noqa: E402
from statistics import NormalDist  # noqa: E402

import numpy as np  # noqa: E402

from diffcheck.judging.decision import BLOCK, Budget, decide, effect_test  # noqa: E402
from diffcheck.judging.floor import Floor  # noqa: E402

Z1 = 1.6448536269514722  # Φ⁻¹(0.95): alpha 0.05, one test


def test_zero_effect_on_three_steps_is_undecided_thin():
    e = effect_test("KL", np.zeros(3), margin=1e-3, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=1)
    assert (e.estimate, e.se, e.upper) == (0.0, 0.0, 0.0)  # the bound alone would call it inside...
    assert not e.beyond and not e.within and e.status == "undecided"  # ...but 3 steps show nothing
    assert "3 steps, fewer than the 16" in e.thin and "thin evidence" in e.text()


def test_an_effect_far_beyond_the_margin_is_beyond():
    x = np.full(64, 0.5) + np.tile([0.01, -0.01], 32)
    e = effect_test("loss", x, margin=0.02, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=1)
    assert e.beyond and not e.within and e.status == "beyond" and e.lower > 0.02


def test_many_steps_of_a_small_effect_are_within():
    # blocks of 16 whose means alternate 0.001 +- 0.0005: mean 0.001, se of 32 block means
    blocks = np.repeat(np.tile([0.0005, 0.0015], 16), BLOCK)
    e = effect_test("KL", blocks, margin=0.01, sigma_floor=0.0005, alpha=0.05, beta=0.2, tests=1)
    se = np.std(np.tile([0.0005, 0.0015], 16), ddof=1) / math.sqrt(32)
    assert math.isclose(e.se, se, rel_tol=1e-9) and math.isclose(e.upper, 0.001 + Z1 * se, rel_tol=1e-9)
    assert e.within and e.status == "within" and not e.thin


def test_a_bound_across_the_margin_is_undecided_not_a_pass():
    # mean 0.01 inside the margin 0.02, but block means spread 0.02: upper bound beyond it
    # (a floor of small spread: its detectable effect is well inside the margin, so this is not thin)
    blocks = np.repeat(np.tile([-0.01, 0.03], 4), BLOCK)
    e = effect_test("loss", blocks, margin=0.02, sigma_floor=0.001, alpha=0.05, beta=0.2, tests=1)
    assert e.lower < 0.02 < e.upper and not e.beyond and not e.within and not e.thin


def test_on_a_zero_floor_the_paths_own_spread_sets_the_power():
    # A floor of exactly 0 (the CPU lane) has no spread to plan with. Mean 0, block means ±0.02:
    # the upper bound (0.012) is inside the margin 0.02, but an effect of the margin's size would
    # go unseen more often than β allows, so this is thin, never a pass.
    blocks = np.repeat(np.tile([-0.02, 0.02], 4), BLOCK)
    e = effect_test("loss", blocks, margin=0.02, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=1)
    se = np.std(np.tile([-0.02, 0.02], 4), ddof=1) / math.sqrt(8)
    assert math.isclose(e.se, se, rel_tol=1e-9) and e.upper < 0.02
    assert math.isclose(e.mde, (Z1 + NormalDist().inv_cdf(0.8)) * math.sqrt(2) * se, rel_tol=1e-9)
    assert e.mde > 0.02 and e.thin.startswith("128 steps detect only") and not e.within
    # half the spread: the same bound rule, now with the power to show the margin
    e = effect_test("loss", blocks / 2, margin=0.02, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=1)
    assert e.within and not e.thin
    # a bitwise-identical path: no spread at all, plainly within
    e = effect_test("loss", np.zeros(32), margin=0.02, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=1)
    assert e.within and e.mde == 0.0


def test_power_too_low_for_the_margin_is_thin():
    # est 0 over 32 steps (2 blocks) but a floor so noisy that the margin is undetectable
    e = effect_test("KL", np.zeros(32), margin=1e-3, sigma_floor=0.01, alpha=0.05, beta=0.2, tests=1)
    assert e.mde > e.margin and "detect only" in e.thin and not e.within


def test_the_cpu_lane_floor_zero_forced_replay_bitwise_identical_is_within():
    kl, dlp = np.zeros(192), np.zeros(192)
    amount, loss, _, _ = decide(kl, dlp, floor=Floor(), factor=4.0, min_effect_kl=1e-3, min_effect_loss=0.02,
                                alpha=0.05, beta=0.2, tests=8)
    assert amount.within and loss.within and (amount.mde, loss.mde) == (0.0, 0.0)


def test_budget_effects_are_decided_the_same_way():
    kl = np.zeros(4)
    *_, b_amount, b_loss = decide(kl, kl, floor=Floor(), factor=4.0, min_effect_kl=1e-3, min_effect_loss=0.02,
                                  alpha=0.05, beta=0.2, tests=1, budget=Budget(kl=0.05, loss=0.1))
    assert not b_amount.within and b_amount.thin and not b_loss.within


# ---------------------------------------------------------------- sequences, synthetic

from test_classify import judge as judge_synthetic, make_seq  # noqa: E402


def test_a_flip_after_three_steps_without_forced_replay_is_inconclusive_with_it_a_pass():
    case, sv = judge_synthetic(make_seq(40, t_star=3), forced=False)
    assert sv.verdict is Verdict.INCONCLUSIVE and case.verdict is Verdict.INCONCLUSIVE
    assert sv.evidence[0].startswith("inconclusive: ") and "3 steps, fewer than the 16" in sv.evidence[0]
    assert "forced replay" in sv.evidence[0] and sv.stats["inconclusive"]
    assert exit_code(case.verdict) == EXIT_INCONCLUSIVE and not bool(case)
    _, sv = judge_synthetic(make_seq(40, t_star=3), forced=True)  # 60 forced steps decide it
    assert sv.verdict is Verdict.BENIGN_DRIFT


def _fluent_loop(seed: int):
    seq = make_seq(seed, n=80, t_star=20, flip="sample")
    loop = seq.cand_tokens[21:29].copy()
    seq.cand_tokens[21:] = np.resize(loop, 59)
    for t in range(21, 80):  # the loop's tokens are what both models expect there
        for rows in (seq.scored_rows, seq.cand_rows):
            top = int(rows[t].argmax())
            rows[t, [top, seq.cand_tokens[t]]] = rows[t, [seq.cand_tokens[t], top]]
    return seq


def test_generate_only_a_loop_after_a_benign_flip_is_inconclusive_with_forced_replay_benign():
    _, sv = judge_synthetic(_fluent_loop(18), forced=False, scored=False)
    assert sv.verdict is Verdict.INCONCLUSIVE, sv.evidence
    assert sv.evidence[0].startswith("inconclusive: generate only: the text after t* looks like garbage")
    assert any(e.startswith("repetition loop:") for e in sv.evidence)
    _, sv = judge_synthetic(_fluent_loop(18), forced=True, scored=False)  # the forced path stays in the floor
    assert sv.verdict is Verdict.BENIGN_DRIFT, sv.evidence


def test_generate_only_garbage_whose_steps_before_t_star_leave_the_floor_still_fails():
    seq = make_seq(19, t_star=20, garbage_from=21, drift=0.8)
    _, sv = judge_synthetic(seq, forced=False, scored=False)
    assert sv.verdict in (Verdict.GIBBERISH, Verdict.DEGRADED), sv.evidence


def test_a_short_identical_sequence_that_is_bitwise_the_reference_is_identical():
    # exactness is observed, not estimated: no effect to bound, whatever the length
    from factories import make_run  # the tests' shared run factory
    from diffcheck.judging.classify import compare_runs

    run = make_run([[5, 6, 7, 8]], k=4, suite="s", case_id="J", role="reference")
    cand = make_run([[5, 6, 7, 8]], k=4, suite="s", case_id="J", role="candidate")
    assert compare_runs(run, cand).verdict is Verdict.IDENTICAL


def test_a_generate_whose_logprobs_moved_is_never_called_exactly_the_reference():
    """Same tokens, other generate logprobs, a forced replay bitwise the golden's: the sequence is not
    judged by the "every step exactly the reference's" shortcut, and its evidence says the generate moved."""
    from factories import make_run
    from diffcheck.judging.classify import compare_runs

    tokens = [[5, 6, 7, 8] * 16]
    import dataclasses

    ref = make_run(tokens, k=4, suite="s", case_id="J", role="reference")
    same = make_run(tokens, k=4, suite="s", case_id="C", role="candidate")
    forced = make_run(tokens, k=4, suite="s", case_id="C", role="candidate", kind="forced")
    top = same.steps.topk_logprobs.copy()
    top[10:20, 0] -= 0.01  # a bf16-sized move of the sampled token's logprob at ten steps
    moved = dataclasses.replace(same, steps=dataclasses.replace(same.steps, topk_logprobs=top,
                                                               logprob=top[:, 0].copy()))
    assert not np.array_equal(ref.steps.logprob, moved.steps.logprob)
    sv = compare_runs(ref, moved, forced=forced).sequences[0]
    assert not any("exactly the reference's" in e for e in sv.evidence), sv.evidence
    assert any(e.startswith("generate: the golden's tokens with other logprobs") for e in sv.evidence), sv.evidence
    sv = compare_runs(ref, same, forced=forced).sequences[0]
    assert sv.verdict is Verdict.IDENTICAL and any("exactly the reference's" in e for e in sv.evidence)


# ---------------------------------------------------------------- the H200 recordings, re-judged offline

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from diffcheck import cases  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPU_SUITE_FILE = ROOT / "cases" / "gpu-h200.toml"
GPU_SUITE = cases.load_suite(GPU_SUITE_FILE)
GPU_GOLDENS = ROOT / "goldens" / GPU_SUITE.name
GPU_CANDIDATES = sorted(p.name.split(".")[0] for p in GPU_GOLDENS.glob("*.run.parquet"))


def _label(cid: str) -> str:
    """From the suite's `expect`, never from the tool: "clean" (must pass) or "faulted" (must fail)."""
    exp = GPU_SUITE.cases[cid].expect
    assert exp is not None, cid
    if exp.verdict is not None:
        return "clean" if passes(exp.verdict) else "faulted"
    assert Verdict.GIBBERISH in exp.not_verdict and Verdict.DEGRADED in exp.not_verdict, cid
    return "clean"


def _rejudge(cid: str, tmp_path: Path, *, generate_only: bool) -> tuple[int, list[str]]:
    """`diffcheck compare CID --suite gpu-h200 --run FILE` on a copy of the recordings; generate-only:
    the goldens and floor replicas and this run, no forced or scored file beside it, judged with no
    engine (``score_missing=False``: the command itself would score the run on this machine's CPU,
    tests/test_cross_hardware_scoring.py)."""
    from diffcheck.cli import main

    folder = tmp_path / ("alone" if generate_only else "all") / GPU_SUITE.name
    folder.mkdir(parents=True)
    for path in GPU_GOLDENS.glob("*.parquet"):
        if path.name.endswith(".run.parquet") and not path.name.startswith(f"{cid}."):
            continue
        if generate_only and (".forced-" in path.name or ".scored-" in path.name):
            continue
        shutil.copy(path, folder / path.name)
    if generate_only:
        from diffcheck.workflows import compare as comparemod

        comparison = comparemod.compare(GPU_SUITE, cid, root=folder.parent, run_file=folder / f"{cid}.run.parquet",
                                        echo=lambda _: None, score_missing=False)
        assert not comparison.scored
        return exit_code(comparison.verdict), [s.verdict.name for v in comparison.verdicts for s in v.sequences]
    report = tmp_path / f"{cid}-{generate_only}.json"
    code = main(["compare", cid, "--suite", str(GPU_SUITE_FILE), "--goldens", str(folder.parent),
                 "--run", str(folder / f"{cid}.run.parquet"), "--json", str(report)])
    data = json.loads(report.read_text())
    return code, [s["verdict"] for c in data["cases"] for s in c["sequences"]]


def test_the_recordings_hold_clean_and_faulted_candidates():
    labels = {cid: _label(cid) for cid in GPU_CANDIDATES}
    assert "clean" in labels.values() and "faulted" in labels.values(), labels


@pytest.mark.parametrize("cid", GPU_CANDIDATES)
def test_with_all_signals_clean_sequences_pass_and_faulted_ones_fail(cid, tmp_path):
    code, verdicts = _rejudge(cid, tmp_path, generate_only=False)
    assert len(verdicts) == 4 * len(GPU_SUITE.cases[cid].references)
    if _label(cid) == "clean":
        assert all(passes(Verdict[v]) for v in verdicts), verdicts
        assert code == EXIT_PASS
    else:
        assert all(Verdict[v] in (Verdict.DEGRADED, Verdict.GIBBERISH) for v in verdicts), verdicts
        assert code == EXIT_REGRESSION


@pytest.mark.parametrize("cid", GPU_CANDIDATES)
def test_generate_only_never_calls_a_clean_sequence_garbage_and_faulted_graphs_still_fail(cid, tmp_path):
    code, verdicts = _rejudge(cid, tmp_path, generate_only=True)
    case = GPU_SUITE.cases[cid]
    if _label(cid) == "clean":
        # a pass where the steps before t* show one, INCONCLUSIVE where they are too few: never a failure
        assert all(passes(Verdict[v]) or v == "INCONCLUSIVE" for v in verdicts), verdicts
        assert code in (EXIT_PASS, EXIT_INCONCLUSIVE)
    elif (case.engine.cudagraph_mode or "").startswith("FULL"):
        assert all(Verdict[v] in (Verdict.DEGRADED, Verdict.GIBBERISH) for v in verdicts), verdicts
        assert code == EXIT_REGRESSION


# -- floors never hold the factor under test -----------------------------------------------------------


def _engine(**changes) -> dict:
    base = {"attention_backend": "CPU_ATTN", "max_num_seqs": 256, "tensor_parallel_size": 1, "cudagraph_mode": "NONE"}
    return {"requested": {**base, **changes}, "effective": {**base, **changes}}


def test_a_replica_that_varies_what_the_candidate_changes_is_left_out_of_its_floor(tmp_path):
    """Replicas (stored as calibrate stores them) that vary the batch shape, the TP size and the
    attention backend; candidates that change one of those, an environment variable, or nothing."""
    from factories import make_run

    from diffcheck import workspace

    tokens = [[5, 6, 7, 8] * 8, [1, 2, 3, 4] * 8]
    golden = make_run(tokens, case_id="J", suite="t", engine=_engine())
    workspace.store_golden(tmp_path, cases.load_suite(write_tiny(tmp_path)).cases["J"], golden)
    varied = {"restart": {}, "batch3": {"max_num_seqs": 3}, "tp2": {"tensor_parallel_size": 2},
              "flash": {"attention_backend": "FLASH_ATTN"}}
    for name, change in varied.items():
        run = make_run(tokens, case_id="J", suite="t", kind="forced", seed=len(name), engine=_engine(**change))
        workspace.store_replica(tmp_path, "t", "J", name, run, golden, perturbation=change, description=name)

    def used(**meta) -> tuple[list[str], list[str]]:
        floor, notes = workspace.load_floor(tmp_path, "t", "J", golden,
                                            candidate=make_run(tokens, case_id="C", suite="t", role="candidate", **meta))
        return sorted(floor.replicas), notes

    assert used(engine=_engine())[0] == ["batch3", "flash", "restart", "tp2"]
    assert used(engine=_engine(max_num_seqs=1))[0] == ["flash", "restart", "tp2"]
    replicas, notes = used(engine=_engine(tensor_parallel_size=2))
    assert replicas == ["batch3", "flash", "restart"]
    assert notes == ["floor replica J.floor-tp2.parquet varies tensor_parallel_size, which C changes: left out "
                     "(a floor never holds the factor under test)"]
    assert used(engine=_engine(attention_backend="FLASH_ATTN", cudagraph_mode="FULL"))[0] == ["batch3", "restart", "tp2"]
    assert used(engine=_engine(), env={"DIFFCHECK_FAULT": "lost-head"})[0] == ["batch3", "flash", "restart", "tp2"]
    assert sorted(workspace.load_floor(tmp_path, "t", "J", golden)[0].replicas) == ["batch3", "flash", "restart", "tp2"]


def write_tiny(folder: Path) -> Path:
    from factories import write_suite

    return write_suite(folder / "cases", {"J": {"role": "reference", "description": "reference"}}, name="t")


def test_the_recorded_flash_attn_candidate_is_judged_without_the_flash_attn_replica(tmp_path, capsys):
    """On the H200 recordings: OF (FLASH_ATTN) against J (TRITON_ATTN), whose floor holds a
    FLASH_ATTN replica. That replica is left out and said so; OF still passes on the rest."""
    code, verdicts = _rejudge("OF", tmp_path, generate_only=False)
    assert code == EXIT_PASS and all(passes(Verdict[v]) for v in verdicts), verdicts
    data = json.loads((tmp_path / "OF-False.json").read_text())
    used = {c["reference_id"]: c["summary"]["floor"]["replicas"] for c in data["cases"]}
    assert "flash-attn" not in used["J"] and used["J"] and used["F"]
    shown = capsys.readouterr()
    assert "floor replica J.floor-flash-attn.parquet varies attention_backend" in shown.out + shown.err


def test_a_scoring_engine_that_fails_is_an_error_never_a_verdict_without_it(tmp_path, monkeypatch):
    from factories import make_run, write_suite

    from diffcheck import workspace
    from diffcheck.core.errors import EngineError
    from diffcheck.workflows import compare as cmp

    suite = cases.load_suite(write_suite(tmp_path / "cases", {
        "J": {"role": "reference", "description": "reference"},
        "C": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "candidate"}}, name="t"))
    root = tmp_path / "goldens"
    golden = make_run([[5, 6, 7, 8] * 8], case_id="J", suite="t")
    workspace.store_golden(root, suite.cases["J"], golden)
    cand = make_run([[5, 6, 7, 8] * 4 + [9] * 16], case_id="C", suite="t", role="candidate", seed=3)

    def scoring_dies(*args, **kwargs):
        raise EngineError("EngineCore died (SIGKILL)")

    monkeypatch.setattr(cmp, "run_candidate", lambda *a, **k: (cand, {}, []))
    monkeypatch.setattr(cmp, "score_candidate", scoring_dies)
    lines = []
    comparison = cmp.compare(suite, "C", root=root, echo=lines.append)
    assert comparison.verdict is Verdict.ERROR
    (v,) = comparison.verdicts
    assert "scoring with reference J failed: EngineCore died (SIGKILL)" in (v.error or "")
    assert not any("judg" in line and "without" in line for line in lines), lines
