"""Where in the model a candidate first leaves its noise floor: pure arithmetic on captured taps.

Input: `Capture` objects (what `diffcheck.engines.taps` brings back from an engine; here only
arrays): per sequence, captured step and *site* (the embedding, then per decoder layer its
input layernorm, attention output, post-attention layernorm, MLP output and the residual
stream after the layer, in the order the model computes them), the L2 norm of the tensor's
row for that token and its projection on ``m`` fixed Gaussian directions (entries N(0, 1/m)).

- The relative error of a site between two sides, ``||a - b|| / ||b||``, is estimated as
  ``||P a - P b|| / ||b||``: unbiased in the square (E||P v||^2 = ||v||^2), with a spread of about
  ``sqrt(2 / m)`` (18 % at m = 64); exactly 0 when the two tensors are equal.
- The floor of a site is the largest relative error any floor replica (the reference under a
  harmless perturbation) shows against the reference, over every captured step and sequence.
- A site is *beyond* when its error exceeds ``max(factor x floor, minimum)``: `factor` is the margin
  rule of the verdicts (`Tolerances.floor_factor`), `minimum` a documented resolution where a
  floor is exactly 0 (fp32 CPU replicas often are).
- The answer is the first beyond site in the order the model computes them (steps first, then
  sites in model order), with its ratio to its margin, whether its inputs were still inside
  their floors (else it *inherited* a bad input), and the five worst other sites.

No engine, no file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diffcheck.judging.tolerances import Tolerances

OPS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "residual")
EMBED = "embed"
MIN_RELATIVE_ERROR = 1e-5  # the margin where a measured floor is 0: well above fp32 rounding (~1e-7) of one op


def site_names(n_layers: int) -> list[tuple[int | None, str]]:
    """(layer, op) of every site in compute order: the embedding (layer None), then each layer's ops."""
    return [(None, EMBED)] + [(layer, op) for layer in range(n_layers) for op in OPS]


def site_label(layer: int | None, op: str) -> str:
    return op if layer is None else f"layers.{layer}.{op}"


def site_inputs(site: int) -> list[int]:
    """The sites whose values feed `site` in the same forward pass (none for the embedding).

    input_layernorm <- the residual stream before the layer; self_attn <- input_layernorm;
    post_attention_layernorm <- self_attn and the residual stream before the layer (their sum);
    mlp <- post_attention_layernorm; residual <- mlp, self_attn and the stream before the layer.
    """
    if site == 0:
        return []
    layer, k = divmod(site - 1, len(OPS))
    before = site - 1 - k  # the previous layer's residual, or the embedding for layer 0
    base = site - k  # this layer's input_layernorm
    op = OPS[k]
    return {
        "input_layernorm": [before],
        "self_attn": [base],
        "post_attention_layernorm": [base + 1, before],
        "mlp": [base + 2],
        "residual": [base + 3, base + 1, before],
    }[op]


@dataclass(frozen=True)
class Capture:
    """One side's taps: ``norm[seq, step, site]``, ``proj[seq, step, site, m]`` (NaN: not captured)."""

    case_id: str
    n_layers: int
    steps: tuple[int, ...]
    norm: np.ndarray
    proj: np.ndarray
    graph_steps: tuple[int, ...] = ()  # steps read back from CUDA-graph replays (in-graph taps); the rest ran eager

    @property
    def sites(self) -> list[tuple[int | None, str]]:
        return site_names(self.n_layers)


def relative_error(a: Capture, b: Capture) -> np.ndarray:
    """``||a - b|| / ||b||`` per [seq, step, site] (from the projections; 0 where both are 0, NaN where not
    captured on both sides). `b` is the reference side."""
    if a.n_layers != b.n_layers or a.steps != b.steps or a.norm.shape != b.norm.shape:
        raise ValueError(f"captures of {a.case_id} and {b.case_id} do not match (layers, steps or sequences)")
    diff = np.linalg.norm(a.proj - b.proj, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / b.norm)
    return np.where(np.isfinite(a.norm) & np.isfinite(b.norm), rel, np.nan)


def site_floors(reference: Capture, replicas: list[Capture]) -> np.ndarray:
    """Per site, the largest relative error of any replica against the reference (0 with no replica)."""
    floors = np.zeros(reference.norm.shape[-1])
    for replica in replicas:
        rel = relative_error(replica, reference)
        floors = np.maximum(floors, np.nanmax(np.nan_to_num(rel, nan=0.0), axis=(0, 1)))
    return floors


@dataclass(frozen=True)
class Finding:
    """One site at one step and sequence, against its margin."""

    seq: int
    step: int
    layer: int | None
    op: str
    relative_error: float
    floor: float
    margin: float
    inherited: bool  # an input of it was already beyond its own margin (this step, or for attention an earlier one)
    inputs: tuple[tuple[str, float, float], ...] = ()  # (site, relative error, margin) of each input

    @property
    def site(self) -> str:
        return site_label(self.layer, self.op)

    @property
    def ratio(self) -> float:
        return self.relative_error / self.margin if self.margin else float("inf")

    def to_dict(self) -> dict:
        return {"seq": self.seq, "step": self.step, "layer": self.layer, "op": self.op, "site": self.site,
                "relative_error": self.relative_error, "floor": self.floor, "margin": self.margin,
                "ratio": self.ratio, "inherited": self.inherited,
                "inputs": [{"site": s, "relative_error": e, "margin": m, "beyond": bool(e > m)}
                           for s, e, m in self.inputs]}


@dataclass(frozen=True)
class Localization:
    """The answer: the first site beyond its floor in model order (None: nothing left its floor)."""

    candidate: str
    reference: str
    steps: tuple[int, ...]
    n_layers: int
    first: Finding | None
    worst: tuple[Finding, ...]  # the worst other sites (one finding per site, largest ratio first)
    floors: np.ndarray  # per site
    margins: np.ndarray  # per site
    worst_by_step: np.ndarray  # [step, site]: the largest relative error over the sequences
    beyond_sites: int  # sites beyond at some step
    factor: float
    minimum: float
    floor_replicas: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def sites(self) -> list[tuple[int | None, str]]:
        return site_names(self.n_layers)

    def to_dict(self) -> dict:
        names = [site_label(layer, op) for layer, op in self.sites]
        return {
            "candidate": self.candidate, "reference": self.reference, "steps": list(self.steps),
            "n_layers": self.n_layers, "factor": self.factor, "minimum": self.minimum,
            "floor_replicas": list(self.floor_replicas),
            "first": self.first.to_dict() if self.first else None,
            "worst": [f.to_dict() for f in self.worst], "beyond_sites": self.beyond_sites,
            "sites": names, "floors": [float(x) for x in self.floors], "margins": [float(x) for x in self.margins],
            "relative_error_by_step": {str(t): [None if not np.isfinite(x) else float(x) for x in row]
                                       for t, row in zip(self.steps, self.worst_by_step)},
            "notes": list(self.notes),
        }


def _finding(rel, beyond, margins, floors, names, s, k, site) -> Finding:
    layer, op = names[site]
    inputs = site_inputs(site)
    inherited = any(beyond[s, k, i] for i in inputs)
    if op == "self_attn":  # attention also reads the keys and values its input wrote at earlier steps
        inherited |= bool(beyond[s, :k, inputs[0]].any())
    return Finding(seq=s, step=-1, layer=layer, op=op, relative_error=float(rel[s, k, site]), floor=float(floors[site]),
                   margin=float(margins[site]), inherited=bool(inherited),
                   inputs=tuple((site_label(*names[i]), float(rel[s, k, i]), float(margins[i])) for i in inputs))


def localize(reference: Capture, candidate: Capture, floors: np.ndarray, *, factor: float | None = None,
             minimum: float = MIN_RELATIVE_ERROR, floor_replicas: tuple[str, ...] = (), n_worst: int = 5) -> Localization:
    """The first (step, layer, op) of `candidate` beyond its floor against `reference`, in model order."""
    import dataclasses

    factor = Tolerances().floor_factor if factor is None else factor
    rel = relative_error(candidate, reference)
    margins = np.maximum(factor * np.asarray(floors, float), minimum)
    beyond = np.nan_to_num(rel, nan=0.0) > margins
    names = site_names(reference.n_layers)
    steps = reference.steps
    first = None
    for k in range(len(steps)):
        hits = np.argwhere(beyond[:, k, :])  # (seq, site) rows
        if len(hits):
            site = int(hits[:, 1].min())
            seqs = hits[hits[:, 1] == site, 0]
            s = int(max(seqs, key=lambda q: rel[q, k, site]))
            first = dataclasses.replace(_finding(rel, beyond, margins, floors, names, s, k, site), step=steps[k])
            break
    best: dict[int, Finding] = {}
    for s, k, site in np.argwhere(beyond):
        f = dataclasses.replace(_finding(rel, beyond, margins, floors, names, int(s), int(k), int(site)),
                                step=steps[int(k)])
        if first is not None and (f.layer, f.op) == (first.layer, first.op):
            continue
        if site not in best or f.ratio > best[site].ratio:
            best[int(site)] = f
    worst = tuple(sorted(best.values(), key=lambda f: -f.ratio)[:n_worst])
    notes = []
    largest = float(np.max(floors)) if len(floors) else 0.0
    if factor * largest <= minimum:
        notes.append(f"every site's floor is {'exactly 0' if largest == 0 else f'at most {largest:.2g}'} "
                     f"({len(floor_replicas)} replica(s)): the margins are the minimum relative error {minimum:g}")
    for side in (candidate, reference):
        if side.graph_steps:
            eager = [t for t in steps if t not in side.graph_steps]
            notes.append(f"{side.case_id}: step(s) {', '.join(map(str, side.graph_steps))} read back from CUDA-graph "
                         "replays (taps recorded in the graph)"
                         + (f"; step(s) {', '.join(map(str, eager))} ran eager" if eager else ""))
    if first is not None and first.step == steps[0]:
        notes.append(f"already beyond at the first captured step {steps[0]}: the departure may be earlier "
                     "(a larger --around or an earlier --step shows it)")
    with np.errstate(all="ignore"):
        worst_by_step = np.nanmax(rel, axis=0) if rel.shape[0] else np.zeros(rel.shape[1:])
    return Localization(candidate=candidate.case_id, reference=reference.case_id, steps=tuple(steps),
                        n_layers=reference.n_layers, first=first, worst=worst, floors=np.asarray(floors, float),
                        margins=margins, worst_by_step=worst_by_step, beyond_sites=int(beyond.any(axis=(0, 1)).sum()),
                        factor=factor, minimum=minimum, floor_replicas=tuple(floor_replicas), notes=tuple(notes))
