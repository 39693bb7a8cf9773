"""Reports: render `CaseVerdict`s as a terminal table, JSON, JUnit XML or one HTML file.

Knows the verdict dataclasses (`diffcheck.core.types`) and the token strings of both
sides; never imports an engine, torch or vllm, and never judges anything: every
verdict, step and number shown comes from the verdicts as given.

The input of the renderers that need texts is `ReportInput`:

- ``verdicts``: the `CaseVerdict`s, in the order to show them.
- ``texts``: ``{(candidate_id, reference_id, sequence index): SequenceTexts}``.
  `SequenceTexts` holds the reference and candidate token strings (decoded one
  token at a time by the caller's tokenizer). Without a tokenizer, build it with
  `SequenceTexts.from_texts(reference_text, candidate_text)`: each side is then
  one whole text and divergence is located by character. A plain pair
  ``(reference_tokens, candidate_tokens)`` is accepted as a value too. Sequences
  without an entry are rendered without texts.
- ``meta``: free-form facts shown in the header (suite, command, versions, ...).
- ``speed``: `diffcheck.report.speed.speed_summary` of the runs (decode tokens/s of
  the candidate and each reference golden, forced replays), or None.

The renderers live in submodules and load lazily (`rich` only when the terminal
table is used): `render_table` / `render_divergence` (terminal), `write_json`,
`write_junit`, `write_html`. Shared pieces used by several of them live here.

What a command writes goes through the registry (`diffcheck.report.registry`):
`write_outputs({format: path or "-"}, result)` renders a result
(`diffcheck.report.results`: a comparison, a check, a matrix, a self-test, a
kernel check) in each requested format and writes each file atomically.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from html import escape as _escape  # not `import html`: the submodule report.html would shadow it
from pathlib import Path
from typing import Any, Mapping, Sequence

from diffcheck.core.types import CaseVerdict, SequenceVerdict

BASELINE_NAMES = ("exact_match", "check_logprobs_close")

_LAZY = {
    "render_table": "diffcheck.report.terminal",
    "render_divergence": "diffcheck.report.terminal",
    "write_json": "diffcheck.report.json_report",
    "report_dict": "diffcheck.report.json_report",
    "write_junit": "diffcheck.report.junit",
    "write_html": "diffcheck.report.html",
    "render_html": "diffcheck.report.html",
    "render_speed": "diffcheck.report.terminal",
    "speed_summary": "diffcheck.report.speed",
    "FORMATS": "diffcheck.report.registry",
    "check_outputs": "diffcheck.report.registry",
    "write_outputs": "diffcheck.report.registry",
    "report_input": "diffcheck.report.results",
}

__all__ = [
    "SequenceTexts",
    "ReportInput",
    "TextKey",
    "atomic_write_text",
    "case_baselines",
    "escape_html",
    "config_delta_lines",
    "worst_sequence",
    "printable",
    *_LAZY,
]

TextKey = tuple[str, str, int]  # (candidate_id, reference_id, sequence index)


@dataclass(frozen=True)
class SequenceTexts:
    """Both sides' generated text of one sequence, split into token strings.

    ``tokenized=False`` means each side is a single whole text (no tokenizer was
    available): renderers then locate the divergence by character.
    """

    reference_tokens: tuple[str, ...]
    candidate_tokens: tuple[str, ...]
    tokenized: bool = True

    def __post_init__(self):
        # Accept lists from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "reference_tokens", tuple(str(t) for t in self.reference_tokens))
        object.__setattr__(self, "candidate_tokens", tuple(str(t) for t in self.candidate_tokens))

    @staticmethod
    def from_texts(reference_text: str, candidate_text: str) -> "SequenceTexts":
        return SequenceTexts((reference_text,), (candidate_text,), tokenized=False)

    @property
    def reference_text(self) -> str:
        return "".join(self.reference_tokens)

    @property
    def candidate_text(self) -> str:
        return "".join(self.candidate_tokens)

    def split(self, shared_prefix: int | None = None) -> "TextSplit":
        """Cut both sides into (shared prefix, reference rest, candidate rest).

        For token texts the cut is at ``shared_prefix`` tokens (the verdict's own
        count, so the page agrees with t*) when it fits both sides, otherwise at
        the common prefix of the token strings. For whole texts it is the common
        prefix of characters.
        """
        if self.tokenized:
            n = _common_prefix(self.reference_tokens, self.candidate_tokens)
            if shared_prefix is not None and 0 <= shared_prefix <= min(
                len(self.reference_tokens), len(self.candidate_tokens)
            ):
                n = shared_prefix
            return TextSplit(
                prefix=self.reference_tokens[:n],
                reference_rest=self.reference_tokens[n:],
                candidate_rest=self.candidate_tokens[n:],
                cut_step=n,
            )
        reference, candidate = self.reference_text, self.candidate_text
        n = _common_prefix(reference, candidate)
        return TextSplit(
            prefix=(reference[:n],) if n else (),
            reference_rest=(reference[n:],) if reference[n:] else (),
            candidate_rest=(candidate[n:],) if candidate[n:] else (),
            cut_step=None,
        )


@dataclass(frozen=True)
class TextSplit:
    """The result of `SequenceTexts.split`: token strings on each side of the cut."""

    prefix: tuple[str, ...]
    reference_rest: tuple[str, ...]
    candidate_rest: tuple[str, ...]
    cut_step: int | None  # step of the first token after the prefix; None for whole texts


@dataclass(frozen=True)
class ReportInput:
    """Everything the HTML report (and any text-aware renderer) needs."""

    verdicts: tuple[CaseVerdict, ...]
    texts: Mapping[TextKey, SequenceTexts] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    speed: Mapping[str, Any] | None = None  # `speed.speed_summary` of the runs

    def __post_init__(self):
        object.__setattr__(self, "verdicts", tuple(self.verdicts))
        texts = {}
        for key, value in dict(self.texts).items():
            if not isinstance(value, SequenceTexts):
                reference_tokens, candidate_tokens = value
                value = SequenceTexts(reference_tokens, candidate_tokens)
            candidate_id, reference_id, index = key
            texts[(str(candidate_id), str(reference_id), int(index))] = value
        object.__setattr__(self, "texts", texts)
        object.__setattr__(self, "meta", dict(self.meta))

    def texts_for(self, case: CaseVerdict, sequence: SequenceVerdict) -> SequenceTexts | None:
        return self.texts.get((case.candidate_id, case.reference_id, sequence.index))


def _common_prefix(reference: Sequence, candidate: Sequence) -> int:
    n = min(len(reference), len(candidate))
    for i in range(n):
        if reference[i] != candidate[i]:
            return i
    return n


def worst_sequence(case: CaseVerdict) -> SequenceVerdict | None:
    """The most severe sequence, earliest t* among equals (where to look first)."""
    if not case.sequences:
        return None
    return min(
        case.sequences,
        key=lambda s: (-s.verdict.severity, s.t_star if s.t_star is not None else 1 << 62, s.index),
    )


def case_baselines(case: CaseVerdict) -> dict[str, bool | None]:
    """What each older rule would have said about the whole case.

    A rule passes a case when it passes every sequence; None when no sequence
    recorded that rule (so a report never claims a baseline it did not see).
    """
    result: dict[str, bool | None] = {}
    names = list(BASELINE_NAMES) + sorted(
        {k for s in case.sequences for k in s.baselines} - set(BASELINE_NAMES)
    )
    for name in names:
        seen = [bool(s.baselines[name]) for s in case.sequences if name in s.baselines]
        result[name] = all(seen) if seen else None
    return result


def config_delta_lines(delta: Mapping[str, Any]) -> list[str]:
    """``path: reference -> candidate`` per changed config value, in path order."""
    lines = []
    for path in sorted(delta, key=str):
        value = delta[path]
        if isinstance(value, (tuple, list)) and len(value) == 2:
            lines.append(f"{path}: {value[0]!r} -> {value[1]!r}")
        else:
            lines.append(f"{path}: {value!r}")
    return lines


# Control characters would corrupt XML and vanish in HTML; show them as the
# Unicode "control pictures" so gibberish made of them stays visible.
_CONTROL_MAP = {c: 0x2400 + c for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROL_MAP[0x7F] = 0x2421
# Lone surrogates cannot be encoded as UTF-8 and U+FFFE/U+FFFF are not XML.
_UNENCODABLE = re.compile("[\ud800-\udfff\ufffe\uffff]")


def printable(text: str) -> str:
    """``text`` with C0 controls (except tab/newline) and DEL as visible symbols.

    Also replaces what no UTF-8 XML/HTML file can hold with U+FFFD.
    """
    return _UNENCODABLE.sub("\ufffd", str(text).translate(_CONTROL_MAP))


def escape_html(value: Any) -> str:
    """``value`` as HTML/SVG text: `printable`, then escaped (quotes too, for attributes)."""
    return _escape(printable(value), quote=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temp file and `os.replace`.

    Readers see either the old file or the whole new one, never a partial write.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; reports are meant to be shared like any output file.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffcheck.report' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
