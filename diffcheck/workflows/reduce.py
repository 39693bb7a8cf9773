"""``diffcheck reduce``: shrink a failing comparison to a smallest case that fails the same way.

The order (docs/reduce.md): the config delta from the reference (ddmin over its units,
`judging.reduce.delta_units`), the prompts (ddmin), the decode steps (bisection between
the onset and the original max_tokens), the batch (does it fail alone, max_num_seqs = 1?).

Every probe is an ordinary comparison (`workflows.compare.compare`) of a derived case
(`cases.derive`: its own id ``<case>.r<hex>``, so its runs and ledger rows are its own)
against the reference's golden cut to the probe's prompts and steps
(`judging.align.prefix_view`), with the reference's full noise floor and the same policy.
The ledger makes a repeated probe free, so a reduce interrupted by Ctrl-C resumes where it
stopped. A probe *still fails* only when its verdict is the original's class; an engine
failure is raised (`EngineError`), never read as "does not fail". The reference engine
that scores candidates' texts is kept open for the whole reduce.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from diffcheck import cases as casesmod
from diffcheck.cases import derive as derivemod
from diffcheck.core.errors import ConfigError, DiffcheckError, EngineError
from diffcheck.core.types import CaseVerdict, Run, Verdict
from diffcheck.judging import reduce as search
from diffcheck.judging.align import prefix_view

Echo = Callable[[str], None]
REDUCIBLE = (Verdict.GIBBERISH, Verdict.DEGRADED)


@dataclass(frozen=True)
class Probe:
    n: int
    stage: str  # original | delta | prompts | steps | batch
    case_id: str
    prompts: tuple[str, ...]
    max_tokens: int
    delta: tuple[str, ...]  # the delta units kept (labels)
    verdict: str
    still_fails: bool
    reused: bool  # the ledger held this run: no engine ran
    seconds: float
    engine: dict[str, Any] = field(default_factory=dict)  # engine overrides (the batch probe)


@dataclass(frozen=True)
class ReduceResult:
    kind: ClassVar[str] = "reduce"

    suite: str
    case_id: str
    reference_id: str
    verdict: str  # the class every accepted probe kept
    original: CaseVerdict
    final: CaseVerdict
    minimal: Any  # the reduced Case
    reference_case: Any  # the reference's configuration on the reduced prompts and steps
    prompts: tuple  # its Prompts
    prompt_token_ids: dict[str, list[int]]
    max_tokens: int
    original_prompts: int
    original_max_tokens: int
    onset: int | None
    t_star: int | None
    dropped: tuple[str, ...]
    kept: tuple[str, ...]
    config_delta: dict[str, Any]
    fails_alone: bool | None  # with max_num_seqs = 1 (None: not asked)
    batch_note: str
    probes: tuple[Probe, ...]
    bound: int
    seconds: float
    versions: dict[str, Any]
    script: dict[str, Any]  # what the standalone script needs (report.reduce renders it)
    files: dict[str, str] = field(default_factory=dict)
    command: str = ""

    @property
    def engine_probes(self) -> int:
        return sum(1 for p in self.probes if not p.reused)

    @property
    def saved(self) -> int:
        return sum(1 for p in self.probes if p.reused)


def _ref_for(case, reference: str | None) -> str:
    if reference is None:
        if not case.references:
            raise ConfigError(f"{casesmod.display_path(case.source)}: case '{case.id}' has no references: "
                              "reduce needs a candidate and the reference it fails against")
        return case.references[0]
    if reference not in case.references:
        raise ConfigError(f"--reference {reference}: not a reference of case '{case.id}' "
                          f"(valid: {', '.join(case.references)})")
    return reference


class _Prober:
    """Runs probes: derived cases compared against the cut golden, memoized by config digest."""

    def __init__(self, suite, case, ref_case, *, root: Path, out: Path, echo: Echo, verbose: bool, session,
                 decode):
        self.suite, self.case, self.ref, self.root, self.out = suite, case, ref_case, root, out
        self.echo, self.verbose, self.session, self.decode = echo, verbose, session, decode
        self.prompts = casesmod.load_prompts(case)
        self.probes: list[Probe] = []
        self.memo: dict[str, tuple[bool, CaseVerdict, Any]] = {}
        self.klass: Verdict | None = None
        self.units = search.delta_units(case, ref_case)

    def prompts_file(self, ids: tuple[str, ...]) -> Path:
        if ids == tuple(p.id for p in self.prompts):
            return self.case.prompts_file
        from diffcheck.report import atomic_write_text

        chosen = [p for p in self.prompts if p.id in ids]
        text = derivemod.prompts_toml(chosen, header=f"prompts of a reduce probe of {self.case.id}")
        import blake3

        path = self.out / "probes" / f"prompts-{blake3.blake3(text.encode()).hexdigest()[:10]}.toml"
        if not path.exists() or path.read_text() != text:
            atomic_write_text(path, text)
        return path

    def derive(self, kept: tuple, ids: tuple[str, ...], max_tokens: int, engine: dict | None = None):
        keep = {k for u in kept for k in u.keys}
        drop = [k for u in self.units for k in u.keys if k not in keep]
        return derivemod.derive(self.case, self.ref, drop=drop, prompts_file=self.prompts_file(ids),
                                max_tokens=max_tokens, engine=engine)

    def __call__(self, stage: str, kept: tuple, ids: tuple[str, ...], max_tokens: int,
                 engine: dict | None = None) -> tuple[bool, CaseVerdict, Any]:
        from diffcheck.workflows.compare import compare

        probe = self.derive(kept, ids, max_tokens, engine)
        digest = casesmod.config_digest(probe)
        if digest in self.memo:
            return self.memo[digest]
        suite = dataclasses.replace(self.suite, cases={**self.suite.cases, probe.id: probe})
        t0 = time.perf_counter()
        comparison = compare(suite, probe.id, root=self.root, echo=self.echo if self.verbose else _quiet,
                             verbose=self.verbose, session=self.session, candidate_session=self.session,
                             view=lambda g: prefix_view(g, ids, max_tokens, decode=self.decode))
        seconds = time.perf_counter() - t0
        verdict = next(v for v in comparison.verdicts if v.reference_id == self.ref.id)
        if verdict.verdict is Verdict.ERROR:
            raise EngineError(f"reduce {self.case.id}: probe {len(self.probes) + 1} ({probe.id}) failed: "
                              f"{verdict.error}")
        if self.klass is None:
            self.klass = verdict.verdict
        still = verdict.verdict is self.klass
        reused = bool(comparison.reused)
        n = len(self.probes) + 1
        self.probes.append(Probe(n=n, stage=stage, case_id=probe.id, prompts=tuple(ids), max_tokens=max_tokens,
                                 delta=tuple(u.label for u in kept), verdict=verdict.verdict.name, still_fails=still,
                                 reused=reused, seconds=seconds, engine=dict(engine or {})))
        what = ("still " + verdict.verdict.name if still else
                f"{verdict.verdict.name}: not {self.klass.name}") if stage != "original" else verdict.verdict.name
        delta = "; delta " + (", ".join(u.label for u in kept) or "none")
        extra = "".join(f"; {k}={v}" for k, v in (engine or {}).items())
        self.echo(f"reduce {self.case.id}: probe {n} ({stage}: prompts {len(ids)} of {len(self.prompts)}, "
                  f"{max_tokens} tokens{delta}{extra}): {what}{' (ledger)' if reused else ''} [{seconds:.0f}s]")
        self.memo[digest] = (still, verdict, (probe, comparison))
        return self.memo[digest]


def _quiet(_: str) -> None:
    pass


def _onset(verdict: CaseVerdict) -> tuple[int | None, int | None]:
    """The earliest gibberish onset and the earliest t* among the failing sequences."""
    bad = [s for s in verdict.sequences if s.verdict is verdict.verdict] or list(verdict.sequences)
    onsets = [s.onset for s in bad if s.onset is not None]
    stars = [s.t_star for s in bad if s.t_star is not None]
    return (min(onsets) if onsets else None), (min(stars) if stars else None)


def reduce(suite, case_id: str, *, root: Path, out: Path, reference: str | None = None, echo: Echo = print,
           verbose: bool = False, command: str = "") -> ReduceResult:
    """Reduce candidate `case_id` of `suite` against `reference` (default: its first); see the module."""
    from diffcheck.engines import models
    from diffcheck.engines import session as sessionmod

    t0 = time.perf_counter()
    case = casesmod.get_case(suite, case_id)
    if case.role != "candidate":
        raise ConfigError(f"{casesmod.display_path(case.source)}: case '{case_id}' is a {case.role}: reduce takes "
                          "a candidate that fails against its reference")
    ref_case = casesmod.get_case(suite, _ref_for(case, reference))
    out = Path(out)
    tok = models.load_tokenizer(case.model)
    decode = (lambda ids: tok.decode(ids)) if tok is not None else None
    full_golden = _golden(root, suite.name, ref_case.id)
    all_ids = tuple(p.id for p in casesmod.load_prompts(case))
    max_tokens = case.sampling.max_tokens or max(s.n_tokens for s in full_golden.sequences)
    with sessionmod.EngineSession(verbose=verbose) as session:
        prober = _Prober(suite, case, ref_case, root=root, out=out, echo=echo, verbose=verbose, session=session,
                         decode=decode)
        units = tuple(prober.units)
        still, original, _ = prober("original", units, all_ids, max_tokens)
        if original.verdict not in REDUCIBLE:
            raise DiffcheckError(f"reduce {case_id}: its comparison against {ref_case.id} is "
                                 f"{original.verdict.name}, not GIBBERISH or DEGRADED: nothing to reduce")
        # 1. the config delta
        kept = units
        if len(units) > 1:
            kept = search.ddmin(units, lambda sub: prober("delta", sub, all_ids, max_tokens)[0])
        elif units:
            pass  # one unit: the failure needs it (without the delta the case is the reference)
        # 2. the prompts
        ids = all_ids
        if len(ids) > 1:
            ids = search.ddmin(ids, lambda sub: prober("prompts", kept, sub, max_tokens)[0])
        # 3. the decode steps: the smallest failing max_tokens between the onset and the original
        last = prober("prompts", kept, ids, max_tokens)[1]
        onset, t_star = _onset(last)
        lo = max(1, (onset if onset is not None else (t_star if t_star is not None else 0)) + 1)
        steps = max_tokens
        if lo < max_tokens:
            steps = search.smallest_failing(lo, max_tokens, lambda t: prober("steps", kept, ids, t)[0])
        # 4. the batch
        fails_alone, note = None, ""
        if len(ids) == 1:
            note = "one prompt: it fails alone (batch size 1)"
            fails_alone = True
        else:
            alone = prober("batch", kept, ids, steps, engine={"max_num_seqs": 1})[0]
            fails_alone = alone
            note = ("fails with max_num_seqs = 1 too: batching is not needed" if alone else
                    "passes with max_num_seqs = 1: the failure needs a batch")
        still, final, (minimal, comparison) = prober("steps", kept, ids, steps)
    if not still:  # bisection assumes monotone steps; the accepted minimum must fail
        raise DiffcheckError(f"reduce {case_id}: the reduced case {minimal.id} does not fail as {original.verdict.name} "
                             f"({final.verdict.name}); the failure is not monotone in the decode steps")
    onset, t_star = _onset(final)
    prompts = tuple(p for p in casesmod.load_prompts(minimal))
    cand = comparison.candidate
    ref_min = dataclasses.replace(ref_case, prompts_file=minimal.prompts_file,
                                  sampling=dataclasses.replace(ref_case.sampling, max_tokens=steps))
    token_ids = {s.prompt_id: list(s.prompt_token_ids) for s in cand.sequences} if cand is not None else {}
    result = ReduceResult(
        suite=suite.name, case_id=case_id, reference_id=ref_case.id, verdict=original.verdict.name,
        original=original, final=final, minimal=minimal, prompts=prompts,
        reference_case=ref_min, prompt_token_ids=token_ids,
        max_tokens=steps, original_prompts=len(all_ids), original_max_tokens=max_tokens, onset=onset, t_star=t_star,
        dropped=tuple(u.label for u in units if u not in kept), kept=tuple(u.label for u in kept),
        config_delta=casesmod.config_delta(minimal, ref_min), fails_alone=fails_alone, batch_note=note,
        probes=tuple(prober.probes), bound=search.probe_bound(len(all_ids), max_tokens, len(units)),
        seconds=time.perf_counter() - t0, versions=_versions(cand),
        script=_script_spec(minimal, ref_case, token_ids, steps), command=command)
    return result


def _golden(root: Path, suite: str, ref_id: str) -> Run:
    from diffcheck import workspace

    return workspace.load_golden(root, suite, ref_id)


def _versions(run: Run | None) -> dict[str, Any]:
    import platform
    import sys

    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    if run is not None:
        out["vllm"] = run.meta.engine.get("version")
        out["vllm_commit"] = run.meta.engine.get("commit")
        out.update({f"hw_{k}": v for k, v in run.meta.hardware.items()})
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def _script_spec(minimal, ref_case, token_ids: dict, steps: int) -> dict[str, Any]:
    """The two configurations as vLLM arguments, for the standalone script."""
    from diffcheck.engines import models
    from diffcheck.engines.vllm_args import is_cpu, llm_kwargs

    on_cpu = is_cpu()
    sides = {}
    for name, c in (("reference", ref_case), ("candidate", minimal)):
        kw, env = llm_kwargs(dataclasses.asdict(c.engine), str(models.resolve_case(c).path), on_cpu=on_cpu)
        kw.pop("kind", None)
        sides[name] = {"llm": kw, "env": {**env, **c.env}}
    s = minimal.sampling
    sampling = {k: v for k, v in dict(max_tokens=steps, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                      seed=s.seed, ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
                                      stop=list(s.stop) if s.stop else None).items() if v is not None}
    sampling["logprobs"] = max(int(s.logprobs or 0), 5)
    return {"sides": sides, "sampling": sampling, "prompt_token_ids": token_ids,
            "model": str(models.resolve_case(minimal).path), "on_cpu": on_cpu}


def write_case(result: ReduceResult, path: Path) -> tuple[str, str]:
    """Append the reduced case (and a reference with its prompts) to suite file `path`, atomically;
    the new text is loaded back before it replaces the file. Returns the two case ids."""
    from diffcheck.report import atomic_write_text

    path = Path(path)
    stem = path.stem
    cand_id, ref_id = f"{result.case_id}-reduced", f"{result.reference_id}-for-{result.case_id}-reduced"
    prompts_rel = f"prompts/{stem}-{cand_id}.toml"
    prompts_path = path.parent / prompts_rel
    old = path.read_text() if path.exists() else (
        f'[suite]\nname = "{stem}"\ndescription = "reduced cases (diffcheck reduce)"\n')
    ref_case, ref = result.reference_case, result.minimal
    text = (old.rstrip("\n") + "\n\n"
            + f"# diffcheck reduce {result.case_id}: {result.verdict} with {len(result.prompts)} prompt(s), "
              f"{result.max_tokens} tokens, delta {', '.join(result.kept) or 'none'}\n"
            + derivemod.case_toml(ref_case, case_id=ref_id, prompts=prompts_rel, role="reference",
                                  description=f"{result.reference_id} on the prompts of {cand_id}")
            + "\n"
            + derivemod.case_toml(ref, case_id=cand_id, prompts=prompts_rel, role="candidate", references=[ref_id],
                                  description=f"{result.case_id} reduced: {result.verdict} "
                                              f"(diffcheck reduce)"))
    prompts_text = derivemod.prompts_toml(result.prompts, header=f"prompts of {cand_id} (diffcheck reduce)")
    import tomllib

    from diffcheck.cases import parse_suite

    atomic_write_text(prompts_path, prompts_text)  # the suite must see it when loaded back
    try:
        parsed = parse_suite(tomllib.loads(text), path=path)
    except (ConfigError, tomllib.TOMLDecodeError) as exc:
        raise DiffcheckError(f"{path}: the reduced case does not load back ({exc}); the file is unchanged") from None
    if cand_id not in parsed.cases or ref_id not in parsed.cases:
        raise DiffcheckError(f"{path}: the reduced cases are missing after loading back")
    atomic_write_text(path, text)
    return cand_id, ref_id

