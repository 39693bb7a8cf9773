"""The seed's text metrics on hand-made strings: prose, Chinese, digit/date soup, edge cases."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffcheck.judging import quality
from diffcheck.judging.quality import (
    digit_ratio,
    max_digit_run,
    output_hash,
    repeated_num_runs,
    steady_decode_tps,
    text_metrics,
    weird_runs,
)

ENGLISH = (
    "Long-context inference needs regression tests that compare every generated token against a "
    "reference run. In 2024 the team found that graph replay could read stale metadata, so the test "
    "suite now records goldens and checks the first divergence step."
)
CHINESE = "本文讨论如何在推理引擎中实现稳定的长上下文质量回归测试，包括背景、问题定义、指标、测试数据与验收标准。"
SOUP = "2024-01-01 2024-01-01 12:00 3.14159 000000"


def test_english_prose_is_clean():
    m = text_metrics(ENGLISH, 48)
    assert m["weird_runs"] == 0
    assert m["repeated_num_runs"] == 0
    assert m["max_digit_run"] == 4  # the year
    assert 0 < m["digit_ratio"] < 0.03
    assert m["token_count"] == 48


def test_chinese_prose_has_no_digits_and_counts_cjk_as_characters():
    assert digit_ratio(CHINESE) == 0.0
    assert weird_runs(CHINESE) == 0 and max_digit_run(CHINESE) == 0
    # 2 digits among 11 non-whitespace characters: CJK characters count in the denominator.
    assert digit_ratio("测试编号为42号的样本") == pytest.approx(2 / 11)


def test_full_width_digits_count_and_cjk_numerals_do_not():
    assert digit_ratio("１２３abc") == pytest.approx(0.5)
    assert max_digit_run("编号１２３４５") == 5
    assert digit_ratio("三十二") == 0.0  # CJK numerals are letters (Lo), not decimal digits
    assert digit_ratio("x²") == 0.0  # a superscript is not a decimal digit


def test_digit_soup_is_flagged():
    m = text_metrics(SOUP)
    assert m["weird_runs"] == 1
    assert m["max_digit_run"] == 6
    assert m["digit_ratio"] == pytest.approx(32 / 38)
    assert m["token_count"] is None


def test_chinese_date_soup_is_flagged():
    soup = "２０２４年０１月０１日２０２４年０１月０１日２０２４年"
    assert weird_runs(soup) == 1
    assert weird_runs("会议定于2024年1月1日举行。") == 0  # one ordinary date


def test_weird_runs_counts_separate_bursts_and_ignores_ordinary_numbers():
    burst = "12:00:00.123 2024-01-01 55 66"
    assert weird_runs(f"First {burst} then words again {burst} end.") == 2
    assert weird_runs("The release was at 2024-01-01 12:00:00 UTC.") == 0  # 6 groups, 14 digits
    assert weird_runs("Count 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 sheep.") == 0  # only 11 digits
    assert weird_runs("Years 1990, 1995, 2000, 2005 were good.") == 0  # only 4 groups


def test_weird_run_thresholds_are_the_documented_ones():
    groups = ["1234"] * (quality.WEIRD_MIN_GROUPS - 1)
    assert weird_runs(" ".join(groups)) == 0
    assert weird_runs(" ".join(groups + ["1234"])) == 1
    # Enough groups but too few digits.
    assert weird_runs(" ".join(["1"] * 15)) == 0


def test_repeated_num_runs():
    assert repeated_num_runs("2024 2024 2024") == 1
    assert repeated_num_runs("1.1.1.1.1") == 1
    assert repeated_num_runs("0, 0, 0 and 7, 7, 7") == 2
    assert repeated_num_runs("2024-01-01") == 0  # 01 twice only
    assert repeated_num_runs("version 1.1 and 1.1") == 0  # letters break adjacency
    assert repeated_num_runs("5 apples 5 pears 5 plums") == 0
    assert repeated_num_runs("7    7    7") == 0  # gaps longer than 3 characters
    assert repeated_num_runs("２０２４ 2024 ２０２４") == 1  # full-width equals ASCII value
    assert repeated_num_runs("01 1 01") == 0  # leading zeros matter


def test_max_digit_run_separators_break_runs():
    assert max_digit_run("3.14159") == 5
    assert max_digit_run("1,000,000") == 3
    assert max_digit_run("2024-01-01") == 4
    assert max_digit_run("abc") == 0


def test_output_hash_is_sha256_of_utf8():
    assert output_hash(CHINESE) == hashlib.sha256(CHINESE.encode("utf-8")).hexdigest()
    assert output_hash("a") != output_hash("a ")
    assert len(output_hash("")) == 64


@pytest.mark.parametrize("text", ["", "   \n\t", "\u3000"])
def test_empty_and_whitespace_text(text):
    m = text_metrics(text, 0)
    assert m["digit_ratio"] == 0.0
    assert m["weird_runs"] == m["repeated_num_runs"] == m["max_digit_run"] == 0
    assert m["token_count"] == 0


def test_text_metrics_keys():
    assert set(text_metrics("x")) == {"digit_ratio", "weird_runs", "repeated_num_runs", "max_digit_run",
                                       "symbol_ratio", "output_hash", "token_count"}


def test_steady_decode_tps_excludes_first_token():
    # First token after 2 s of prefill, then one token every 0.1 s.
    times = [2.0 + 0.1 * i for i in range(11)]
    assert steady_decode_tps(times) == pytest.approx(10.0)
    assert steady_decode_tps(times, skip_first=3) == pytest.approx(10.0)
    assert steady_decode_tps(n_tokens=11, seconds=1.0) == pytest.approx(10.0)
    assert steady_decode_tps([1.0]) is None
    assert steady_decode_tps(n_tokens=1, seconds=5.0) is None
    assert steady_decode_tps([1.0, 1.0]) is None  # no elapsed time
    with pytest.raises(ValueError):
        steady_decode_tps()
    with pytest.raises(ValueError):
        steady_decode_tps(times, skip_first=0)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_metric_invariants(text):
    m = text_metrics(text)
    assert 0.0 <= m["digit_ratio"] <= 1.0
    assert m["max_digit_run"] <= len(text)
    assert m["weird_runs"] >= 0 and m["repeated_num_runs"] >= 0
    if not any(c.isdecimal() for c in text):
        assert m["digit_ratio"] == 0 and m["max_digit_run"] == 0 and m["weird_runs"] == 0
