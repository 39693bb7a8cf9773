"""``kind = "openai"``: an OpenAI-compatible vLLM server, started by diffcheck or already running.

Longer than 400 lines because it holds the HTTP client, the server's start and supervision, and every one-line error of a served engine.

Two modes:

- **started** (no ``engine.base_url``): diffcheck runs ``vllm serve`` itself on
  127.0.0.1 and a free port, with the case's engine table mapped to CLI flags
  (`vllm_args.llm_kwargs`, the mapping the offline engine uses, then one flag per
  argument) and its ``env`` in the server's environment (faults included). A fresh
  random API key goes to the server in ``VLLM_API_KEY`` (vLLM's equivalent of
  ``--api-key``; as a flag it would sit in the process table and in vLLM's
  "non-default args" log line) and to the client. diffcheck waits for ``/health``
  (`START_TIMEOUT_S`), and stops the server when the engine closes. The server runs
  under a supervisor in its own process group (`vllm_serve`): stopping is SIGTERM to
  the group, SIGKILL after a grace period; atexit and SIGTERM/SIGHUP handlers stop
  every live server, Ctrl-C unwinds through `close()`, and if diffcheck dies without
  running any of that, the supervisor sees its pipe close and stops the group itself.
  Forced replay works as offline: the server loads diffcheck's forcing processor
  (``--logits-processors diffcheck.engines.forcing:ForceTokens``, raw logprobs), and
  each forced request carries ``vllm_xargs = {"diffcheck_force": [ids]}``.
- **base_url**: a server that already runs. Its API key, if any, is read from the
  environment variable ``engine.api_key_env`` names (never from a case file), and
  never written to a run, a log or an error. Its logits processors are not
  diffcheck's to choose, so forced replay (and floor replicas) are unavailable and
  ``compare`` says so. The engine fields of the case describe what the server is
  declared to run; they cannot be applied to it.

Requests: ``/v1/completions`` only. Chat prompts get the chat template applied
client-side with the model's tokenizer (`prompting`), and every prompt is sent as
token ids, so the server sees exactly the ids the offline engine sees (a chat
endpoint would template server-side, and a template or tokenizer difference would
pass for an engine difference). ``return_tokens_as_token_ids`` and
``return_token_ids`` give ids, not strings; ``logprobs = k`` the top-k per step;
``prompt_logprobs = k`` the scoring. Sampling is the offline engine's: the case's
parameters, the same per-request seed, and the penalties sent as their neutral
values so a server's own defaults (``--generation-config``) cannot change them.

Every failure is one `EngineError` line: the server's own error text for an HTTP
4xx/5xx (a wrong model name: "The model `x` does not exist"), or how the server
ended (its exit status and the root-cause line of its log) when it died, or the
timeout that expired.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from diffcheck.engines import prompting
from diffcheck.engines.base import Engine, run_meta
from diffcheck.engines.registry import register_engine
from diffcheck.engines.vllm_outputs import concat, steps_from_logprobs
from diffcheck.core.errors import ConfigError, EngineError
from diffcheck.core.types import Run, SequenceInfo

START_TIMEOUT_S = float(os.environ.get("DIFFCHECK_SERVER_START_TIMEOUT_S", "600"))
REQUEST_TIMEOUT_S = float(os.environ.get("DIFFCHECK_SERVER_REQUEST_TIMEOUT_S", "1800"))
STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL
FORCING_PROCESSOR = "diffcheck.engines.forcing:ForceTokens"
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
_Logprob = namedtuple("_Logprob", "logprob rank")  # what vllm_outputs.steps_from_logprobs reads
_CLAMPED = -9999.0  # vLLM writes -inf as this in JSON


# -- server processes ------------------------------------------------------------------------------

class ServerProcess:
    """One ``vllm serve`` under its supervisor (`vllm_serve`), in its own process group."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path | None):
        read_end, self._write_end = os.pipe()
        out = open(log_path, "ab") if log_path is not None else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "diffcheck.engines.vllm_serve", "--parent-fd", str(read_end),
                 "--grace", str(STOP_GRACE_S), "--", *args],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
                start_new_session=True, pass_fds=(read_end,), close_fds=True)
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
            if out is not None:
                out.close()
        self.pgid = self.proc.pid  # a new session: the supervisor leads its group
        _LIVE.add(self)
        _install_handlers()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after the grace period, until no process of it is left."""
        from diffcheck.engines.vllm_serve import group_members

        try:
            if self.proc.poll() is None:
                _killpg(self.pgid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=STOP_GRACE_S + 10)
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + 10
            while group_members(self.pgid) and time.monotonic() < deadline:
                _killpg(self.pgid, signal.SIGKILL)
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        finally:
            if self._write_end is not None:
                os.close(self._write_end)
                self._write_end = None
            _LIVE.discard(self)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_LIVE: set[ServerProcess] = set()
_HANDLERS_LOCK = threading.Lock()
_HANDLED: dict[int, Any] = {}


def stop_all() -> None:
    """Stop every server this process started (atexit, signal handlers)."""
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # keep stopping the others
            pass


def _on_signal(signum, frame):
    stop_all()
    previous = _HANDLED.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)  # end the way the signal would have ended us
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """atexit and SIGTERM/SIGHUP (main thread only) stop live servers; Ctrl-C unwinds through close()."""
    with _HANDLERS_LOCK:
        if _HANDLED or threading.current_thread() is not threading.main_thread():
            return
        atexit.register(stop_all)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            _HANDLED[sig] = signal.signal(sig, _on_signal)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(engine_cfg: dict[str, Any], model_path: str, *, on_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The case's engine table as ``vllm serve MODEL --flag value ...`` arguments and environment.

    The mapping is the offline engine's (`vllm_args.llm_kwargs`); each keyword becomes
    its flag: True -> ``--key``, False -> ``--no-key``, a table -> JSON, a list -> values.
    """
    from diffcheck.engines.vllm_args import llm_kwargs

    kw, env = llm_kwargs(engine_cfg, model_path, on_cpu=on_cpu)
    args = ["serve", str(kw.pop("model"))]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args, env


# -- the engine ------------------------------------------------------------------------------------

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
        log_dir = Path(log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = (None if verbose or not self.started
                         else log_dir / f"diffcheck-{case.suite}-{case.id}-{os.getpid()}.server.log")
        self.server: ServerProcess | None = None
        self.timings: dict[str, float] = {}
        self.mechanism = "v1_logits_processor via vllm_xargs" if self.started else "none (base_url)"
        self._key: str | None = None
        self._closed = False
        self._opener = urllib.request.build_opener()
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
        if _loopback(parts.hostname):
            self._opener = _direct_opener()  # a proxy from the environment must not see a local server's key
        name = self.requested.get("api_key_env")
        if name:
            key = os.environ.get(name)
            if not key:
                raise ConfigError(f"case '{self.case.id}': engine.api_key_env names {name}, which is not set "
                                  "in the environment")
            self._key = key

    def _start_server(self) -> None:
        from diffcheck.engines.vllm_args import is_cpu
        from diffcheck.storage.identity import vllm_source_state

        self._key = secrets.token_urlsafe(32)
        self.served = self.requested.get("served_model_name") or f"diffcheck-{self.case.id}"
        args, env = serve_args(self.requested, str(self.model.path), on_cpu=is_cpu())
        port = free_port()
        args += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.served,
                 "--generation-config", "vllm", "--disable-uvicorn-access-log",
                 "--logits-processors", FORCING_PROCESSOR, "--logprobs-mode", "raw_logprobs"]
        self.serve_args = args
        self.server_env = {**env, **self.env}
        child_env = {**os.environ, **self.server_env, "VLLM_API_KEY": self._key, "PYTHONUNBUFFERED": "1"}
        self.url = f"http://127.0.0.1:{port}"
        self._opener = _direct_opener()
        self.where = f"vllm serve on 127.0.0.1:{port}"
        self._source = vllm_source_state()
        if self.log_path is not None:
            self.log_path.write_text("")
        self.server = ServerProcess(args, child_env, self.log_path)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self.server.returncode
            if code is not None:
                raise EngineError(f"engine failed to start for case '{self.case.id}': vllm serve exited "
                                  f"{_status(code)} before it was healthy: {self._log_cause()}{self._log_hint()}")
            try:
                with self._opener.open(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"engine failed to start for case '{self.case.id}': vllm serve was not healthy "
                                  f"within {self.start_timeout_s:g}s{self._log_hint()}")
            time.sleep(0.5)

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
            detail = _error_text(exc)
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
            deadline = time.monotonic() + STOP_GRACE_S + 10
            while self.server.returncode is None and time.monotonic() < deadline:
                time.sleep(0.1)
            code = self.server.returncode
            if code is not None:
                cause = self._log_cause()
                return EngineError(f"vllm serve exited {_status(code)} during {what} for case '{self.case.id}'"
                                   + (f": {cause}" if cause else "") + self._log_hint())
        reason = getattr(exc, "reason", exc)
        return EngineError(self._redact(f"{self.where} stopped answering during {what} for case '{self.case.id}': "
                                        f"{type(reason).__name__}: {reason}"))

    def _log_cause(self) -> str:
        """The server log's root-cause line (`vllm_logs.root_cause`), else its last line; "" without a log."""
        from diffcheck.engines.vllm_logs import read_log, root_cause

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
        s = dataclasses.asdict(self.case.sampling)
        body: dict[str, Any] = {
            "model": self.served_model_name, "prompt": prompt, "n": 1, "stream": False, "echo": False,
            "max_tokens": s["max_tokens"], "temperature": s["temperature"], "top_p": s["top_p"],
            "top_k": s["top_k"] if s["top_k"] is not None else -1, "seed": s["seed"],
            "ignore_eos": s["ignore_eos"], "skip_special_tokens": s["skip_special_tokens"],
            "logprobs": s["logprobs"], "min_tokens": s.get("min_tokens"),
            "stop": list(s["stop"]) if s.get("stop") else None,
            "return_tokens_as_token_ids": True, "return_token_ids": True, **_NEUTRAL,
        }
        body.update(override)
        return {k: v for k, v in body.items() if v is not None}

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
        k = int(self.case.sampling.logprobs or 0)
        t0 = time.perf_counter()
        # One request with every prompt: the server schedules them together, as LLM.generate does.
        choices = self._completion(self._body(prompt_ids), "generation") if prompt_ids else []
        elapsed = time.perf_counter() - t0
        seqs, steps = [], []
        for prompt, ids, choice in zip(self.prompts, prompt_ids, choices):
            tokens = _token_ids(choice)
            steps.append(steps_from_logprobs(tokens, _step_logprobs(tokens, choice.get("logprobs"), k), k))
            seqs.append(SequenceInfo(prompt_id=prompt.id, prompt_token_ids=tuple(ids), text=choice.get("text", ""),
                                     finish_reason=str(choice.get("finish_reason")), n_tokens=len(tokens)))
        n = sum(s.n_tokens for s in seqs)
        if progress is not None:
            progress(n, n)
        self.timings.update(generate_s=elapsed, generate_tokens=n, tokens_per_s=n / elapsed if elapsed else 0.0)
        return Run(meta=run_meta(self, "generate"), sequences=tuple(seqs), steps=concat(steps, k))

    def force(self, reference: Run, *, starts=None, progress=None) -> Run:
        """Teacher-force `reference`'s tokens through the server's decode path (diffcheck's processor).

        `starts`: as `VllmOffline.force` (per sequence the first step to force, None to leave it out).
        """
        if not self.started:
            raise EngineError(f"forced replay: not available on engine openai (base_url) for case '{self.case.id}': "
                              "diffcheck cannot load its forcing processor into a server it did not start")
        k = int(self.case.sampling.logprobs or 0)
        starts = [0] * len(reference.sequences) if starts is None else list(starts)
        if len(starts) != len(reference.sequences):
            raise ValueError(f"starts has {len(starts)} entries for {len(reference.sequences)} sequences")
        jobs, from_steps = {}, []
        for i, seq in enumerate(reference.sequences):
            path = [int(t) for t in reference.sequence(i).token_id]
            start = starts[i]
            if start is not None and not 0 <= int(start) <= len(path):
                raise ValueError(f"seq {i}: start {start} is outside its {len(path)} steps")
            forced = path[int(start):] if start is not None else []
            from_steps.append(int(start) if forced else None)
            if forced:
                # ignore_eos: the forced path may hold EOS before its end; max_tokens caps it exactly.
                jobs[i] = (forced, self._body(list(seq.prompt_token_ids) + path[: int(start)], max_tokens=len(forced),
                                              ignore_eos=True, min_tokens=0, stop=None, logprobs=k,
                                              vllm_xargs={"diffcheck_force": forced}))
        t0 = time.perf_counter()
        # One request per sequence (each has its own forced ids), sent together so the server batches them.
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            futures = {i: pool.submit(self._completion, body, "forced decode replay") for i, (_, body) in jobs.items()}
            results = {i: f.result()[0] for i, f in futures.items()}
        elapsed = time.perf_counter() - t0
        seqs, steps = [], []
        for i, seq in enumerate(reference.sequences):
            if i not in results:
                seqs.append(dataclasses.replace(seq, text="", n_tokens=0))
                steps.append(steps_from_logprobs([], None, k))
                continue
            choice, expected = results[i], jobs[i][0]
            tokens = _token_ids(choice)
            if tokens != expected:
                raise EngineError(f"forced replay did not follow the reference for case '{self.case.id}' seq {i} "
                                  f"({len(tokens)} of {len(expected)} tokens; is {FORCING_PROCESSOR} loaded?)")
            steps.append(steps_from_logprobs(tokens, _step_logprobs(tokens, choice.get("logprobs"), k), k))
            seqs.append(SequenceInfo(prompt_id=seq.prompt_id, prompt_token_ids=seq.prompt_token_ids,
                                     text=choice.get("text", ""), finish_reason=str(choice.get("finish_reason")),
                                     n_tokens=len(tokens)))
        n = sum(s.n_tokens for s in seqs)
        if progress is not None:
            progress(n, n)
        self.timings.update(force_s=elapsed, force_tokens=n)
        source = {"reference": reference.meta.case_id, "mechanism": self.mechanism}
        if any(s not in (0, None) for s in from_steps):
            source["from_steps"] = from_steps
        return Run(meta=run_meta(self, "forced", source), sequences=tuple(seqs), steps=concat(steps, k))

    def score(self, run: Run, *, progress=None) -> Run:
        """The server's logprob of each of `run`'s tokens, through prompt logprobs (prefill)."""
        k = int(self.case.sampling.logprobs or 0)
        kept, prompts = [], []
        for i, seq in enumerate(run.sequences):
            tokens = [int(t) for t in run.sequence(i).token_id]
            if tokens:
                kept.append(i)
                prompts.append(list(seq.prompt_token_ids) + tokens)
        body = self._body(prompts, max_tokens=1, prompt_logprobs=k, logprobs=None, seed=0,
                          return_tokens_as_token_ids=None, return_token_ids=None)
        t0 = time.perf_counter()
        choices = self._completion(body, "reference scoring") if prompts else []
        elapsed = time.perf_counter() - t0
        by_index = dict(zip(kept, choices))
        seqs, steps = [], []
        for i, seq in enumerate(run.sequences):
            choice = by_index.get(i)
            if choice is None:
                seqs.append(dataclasses.replace(seq, text="", finish_reason="scored", n_tokens=0))
                steps.append(steps_from_logprobs([], None, k))
                continue
            tokens = [int(t) for t in run.sequence(i).token_id]
            positions = (choice.get("prompt_logprobs") or [])[len(seq.prompt_token_ids):]
            if len(positions) != len(tokens):
                raise EngineError(f"{self.where} returned {len(positions)} prompt logprobs for {len(tokens)} tokens "
                                  f"during reference scoring for case '{self.case.id}'")
            steps.append(steps_from_logprobs(tokens, [_prompt_position(p) for p in positions], k))
            seqs.append(SequenceInfo(prompt_id=seq.prompt_id, prompt_token_ids=seq.prompt_token_ids, text=seq.text,
                                     finish_reason="scored", n_tokens=len(tokens)))
        if progress is not None:
            progress(sum(s.n_tokens for s in seqs), sum(s.n_tokens for s in seqs))
        self.timings.update(score_s=elapsed)
        source = {"scored_run": run.meta.case_id, "scored_kind": run.meta.kind, "scorer": self.case.id}
        return Run(meta=run_meta(self, "scored", source), sequences=tuple(seqs), steps=concat(steps, k))


# -- response parsing -----------------------------------------------------------------------------

def _status(code: int) -> str:
    """How a process ended, from its exit status (the supervisor reports a signal as 128 + N)."""
    sig = -code if code < 0 else code - 128 if code > 128 else None
    if sig is not None:
        try:
            return f"on {signal.Signals(sig).name}"
        except ValueError:
            pass
    return f"with code {code}"


def _loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or bool(host and host.startswith("127."))


def _direct_opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _error_text(exc: urllib.error.HTTPError) -> str:
    """The server's own error message, one line."""
    try:
        raw = exc.read().decode("utf-8", "replace")
    except Exception:
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


def _token_ids(choice: dict) -> list[int]:
    ids = choice.get("token_ids")
    if ids is None:
        lp = choice.get("logprobs") or {}
        ids = [_token_id(t) for t in lp.get("tokens") or []]
    return [int(t) for t in ids]


def _step_logprobs(tokens: list[int], block: dict | None, k: int) -> list[dict | None] | None:
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


def _prompt_position(entry: dict | None) -> dict[int, _Logprob] | None:
    if not entry:
        return None
    return {int(tid): _Logprob(_value(v.get("logprob")), v.get("rank")) for tid, v in entry.items()}
