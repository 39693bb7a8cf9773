"""The HTML report renders in a real browser: headless Chromium draws the plot.

Needs the Debian package ``chromium``; install it with
``apt-get update && apt-get install -y chromium``. Without it this test fails
(it does not skip): a report nobody can see rendered is not tested.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from diffcheck.report import ReportInput
from diffcheck.report.html import write_html
from diffcheck.report.plot import DIVERGENCE_COLOUR, NLL_CANDIDATE_COLOUR, ONSET_COLOUR
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict

INSTALL = "apt-get update && apt-get install -y chromium"
WINDOW = (1200, 900)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"headless Chromium is needed for the HTML report test; install it with: {INSTALL}")


def gibberish_report(n: int = 400) -> ReportInput:
    rng = np.random.default_rng(7)
    t_star, onset = 150, 220
    kl = np.abs(rng.normal(0, 0.02, n))
    kl[onset:] += np.abs(rng.normal(3, 1, n - onset))
    nll_candidate = np.abs(rng.normal(1.5, 0.6, n))
    nll_candidate[onset:] += 6
    sequence = SequenceVerdict(
        index=0,
        prompt_id="story <1>",
        verdict=Verdict.GIBBERISH,
        t_star=t_star,
        onset=onset,
        shared_prefix=t_star,
        reference_len=n,
        candidate_len=n,
        evidence=("reference NLL of candidate tokens jumps to 7.5 nats at step 220",),
        baselines={"exact_match": False, "check_logprobs_close": True},
        quality={"digit_ratio": 0.4, "weird_runs": 9, "token_count": n},
        series={
            "forced_kl": kl,
            "ref_nll_candidate": nll_candidate,
            "ref_nll_reference": np.abs(rng.normal(1.5, 0.6, n)),
        },
    )
    case = CaseVerdict("O-fp8", "O-eager", Verdict.GIBBERISH, (sequence,), config_delta={"kv": ("auto", "fp8")})
    reference = [f"w{i} " for i in range(n)]
    candidate = reference[:t_star] + [f"{i % 97}<&> " for i in range(t_star, n)]
    return ReportInput([case], {("O-fp8", "O-eager", 0): (reference, candidate)}, {"suite": "browser-test"})


def colour_mask(pixels: np.ndarray, colour: str, tolerance: int = 40) -> np.ndarray:
    target = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int32)
    return np.abs(pixels.astype(np.int32) - target).max(axis=2) <= tolerance


def test_chromium_screenshot_shows_the_plot(tmp_path):
    browser = chromium()
    page = write_html(tmp_path / "report.html", gibberish_report())
    png = tmp_path / "report.png"
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}", page.resolve().as_uri(),
    ]
    env = {**os.environ, "HOME": str(tmp_path)}  # keep Chromium's caches out of the real home
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert png.exists(), f"chromium wrote no screenshot (rc={result.returncode}): {result.stderr[-2000:]}"

    pixels = np.asarray(Image.open(png).convert("RGB"))
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    non_white = (pixels < 235).any(axis=2).mean()
    assert non_white > 0.02, f"the page looks blank ({non_white:.1%} non-white pixels)"

    # Each curve spans the plot horizontally; a legend swatch alone is 22 px wide.
    for name, colour in (("divergence curve", DIVERGENCE_COLOUR), ("candidate NLL curve", NLL_CANDIDATE_COLOUR)):
        ys, xs = np.nonzero(colour_mask(pixels, colour))
        assert xs.size > 300, f"{name} ({colour}): only {xs.size} pixels of its colour in the screenshot"
        width = xs.max() - xs.min()
        assert width > 500, f"{name} ({colour}) spans only {width} px: the plot is not drawn"
    # The KL curve jumps at the onset: its pixels right of the onset marker sit higher than left of it.
    onset_ys, onset_xs = np.nonzero(colour_mask(pixels, ONSET_COLOUR, tolerance=30))
    assert onset_xs.size, "the onset marker is missing"
    marker_x = int(np.bincount(onset_xs).argmax())  # the vertical line's column
    marker_ys = onset_ys[onset_xs == marker_x]
    assert marker_ys.max() - marker_ys.min() > 200, "the onset marker line does not cross the panels"
    ys, xs = np.nonzero(colour_mask(pixels, DIVERGENCE_COLOUR))
    in_plot = ys > marker_ys.min()  # leave out the legend swatch above the panels
    left = ys[in_plot & (xs < marker_x - 5)]
    right = ys[in_plot & (xs > marker_x + 5)]
    assert left.size and right.size and np.median(right) < np.median(left) - 40
