"""The engine kinds on the real engines: ``openai`` (a vllm serve diffcheck starts, or one at base_url) and ``hf``.

One suite, one goldens root for the module; real engines only, one at a time (the
base_url server is stopped before anything else starts). Every CLI call runs in a
subprocess whose descendants are watched with psutil (an oracle independent of
diffcheck's own /proc scan), so a test can say that no server or engine process
outlived it. Test time on the 2-core machine: about 6 minutes, most of it server and
engine start-ups.

No assertion here is on how fast anything was: a test waits for an event that must
come (a process, a line of output, the end of every process) and asserts what
happened and in which order; `EVENTUALLY_S` only bounds such a wait, generously, so
that a hang fails with a message instead of hanging the suite. The tests before the
first engine test need no engine (the wire format, the bookkeeping shared by the
kinds, the server process's signals, ports and warnings).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from factories import make_run, write_suite

engine = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SMOKE = {"max_tokens": 24, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234, "logprobs": 20}
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1}
KEY_ENV = "DC_TEST_SERVER_KEY"
EXT_NAME = "smol-ext"
# Bounds a wait for something that must happen (never a measure of speed): a loaded 2-core machine
# took over 180 s for a server start.
EVENTUALLY_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXT_PORT = _free_port()
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference (vLLM offline)"},
    "SV": {"inherits": "J", "role": "candidate", "references": ["J"], "tags": ["replay-full"],
           "description": "J's config served by a vllm serve that diffcheck starts", "engine": {"kind": "openai"}},
    "SK": {"inherits": "SV", "description": "a long generation, for a server killed mid-run",
           "sampling": {"max_tokens": 900, "ignore_eos": True}},
    "BU": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "a server already running",
           "engine": {"kind": "openai", "base_url": f"http://127.0.0.1:{EXT_PORT}/v1", "served_model_name": EXT_NAME,
                      "api_key_env": KEY_ENV}},
    "BW": {"inherits": "BU", "description": "the same server, a model name it does not serve",
           "engine": {"served_model_name": "no-such-model"}},
    "HF": {"inherits": "J", "description": "transformers, eager fp32: the independent reference",
           "engine": {"kind": "hf"}},
    "HG": {"inherits": "HF", "description": "transformers, greedy", "sampling": {"temperature": 0.0}},
    "JH": {"inherits": "J", "role": "candidate", "references": ["J", "HF"], "tags": ["replay-full"],
           "description": "J's config against J and against HF"},
    # In-process engine core: every prompt is queued before the first schedule. With vLLM's
    # engine-core process, the first prefill may hold one prompt or both (a race with the
    # front end); that moves the decode step the fault counts for one sequence, and two runs
    # with the same bug part (seen in CI: a different frozen context from token 10 on).
    "JE": {"inherits": "J", "description": "J with stale decode metadata from step 8 (a reference that has the bug)",
           "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
    "CE": {"inherits": "JE", "role": "candidate", "references": ["JE", "HF"],
           "description": "the same bug in the candidate: invisible against JE, visible against HF"},
}


# -- helpers ----------------------------------------------------------------------------------------

class Descendants:
    """Every descendant process of `pid`, polled with psutil while it runs (pid -> create time, cmdline, pgid)."""

    def __init__(self, pid: int):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.seen: dict[int, dict] = {}
        self.environ: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            try:
                children = self.root.children(recursive=True)
            except self.psutil.Error:
                children = []
            for p in children:
                if p.pid in self.seen:
                    continue
                try:
                    info = {"create": p.create_time(), "cmdline": p.cmdline(), "pgid": os.getpgid(p.pid),
                            "ppid": p.ppid()}
                    if any("--served-model-name" in c for c in info["cmdline"]):
                        self.environ[p.pid] = p.environ()
                except (self.psutil.Error, OSError):
                    continue
                self.seen[p.pid] = info
            self._stop.wait(0.2)

    def stop(self):
        self._stop.set()
        self._thread.join()

    def servers(self) -> list[int]:
        """The vllm serve processes (not diffcheck's supervisor, which carries the same arguments)."""
        found = [pid for pid, i in self.seen.items() if any("--served-model-name" in c for c in i["cmdline"])
                 and not any("diffcheck.engines.vllm_serve" in c for c in i["cmdline"])]
        # A forked child of the server (its engine core, when vLLM forks) carries the same command line.
        return [pid for pid in found if self.seen[pid]["ppid"] not in found]

    def engine_cores(self) -> list[int]:
        """The processes a vllm serve process started (its engine core): the whole server tree exists."""
        servers = set(self.servers())
        return [pid for pid, i in self.seen.items() if i["ppid"] in servers]

    def alive(self) -> list[str]:
        out = []
        for pid, info in self.seen.items():
            try:
                p = self.psutil.Process(pid)
                if p.create_time() == info["create"] and p.status() != self.psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {' '.join(info['cmdline'])[:120]}")
            except self.psutil.Error:
                pass
        pgids = {i["pgid"] for i in self.seen.values()} - {os.getpgid(0)}
        for p in self.psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(p.pid) in pgids and p.status() != self.psutil.STATUS_ZOMBIE and p.pid not in self.seen:
                    out.append(f"{p.pid} (in a server's process group)")
            except (self.psutil.Error, OSError):
                pass
        return out

    def wait_gone(self) -> list[str]:
        """What is still alive once every process has ended, or when `EVENTUALLY_S` have passed."""
        deadline = time.monotonic() + EVENTUALLY_S
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


class Lines:
    """A command's stdout and stderr, read as they come, so a test can wait for what it says."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.said: list[str] = []
        self.ended = 0  # streams read to their end
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._read, args=(f,), daemon=True) for f in (proc.stdout, proc.stderr)]
        for t in self.threads:
            t.start()

    def _read(self, stream):
        for line in stream:
            with self.cond:
                self.said.append(line)
                self.cond.notify_all()
        with self.cond:
            self.ended += 1
            self.cond.notify_all()

    def text(self) -> str:
        with self.cond:
            return "".join(self.said)

    def wait_for(self, needle: str) -> None:
        """Until a line holds `needle`; fails (with what the command said) if it ends or hangs first."""
        with self.cond:
            self.cond.wait_for(lambda: any(needle in ln for ln in self.said) or self.ended == len(self.threads),
                               timeout=EVENTUALLY_S)
        if not any(needle in ln for ln in self.said):
            raise AssertionError(f"diffcheck never said {needle!r}; it said: {self.text()[-3000:]}")

    def wait_end(self) -> str:
        """Everything the command said, once it has ended."""
        _wait(self.proc, "the command")
        for t in self.threads:
            t.join()
        return self.text()


def _wait(proc: subprocess.Popen, what: str) -> int:
    try:
        return proc.wait(timeout=EVENTUALLY_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{what} did not end within {EVENTUALLY_S}s (killed)") from None


def _env(ctx, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCHECK_")}
    env.update(DIFFCHECK_GOLDENS=str(ctx["root"]), TMPDIR=str(ctx["logs"]), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _start_cli(ctx, args, preexec_fn=None, **env) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "diffcheck", *args, "--suite", str(ctx["suite_path"])], cwd=ctx["tmp"],
                            env=_env(ctx, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn)


def _cli(ctx, args, **env):
    """Run the CLI, watching its descendants; (returncode, stdout, stderr, Descendants)."""
    proc = _start_cli(ctx, args, **env)
    watch = Descendants(proc.pid)
    try:
        out, err = proc.communicate(timeout=EVENTUALLY_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"diffcheck {' '.join(args)} did not end within {EVENTUALLY_S}s (killed); "
                             f"it said: {(out + err)[-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    return proc.returncode, out, err, watch


def _no_survivors(watch: Descendants):
    """No process the command started is left, once they have all ended (after a SIGKILL of diffcheck its
    server's supervisor stops the server itself, after diffcheck has gone)."""
    left = watch.wait_gone()
    assert not left, f"processes outlived the command (still alive {EVENTUALLY_S}s after it ended): {left}"


def _everything_written(ctx) -> str:
    """All files under the goldens root and the log folder, as text (binary bytes decoded leniently)."""
    chunks = []
    for folder in (ctx["root"], ctx["logs"], ctx["tmp"] / "reports"):
        for path in Path(folder).rglob("*") if Path(folder).exists() else []:
            if path.is_file():
                chunks.append(path.read_bytes().decode("latin-1"))
    return "\n".join(chunks)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """The suite, and the goldens of J (vLLM offline) and HF (transformers) with HF's noise floor."""
    tmp = tmp_path_factory.mktemp("kinds")
    (tmp / "logs").mkdir()
    suite_path = write_suite(tmp / "cases", CASES, name="kinds", description="engine kinds",
                             prompts=ROOT / "cases" / "prompts" / "smoke-en.toml", sampling=SMOKE, engine=ENGINE)
    c = {"tmp": tmp, "suite_path": suite_path, "root": tmp / "goldens", "logs": tmp / "logs"}
    rc, out, err, watch = _cli(c, ["golden", "record", "J", "HF"])
    assert rc == 0, out + err
    _no_survivors(watch)
    rc, out, err, _ = _cli(c, ["calibrate", "HF"])
    assert rc == 0, out + err
    return c


def _read(ctx, name):
    from diffcheck.storage import store

    return store.read_run(ctx["root"] / "kinds" / name)


def _verdicts(path: Path) -> dict[str, dict]:
    data = json.loads(Path(path).read_text())
    return {c["reference_id"]: c for c in data["cases"]}


# -- the openai engine, without a server ---------------------------------------------------------------

def test_serve_args_are_what_vllm_serve_parses():
    """The case's engine table as flags: vLLM's own serve parser gives back the offline engine's arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from diffcheck.engines.server_process import serve_args
    from diffcheck.engines.vllm_args import llm_kwargs

    cfg = {"kind": "openai", "dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "seed": 7,
           "enable_prefix_caching": False, "max_num_seqs": 3, "kv_cache_memory_gib": 1.5,
           "compile_mode": 0, "attention_backend": "CPU_ATTN", "extra": {}}
    args, env = serve_args(cfg, "/models/m", on_cpu=True)
    assert args[:2] == ["serve", "/models/m"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", args[1], *args[2:]])
    engine_args = AsyncEngineArgs.from_cli_args(parsed)
    expected, expected_env = llm_kwargs(cfg, "/models/m", on_cpu=True)
    assert env == expected_env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    for key in ("model", "dtype", "enforce_eager", "max_model_len", "seed", "enable_prefix_caching", "max_num_seqs",
                "gpu_memory_utilization", "disable_log_stats"):
        assert getattr(engine_args, key) == expected[key], key
    assert int(engine_args.compilation_config.mode) == 0
    assert "CPU_ATTN" in str(engine_args.attention_config.backend)


def test_completion_logprobs_become_vllms_ranked_top_k():
    """A completions response (token ids as strings, the sampled token first) -> Steps with vLLM's rank order."""
    from diffcheck.engines.openai_wire import prompt_position, step_logprobs
    from diffcheck.engines.vllm_outputs import steps_from_logprobs

    block = {"tokens": ["token_id:7", "token_id:5"], "token_logprobs": [-3.0, -0.1],
             "top_logprobs": [{"token_id:7": -3.0, "token_id:1": -0.5, "token_id:2": -1.0},  # 7 outside the top-2
                              {"token_id:5": -0.1, "token_id:9": -2.5}]}  # 5 is the top-1
    steps = steps_from_logprobs([7, 5], step_logprobs([7, 5], block, 2), 2)
    assert steps["topk_ids"].tolist() == [[1, 2], [5, 9]]
    assert steps["topk_logprobs"].tolist() == [[-0.5, -1.0], [-0.10000000149011612, -2.5]]
    assert steps["logprob"].tolist() == [-3.0, np.float32(-0.1)]
    scored = prompt_position({"4": {"logprob": -9999.0, "rank": 300, "decoded_token": "x"},
                               "8": {"logprob": -0.2, "rank": 1, "decoded_token": "y"}})
    steps = steps_from_logprobs([4], [scored], 2)
    assert steps["logprob"][0] == -np.inf and steps["topk_ids"].tolist() == [[8, -1]]


# -- forced replay and scoring: the bookkeeping every kind shares (engines.base) ------------------------

class ToyEngine:
    """Builds an engine whose two primitives write down what they were asked and answer with rows made
    from the job itself, so every line of what `force` and `score` return comes from the shared code."""

    @staticmethod
    def make(tmp_path, *, follow: bool = True):
        from diffcheck import cases
        from diffcheck.engines.base import Engine, ForcedRows
        from diffcheck.engines.vllm_outputs import steps_from_logprobs

        suite = cases.load_suite(write_suite(tmp_path, {"T": {"role": "reference"}}, sampling={"logprobs": 2}))

        def rows(tokens):  # per step: the token itself at rank 1, logprob -token/100
            return steps_from_logprobs(tokens, [{t: SimpleNamespace(logprob=-t / 100, rank=1)} for t in tokens], 2)

        class Toy(Engine):
            name = mechanism = "toy"

            def __init__(self):
                self._take_case(suite.cases["T"], SimpleNamespace(identity=lambda: {}), [], False, "vllm")
                self.timings, self.asked = {}, []

            def generate(self, *, progress=None):
                raise NotImplementedError

            def info(self):
                return {"name": "toy"}

            def close(self):
                pass

            def _force_rows(self, jobs, k, *, progress=None):
                self.asked.append(("force", [(j.index, j.start, j.context, j.forced) for j in jobs]))
                out = [list(j.forced) if follow else [0] + list(j.forced[1:]) for j in jobs]
                return [ForcedRows(steps=rows(t), tokens=t, text=f"forced {j.index}", finish_reason="length")
                        for j, t in zip(jobs, out)]

            def _score_rows(self, jobs, k, *, progress=None):
                self.asked.append(("score", [(j.index, j.context, j.tokens) for j in jobs]))
                return [rows(j.tokens) for j in jobs]

        return Toy()


def test_forced_replay_bookkeeping_is_the_same_for_every_kind(tmp_path):
    from diffcheck.core.errors import EngineError

    ref = make_run([[5, 6, 7, 8], [9, 10], []], prompt_token_ids=[(1, 2), (3,), (4,)], texts=["a", "b", ""],
                   finish_reasons="stop", case_id="R")
    eng = ToyEngine.make(tmp_path)
    seen = []
    run = eng.force(ref, starts=[1, None, 0], progress=lambda done, total: seen.append((done, total)))
    # seq 0 from step 1 (its prompt + the first reference token as context); seq 1 left out; seq 2 has no steps
    assert eng.asked == [("force", [(0, 1, [1, 2, 5], [6, 7, 8])])]
    assert [(q.text, q.finish_reason, q.n_tokens) for q in run.sequences] == [
        ("forced 0", "length", 3), ("", "stop", 0), ("", "stop", 0)]
    assert [q.prompt_token_ids for q in run.sequences] == [(1, 2), (3,), (4,)]
    assert run.steps.seq.tolist() == [0, 0, 0] and run.steps.step.tolist() == [0, 1, 2]
    assert run.steps.token_id.tolist() == [6, 7, 8] and run.steps.topk_ids[:, 0].tolist() == [6, 7, 8]
    assert np.allclose(run.steps.logprob, [-0.06, -0.07, -0.08], rtol=2 ** -7 + 2 ** -11, atol=0)  # their stored form
    assert run.meta.kind == "forced" and run.meta.case_id == "T"
    assert run.meta.source == {"reference": "R", "mechanism": "toy", "from_steps": [1, None, None]}
    assert seen == [(3, 3)] and eng.timings["force_tokens"] == 3 and "force_s" in eng.timings
    full = eng.force(ref)
    assert eng.asked[-1] == ("force", [(0, 0, [1, 2], [5, 6, 7, 8]), (1, 0, [3], [9, 10])])
    assert full.meta.source == {"reference": "R", "mechanism": "toy"}  # every sequence from step 0
    with pytest.raises(ValueError, match="starts has 2 entries for 3 sequences"):
        eng.force(ref, starts=[0, 0])
    with pytest.raises(ValueError, match="seq 1: start 3 is outside its 2 steps"):
        eng.force(ref, starts=[0, 3, None])
    with pytest.raises(EngineError, match=r"did not follow the reference for case 'T' seq 0 \(4 of 4 tokens; mechanism toy\)"):
        ToyEngine.make(tmp_path / "astray", follow=False).force(ref)


def test_scoring_bookkeeping_is_the_same_for_every_kind(tmp_path):
    ref = make_run([[5, 6], [], [9]], prompt_token_ids=[(1, 2), (3,), (4,)], texts=["a", "b", "c"],
                   finish_reasons="stop", kind="forced", case_id="C")
    eng = ToyEngine.make(tmp_path)
    run = eng.score(ref)
    assert eng.asked == [("score", [(0, [1, 2, 5, 6], [5, 6]), (2, [4, 9], [9])])]
    assert [(q.text, q.finish_reason, q.n_tokens) for q in run.sequences] == [
        ("a", "scored", 2), ("", "scored", 0), ("c", "scored", 1)]
    assert run.steps.seq.tolist() == [0, 0, 2] and run.steps.token_id.tolist() == [5, 6, 9]
    assert run.meta.kind == "scored"
    assert run.meta.source == {"scored_run": "C", "scored_kind": "forced", "scorer": "T"}


# -- the server process: signals, ports, stops, logs; the key's way to the server ---------------------------

def test_a_port_another_process_took_is_told_apart_from_a_failed_start():
    from diffcheck.engines.server_process import bind_failed, free_port

    assert bind_failed(8000, "INFO ...\nOSError: [Errno 98] Address already in use\n")
    assert bind_failed(8000, "ERROR [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): "
                             "address already in use\n")
    assert not bind_failed(8000, "ValueError: max_model_len 99999 is larger than the model's 8192\n")
    with socket.socket() as held:  # no log (--verbose): a listener on the port now says it was taken
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert bind_failed(held.getsockname()[1], "")
    assert not bind_failed(free_port(), "")


HANDLERS = """
import os, signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
from diffcheck.engines import server_process as sp
sp._install_handlers()
assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, "an inherited ignore is kept"
assert signal.getsignal(signal.SIGTERM) is sp._on_signal
if sys.argv[1] == "returns":
    sp._HANDLED[signal.SIGTERM] = lambda signum, frame: None  # a handler before ours that returns
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("still running")
"""


@pytest.mark.parametrize("previous", ["default", "returns"])
def test_a_sigterm_stops_the_servers_and_then_the_run(previous):
    """SIGTERM ends diffcheck after its servers are stopped, also where an earlier handler returned normally."""
    proc = subprocess.run([PY, "-c", HANDLERS, previous], capture_output=True, text=True, timeout=EVENTUALLY_S)
    assert "still running" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == (-signal.SIGTERM if previous == "default" else 128 + signal.SIGTERM), proc.stderr


def test_a_server_process_that_outlives_its_sigkill_is_reported_by_pid(monkeypatch, capsys):
    from diffcheck.engines import server_process, vllm_serve

    server = server_process.ServerProcess.__new__(server_process.ServerProcess)
    server.proc = subprocess.Popen([PY, "-c", "pass"])
    server.pgid, server._write_end = server.proc.pid, None
    monkeypatch.setattr(server_process, "_killpg", lambda pgid, sig: None)
    monkeypatch.setattr(server_process, "KILL_WAIT_S", 0.5)
    monkeypatch.setattr(vllm_serve, "group_members", lambda pgid: [4243])  # a process SIGKILL does not end
    server.stop()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"diffcheck: warning: vllm serve (supervisor pid {server.proc.pid}) left processes running "
                   "after SIGKILL: pid 4243"]


def test_a_server_that_cannot_be_stopped_is_reported_and_the_others_still_stop(monkeypatch, capsys):
    from diffcheck.engines import server_process

    stopped = []

    class Server:
        def __init__(self, pid, fails):
            self.proc, self.fails = SimpleNamespace(pid=pid), fails

        def stop(self):
            if self.fails:
                raise PermissionError(1, "Operation not permitted")
            stopped.append(self.proc.pid)

    monkeypatch.setattr(server_process, "_LIVE", {Server(4242, True), Server(4243, False)})
    server_process.stop_all()
    assert stopped == [4243]
    assert capsys.readouterr().err.splitlines() == [
        "diffcheck: warning: could not stop vllm serve (supervisor pid 4242): PermissionError: "
        "[Errno 1] Operation not permitted"]


def test_engine_logs_go_to_one_private_directory_per_process(tmp_path):
    from diffcheck.engines.vllm_logs import private_log_dir

    folder = private_log_dir(tmp_path)
    assert folder.parent == tmp_path and folder.name.startswith("diffcheck-logs-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert private_log_dir(tmp_path) == folder  # one per process, kept
    assert private_log_dir(tmp_path / "elsewhere").parent == tmp_path / "elsewhere"


def _attached(base_url: str, key_env: str | None = KEY_ENV):
    """An openai engine's connection to `base_url` as `_attach` sets it up (no request sent)."""
    from diffcheck.engines.openai_server import OpenAIServer

    eng = OpenAIServer.__new__(OpenAIServer)
    eng.case, eng.base_url, eng._key, eng.request_timeout_s = SimpleNamespace(id="P"), base_url, None, 30.0
    eng.requested = {"kind": "openai", "base_url": base_url, "api_key_env": key_env}
    eng.server = None
    eng._attach()
    return eng


def test_a_key_sent_in_clear_to_another_machine_gets_one_warning(monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, "sekrit-key")
    _attached("http://10.1.2.3:8000/v1")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("diffcheck: warning: case 'P': engine.base_url http://10.1.2.3:8000 ")
    assert "in clear" in err[0] and f"${KEY_ENV}" in err[0] and "sekrit-key" not in err[0]
    for quiet, key_env in (("https://10.1.2.3:8000/v1", KEY_ENV), ("http://127.0.0.1:8000/v1", KEY_ENV),
                           ("http://10.1.2.3:8000/v1", None)):
        _attached(quiet, key_env)
        assert capsys.readouterr().err == "", quiet


def test_the_key_never_follows_a_redirect(monkeypatch):
    """A server's redirect is an error: urllib's stock opener would resend the Authorization header to the
    URL the server names (shown below), one the user never named."""
    import http.server
    import urllib.request

    from diffcheck.core.errors import EngineError

    heard = []

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            heard.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)

    class Redirecting(Elsewhere):
        def do_GET(self):
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{elsewhere.server_port}/collect")
            self.end_headers()

    redirecting = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    for server in (elsewhere, redirecting):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv(KEY_ENV, "sekrit-key")
        eng = _attached(f"http://127.0.0.1:{redirecting.server_port}/v1")
        with pytest.raises(EngineError, match="answered HTTP 307 to the model list for case 'P'"):
            eng._model_list()
        assert heard == []
        stock = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        stock.open(urllib.request.Request(f"http://127.0.0.1:{redirecting.server_port}/v1/models",
                                          headers={"Authorization": "Bearer sekrit-key"}), timeout=30).read()
        assert heard == ["Bearer sekrit-key"]  # what the engine's opener refused to do
    finally:
        for server in (elsewhere, redirecting):
            server.shutdown()
            server.server_close()


# -- a vllm serve that diffcheck starts ----------------------------------------------------------------

@engine
def test_started_server_candidate_compared_with_an_offline_golden(ctx):
    """`diffcheck compare SV`: J's config through vllm serve on loopback against J's offline golden.

    What differs between the two, on this machine: nothing. The served run is token- and
    logprob-identical to the offline golden (one batched /v1/completions request with
    token-id prompts: the same batch and the same ids), and the server's forced replay
    (diffcheck's processor, vllm_xargs) matches the golden at every step.
    """
    report = ctx["tmp"] / "reports" / "SV.json"
    report.parent.mkdir(exist_ok=True)
    rc, out, err, watch = _cli(ctx, ["compare", "SV", "--json", str(report)])
    assert rc == 0, out + err
    assert "signals: generate, forced replay" in out + err
    (v,) = _verdicts(report).values()
    assert v["verdict"] in ("IDENTICAL", "BENIGN_DRIFT"), v
    cand, golden = _read(ctx, "SV.run.parquet"), _read(ctx, "J.parquet")
    forced = _read(ctx, "SV.forced-J.parquet")
    assert cand.meta.engine["name"] == "openai" and cand.meta.engine["mode"] == "started"
    assert forced.meta.source["mechanism"] == "v1_logits_processor via vllm_xargs"
    assert [s.prompt_token_ids for s in cand.sequences] == [s.prompt_token_ids for s in golden.sequences]
    print(f"SV vs J: {v['verdict']}; tokens equal: {np.array_equal(cand.steps.token_id, golden.steps.token_id)}; "
          f"max |dlogprob| generate {np.nanmax(np.abs(cand.steps.logprob - golden.steps.logprob)):.3g}, "
          f"forced {np.nanmax(np.abs(forced.steps.logprob - golden.steps.logprob)):.3g}")
    # every step of the forced replay came from the server, teacher-forced along the golden
    assert np.array_equal(forced.steps.token_id, golden.steps.token_id)
    assert np.allclose(forced.steps.logprob, golden.steps.logprob, atol=0.05)
    # the server: on loopback, its key random, in its environment only, written nowhere
    (server,) = watch.servers()
    cmdline = watch.seen[server]["cmdline"]
    assert cmdline[cmdline.index("--host") + 1] == "127.0.0.1"
    key = watch.environ[server].get("VLLM_API_KEY")
    assert key and len(key) >= 32 and not any(key in " ".join(i["cmdline"]) for i in watch.seen.values())
    assert key not in out + err + _everything_written(ctx)
    # its log: in a private directory (mode 0700) of the diffcheck process, kept after the run
    logs = list(ctx["logs"].glob("diffcheck-logs-*/diffcheck-kinds-SV-*.server.log"))
    assert logs and all(stat.S_IMODE(log.parent.stat().st_mode) == 0o700 for log in logs), logs
    _no_survivors(watch)


def _wait_for(pred, what: str, said: Lines):
    """The first true value of `pred`, polled until it comes; fails with what diffcheck said if it ends first."""
    deadline = time.monotonic() + EVENTUALLY_S
    while time.monotonic() < deadline and said.proc.poll() is None:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} (diffcheck {'ended' if said.proc.poll() is not None else 'still runs'}); "
                         f"it said: {said.text()[-3000:]}")


def _error_lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


@engine
def test_server_killed_mid_run_is_an_error_verdict_exit_3_in_one_line(ctx):
    proc = _start_cli(ctx, ["compare", "SK", "--force"])
    watch = Descendants(proc.pid)
    said = Lines(proc)
    try:
        # Said once the server answers, right before the 2 x 900-token generation request goes out.
        said.wait_for("SK: engine up in")
        (server,) = watch.servers()
        os.kill(server, signal.SIGKILL)
        text = said.wait_end()
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    assert proc.returncode == 3, text
    assert "Traceback" not in text
    lines = _error_lines(text, "vllm serve exited on SIGKILL during generation for case 'SK'")
    assert len(lines) == 1 and "ERROR" in text, text
    _no_survivors(watch)


@engine
def test_server_never_healthy_is_an_error_verdict_exit_3(ctx):
    rc, out, err, watch = _cli(ctx, ["compare", "SV", "--force"], DIFFCHECK_SERVER_START_TIMEOUT_S="3")
    assert rc == 3, out + err
    assert len(_error_lines(out + err, "vllm serve was not healthy within 3s")) == 1, out + err
    assert "Traceback" not in out + err
    _no_survivors(watch)


def _sigint_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_interrupts_diffcheck_started_with_sigint_ignored():
    """A shell without job control starts a background job (a script's ``make test &``, some CI runners) with
    SIGINT ignored, and Python then raises no KeyboardInterrupt: diffcheck's main puts Ctrl-C back."""
    code = ("import os, signal, time\n"
            "from diffcheck.cli import main\n"
            "main(['--version'])\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "    print('SIGINT ignored')\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, preexec_fn=_sigint_ignored,
                          timeout=EVENTUALLY_S)
    assert proc.stdout.splitlines()[-1:] == ["interrupted"], proc.stdout + proc.stderr


@engine
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "crash"])
def test_no_server_outlives_diffcheck_interrupted_or_killed(ctx, how):
    """Ctrl-C, a SIGTERM, or a SIGKILL (nothing of diffcheck's can run) while the server starts: diffcheck
    ends non-zero and nothing it started is left.

    The Ctrl-C case starts diffcheck with SIGINT ignored, as a shell without job control starts a
    background job: Python then raises no KeyboardInterrupt, and this test once saw diffcheck finish
    the run it was sent SIGINT in and exit 0 (in a fresh clone, the suite run in the background).
    diffcheck's main puts Ctrl-C back, so the case covers a terminal's Ctrl-C too.
    """
    proc = _start_cli(ctx, ["run", "SV", "--force"], preexec_fn=_sigint_ignored if how == signal.SIGINT else None)
    watch = Descendants(proc.pid)
    said = Lines(proc)
    try:
        # the engine core is a grandchild of the server: wait until the whole tree exists
        _wait_for(watch.engine_cores, "engine process of the server", said)
        proc.send_signal(how)
        text = said.wait_end()
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    assert proc.returncode != 0 and proc.returncode in (130, -how, 128 + how), (
        f"diffcheck exited {proc.returncode} after {how.name}; it said: {text[-3000:]}")
    _no_survivors(watch)


# -- a server that already runs (base_url) ----------------------------------------------------------------

class ExternalServer:
    """A vllm serve this test starts itself (vLLM's own module, not diffcheck's launcher), key in its env."""

    def __init__(self, key: str, log: Path):
        from diffcheck.engines.models import resolve

        model = resolve("smollm2-135m").path
        env = {**os.environ, "VLLM_API_KEY": key, "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(EXT_PORT), "--served-model-name", EXT_NAME, "--dtype", "float32", "--enforce-eager",
             "--max-model-len", "1024", "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching",
             "--disable-log-stats"], env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        import urllib.request

        deadline = time.monotonic() + EVENTUALLY_S
        while True:
            assert self.proc.poll() is None, f"the test's vllm serve exited: see {log}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{EXT_PORT}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the test's vllm serve was not healthy after {EVENTUALLY_S}s"
            time.sleep(0.5)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def external(ctx):
    key = "dc-test-key-" + os.urandom(12).hex()
    server = ExternalServer(key, ctx["logs"] / "external-server.log")
    try:
        yield {"key": key, "server": server}
    finally:
        server.stop()


@engine
def test_base_url_candidate_runs_with_no_code_changes(ctx, external):
    key = external["key"]
    rc, out, err, watch = _cli(ctx, ["run", "BU", "--force"], **{KEY_ENV: key})
    assert rc == 0, out + err
    run = _read(ctx, "BU.run.parquet")
    assert run.meta.engine["mode"] == "base_url" and run.meta.engine["served_model_name"] == EXT_NAME
    assert run.meta.engine["requested"]["api_key_env"] == KEY_ENV
    assert run.n_tokens == 48 and not (ctx["root"] / "kinds" / "BU.forced-J.parquet").exists()
    assert key not in out + err + _everything_written(ctx)
    assert watch.servers() == []  # diffcheck started no server of its own
    _no_survivors(watch)


@engine
def test_base_url_errors_are_one_line_with_the_servers_text_and_never_the_key(ctx, external):
    key = external["key"]
    rc, out, err, _ = _cli(ctx, ["compare", "BW", "--force"], **{KEY_ENV: key})
    assert rc == 3 and "ERROR" in out, out + err
    assert len(_error_lines(out + err, "The model `no-such-model` does not exist")) == 1, out + err
    assert "HTTP 404" in out + err
    wrong = "not-" + key
    rc, out2, err2, _ = _cli(ctx, ["run", "BU", "--force"], **{KEY_ENV: wrong})
    assert rc == 3 and len(_error_lines(err2, "HTTP 401")) == 1 and "Unauthorized" in err2, out2 + err2
    rc, out3, err3, _ = _cli(ctx, ["run", "BU", "--force"])  # the variable is not set at all
    assert rc == 2 and f"engine.api_key_env names {KEY_ENV}, which is not set" in err3, out3 + err3
    said = out + err + out2 + err2 + out3 + err3
    assert "Traceback" not in said
    everything = said + _everything_written(ctx)  # runs, reports and every server log
    assert key not in everything and wrong not in everything


@engine
def test_base_url_run_judged_after_the_server_stops_says_what_it_lacked(ctx, external):
    external["server"].stop()  # one engine at a time: the reference engine may be needed to score
    report = ctx["tmp"] / "reports" / "BU.json"
    report.parent.mkdir(exist_ok=True)
    run_file = ctx["root"] / "kinds" / "BU.run.parquet"
    rc, out, err, watch = _cli(ctx, ["compare", "BU", "--run", str(run_file), "--json", str(report)])
    assert rc == 0, out + err
    assert "forced replay: not available on engine openai (base_url)" in out + err
    (v,) = _verdicts(report).values()
    assert v["summary"]["signals"]["unavailable"] == ["forced replay: not available on engine openai (base_url)"]
    assert v["verdict"] in ("IDENTICAL", "BENIGN_DRIFT"), v
    assert external["key"] not in out + err + _everything_written(ctx)
    _no_survivors(watch)


# -- hf: the independent reference ----------------------------------------------------------------------

@engine
def test_hf_greedy_is_bit_reproducible_on_vllms_prompt_ids(ctx):
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    suite = cases.load_suite(ctx["suite_path"])
    golden = _read(ctx, "J.parquet")
    with sessionmod.open_engine(cases.get_case(suite, "HG")) as eng:
        assert eng.prompt_token_ids() == [list(s.prompt_token_ids) for s in golden.sequences]
        a, b = eng.generate(), eng.generate()
        forced = eng.force(a)
    assert np.array_equal(a.steps.token_id, b.steps.token_id)
    assert np.array_equal(a.steps.logprob, b.steps.logprob)
    assert np.array_equal(a.steps.topk_logprobs, b.steps.topk_logprobs)
    # greedy: every token is its step's top-1
    assert np.array_equal(a.steps.token_id, a.steps.topk_ids[:, 0])
    # teacher forcing (one forward pass) against the KV-cached generation: fp32 rounding only
    assert np.abs(forced.steps.logprob - a.steps.logprob).max() < 1e-3


@engine
def test_vllm_J_against_the_hf_reference_within_the_floor_or_explained(ctx):
    """J's config (vLLM eager fp32) against HF through forced replay and scoring: inside HF's floor.

    In memory the two differ by fp32 rounding (measured: at most 2e-5 nats per step,
    bench/bench_engine_kinds.py); the stored runs keep 6 mantissa bits of each logprob
    (0.83 % relative, docs/golden-format.md), so stored, they differ by at most one
    storage step on either side, and the same top-1 wins nearly everywhere.
    """
    report = ctx["tmp"] / "reports" / "JH.json"
    report.parent.mkdir(exist_ok=True)
    rc, out, err, watch = _cli(ctx, ["compare", "JH", "--json", str(report)])
    assert rc == 0, out + err
    verdicts = _verdicts(report)
    assert verdicts["J"]["verdict"] == "IDENTICAL", verdicts["J"]
    # the samplers differ (hf.py), so the texts part: BENIGN_DRIFT at best, judged on the forced path
    assert verdicts["HF"]["verdict"] in ("IDENTICAL", "BENIGN_DRIFT"), verdicts["HF"]
    signals = verdicts["HF"]["summary"]["signals"]
    assert signals["forced"] and signals["floor"]
    hf, forced = _read(ctx, "HF.parquet"), _read(ctx, "JH.forced-HF.parquet")
    assert forced.meta.engine["name"] == "vllm" and hf.meta.engine["name"] == "hf"
    assert np.array_equal(forced.steps.token_id, hf.steps.token_id)
    diff = np.abs(forced.steps.logprob - hf.steps.logprob)
    assert np.all(diff <= 2 * 0.0083 * np.abs(hf.steps.logprob) + 1e-4), float(diff.max())
    same_top1 = (forced.steps.topk_ids[:, 0] == hf.steps.topk_ids[:, 0]).mean()
    assert same_top1 >= 0.95
    # the texts parted, so HF scored J's text: the candidate's tokens with HF's logprobs
    assert signals["scored"]
    scored, cand = _read(ctx, "JH.scored-HF.parquet"), _read(ctx, "JH.run.parquet")
    assert scored.meta.engine["name"] == "hf" and np.array_equal(scored.steps.token_id, cand.steps.token_id)
    diff_scored = np.abs(scored.steps.logprob - cand.steps.logprob)
    assert np.all(diff_scored <= 2 * 0.0083 * np.abs(cand.steps.logprob) + 1e-4), float(diff_scored.max())
    print(f"JH vs HF: {verdicts['HF']['verdict']}; stored forced max |dlogprob| {diff.max():.3g}; "
          f"same top-1 {same_top1:.3f}; steps with equal stored logprobs {(diff == 0).mean():.3f}")
    _no_survivors(watch)


@engine
def test_a_fault_in_both_vllm_reference_and_candidate_shows_only_against_hf(ctx):
    """The point of an independent reference: a bug the vLLM reference shares is invisible against it."""
    rc, out, err, _ = _cli(ctx, ["golden", "record", "JE"])
    assert rc == 0, out + err
    report = ctx["tmp"] / "reports" / "CE.json"
    rc, out, err, watch = _cli(ctx, ["compare", "CE", "--json", str(report)])
    assert rc == 1, out + err
    verdicts = _verdicts(report)
    assert verdicts["JE"]["verdict"] in ("IDENTICAL", "BENIGN_DRIFT"), verdicts["JE"]
    assert verdicts["HF"]["verdict"] in ("GIBBERISH", "DEGRADED"), verdicts["HF"]
    print(f"CE vs JE: {verdicts['JE']['verdict']}; CE vs HF: {verdicts['HF']['verdict']}")
    _no_survivors(watch)
