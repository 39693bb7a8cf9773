"""What goes over the wire to an OpenAI-compatible vLLM server: ``/v1/completions`` bodies and their answers.

Requests: every prompt as token ids (`prompting` applies the chat template client-side),
``return_tokens_as_token_ids`` and ``return_token_ids`` (ids, not strings),
``logprobs = k`` for the top-k per step, ``prompt_logprobs = k`` for scoring, and the
case's sampling with the penalties sent as their neutral values, so a server's own
defaults (``--generation-config``) cannot change them.

Answers become what `vllm_outputs.steps_from_logprobs` reads from vLLM's offline
outputs: per step ``{token_id: (logprob, rank)}``. The server lists the sampled token
first and the top-k without ranks; `step_logprobs` recovers vLLM's rank order.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections import namedtuple
from typing import Any

import numpy as np

from diffcheck.engines.vllm_outputs import steps_from_logprobs

NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
_Logprob = namedtuple("_Logprob", "logprob rank")  # what vllm_outputs.steps_from_logprobs reads
_CLAMPED = -9999.0  # vLLM writes -inf as this in JSON


def completion_body(sampling: dict[str, Any], model: str, prompt, **override) -> dict[str, Any]:
    """A ``/v1/completions`` body for `prompt` (ids, or a list of id lists) with the case's `sampling`
    (``dataclasses.asdict`` of it); `override` replaces fields, and a None field is left out."""
    s = sampling
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "n": 1, "stream": False, "echo": False,
        "max_tokens": s["max_tokens"], "temperature": s["temperature"], "top_p": s["top_p"],
        "top_k": s["top_k"] if s["top_k"] is not None else -1, "seed": s["seed"],
        "ignore_eos": s["ignore_eos"], "skip_special_tokens": s["skip_special_tokens"],
        "logprobs": s["logprobs"], "min_tokens": s.get("min_tokens"),
        "stop": list(s["stop"]) if s.get("stop") else None,
        "return_tokens_as_token_ids": True, "return_token_ids": True, **NEUTRAL,
    }
    body.update(override)
    return {k: v for k, v in body.items() if v is not None}


def loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or bool(host and host.startswith("127."))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would send the request's headers (the API key) to the new URL."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def opener(*, direct: bool):
    """The HTTP opener: no redirects ever; `direct`: no proxy from the environment either (a loopback server)."""
    handlers: list = [_NoRedirect()]
    if direct:
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


def error_text(exc: urllib.error.HTTPError) -> str:
    """The server's own error message, one line."""
    try:
        raw = exc.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):  # the body could not be read: the status line says enough
        raw = ""
    text = raw
    try:
        data = json.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(err, dict):
            text = str(err.get("message") or err.get("detail") or err)
        elif err is not None:
            text = str(err)
    except (ValueError, AttributeError):
        pass
    text = " ".join(text.split()) or (exc.reason or "")
    return text[:500]


def _value(v: float | None) -> float:
    return float("-inf") if v is None or v <= _CLAMPED else float(v)


def _token_id(key: str) -> int:
    return int(key.split(":", 1)[1]) if key.startswith("token_id:") else int(key)


def token_ids(choice: dict) -> list[int]:
    """The completion's token ids (``return_token_ids``, else its ``token_id:N`` logprob tokens)."""
    ids = choice.get("token_ids")
    if ids is None:
        lp = choice.get("logprobs") or {}
        ids = [_token_id(t) for t in lp.get("tokens") or []]
    return [int(t) for t in ids]


def choice_steps(choice: dict, k: int) -> tuple[list[int], dict[str, np.ndarray]]:
    """One completion's tokens and their `Steps` columns (top-`k` in vLLM's rank order)."""
    tokens = token_ids(choice)
    return tokens, steps_from_logprobs(tokens, step_logprobs(tokens, choice.get("logprobs"), k), k)


def step_logprobs(tokens: list[int], block: dict | None, k: int) -> list[dict | None] | None:
    """Completions logprobs -> per step ``{token_id: (logprob, rank)}`` as vLLM's own dicts would be.

    The server sends, per step, the sampled token first and then the top-k in rank
    order, without ranks; the sampled token is among the top-k unless the step has
    k + 1 entries. Ranks are recovered from that and the logprobs (ties keep the
    server's order).
    """
    if not block:
        return None
    tops = block.get("top_logprobs") or []
    own = block.get("token_logprobs") or []
    out: list[dict | None] = []
    for t, token in enumerate(tokens):
        top = tops[t] if t < len(tops) else None
        if not top:
            out.append({token: _Logprob(_value(own[t]), k + 1)} if t < len(own) and own[t] is not None else None)
            continue
        items = [(_token_id(key), _value(v)) for key, v in top.items()]
        entry: dict[int, _Logprob] = {}
        if len(items) > k and items[0][0] == token:
            entry[token] = _Logprob(items[0][1], k + 1)  # the sampled token, outside the top-k
            items = items[1:]
        for rank, (tid, v) in enumerate(sorted(items, key=lambda x: -x[1]), 1):
            entry.setdefault(tid, _Logprob(v, rank))
        if token not in entry and t < len(own) and own[t] is not None:
            entry[token] = _Logprob(_value(own[t]), k + 1)
        out.append(entry)
    return out


def prompt_position(entry: dict | None) -> dict[int, _Logprob] | None:
    """One position of ``prompt_logprobs`` (``{id: {logprob, rank, ...}}``) as vLLM's offline dict."""
    if not entry:
        return None
    return {int(tid): _Logprob(_value(v.get("logprob")), v.get("rank")) for tid, v in entry.items()}
