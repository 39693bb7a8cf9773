"""The per-sequence plot of the HTML report: one inline SVG of a sequence's series over steps.

Knows how to draw a `SequenceVerdict`'s per-step series as SVG paths; judges nothing.
The top panel is the divergence curve (the first present of ``forced_kl``, ``kl``,
``forced_dlogprob``, ``dlogprob``: the forced path is preferred because it compares
both engines on the same tokens at every step), the bottom panel the reference NLL of
the candidate's tokens (``ref_nll_candidate``) beside that of the reference's own
tokens (``ref_nll_reference``); dashed t* and solid onset markers cross both. Curves
are decimated to min/max per pixel bucket, so the size stays bounded and spikes survive.
"""

from __future__ import annotations

import math

import numpy as np

from diffcheck.core.types import SequenceVerdict
from diffcheck.report import escape_html as _e

# Distinctive colours: the browser test finds the curves in a screenshot by them.
DIVERGENCE_COLOUR = "#e6007e"  # magenta
NLL_CANDIDATE_COLOUR = "#0050ff"  # blue
NLL_REFERENCE_COLOUR = "#20a040"  # green
T_STAR_COLOUR = "#ff8c00"  # orange
ONSET_COLOUR = "#c00000"  # dark red

DIVERGENCE_SERIES = (
    ("forced_kl", "KL, forced on reference tokens"),
    ("kl", "KL"),
    ("forced_dlogprob", "Δlogprob, forced on reference tokens"),
    ("dlogprob", "Δlogprob"),
)
NLL_SERIES = (
    ("ref_nll_candidate", "reference NLL of candidate tokens", NLL_CANDIDATE_COLOUR),
    ("ref_nll_reference", "reference NLL of reference tokens", NLL_REFERENCE_COLOUR),
)

# Plot geometry (SVG user units; the SVG scales to the page width).
_W, _LEFT, _RIGHT = 960, 64, 16
_LEGEND_H, _PANEL_H, _GAP, _AXIS_H = 28, 140, 34, 36
_BUCKET_PX = 3.0


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo
    if span <= 0 or not math.isfinite(span):
        return [lo]
    raw = span / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return ticks


def _path_d(x: np.ndarray, y: np.ndarray) -> str:
    """SVG path data through finite points, broken at NaN, min/max-decimated per bucket."""
    valid = np.isfinite(y)
    idx = np.flatnonzero(valid)
    if idx.size == 0:
        return ""
    parts = []
    for segment in np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1):
        xs, ys = x[segment], y[segment]
        if xs.size > 2 * (xs[-1] - xs[0]) / _BUCKET_PX + 4:
            bucket = np.floor((xs - xs[0]) / _BUCKET_PX).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
            keep = []
            for a, b in zip(starts, np.r_[starts[1:], xs.size]):
                lo, hi = a + int(np.argmin(ys[a:b])), a + int(np.argmax(ys[a:b]))
                keep += sorted({lo, hi})
            xs, ys = xs[keep], ys[keep]
        points = " L".join(f"{px:.1f},{py:.1f}" for px, py in zip(xs, ys))
        parts.append("M" + points if xs.size > 1 else f"M{xs[0]:.1f},{ys[0]:.1f} h0.01")
    return " ".join(parts)


def _series(sequence: SequenceVerdict, name: str) -> np.ndarray | None:
    values = sequence.series.get(name)
    if values is None:
        return None
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    return array if np.isfinite(array).any() or np.isinf(array).any() else None


def _panel(
    *, top: float, curves: list[tuple[np.ndarray, str, str]], x_of, title: str
) -> list[str]:
    """One panel: frame, y ticks and grid, and a <path> per curve."""
    finite = np.concatenate([c[np.isfinite(c)] for c, _, _ in curves])
    lo = min(0.0, float(finite.min())) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 1.0
    if hi - lo < 1e-12:
        hi = lo + (abs(lo) * 0.1 or 1.0)
    hi += (hi - lo) * 0.05
    bottom = top + _PANEL_H

    def y_of(values):
        clipped = np.clip(values, lo, hi)  # ±inf stay visible at the panel edge
        return bottom - (clipped - lo) / (hi - lo) * _PANEL_H

    out = [f'<rect x="{_LEFT}" y="{top}" width="{_W - _LEFT - _RIGHT}" height="{_PANEL_H}" class="frame"/>']
    for tick in _nice_ticks(lo, hi):
        ty = float(y_of(np.array(tick)))
        out.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{ty:.1f}" y2="{ty:.1f}" class="grid"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{ty + 4:.1f}" class="ytick">{tick:.4g}</text>')
    out.append(
        f'<text x="14" y="{top + _PANEL_H / 2:.0f}" class="ylabel" '
        f'transform="rotate(-90 14 {top + _PANEL_H / 2:.0f})">{_e(title)}</text>'
    )
    for values, colour, css in curves:
        d = _path_d(x_of(np.arange(values.size)), y_of(values))
        if d:
            out.append(f'<path d="{d}" class="curve {css}" stroke="{colour}"/>')
    return out


def plot_svg(sequence: SequenceVerdict) -> str:
    """The inline SVG plot of one sequence's series; "" when it has none to draw."""
    present = ((_series(sequence, name), label) for name, label in DIVERGENCE_SERIES)
    divergence = next(((values, label) for values, label in present if values is not None), None)
    nll = [(_series(sequence, name), label, colour, name) for name, label, colour in NLL_SERIES]
    nll = [item for item in nll if item[0] is not None]
    if divergence is None and not nll:
        return ""
    lengths = [divergence[0].size] if divergence else []
    lengths += [item[0].size for item in nll]
    n_steps = max(lengths + [sequence.reference_len, sequence.candidate_len, 2])
    plot_w = _W - _LEFT - _RIGHT

    def x_of(steps):
        return _LEFT + np.asarray(steps, dtype=np.float64) / (n_steps - 1) * plot_w

    panels, legend = [], []
    top = _LEGEND_H
    if divergence is not None:
        panels += _panel(
            top=top, curves=[(divergence[0], DIVERGENCE_COLOUR, "divergence")], x_of=x_of,
            title="KL" if "KL" in divergence[1] else "Δlogprob",
        )
        legend.append((divergence[1], DIVERGENCE_COLOUR, ""))
        top += _PANEL_H + _GAP
    if nll:
        panels += _panel(
            top=top, curves=[(v, colour, name.replace("_", "-")) for v, _, colour, name in nll], x_of=x_of,
            title="NLL (nats)",
        )
        legend += [(label, colour, "") for _, label, colour, _ in nll]
        top += _PANEL_H + _GAP
    plot_bottom = top - _GAP
    height = plot_bottom + _AXIS_H

    out = [
        f'<svg class="plot" viewBox="0 0 {_W} {height:.0f}" width="{_W}" height="{height:.0f}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img">',
        f"<title>seq {sequence.index}: per-step curves</title>",
        *panels,
    ]
    for tick in _nice_ticks(0, n_steps - 1, 8):
        tx = float(x_of(tick))
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{plot_bottom}" y2="{plot_bottom + 4}" class="axis"/>')
        out.append(f'<text x="{tx:.1f}" y="{plot_bottom + 16}" class="xtick">{int(round(tick))}</text>')
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{plot_bottom + 32}" class="xlabel">step</text>')
    for step, label, colour, dash, dy in (
        (sequence.t_star, "t*", T_STAR_COLOUR, "6 4", 0),
        (sequence.onset, "onset", ONSET_COLOUR, "", 12 if sequence.onset == sequence.t_star else 0),
    ):
        if step is None:
            continue
        mx = float(x_of(min(step, n_steps - 1)))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{_LEGEND_H}" y2="{plot_bottom}" '
            f'stroke="{colour}" class="marker"{dash_attr}/>'
        )
        # Near the right edge the label goes left of its line so it stays inside the plot.
        anchor, tx = ("end", mx - 3) if mx > _W - _RIGHT - 80 else ("start", mx + 3)
        out.append(
            f'<text x="{tx:.1f}" y="{_LEGEND_H + 11 + dy}" fill="{colour}" class="mlabel" '
            f'text-anchor="{anchor}">{label}={step}</text>'
        )
        legend.append((label, colour, dash))
    x = _LEFT
    for label, colour, dash in legend:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{x}" x2="{x + 22}" y1="12" y2="12" stroke="{colour}" class="swatch"{dash_attr}/>')
        out.append(f'<text x="{x + 27}" y="16" class="legend">{_e(label)}</text>')
        x += 36 + 6.5 * len(label)
    out.append("</svg>")
    return "\n".join(out)
