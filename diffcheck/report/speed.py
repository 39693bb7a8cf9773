"""Speed of the runs behind a comparison: decode tokens/s of the candidate against each reference.

Every run records its engine's timings (``RunMeta.timings``): ``startup_s``,
``generate_s`` and ``generate_tokens`` (one ``LLM.generate`` call over the whole
prompt set), ``force_s`` and ``force_tokens`` (the forced replay; tokens the engine
produced, which a partial replay keeps below the path's length). Goldens carry
theirs, so a report can say "FULL graph is 10x faster and correct" in one place.

`speed_summary` turns the runs into plain JSON values (what the JSON report's
``speed`` key holds and the HTML and terminal reports render); it judges nothing
and never fails on a run without timings (those fields are null). A ratio is given
only where both sides have a rate, and says whether the hardware was the same.
"""

from __future__ import annotations

from typing import Any, Mapping

from diffcheck.core.types import Run

NOTE = ("decode tokens/s: generated tokens over the wall time of one generate call for the whole prompt set "
        "(prefill included; a fresh engine's first call, so JIT and autotuning are in it); forced tokens/s: forced "
        "steps the engine produced over the replay's time")


def _num(value) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if f == f else None  # NaN -> None


def _rate(tokens, seconds) -> float | None:
    tokens, seconds = _num(tokens), _num(seconds)
    return tokens / seconds if tokens is not None and seconds else None


def hardware_label(run: Run) -> str:
    hw = run.meta.hardware or {}
    return str(hw.get("gpu_name") or hw.get("cpu_model") or hw.get("machine") or "")


def engine_label(run: Run) -> str:
    eff = (run.meta.engine or {}).get("effective") or {}
    parts = [eff.get("attention_backend"), eff.get("cudagraph_mode"), eff.get("compile_mode"), eff.get("dtype")]
    return ", ".join(str(p) for p in parts if p not in (None, ""))


def run_speed(run: Run, role: str) -> dict[str, Any]:
    """One run's timings: start-up, generation (tokens, seconds, tokens/s)."""
    t = run.meta.timings or {}
    tokens = t.get("generate_tokens", run.n_tokens if "generate_s" in t else None)
    return {
        "role": role,
        "case": run.meta.case_id,
        "engine": engine_label(run),
        "hardware": hardware_label(run),
        "startup_s": _num(t.get("startup_s")),
        "generate_tokens": None if tokens is None else int(tokens),
        "generate_s": _num(t.get("generate_s")),
        "decode_tokens_per_s": _rate(tokens, t.get("generate_s")),
    }


def forced_speed(forced: Run) -> dict[str, Any]:
    """A forced run's replay: mode, steps produced by the engine, seconds, tokens/s."""
    t = forced.meta.timings or {}
    src = forced.meta.source or {}
    produced = t.get("force_tokens")
    if produced is None and "force_s" in t and src.get("replay", "full") == "full":
        produced = forced.n_tokens  # a full replay produces the whole path
    return {
        "reference": src.get("reference"),
        "replay": src.get("replay", "full"),
        "path_steps": forced.n_tokens,
        "forced_tokens": None if produced is None else int(produced),
        "force_s": _num(t.get("force_s")),
        "forced_tokens_per_s": _rate(produced, t.get("force_s")),
        "replayed": list(src.get("replayed") or []),
        "reused": list(src.get("reused") or []),
        "replayed_full": list(src.get("replayed_full") or []),
    }


def speed_summary(candidate: Run | None, references: Mapping[str, Run],
                  forced: Mapping[str, Run] | None = None) -> dict[str, Any] | None:
    """Timings of the candidate, its forced replays and each reference golden, and the candidate's
    decode speed-up over each reference. None without a candidate run."""
    if candidate is None:
        return None
    cand = run_speed(candidate, "candidate")
    cand["forced"] = [forced_speed(f) for _, f in sorted((forced or {}).items())]
    refs = [run_speed(run, "reference") for _, run in sorted(references.items())]
    ratios = []
    for ref in refs:
        a, b = cand["decode_tokens_per_s"], ref["decode_tokens_per_s"]
        ratios.append({
            "candidate": cand["case"], "reference": ref["case"],
            "decode_speedup": a / b if a is not None and b else None,
            "same_hardware": bool(cand["hardware"]) and cand["hardware"] == ref["hardware"],
        })
    return {"note": NOTE, "runs": [cand, *refs], "ratios": ratios}


def speed_lines(summary: Mapping[str, Any] | None) -> list[str]:
    """Plain lines for terminals and logs: one per run, one per forced replay, one per ratio."""
    if not summary:
        return []
    lines = []
    for run in summary["runs"]:
        rate = run["decode_tokens_per_s"]
        what = (f"{run['generate_tokens']} tokens in {run['generate_s']:.2f} s = {rate:.0f} tok/s" if rate is not None
                else "no timings recorded")
        start = f"; start-up {run['startup_s']:.1f} s" if run["startup_s"] is not None else ""
        lines.append(f"{run['role']} {run['case']} ({run['engine'] or '?'}; {run['hardware'] or '?'}): {what}{start}")
        for f in run.get("forced", ()):
            if f["forced_tokens_per_s"] is not None:
                lines.append(f"  forced along {f['reference']} ({f['replay']}): {f['forced_tokens']} of "
                             f"{f['path_steps']} steps in {f['force_s']:.2f} s = {f['forced_tokens_per_s']:.0f} tok/s")
            elif f["force_s"] == 0.0:
                lines.append(f"  forced along {f['reference']} ({f['replay']}): nothing to replay, "
                             f"{f['path_steps']} steps from its own generation")
            for r in f.get("replayed_full", ()):
                lines.append(f"  sequence {r['seq']} replayed from step 0: its replay from t*={r['from_step']} did not "
                             f"reproduce the generation there (KL {r['kl']:.2g})")
    for r in summary["ratios"]:
        if r["decode_speedup"] is not None:
            hw = "" if r["same_hardware"] else " (different hardware: not comparable)"
            lines.append(f"{r['candidate']} decodes {r['decode_speedup']:.2f}x as fast as {r['reference']}{hw}")
    return lines
