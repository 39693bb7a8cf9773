"""The engine kinds on the real engines: ``openai`` (a vllm serve diffcheck starts, or one at base_url) and ``hf``.

One suite, one goldens root for the module; real engines only, one at a time (the
base_url server is stopped before anything else starts). Every CLI call runs in a
subprocess whose descendants are watched with psutil (an oracle independent of
diffcheck's own /proc scan), so a test can say that no server or engine process
outlived it. Test time on the 2-core machine: about 6 minutes, most of it server and
engine start-ups.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from factories import write_suite

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SMOKE = {"max_tokens": 24, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234, "logprobs": 20}
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1}
KEY_ENV = "DC_TEST_SERVER_KEY"
EXT_NAME = "smol-ext"


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
                    info = {"create": p.create_time(), "cmdline": p.cmdline(), "pgid": os.getpgid(p.pid)}
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
        return [pid for pid, i in self.seen.items() if any("--served-model-name" in c for c in i["cmdline"])
                and not any("diffcheck.engines.vllm_serve" in c for c in i["cmdline"])]

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

    def wait_gone(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


def _env(ctx, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCHECK_")}
    env.update(DIFFCHECK_GOLDENS=str(ctx["root"]), TMPDIR=str(ctx["logs"]), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _start_cli(ctx, args, **env) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "diffcheck", *args, "--suite", str(ctx["suite_path"])], cwd=ctx["tmp"],
                            env=_env(ctx, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _cli(ctx, args, timeout=480, **env):
    """Run the CLI, watching its descendants; (returncode, stdout, stderr, Descendants)."""
    proc = _start_cli(ctx, args, **env)
    watch = Descendants(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    return proc.returncode, out, err, watch


def _no_survivors(watch: Descendants, timeout: float = 5.0):
    left = watch.wait_gone(timeout)
    assert not left, f"processes outlived the command: {left}"


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
    rc, out, err, _ = _cli(c, ["calibrate", "HF"], timeout=300)
    assert rc == 0, out + err
    return c


def _read(ctx, name):
    from diffcheck.storage import store

    return store.read_run(ctx["root"] / "kinds" / name)


def _verdicts(path: Path) -> dict[str, dict]:
    data = json.loads(Path(path).read_text())
    return {c["reference_id"]: c for c in data["cases"]}


# -- the openai engine, without a server ---------------------------------------------------------------

def test_serve_args_are_what_vllm_serve_parses(tmp_path):
    """The case's engine table as flags: vLLM's own serve parser gives back the offline engine's arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from diffcheck.engines.openai_server import serve_args
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
    from diffcheck.engines.openai_server import _prompt_position, _step_logprobs
    from diffcheck.engines.vllm_outputs import steps_from_logprobs

    block = {"tokens": ["token_id:7", "token_id:5"], "token_logprobs": [-3.0, -0.1],
             "top_logprobs": [{"token_id:7": -3.0, "token_id:1": -0.5, "token_id:2": -1.0},  # 7 outside the top-2
                              {"token_id:5": -0.1, "token_id:9": -2.5}]}  # 5 is the top-1
    steps = steps_from_logprobs([7, 5], _step_logprobs([7, 5], block, 2), 2)
    assert steps["topk_ids"].tolist() == [[1, 2], [5, 9]]
    assert steps["topk_logprobs"].tolist() == [[-0.5, -1.0], [-0.10000000149011612, -2.5]]
    assert steps["logprob"].tolist() == [-3.0, np.float32(-0.1)]
    scored = _prompt_position({"4": {"logprob": -9999.0, "rank": 300, "decoded_token": "x"},
                               "8": {"logprob": -0.2, "rank": 1, "decoded_token": "y"}})
    steps = steps_from_logprobs([4], [scored], 2)
    assert steps["logprob"][0] == -np.inf and steps["topk_ids"].tolist() == [[8, -1]]


# -- a vllm serve that diffcheck starts ----------------------------------------------------------------

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
    assert list(ctx["logs"].glob("diffcheck-kinds-SV-*.server.log"))
    _no_survivors(watch)


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _listening(pid: int) -> bool:
    import psutil

    try:
        return any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())
    except psutil.Error:
        return False


def _error_lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


def test_server_killed_mid_run_is_an_error_verdict_exit_3_in_one_line(ctx):
    proc = _start_cli(ctx, ["compare", "SK", "--force"])
    watch = Descendants(proc.pid)
    try:
        server = _wait_for(lambda: (watch.servers() or [None])[0], 120, "the server process")
        _wait_for(lambda: _listening(server), 240, "the server to listen")
        time.sleep(4)  # /v1/models, /version, then the 2 x 900-token generation (tens of seconds here)
        os.kill(server, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    assert proc.returncode == 3, out + err
    assert "Traceback" not in out + err
    lines = _error_lines(out + err, "vllm serve exited on SIGKILL during generation for case 'SK'")
    assert len(lines) == 1 and "ERROR" in out, out + err
    _no_survivors(watch, timeout=30)


def test_server_never_healthy_is_an_error_verdict_exit_3(ctx):
    rc, out, err, watch = _cli(ctx, ["compare", "SV", "--force"], DIFFCHECK_SERVER_START_TIMEOUT_S="3")
    assert rc == 3, out + err
    assert len(_error_lines(out + err, "vllm serve was not healthy within 3s")) == 1, out + err
    assert "Traceback" not in out + err
    _no_survivors(watch, timeout=10)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "crash"])
def test_no_server_outlives_diffcheck_interrupted_or_killed(ctx, how):
    """Ctrl-C, a SIGTERM, or a SIGKILL (nothing of diffcheck's can run) while the server starts: nothing is left."""
    proc = _start_cli(ctx, ["run", "SV", "--force"])
    watch = Descendants(proc.pid)
    try:
        # the engine core is a grandchild of the server: wait until the whole tree exists
        try:
            _wait_for(lambda: watch.servers() and len(watch.seen) >= 3, 300, "the server's engine process")
        except AssertionError as exc:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{exc}; seen {watch.seen}; diffcheck said: {(out + err)[-3000:]}") from None
        proc.send_signal(how)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    assert proc.returncode in (130, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL, 128 + how), proc.returncode
    _no_survivors(watch, timeout=40)


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

        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, f"the test's vllm serve exited: see {log}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{EXT_PORT}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the test's vllm serve did not become healthy"
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

def test_hf_greedy_is_bit_reproducible_on_vllms_prompt_ids(ctx):
    from diffcheck import cases
    from diffcheck.workflows import runner

    suite = cases.load_suite(ctx["suite_path"])
    golden = _read(ctx, "J.parquet")
    with runner.open_engine(cases.get_case(suite, "HG")) as eng:
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
