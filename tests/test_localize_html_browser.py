"""The localize heatmap renders in a real browser: headless Chromium lays out the maps and draws the
first beyond cell where a reader sees it.

Needs the Debian package ``chromium`` (``apt-get update && apt-get install -y chromium``, `make browser`).
Without it this test fails (it does not skip), as tests/test_report_html_browser.py does.

The page is built from synthetic captures of a SmolLM2-sized model (30 layers, 7 captured steps)
through diffcheck.judging.localize: layer 12's attention goes wrong at step 33, and everything it
reaches after it.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
from PIL import Image
from test_report_html_browser import chromium, colour_mask

from diffcheck.judging import localize as L
from diffcheck.report import registry
from diffcheck.report.localize import FIRST_COLOUR, LocalizeReport, ratio_colour

WINDOW = (1400, 1100)
N_LAYERS, STEPS, SEQS, DIM = 30, tuple(range(30, 37)), 2, 32
SITES = L.site_names(N_LAYERS)
BAD_LAYER, BAD_STEP = 12, 33

# Run after the page has laid out: what a reader would see of the first beyond cell, into the DOM that
# --dump-dom prints. Only the probe copy of the page gets it; the page itself has no script.
PROBE = """<script>
window.addEventListener('load', () => {
  const cells = document.querySelectorAll('td.cell');
  const first = document.querySelectorAll('td.cell.first');
  const out = {cells: cells.length, firsts: first.length, width: innerWidth, height: innerHeight};
  if (first.length) {
    const f = first[0], r = f.getBoundingClientRect(), style = getComputedStyle(f);
    out.first = {site: f.dataset.site, step: f.dataset.step, text: f.textContent, left: r.left, top: r.top,
                 width: r.width, height: r.height, outline: style.outlineColor, outlineWidth: style.outlineWidth,
                 background: style.backgroundColor,
                 onTop: document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2) === f};
  }
  out.sized = [...cells].filter(c => {
    const r = c.getBoundingClientRect(); return r.width >= 10 && r.height >= 8;
  }).length;
  out.backgrounds = [...new Set([...cells].map(c => getComputedStyle(c).backgroundColor))];
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def page(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.normal(size=(SEQS, len(STEPS), len(SITES), DIM))
    cand = base.copy()
    k0, bad = STEPS.index(BAD_STEP), SITES.index((BAD_LAYER, "self_attn"))
    where = [(0, k0, i) for i in range(bad, len(SITES))]
    where += [(s, k, i) for s in range(SEQS) for k in range(k0 + 1, len(STEPS)) for i in range(bad, len(SITES))]
    for n, (s, k, i) in enumerate(where):  # errors from 1e-3 to 0.3: several colours beyond the margin
        noise = rng.normal(size=DIM)
        size = 10 ** (-3 + 2.5 * n / len(where))
        cand[s, k, i] += noise / np.linalg.norm(noise) * size * np.linalg.norm(base[s, k, i])

    def capture(v, case_id):
        return L.Capture(case_id=case_id, n_layers=N_LAYERS, steps=STEPS, norm=np.linalg.norm(v, axis=-1), proj=v)

    loc = L.localize(capture(base, "J"), capture(cand, "M12 <&>"), np.zeros(len(SITES)), floor_replicas=("restart",))
    report = LocalizeReport(localization=loc, step=STEPS[-1], around=len(STEPS) - 1, onset_source="--step")
    path = tmp_path / "localize.html"
    path.write_text(registry.render("html", report), encoding="utf-8")
    return path


def run_chromium(tmp_path, url, *args):
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'profile'}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}", *args, url,
    ]
    env = {**os.environ, "HOME": str(tmp_path)}  # keep Chromium's caches out of the real home
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)


def test_chromium_lays_out_the_maps_and_shows_the_first_beyond_cell(tmp_path):
    path = page(tmp_path)
    probe = tmp_path / "probe.html"
    probe.write_text(path.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = run_chromium(tmp_path, probe.resolve().as_uri(), "--dump-dom", "--virtual-time-budget=5000")
    assert '<pre id="probe">' in dom.stdout, \
        f"chromium printed no laid-out page (rc={dom.returncode}): {dom.stderr[-2000:]}"
    seen = json.loads(dom.stdout.split('<pre id="probe">')[1].split("</pre>")[0].replace("&amp;", "&")
                      .replace("&lt;", "<").replace("&gt;", ">"))
    assert seen["cells"] == len(STEPS) * len(SITES) and seen["sized"] == seen["cells"], seen
    assert len(seen["backgrounds"]) >= 5, f"the cells are not coloured apart: {seen['backgrounds']}"
    assert seen["firsts"] == 1
    first = seen["first"]
    assert (first["site"], first["step"], first["text"]) == (f"layers.{BAD_LAYER}.self_attn", str(BAD_STEP), "1st")
    # Visible without scrolling, not covered by anything, outlined in its colour.
    assert 0 <= first["left"] and first["left"] + first["width"] <= seen["width"], first
    assert 0 <= first["top"] and first["top"] + first["height"] <= seen["height"], first
    assert first["onTop"], "another element covers the first beyond cell"
    rgb = tuple(int(FIRST_COLOUR[i:i + 2], 16) for i in (1, 3, 5))
    assert first["outline"] == "rgb(%d, %d, %d)" % rgb and float(first["outlineWidth"].rstrip("px")) >= 2

    # The screenshot of the page itself (no probe): the outline is drawn around that box.
    png = tmp_path / "localize.png"
    shot = run_chromium(tmp_path, path.resolve().as_uri(), f"--screenshot={png}")
    assert png.exists(), f"chromium wrote no screenshot (rc={shot.returncode}): {shot.stderr[-2000:]}"
    pixels = np.asarray(Image.open(png).convert("RGB"))
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    left, top = int(first["left"]), int(first["top"])
    right, bottom = int(first["left"] + first["width"]), int(first["top"] + first["height"])
    outline = colour_mask(pixels, FIRST_COLOUR, tolerance=30)
    ring = outline[top - 4:bottom + 4, left - 4:right + 4]
    for name, edge in (("top", ring[:5]), ("bottom", ring[-5:]), ("left", ring[:, :5]), ("right", ring[:, -5:])):
        assert edge.any(axis=1 if name in ("top", "bottom") else 0).sum() >= 3, f"no outline on the {name} edge"
    # The cell itself is painted in its colour (beyond: the scale's red end, not the outline's).
    inside = pixels[top + 3:bottom - 3, left + 3:right - 3].reshape(-1, 3).astype(int)
    red, blue = inside[:, 0].mean(), inside[:, 2].mean()
    assert red > blue + 40, f"the first beyond cell is not painted beyond-red (mean RGB {inside.mean(axis=0)})"
    # The rest of the map is drawn: the cells beyond in the scale's dark reds cover real area.
    dark = colour_mask(pixels, ratio_colour(10 ** 4.5), tolerance=60)
    assert dark.sum() > 2000, f"only {dark.sum()} pixels of the map's beyond colours"
