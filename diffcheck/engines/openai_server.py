"""``kind = "openai"``: an OpenAI-compatible vLLM server, started by diffcheck or already running.

This module is the engine: the HTTP client, the server's models, generation and the two
primitives of forced replay and scoring (`Engine.force` / `Engine.score` keep their
books). Beside it: `server_process` (the life cycle of a ``vllm serve`` diffcheck
starts: flags, port, start, health, stop) and `openai_wire` (the request bodies and
how answers become `Steps`).

Two modes:

- **started** (no ``engine.base_url``): diffcheck runs ``vllm serve`` itself on
  127.0.0.1 and a free port, with the case's engine table mapped to CLI flags
  (`server_process.serve_args`) and its ``env`` in the server's environment (faults
  included). A fresh random API key goes to the server in ``VLLM_API_KEY`` (vLLM's
  equivalent of ``--api-key``; as a flag it would sit in the process table and in
  vLLM's "non-default args" log line) and to the client. diffcheck waits for
  ``/health`` (`START_TIMEOUT_S`) and stops the server when the engine closes
  (`server_process.ServerProcess`: nothing it starts outlives diffcheck). When another
  process took the port before ``vllm serve`` bound it, the server is started again on
  a new port (`server_process.PORT_ATTEMPTS` in all). The server's log goes to a
  private directory (`vllm_logs.private_log_dir`), kept after the run.
  Forced replay works as offline: the server loads diffcheck's forcing processor
  (``--logits-processors diffcheck.engines.forcing:ForceTokens``, raw logprobs), and
  each forced request carries ``vllm_xargs = {"diffcheck_force": [ids]}``.
- **base_url**: a server that already runs. Its API key, if any, is read from the
  environment variable ``engine.api_key_env`` names (never from a case file), and
  never written to a run, a log or an error. It goes in the ``Authorization`` header
  to that URL only: redirects are refused (urllib would resend the header to the new
  URL), and a plain ``http://`` URL off this machine gets one warning line that the
  key crosses the network in clear. Its logits processors are not diffcheck's to
  choose, so forced replay (and floor replicas) are unavailable and ``compare`` says
  so. The engine fields of the case describe what the server is declared to run;
  they cannot be applied to it.

Requests: ``/v1/completions`` only, every prompt as token ids (`openai_wire`), so the
server sees exactly the ids the offline engine sees (a chat endpoint would template
server-side, and a template or tokenizer difference would pass for an engine
difference). Sampling is the offline engine's: the case's parameters, the same
per-request seed, and the penalties sent as their neutral values.

Every failure is one `EngineError` line: the server's own error text for an HTTP
4xx/5xx (a wrong model name: "The model `x` does not exist"), or how the server
ended (its exit status and the root-cause line of its log) when it died, or the
timeout that expired.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from diffcheck.core import progress as progressmod
from diffcheck.core.errors import ConfigError, EngineError
from diffcheck.core.types import Run, SequenceInfo
from diffcheck.engines import openai_wire as wire
from diffcheck.engines import prompting
from diffcheck.engines.base import Engine, ForcedRows, run_meta, warn
from diffcheck.engines.registry import register_engine
from diffcheck.engines.server_process import (PORT_ATTEMPTS, STOP_GRACE_S, ServerProcess, bind_failed, free_port,
                                              serve_args, status, wait_healthy)
from diffcheck.engines.vllm_logs import private_log_dir, read_log, root_cause
from diffcheck.engines.vllm_outputs import concat, steps_from_logprobs

START_TIMEOUT_S = float(os.environ.get("DIFFCHECK_SERVER_START_TIMEOUT_S", "600"))
REQUEST_TIMEOUT_S = float(os.environ.get("DIFFCHECK_SERVER_REQUEST_TIMEOUT_S", "1800"))
FORCING_PROCESSOR = "diffcheck.engines.forcing:ForceTokens"


@register_engine("openai", capabilities=("generate", "topk_logprobs", "forced_replay", "prompt_scoring", "replicas"),
                 description="an OpenAI-compatible vLLM server: started by diffcheck, or at engine.base_url")
class OpenAIServer(Engine):
    """A served vLLM for one case, through ``/v1/completions``. Use as a context manager."""

    name = "openai"

    @classmethod
    def unavailable(cls, engine_cfg: dict[str, Any]) -> dict[str, str]:
        out = super().unavailable(engine_cfg)
        if engine_cfg.get("base_url"):
            out.update(forced_replay="base_url", replicas="base_url")
        return out

    @classmethod
    def code_identity(cls, engine_cfg: dict[str, Any]) -> dict[str, Any] | None:
        return None if engine_cfg.get("base_url") else super().code_identity(engine_cfg)

    def __init__(self, case, model, *, prompts, verbose: bool = False, log_dir: Path | None = None,
                 start_timeout_s: float | None = None, request_timeout_s: float | None = None):
        self._take_case(case, model, prompts, verbose, "openai")
        self.start_timeout_s = START_TIMEOUT_S if start_timeout_s is None else float(start_timeout_s)
        self.request_timeout_s = REQUEST_TIMEOUT_S if request_timeout_s is None else float(request_timeout_s)
        self.base_url = self.requested.get("base_url")
        self.started = self.base_url is None
        self.log_path = (None if verbose or not self.started
                         else private_log_dir(log_dir) / f"diffcheck-{case.suite}-{case.id}-{os.getpid()}.server.log")
        self.server: ServerProcess | None = None
        self.timings: dict[str, float] = {}
        self.mechanism = "v1_logits_processor via vllm_xargs" if self.started else "none (base_url)"
        self._key: str | None = None
        self._closed = False
        self._opener = wire.opener(direct=False)
        t0 = time.perf_counter()
        try:
            self.tokenizer = prompting.load_tokenizer(model.path)
            if self.started:
                self._start_server()
            else:
                self._attach()
            self._models = self._model_list()
            self.served_model_name = self.requested.get("served_model_name") or self._only_model()
            self._max_model_len = next((m.get("max_model_len") for m in self._models
                                        if m.get("id") == self.served_model_name), None)
            self.server_version = self._server_version()
        except BaseException:
            self.close()
            raise
        self.timings["startup_s"] = time.perf_counter() - t0
        self._info = self._make_info()

    # -- life cycle -----------------------------------------------------------------------------
    def _attach(self) -> None:
        parts = urlsplit(self.base_url)
        self.url = self.base_url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]
        self.where = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        local = wire.loopback(parts.hostname)
        # A loopback server: no proxy from the environment may see its key.
        self._opener = wire.opener(direct=local)
        name = self.requested.get("api_key_env")
        if name:
            key = os.environ.get(name)
            if not key:
                raise ConfigError(f"case '{self.case.id}': engine.api_key_env names {name}, which is not set "
                                  "in the environment")
            self._key = key
            if parts.scheme == "http" and not local:
                warn(f"case '{self.case.id}': engine.base_url {self.where} is plain http:// to another machine; "
                     f"the API key from ${name} goes over the network in clear (use https://)")

    def _start_server(self) -> None:
        """``vllm serve`` on a free port, until ``/health`` answers; again on a new port when another
        process took the port first (`server_process.bind_failed`), `PORT_ATTEMPTS` starts in all."""
        from diffcheck.engines.vllm_args import is_cpu
        from diffcheck.storage.identity import vllm_source_state

        self._key = secrets.token_urlsafe(32)
        self.served = self.requested.get("served_model_name") or f"diffcheck-{self.case.id}"
        base_args, env = serve_args(self.requested, str(self.model.path), on_cpu=is_cpu())
        self.server_env = {**env, **self.env}
        child_env = {**os.environ, **self.server_env, "VLLM_API_KEY": self._key, "PYTHONUNBUFFERED": "1"}
        self._opener = wire.opener(direct=True)
        self._source = vllm_source_state()
        deadline = time.monotonic() + self.start_timeout_s
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()
            self.serve_args = base_args + [
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.served,
                "--generation-config", "vllm", "--disable-uvicorn-access-log",
                "--logits-processors", FORCING_PROCESSOR, "--logprobs-mode", "raw_logprobs"]
            self.url = f"http://127.0.0.1:{port}"
            self.where = f"vllm serve on 127.0.0.1:{port}"
            if self.log_path is not None:
                self.log_path.write_text("")  # one attempt's log: its root cause is that attempt's
            self.server = ServerProcess(self.serve_args, child_env, self.log_path)
            try:
                code = wait_healthy(self.server, self.url, self._opener, deadline)
            except TimeoutError:
                raise EngineError(f"engine failed to start for case '{self.case.id}': vllm serve was not healthy "
                                  f"within {self.start_timeout_s:g}s{self._log_hint()}") from None
            if code is None:
                return
            if attempt < PORT_ATTEMPTS and bind_failed(port, read_log(self.log_path)):
                progressmod.log(f"{self.case.id}: port {port} was taken before vllm serve bound it; "
                                f"starting it again on another port ({attempt + 1} of {PORT_ATTEMPTS})")
                server, self.server = self.server, None
                server.stop()
                continue
            raise EngineError(f"engine failed to start for case '{self.case.id}': vllm serve exited "
                              f"{status(code)} before it was healthy: {self._log_cause()}{self._log_hint()}")

    def close(self) -> None:
        """Stop the server diffcheck started (its whole process group); calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def info(self) -> dict[str, Any]:
        return self._info

    def _make_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.name, "mode": "started" if self.started else "base_url"}
        if self.started:
            info.update(self._source)
            info["serve_args"] = list(self.serve_args)
            info["server_env"] = dict(self.server_env)
        else:
            info.update(version=self.server_version, base_url=self.url)
        info.update(
            server_version=self.server_version, served_model_name=self.served_model_name,
            endpoint="/v1/completions", prompts="token ids (chat template applied client-side)",
            requested=self.requested, effective={"max_model_len": self._max_model_len},
            forcing_mechanism=self.mechanism,
        )
        return info

    # -- HTTP -------------------------------------------------------------------------------------
    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def _request(self, method: str, path: str, body: dict | None, what: str, timeout: float | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        timeout = self.request_timeout_s if timeout is None else timeout
        try:
            with self._opener.open(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = wire.error_text(exc)
            raise EngineError(self._redact(f"{self.where} answered HTTP {exc.code} to {what} for case "
                                           f"'{self.case.id}': {detail}")) from None
        except (TimeoutError, socket.timeout):
            raise EngineError(f"{self.where} did not answer {what} for case '{self.case.id}' within "
                              f"{timeout:g}s") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise self._gone(what, exc) from None

    def _gone(self, what: str, exc: BaseException) -> EngineError:
        """The error for a server that stopped answering: how it ended, when diffcheck started it."""
        if self.server is not None:
            # A dead server's supervisor first stops what is left of its group (up to the grace period).
            code = self.server.returncode
            if code is None:
                code = self.server.wait_exit(STOP_GRACE_S + 10)
            if code is not None:
                cause = self._log_cause()
                return EngineError(f"vllm serve exited {status(code)} during {what} for case '{self.case.id}'"
                                   + (f": {cause}" if cause else "") + self._log_hint())
        reason = getattr(exc, "reason", exc)
        return EngineError(self._redact(f"{self.where} stopped answering during {what} for case '{self.case.id}': "
                                        f"{type(reason).__name__}: {reason}"))

    def _log_cause(self) -> str:
        """The server log's root-cause line (`vllm_logs.root_cause`), else its last line; "" without a log."""
        text = read_log(self.log_path)
        if not text.strip():
            return ""
        none = RuntimeError("no error line")
        line = root_cause(none, text)
        if line == f"RuntimeError: {none}":
            line = [ln for ln in text.splitlines() if ln.strip()][-1].strip()
        return self._redact(" ".join(line.split()))[:400]

    def _log_hint(self) -> str:
        return f"; full log: {self.log_path} (or rerun with --verbose)" if self.log_path else ""

    def _model_list(self) -> list[dict]:
        """The server's ``/v1/models`` entries (also the first authenticated request: a bad key fails here)."""
        models = self._request("GET", "/v1/models", None, "the model list", timeout=60)
        data = models.get("data") if isinstance(models, dict) else None
        return [m for m in data or [] if isinstance(m, dict)]

    def _only_model(self) -> str:
        ids = [str(m.get("id")) for m in self._models]
        if len(ids) != 1:
            raise ConfigError(f"case '{self.case.id}': {self.where} serves {len(ids)} models "
                              f"({', '.join(ids) or 'none'}); set engine.served_model_name")
        return ids[0]

    def _server_version(self) -> str | None:
        try:
            out = self._request("GET", "/version", None, "the version query", timeout=30)
        except EngineError:
            return None  # not every OpenAI-compatible server has /version
        return str(out.get("version")) if isinstance(out, dict) else None

    # -- requests ---------------------------------------------------------------------------------
    def _body(self, prompt, **override) -> dict[str, Any]:
        return wire.completion_body(dataclasses.asdict(self.case.sampling), self.served_model_name, prompt, **override)

    def _completion(self, body: dict, what: str) -> list[dict]:
        out = self._request("POST", "/v1/completions", body, what)
        choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        n = len(body["prompt"]) if body["prompt"] and isinstance(body["prompt"][0], list) else 1
        if len(choices) != n:
            raise EngineError(f"{self.where} returned {len(choices)} completions for {n} prompts during {what} "
                              f"for case '{self.case.id}'")
        return choices

    def prompt_token_ids(self) -> list[list[int]]:
        return prompting.prompt_token_ids(self.tokenizer, self.prompts)

    def generate(self, *, progress=None) -> Run:
        prompt_ids = self.prompt_token_ids()
        k = self._k()
        t0 = time.perf_counter()
        # One request with every prompt: the server schedules them together, as LLM.generate does.
        choices = self._completion(self._body(prompt_ids), "generation") if prompt_ids else []
        elapsed = time.perf_counter() - t0
        seqs, steps = [], []
        for prompt, ids, choice in zip(self.prompts, prompt_ids, choices):
            tokens, rows = wire.choice_steps(choice, k)
            steps.append(rows)
            seqs.append(SequenceInfo(prompt_id=prompt.id, prompt_token_ids=tuple(ids), text=choice.get("text", ""),
                                     finish_reason=str(choice.get("finish_reason")), n_tokens=len(tokens)))
        n = sum(s.n_tokens for s in seqs)
        self._report(progress, n)
        self.timings.update(generate_s=elapsed, generate_tokens=n, tokens_per_s=n / elapsed if elapsed else 0.0)
        return Run(meta=run_meta(self, "generate"), sequences=tuple(seqs), steps=concat(steps, k))

    # -- the primitives of forced replay and scoring (the bookkeeping is `Engine.force` / `Engine.score`) --
    def _check_forcing(self) -> None:
        if not self.started:
            raise EngineError(f"forced replay: not available on engine openai (base_url) for case '{self.case.id}': "
                              "diffcheck cannot load its forcing processor into a server it did not start")

    def _force_hint(self) -> str:
        return f"is {FORCING_PROCESSOR} loaded?"

    def _force_rows(self, jobs, k, *, progress=None) -> list[ForcedRows]:
        """One request per job (each has its own forced ids), sent together so the server batches them."""
        # ignore_eos: the forced path may hold EOS before its end; max_tokens caps it exactly.
        bodies = [self._body(job.context, max_tokens=len(job.forced), ignore_eos=True, min_tokens=0, stop=None,
                             logprobs=k, vllm_xargs={"diffcheck_force": job.forced}) for job in jobs]
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            futures = [pool.submit(self._completion, body, "forced decode replay") for body in bodies]
            choices = [f.result()[0] for f in futures]
        rows = []
        for choice in choices:
            tokens, steps = wire.choice_steps(choice, k)
            rows.append(ForcedRows(steps=steps, tokens=tokens, text=choice.get("text", ""),
                                   finish_reason=str(choice.get("finish_reason"))))
        return rows

    def _score_rows(self, jobs, k, *, progress=None) -> list[dict]:
        """One request holding every job's prompt + tokens, with ``prompt_logprobs = k``."""
        body = self._body([job.context for job in jobs], max_tokens=1, prompt_logprobs=k, logprobs=None, seed=0,
                          return_tokens_as_token_ids=None, return_token_ids=None)
        choices = self._completion(body, "reference scoring")
        rows = []
        for job, choice in zip(jobs, choices):
            positions = (choice.get("prompt_logprobs") or [])[len(job.prompt):]
            if len(positions) != len(job.tokens):
                raise EngineError(f"{self.where} returned {len(positions)} prompt logprobs for {len(job.tokens)} "
                                  f"tokens during reference scoring for case '{self.case.id}'")
            rows.append(steps_from_logprobs(job.tokens, [wire.prompt_position(p) for p in positions], k))
        return rows
