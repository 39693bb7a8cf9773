"""The seed's text-quality metrics, defined precisely.

Pure functions of a text (and counts/times); no engine, no numpy needed. The
seed log reported, per run, digit_ratio, weird_runs, repeated_num_runs,
max_digit_run, an output hash, the token count and the steady decode
tokens/s, without defining them; the definitions below are ours and each
docstring is the definition the README quotes.

Characters, for every metric:

- a *digit* is a Unicode decimal digit (category Nd, ``str.isdecimal``):
  ASCII 0-9, full-width ０-９, Arabic-Indic digits and the like. CJK numerals
  (一, 二, 三) and superscripts (²) are not digits;
- *whitespace* is ``str.isspace``; every other character, CJK ideographs
  included, is a non-whitespace character;
- a *digit group* is a maximal run of consecutive digits; its value is its
  digits read as ASCII ("２０２４" and "2024" are the same value; leading
  zeros count: "01" differs from "1");
- a *soup character* is any character that is not alphanumeric
  (``str.isalnum``), or a digit, or one of the CJK date/time units
  年月日时時分秒号號: digits, whitespace, punctuation, symbols. Letters of any
  script (CJK ideographs included) and non-decimal numerals (², 三) are not.
"""

from __future__ import annotations

import dataclasses

import hashlib
import re
import unicodedata
from typing import Any, Sequence

# Thresholds of weird_runs (see its docstring for the reasons).
WEIRD_MIN_DIGITS = 16
WEIRD_MIN_GROUPS = 6
# Thresholds of repeated_num_runs.
REPEAT_MIN_COUNT = 3
REPEAT_MAX_GAP = 3

_DATE_UNITS = frozenset("年月日时時分秒号號")
_DIGIT = re.compile(r"\d")  # exactly str.isdecimal (Unicode Nd)
_GROUP = re.compile(r"\d+")  # \d in a str pattern is exactly Unicode Nd, i.e. str.isdecimal


# \W is "not str.isalnum() and not '_'", so this is exactly the soup characters.
# A weird run needs >= WEIRD_MIN_DIGITS digits, so shorter stretches are never scanned.
_SOUP = re.compile(r"[\W\d_" + "".join(sorted(_DATE_UNITS)) + r"]{%d,}" % WEIRD_MIN_DIGITS)


def _ascii_digits(group: str) -> str:
    if group.isascii():
        return group
    return "".join(str(unicodedata.decimal(c)) for c in group)


def digit_ratio(text: str) -> float:
    """Digits / non-whitespace characters; 0.0 for a text with no non-whitespace character.

    Clean prose scores near 0 (the seed's clean runs: 0.004-0.02; Chinese prose
    with no digits: exactly 0); digit/date soup scores 0.1-0.6.
    """
    nonspace = len(text) - sum(map(str.isspace, text))
    if nonspace == 0:
        return 0.0
    return len(_DIGIT.findall(text)) / nonspace


def max_digit_run(text: str) -> int:
    """Length of the longest digit group: consecutive digits only.

    Any other character ends a run, separators included, so "2024-01-01" -> 4,
    "3.14159" -> 5, "1,000,000" -> 3, "000000" -> 6. Clean text rarely exceeds
    4 (years); long runs are a symptom of number soup.
    """
    return max((len(m.group()) for m in _GROUP.finditer(text)), default=0)


def repeated_num_runs(text: str) -> int:
    """Number of runs of one number repeated back to back.

    Walk the digit groups in order. Two neighbouring groups are *adjacent* when
    the text between them is 1 to `REPEAT_MAX_GAP` (3) characters long and
    contains no alphanumeric character (only whitespace, punctuation,
    symbols; no letter, no CJK character). A repeated number run is a maximal chain of adjacent groups
    with the same value, at least `REPEAT_MIN_COUNT` (3) long; the result counts
    such chains. "2024 2024 2024" -> 1, "1.1.1.1.1" -> 1, "0, 0, 0 and 7, 7, 7" -> 2,
    "2024-01-01" -> 0 (01 appears only twice), "version 1.1" -> 0.
    """
    runs = 0
    chain = 0
    prev_value, prev_end = None, None
    for m in _GROUP.finditer(text):
        value = _ascii_digits(m.group())
        gap = text[prev_end:m.start()] if prev_end is not None else None
        adjacent = gap is not None and 0 < len(gap) <= REPEAT_MAX_GAP and not any(map(str.isalnum, gap))
        if adjacent and value == prev_value:
            chain += 1
        else:
            runs += chain >= REPEAT_MIN_COUNT
            chain = 1
        prev_value, prev_end = value, m.end()
    runs += chain >= REPEAT_MIN_COUNT
    return runs


def soup_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each weird run counted by `weird_runs`, in text order."""
    spans = []
    for m in _SOUP.finditer(text):
        groups = _GROUP.findall(m.group())
        if len(groups) >= WEIRD_MIN_GROUPS and sum(map(len, groups)) >= WEIRD_MIN_DIGITS:
            spans.append(m.span())
    return spans


def weird_runs(text: str) -> int:
    """Number of stretches of digit/date soup.

    A stretch is a maximal substring made only of soup characters (digits,
    whitespace, punctuation, symbols, CJK date/time units such as 年月日; any
    letter or other CJK character ends it). It is weird when it holds at least `WEIRD_MIN_GROUPS` (6)
    digit groups and at least `WEIRD_MIN_DIGITS` (16) digits.
    "2024-01-01 2024-01-01 12:00 3.14159 000000" is one weird run (11 groups, 32
    digits). The thresholds keep ordinary numbers out: a timestamp
    "2024-01-01 12:00:00" (6 groups, 14 digits), a phone number, a list of
    four years or "1, 2, ..., 10" (11 digits) are not weird. A long soup with no
    letter in it counts once, so a run that degrades into soup for good scores
    1 while sporadic bursts score one each (the seed saw 1-6 on bad runs, 0 on
    clean ones). Known false positive: a long table of bare numbers.
    """
    return len(soup_spans(text))


def symbol_ratio(text: str) -> float:
    """Punctuation and symbols / non-whitespace characters; 0.0 for a text with none.

    Not one of the seed's metrics: a second kind of soup seen on real CUDA-graph
    corruption ("A,,,,-.- of-,,,-- the and,-,"). A *symbol* is a non-whitespace
    character that is neither alphanumeric (``str.isalnum``) nor a digit. English
    prose scores ~0.03-0.08, markdown and code more; judge it against the
    reference's own text, never alone.
    """
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(1 for c in chars if not c.isalnum()) / len(chars)


def repeated_ngrams(tokens: Sequence[int], n: int = 4) -> list[bool]:
    """Per token position i: the n-gram ending at i occurred earlier in `tokens`.

    A repetition loop ("a bicycle is a bicycle is a bicycle") makes this true at
    nearly every position once the loop has started; prose repeats an n-gram here
    and there.
    """
    seen: set[tuple[int, ...]] = set()
    out = [False] * len(tokens)
    for i in range(n - 1, len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1])
        out[i] = gram in seen
        seen.add(gram)
    return out


def output_hash(text: str) -> str:
    """sha256 hex of the UTF-8 text (the seed's output hash: equal texts, equal hashes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def steady_decode_tps(step_times: Sequence[float] | None = None, *, n_tokens: int | None = None,
                      seconds: float | None = None, skip_first: int = 1) -> float | None:
    """Steady decode tokens/s: the rate after the first `skip_first` tokens.

    The first token's latency is prefill (prompt processing) plus one decode,
    and warm-up (graph capture, compilation) lands there too, so it is not
    decode speed. Two ways to give the times:

    - ``step_times``: the emission time (seconds, monotonic clock) of each
      generated token; the rate is ``(n - skip_first) / (t[n-1] - t[skip_first-1])``;
    - ``n_tokens`` and ``seconds``: the token count and the wall time from the
      emission of token ``skip_first - 1`` to the last one; the rate is
      ``(n_tokens - skip_first) / seconds``.

    None when there is no token after the skipped ones or the duration is not
    positive. ``skip_first`` must be >= 1.
    """
    if skip_first < 1:
        raise ValueError(f"skip_first must be >= 1, got {skip_first}")
    if step_times is not None:
        if n_tokens is not None or seconds is not None:
            raise ValueError("give step_times or (n_tokens, seconds), not both")
        times = [float(t) for t in step_times]
        if len(times) <= skip_first:
            return None
        span = times[-1] - times[skip_first - 1]
        return (len(times) - skip_first) / span if span > 0 else None
    if n_tokens is None or seconds is None:
        raise ValueError("give step_times or both n_tokens and seconds")
    if n_tokens <= skip_first or seconds <= 0:
        return None
    return (n_tokens - skip_first) / float(seconds)


def text_metrics(text: str, n_tokens: int | None = None) -> dict[str, Any]:
    """All of the seed's per-run text metrics of one sequence.

    Keys: digit_ratio, weird_runs, repeated_num_runs, max_digit_run,
    output_hash, token_count (``n_tokens`` as given; None when not given), and
    symbol_ratio (ours, not the seed's).
    """
    return {
        "digit_ratio": digit_ratio(text),
        "symbol_ratio": symbol_ratio(text),
        "weird_runs": weird_runs(text),
        "repeated_num_runs": repeated_num_runs(text),
        "max_digit_run": max_digit_run(text),
        "output_hash": output_hash(text),
        "token_count": None if n_tokens is None else int(n_tokens),
    }


def with_quality(verdict, candidate) -> CaseVerdict:
    """Fill in the seed's text metrics the classifier skipped (identical sequences), for reports."""
    seqs = tuple(s if s.quality else dataclasses.replace(
        s, quality=text_metrics(candidate.sequences[s.index].text, candidate.sequences[s.index].n_tokens))
        for s in verdict.sequences)
    return dataclasses.replace(verdict, sequences=seqs)
