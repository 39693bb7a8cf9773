"""The taps on the real engine: the two ways a hook keeps a layer's numbers agree, and hooks put in at
model load (as an engine with CUDA graphs needs them) capture what hooks put in at the first arm do.

- *eager*: the pre-hook maps each row of the pass to its request and position and the hooks reduce
  only the planned rows;
- *device*: the hooks reduce every row of the pass into persistent buffers with tensor ops alone (what
  a CUDA graph records) and the rows are read back after the forward pass, the way a graph replay's
  are. ``buffered=True`` sends decode-only eager passes this way, so the read-back code runs here,
  without a GPU. The replay itself (no Python) is only on the GPU lane (docs/localize.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ROOT
from factories import write_suite

pytestmark = pytest.mark.engine

STEPS, TOKENS = (0, 1, 2, 3), 5  # step 0: the prefill's last position (eager either way); 1..3 decode passes
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "JP": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "taps installed at model load",
           "env": {"DIFFCHECK_PLUGIN_MODULES": "diffcheck.engines.taps"}},
}


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod
    from diffcheck.engines import taps

    folder = tmp_path_factory.mktemp("taps")
    suite = cases.load_suite(write_suite(
        folder, CASES, name="taps", description="taps engine test", prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
        sampling={"max_tokens": TOKENS, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234, "logprobs": 5},
        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1}))
    quiet = lambda _: None  # noqa: E731
    out = {}
    with sessionmod.EngineSession(taps=True) as session:
        golden = sessionmod.generate(suite.cases["J"], session=session, echo=quiet)
        for cid in ("J", "JP"):
            engine = session.get(suite.cases[cid], quiet)
            out[cid, "eager"] = taps.capture(engine, golden, STEPS)
            out[cid, "buffered"] = taps.capture(engine, golden, STEPS, buffered=True)
            jobs, plan = taps.forcing_plan(golden, STEPS)  # the same, by hand, for the taps' own counts
            engine.worker_rpc("diffcheck_taps_arm", plan, True)
            engine._force_rows(jobs, 1)
            out[cid, "counts"] = engine.worker_rpc("diffcheck_taps_collect")
            engine.worker_rpc("diffcheck_taps_arm", [], False)
            out[cid, "installed"] = engine.worker_rpc("diffcheck_taps_collect")["installed"]
    return golden, out


def _same(a, b):
    from diffcheck.judging.localize import relative_error

    assert a.norm.shape == b.norm.shape and np.isfinite(a.norm).all() and np.isfinite(b.norm).all()
    # Two forward passes of the CPU engine agree to fp32 rounding, not bitwise: under CI's load a fresh
    # engine's first pass differed from later ones by 9.4e-7 relative. A read-back of the wrong row,
    # position or site is off by O(1), so 1e-5 still catches every such slip.
    np.testing.assert_allclose(a.norm, b.norm, rtol=1e-5, atol=0)
    np.testing.assert_allclose(a.proj, b.proj, rtol=1e-5, atol=1e-6 * float(np.abs(b.proj).max()))
    assert float(np.nanmax(relative_error(a, b))) < 1e-5


@pytest.mark.parametrize("cid", ["J", "JP"])
def test_the_device_buffers_read_back_what_the_eager_hooks_keep(captured, cid):
    _, out = captured
    eager, buffered = out[cid, "eager"], out[cid, "buffered"]
    _same(buffered, eager)
    # a norm of a real activation is not 0 anywhere: every planned site was read back, none left at its zero fill
    assert (buffered.norm > 0).all()
    counts = out[cid, "counts"]  # the decode passes went through the buffers; step 0 (a prefill) did not
    assert counts["read_back"] == len(STEPS) - 1 and counts["replayed"] == 0 and counts["passes"] >= len(STEPS)
    assert eager.graph_steps == () and buffered.graph_steps == ()  # no CUDA graph on this lane: nothing replayed


def test_hooks_put_in_at_model_load_capture_what_hooks_put_in_at_arm_do(captured):
    _, out = captured
    assert out["J", "installed"] == "arm" and out["JP", "installed"] == "load"
    _same(out["JP", "eager"], out["J", "eager"])


def test_the_capture_covers_every_site_of_every_planned_step(captured):
    from diffcheck.judging.localize import site_names

    golden, out = captured
    cap = out["J", "eager"]
    assert cap.steps == STEPS and cap.norm.shape == (len(golden.sequences), len(STEPS), len(site_names(cap.n_layers)))
    assert cap.n_layers == 30  # SmolLM2-135M
