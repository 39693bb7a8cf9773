"""Builders the tests share: one synthetic run (`make_run`) and one case-suite file (`write_suite`).

`make_run` builds a `diffcheck.core.types.Run` from per-sequence data. Where the step
data comes from, first match wins:

- ``distributions``: one ``[n, V]`` array of log-probabilities per sequence. Each
  step records what an engine would: the token (``tokens``, else the row's argmax),
  its logprob from the row, and the row's ``k`` most probable ids (stable order).
- ``tokens``: token ids per sequence. Step t's top-k is the token and the ``k - 1``
  ids after it, with the fixed logprobs ``-0.1, -3.1, -6.1, ...`` (they sum below 1),
  and the token's logprob is -0.1.
- ``lengths``: steps per sequence, with random top-k lists (seeded by ``seed``;
  distinct ids in each row, logprobs sorted descending); the token is the top-1 id.
- ``topk_ids`` alone: the token is each row's first id.

Any of ``logprobs`` (the token's logprob per step), ``topk_ids`` / ``topk_logprobs``
(``[n, K]`` per sequence; -1 / -inf pad short lists) replaces what was derived.
Sequences: ``texts`` (one string for all, or one each; default the token ids
joined by spaces), ``prompt_ids`` (default ``p0, p1, ...``, the ids of
`DEFAULT_PROMPTS`), ``prompt_token_ids`` (one tuple for all, or one each) and
``finish_reasons`` (one for all, or one each). The run's identity: ``kind``
("generate", "forced", "scored"), ``role``, ``case_id``, ``suite``; any other
keyword goes to `RunMeta` (``engine=``, ``model=``, ``sampling=``, ``timings=``, ...).

    make_run([[5, 6, 7], [8]])                          # two sequences of tokens
    make_run(lengths=(5, 0, 7), k=20, seed=3)           # random top-20 lists
    make_run([ref_tokens], distributions=[rows], k=8, kind="forced", role="candidate", case_id="O")

`write_suite` writes one suite file: ``[suite]``, ``[defaults]`` (model, prompts,
optional sampling and engine tables) and one ``[cases.ID]`` table per entry of
``cases`` (a dict of case id -> dict of keys; nested dicts become inline tables).
``prompts`` is either a path the suite names as is (absolute, or relative to the
suite file) or a list of prompt dicts, written to ``prompts/<name>.toml`` beside
the suite. ``text=`` writes the given text verbatim instead (broken-suite tests);
`suite_text` returns what `write_suite` would write.

    write_suite(tmp_path, {"J": {"role": "reference", "description": "eager"},
                           "O": {"inherits": "J", "role": "candidate", "references": ["J"],
                                 "engine": {"enforce_eager": False}}}, name="tiny")
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from diffcheck.core.types import Run, RunMeta, SequenceInfo, Steps

VOCAB = 49152  # random ids are drawn below this (smollm2's vocabulary size)
LADDER_STEP = 3.0  # nats between the ranks of a tokens-only run's top-k
DEFAULT_PROMPTS = (
    {"id": "p0", "text": "Say something short."},
    {"id": "p1", "text": "Say something else."},
)
DEFAULT_CASES = {"J": {"role": "reference", "description": "reference"}}


def _per_sequence(value, n: int, what: str) -> list:
    """`value` for each of `n` sequences: a str or a flat tuple of ints is shared, a list is one each."""
    if isinstance(value, str) or (isinstance(value, tuple) and all(isinstance(v, (int, np.integer)) for v in value)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what}: {len(values)} values for {n} sequences")
    return values


def make_run(
    tokens: Sequence[Sequence[int]] | None = None,
    *,
    lengths: Sequence[int] | None = None,
    distributions: Sequence[np.ndarray] | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    topk_ids: Sequence[np.ndarray] | None = None,
    topk_logprobs: Sequence[np.ndarray] | None = None,
    k: int = 4,
    seed: int = 0,
    kind: str = "generate",
    role: str = "reference",
    case_id: str = "J",
    suite: str = "t",
    texts: str | Sequence[str] | None = None,
    prompt_ids: Sequence[str] | None = None,
    prompt_token_ids: tuple[int, ...] | Sequence[Sequence[int]] = (1, 2, 3),
    finish_reasons: str | Sequence[str] = "length",
    **meta: Any,
) -> Run:
    """A synthetic run; see the module docstring for where each column comes from."""
    rng = np.random.default_rng(seed)
    if distributions is not None:
        n_seq = len(distributions)
    elif tokens is not None:
        n_seq = len(tokens)
    elif lengths is not None:
        n_seq = len(lengths)
    elif topk_ids is not None:
        n_seq = len(topk_ids)
    else:
        raise ValueError("give tokens, lengths, distributions or topk_ids")

    cols: dict[str, list[np.ndarray]] = {"token_id": [], "logprob": [], "topk_ids": [], "topk_logprobs": []}
    for i in range(n_seq):
        if distributions is not None:
            rows = np.asarray(distributions[i], np.float64)
            tok = np.asarray(tokens[i]) if tokens is not None else rows.argmax(1)
            order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
            ids, lps = order, np.take_along_axis(rows, order, 1)
            lp = rows[np.arange(len(tok)), tok]
        elif tokens is not None:
            tok = np.asarray(tokens[i], np.int64).reshape(-1)
            ids = tok[:, None] + np.arange(k)
            lps = np.broadcast_to(-0.1 - LADDER_STEP * np.arange(k), ids.shape)
            lp = lps[:, 0]
        elif lengths is not None:
            m = int(lengths[i])
            ids = rng.integers(0, VOCAB // max(k, 1), (m, k)) * k + rng.permuted(np.tile(np.arange(k), (m, 1)), axis=1)
            lps = -np.sort(rng.exponential(2.0, (m, k)), axis=1)
            tok, lp = ids[:, 0], lps[:, 0]
        else:
            ids = np.asarray(topk_ids[i])
            lps = np.asarray(topk_logprobs[i]) if topk_logprobs is not None else np.zeros(ids.shape)
            tok, lp = ids[:, 0], lps[:, 0]
        if topk_ids is not None:
            ids = np.asarray(topk_ids[i])
        if topk_logprobs is not None:
            lps = np.asarray(topk_logprobs[i])
        if logprobs is not None:
            lp = np.asarray(logprobs[i])
        cols["token_id"].append(np.asarray(tok, np.int32).reshape(-1))
        cols["logprob"].append(np.asarray(lp, np.float32).reshape(-1))
        cols["topk_ids"].append(np.asarray(ids, np.int32))  # [n, K]
        cols["topk_logprobs"].append(np.asarray(lps, np.float32))

    counts = [len(t) for t in cols["token_id"]]
    width = cols["topk_ids"][0].shape[1] if n_seq else k
    steps = Steps(
        seq=np.repeat(np.arange(n_seq, dtype=np.int32), counts),
        step=np.concatenate([np.arange(c, dtype=np.int32) for c in counts] or [np.zeros(0, np.int32)]),
        token_id=np.concatenate(cols["token_id"] or [np.zeros(0, np.int32)]),
        logprob=np.concatenate(cols["logprob"] or [np.zeros(0, np.float32)]),
        topk_ids=np.concatenate(cols["topk_ids"] or [np.zeros((0, width), np.int32)]),
        topk_logprobs=np.concatenate(cols["topk_logprobs"] or [np.zeros((0, width), np.float32)]),
    )
    if texts is None:
        texts = [" ".join(str(int(t)) for t in tok) for tok in cols["token_id"]]
    texts = _per_sequence(texts, n_seq, "texts")
    prompt_ids = _per_sequence(prompt_ids if prompt_ids is not None else [f"p{i}" for i in range(n_seq)], n_seq,
                               "prompt_ids")
    prompt_token_ids = _per_sequence(prompt_token_ids, n_seq, "prompt_token_ids")
    finish_reasons = _per_sequence(finish_reasons, n_seq, "finish_reasons")
    sequences = tuple(
        SequenceInfo(prompt_id=prompt_ids[i], prompt_token_ids=tuple(int(t) for t in prompt_token_ids[i]),
                     text=texts[i], finish_reason=finish_reasons[i], n_tokens=counts[i])
        for i in range(n_seq)
    )
    return Run(meta=RunMeta(suite=suite, case_id=case_id, role=role, kind=kind, **meta), sequences=sequences,
               steps=steps)


# -- suite files ----------------------------------------------------------------------------------


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _table(header: str, items: dict) -> str:
    return f"[{header}]\n" + "".join(f"{_key(k)} = {_value(v)}\n" for k, v in items.items())


def suite_text(
    cases: dict[str, dict] | None = None,
    *,
    name: str = "t",
    description: str = "test suite",
    model: str | Path = "smollm2-135m",
    prompts: str | Path = "prompts/t.toml",
    sampling: dict | None = None,
    engine: dict | None = None,
) -> str:
    """The TOML text of a suite (``prompts`` here is the path the suite names)."""
    defaults: dict[str, Any] = {"model": model, "prompts": prompts}
    if sampling is not None:
        defaults["sampling"] = sampling
    if engine is not None:
        defaults["engine"] = engine
    tables = [_table("suite", {"name": name, "description": description}), _table("defaults", defaults)]
    tables += [_table(f"cases.{_key(cid)}", body) for cid, body in (cases or DEFAULT_CASES).items()]
    return "\n".join(tables)


def prompts_text(prompts: Sequence[dict]) -> str:
    """A prompts file: one ``[[prompt]]`` table per dict (``id``, ``text``, optional ``chat``, ...)."""
    return "\n".join("[[prompt]]\n" + "".join(f"{_key(k)} = {_value(v)}\n" for k, v in p.items()) for p in prompts)


def write_suite(
    folder: str | Path,
    cases: dict[str, dict] | None = None,
    *,
    name: str = "t",
    description: str = "test suite",
    model: str | Path = "smollm2-135m",
    prompts: str | Path | Sequence[dict] = DEFAULT_PROMPTS,
    sampling: dict | None = None,
    engine: dict | None = None,
    text: str | None = None,
) -> Path:
    """Write ``<folder>/<name>.toml`` (and its prompts file when ``prompts`` is a list); return its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    if text is None:
        if not isinstance(prompts, (str, Path)):
            (folder / "prompts").mkdir(exist_ok=True)
            (folder / "prompts" / f"{name}.toml").write_text(prompts_text(prompts))
            prompts = f"prompts/{name}.toml"
        text = suite_text(cases, name=name, description=description, model=model, prompts=prompts,
                          sampling=sampling, engine=engine)
    path.write_text(text)
    return path
