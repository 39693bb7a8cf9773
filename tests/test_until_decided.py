"""`compare --until-decided` (issue 21): the sequential extension's rules on synthetic numbers.

No engine: the plan of looks, the alpha rule (Bonferroni over the planned looks, checked by
simulation against paths whose true effect sits exactly on the margin), the loop with a fake
extension whose answers are known, the golden made longer by a regenerated run, the power
reached, the judge reading a longer forced path, and the flags' one-line errors."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from diffcheck.core.errors import DataError
from diffcheck.core.types import Verdict
from diffcheck.judging import sequential as seq
from diffcheck.judging.decision import decide, effect_test, family
from diffcheck.judging.floor import Floor

from factories import make_run

# ---------------------------------------------------------------- the plan and the alpha rule


def test_looks_double_from_the_goldens_length_up_to_the_budget():
    assert seq.plan_looks(8, 64) == (8, 16, 32, 64)
    assert seq.plan_looks(8, 50) == (8, 16, 32, 50)  # the last look is the budget itself
    assert seq.plan_looks(24, 24) == (24,) and seq.plan_looks(100, 64) == (100,)  # nothing to extend
    assert seq.plan_looks(0, 64) == (0,)  # an empty sequence has no path to extend
    assert seq.planned_looks([(8, 16, 32, 64), (24, 48, 64), (64,)]) == 4
    assert seq.planned_looks([]) == 1


def test_each_look_is_judged_at_alpha_over_the_comparisons_tests_times_looks():
    # 8 sequences x (KL, loss, far step) x 4 planned looks
    assert family(8, looks=4).m == 96 and family(0, looks=0).m == 3
    assert 0.05 / family(8, looks=4).m == pytest.approx(0.05 / 96)


def _false_decisions(tests: int, looks: tuple[int, ...], n_paths: int, seed: int) -> tuple[float, float]:
    """How often a path whose true mean sits exactly on the margin is called beyond it, and how
    often called within it, at any of `looks` (both are wrong: the truth is the margin itself)."""
    rng = np.random.default_rng(seed)
    margin, sd = 0.02, 0.05
    beyond = within = 0
    for _ in range(n_paths):
        x = rng.normal(margin, sd, looks[-1])
        y = rng.normal(margin, sd, looks[-1])
        common = dict(margin=margin, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=tests)
        beyond += any(effect_test("loss", x[:n], **common).beyond for n in looks)
        within += any(effect_test("loss", y[:n], **common).within for n in looks)
    return beyond / n_paths, within / n_paths


def test_bonferroni_over_the_looks_keeps_the_false_decision_rate_at_alpha():
    # Four looks of one sequence, 64 to 512 batch-means blocks each. Uncorrected, looking four
    # times nearly triples the false decisions (measured 0.14-0.15 either way); at alpha / 4
    # per look they stay at most alpha. 3000 paths: a rate of 0.05 is measured within ±0.012
    # (3 standard errors).
    looks = seq.plan_looks(1024, 8192)
    assert looks == (1024, 2048, 4096, 8192)
    naive = _false_decisions(1, looks, 3000, seed=1)
    corrected = _false_decisions(len(looks), looks, 3000, seed=2)  # one test of one sequence, over its looks
    assert min(naive) > 0.09, naive
    assert max(corrected) <= 0.062, corrected


# ---------------------------------------------------------------- the loop, with a fake extension

FLOOR = Floor()  # unmeasured: margins are the minimum effect of interest (KL 1e-3, loss 0.02), like the CPU lane's floor of 0


class FakeExtension:
    """Paths drawn once per sequence at their full length; a look of n steps judges their first n
    steps with `decide` at the corrected level. `ends`: a sequence whose reference stops there."""

    def __init__(self, effects: dict[int, float], *, tests: int, longest: int = 4096, ends: dict[int, int] = {}):
        rng = np.random.default_rng(7)
        self.kl = {i: np.abs(rng.normal(1e-5, 1e-5, longest)) for i in effects}
        self.d = {i: -rng.normal(e, 0.05, longest) for i, e in effects.items()}  # loss = -Δ has mean e
        self.tests, self.ends, self.calls = tests, ends, []

    def verdict(self, i: int, n: int) -> Verdict:
        amount, loss, _, _ = decide(self.kl[i][:n], self.d[i][:n], floor=FLOOR, factor=4, min_effect_kl=1e-3,
                                    min_effect_loss=0.02, alpha=0.05, beta=0.2, tests=self.tests)
        if amount.beyond or loss.beyond:
            return Verdict.DEGRADED
        return Verdict.BENIGN_DRIFT if amount.within and loss.within else Verdict.INCONCLUSIVE

    def __call__(self, targets: dict[int, int]) -> dict[int, seq.Extended]:
        self.calls.append(dict(targets))
        out = {}
        for i, n in targets.items():
            end = self.ends.get(i)
            reached = min(n, end) if end is not None else n
            ended = f"the reference ended at step {end} (stop)" if end is not None and end <= n else ""
            out[i] = seq.Extended(steps=reached, verdict=self.verdict(i, reached), tokens=2 * reached, ended=ended)
        return out


def test_the_loop_extends_until_decided_and_never_past_a_decision():
    schedule = seq.plan_looks(16, 4096)  # 9 looks
    tests = family(3, looks=len(schedule)).m
    fake = FakeExtension({0: 0.0, 1: 0.06, 2: 0.019}, tests=tests)
    tracks = [seq.Track(i, schedule, [seq.Look(16, fake.verdict(i, 16))]) for i in (0, 1, 2)]
    assert all(t.verdict is Verdict.INCONCLUSIVE for t in tracks)  # 16 steps of these paths decide nothing
    seen = []
    seq.run_looks(tracks, fake, on_look=lambda k, targets: seen.append((k, dict(targets))))
    clean, broken, edge = tracks
    # a loss of 0.06 nats per step is shown beyond the margin 0.02 at look 3 (64 steps); no look is taken after it
    assert broken.verdict is Verdict.DEGRADED and len(broken.looks) == 3 and broken.stopped == f"decided at look {len(broken.looks)}"
    assert all(broken.index not in call for call in fake.calls[len(broken.looks) - 1:])
    # no effect: shown within once the path can show the margin's size
    assert clean.verdict is Verdict.BENIGN_DRIFT and clean.steps < 4096
    # an effect just inside the margin (0.019 vs 0.02) is never shown either way: it stays
    # INCONCLUSIVE at the budget, never a pass
    assert edge.verdict is Verdict.INCONCLUSIVE and edge.steps == 4096
    assert edge.stopped == "budget of 4096 steps reached" and len(edge.looks) == len(schedule)
    # look k asks every undecided sequence for its k-th planned length, doubling
    assert [k for k, _ in seen] == list(range(2, len(schedule) + 1))
    assert all(set(targets.values()) == {schedule[k - 1]} for k, targets in seen)
    assert [lk.steps for lk in edge.looks] == list(schedule)
    assert edge.tokens == 2 * sum(schedule[1:])  # what each extension said it spent


def test_a_reference_that_stops_ends_its_sequences_looks():
    schedule = seq.plan_looks(16, 1024)
    fake = FakeExtension({0: 0.019}, tests=family(1, looks=len(schedule)).m, ends={0: 40})
    track = seq.Track(0, schedule, [seq.Look(16, Verdict.INCONCLUSIVE)])
    seq.run_looks([track], fake)
    assert [lk.steps for lk in track.looks] == [16, 32, 40]  # the third look reaches the reference's end
    assert track.verdict is Verdict.INCONCLUSIVE and track.stopped == "the reference ended at step 40 (stop)"
    assert len(fake.calls) == 2


def test_a_sequence_without_planned_looks_is_not_extended():
    track = seq.Track(0, (24,), [seq.Look(24, Verdict.INCONCLUSIVE)])
    calls = []
    seq.run_looks([track], lambda targets: calls.append(targets) or {})
    assert calls == [] and track.verdict is Verdict.INCONCLUSIVE and track.stopped == "budget of 24 steps reached"


# ---------------------------------------------------------------- the power reached


def test_the_power_reached_is_the_minimum_detectable_effect_at_beta_005():
    class Tol:
        floor_factor, min_effect_kl, min_effect_loss, alpha, min_steps = 4, 1e-3, 0.02, 0.05, 16

    # a measured floor of known spread: the planned formula, (z + z_0.95)·σ·√(2/n_blocks)
    floor = Floor(n_steps=4096, kl_block_sd=1e-4, loss_block_sd=0.01)
    z = NormalDist().inv_cdf(1 - 0.05 / 8)
    for n in (64, 256):
        p = seq.power_reached(np.zeros(n), np.zeros(n), floor=floor, tol=Tol, tests=8)
        want = (z + NormalDist().inv_cdf(0.95)) * math.sqrt(2 / (n / 16))
        assert p["power"] == 0.95 and p["steps"] == n
        assert p["kl"] == pytest.approx(want * 1e-4) and p["loss"] == pytest.approx(want * 0.01)
    # four times the steps, half the effect
    p64 = seq.power_reached(np.zeros(64), np.zeros(64), floor=floor, tol=Tol, tests=8)
    p256 = seq.power_reached(np.zeros(256), np.zeros(256), floor=floor, tol=Tol, tests=8)
    assert p256["loss"] == pytest.approx(p64["loss"] / 2)
    # more power asked for than the verdict's 0.8: a larger detectable effect on the same path
    x = np.random.default_rng(3).normal(0, 0.05, 256)
    at_08 = effect_test("loss", x, margin=0.02, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=8).mde
    assert seq.power_reached(np.zeros(256), -x, floor=Floor(), tol=Tol, tests=8)["loss"] > at_08


# ---------------------------------------------------------------- the golden made longer


def _runs():
    golden = make_run([[5, 6, 7], [8, 9], [1, 2, 3, 4]], k=4, finish_reasons=["length", "length", "stop"],
                      role="reference", case_id="J")
    again = make_run([[5, 6, 7, 10, 11, 12], [8, 9, 13], [1, 2, 3, 4]], k=4,
                     finish_reasons=["length", "stop", "stop"], role="reference", case_id="J")
    return golden, again


def test_the_regenerated_reference_must_start_with_the_golden():
    golden, again = _runs()
    assert seq.first_departure(golden, again) is None
    other = make_run([[5, 6, 99, 10], [8, 9, 13], [1, 2, 3, 4]], k=4)
    assert seq.first_departure(golden, other) == "seq 0 step 2: token 99, the golden's 7"
    short = make_run([[5, 6], [8, 9, 13], [1, 2, 3, 4]], k=4)
    assert seq.first_departure(golden, short).startswith("seq 0 ended at step 2")


def test_extend_run_keeps_the_goldens_rows_and_adds_the_continuation():
    golden, again = _runs()
    longer, reached = seq.extend_run(golden, again, {0: 5, 1: 8}, decode=lambda ids: " ".join(map(str, ids)))
    assert [s.n_tokens for s in longer.sequences] == [5, 3, 4]
    assert longer.sequence(0).token_id.tolist() == [5, 6, 7, 10, 11]
    assert reached == {0: (5, ""), 1: (3, "the reference ended at step 3 (stop)")}
    assert longer.sequences[0].finish_reason == "length" and longer.sequences[0].text == "5 6 7 10 11"
    # the golden's own rows stay the golden's (not the regeneration's), the new ones are the regeneration's
    g0, a0, l0 = golden.sequence(0), again.sequence(0), longer.sequence(0)
    assert np.array_equal(l0.topk_logprobs[:3], g0.topk_logprobs) and np.array_equal(l0.topk_ids[3:], a0.topk_ids[3:5])
    assert longer.sequence(2).token_id.tolist() == [1, 2, 3, 4] and longer.meta == golden.meta
    assert longer.steps.step.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]


def test_the_judge_reads_the_longer_forced_path_and_keeps_the_candidates_alignment():
    from diffcheck.judging.classify import compare_runs

    tokens = [list(range(100, 108)), list(range(200, 208))]
    longer_tokens = [t + list(range(300, 340)) for t in tokens]
    golden = make_run(tokens, k=4, role="reference", case_id="J")
    longer = make_run(longer_tokens, k=4, role="reference", case_id="J")
    candidate = make_run(tokens, k=4, role="candidate", case_id="A")
    # the candidate's forced rows: the reference's, the loss on its own token 0.001 nats per step
    forced = make_run(longer_tokens, k=4, kind="forced", role="candidate", case_id="A",
                      logprobs=[np.full(48, -0.101)] * 2)
    v = compare_runs(golden, candidate, forced=forced, forced_reference=longer, candidate_id="A", reference_id="J")
    for s in v.sequences:
        assert s.t_star is None and s.reference_len == 8  # the candidate's own text is judged as before
        assert s.stats["effects"]["path"] == "forced replay" and s.stats["effects"]["loss"]["n_steps"] == 48
        assert s.stats["forced_n"] == 48 and len(s.series["forced_kl"]) == 48
    short = compare_runs(golden, candidate, forced=forced, candidate_id="A", reference_id="J")
    assert all(s.stats["effects"]["loss"]["n_steps"] == 8 for s in short.sequences)  # without it: 8 steps
    assert short.verdict is Verdict.INCONCLUSIVE
    bad = make_run([[1] + t[1:] for t in longer_tokens], k=4, role="reference", case_id="J")
    with pytest.raises(DataError, match="extended reference"):
        compare_runs(golden, candidate, forced=make_run([[1] + t[1:] for t in longer_tokens], k=4, kind="forced"),
                     forced_reference=bad)


# ---------------------------------------------------------------- the flags


@pytest.mark.parametrize("args, says", [
    (["--max-tokens", "64"], "--max-tokens is valid only with --until-decided"),
    (["--until-decided", "--max-tokens", "many"], "--max-tokens 'many' is not valid: a whole number"),
    (["--until-decided", "--max-tokens", "0"], "--max-tokens '0' is not valid"),
    (["--until-decided", "--run", "{run}"], "--until-decided needs the engines"),
])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, args, says):
    from diffcheck import cli as climod

    run = tmp_path / "A.run.parquet"
    run.write_bytes(b"")
    rc = climod.main(["compare", "A"] + [a.format(run=run) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("diffcheck: error: ") and says in err[0], err


def test_the_help_states_the_default_budget():
    from click.testing import CliRunner

    from diffcheck.cli import cli

    out = CliRunner().invoke(cli, ["compare", "--help"]).output
    assert "--until-decided" in out and f"(default {seq.DEFAULT_MAX_TOKENS})" in " ".join(out.split())
