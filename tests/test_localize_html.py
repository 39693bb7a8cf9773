"""The HTML heatmap of `diffcheck localize` (diffcheck.report.localize.render_html), on Localizations
built from synthetic captures through diffcheck.judging.localize (no engine): one map per captured
step, a cell per site, the first beyond cell outlined and labelled, inherited cells marked, the
exact numbers in each cell's title, odd case ids escaped. The browser test is
tests/test_report_html_browser.py."""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
from test_localize import SEQS, SITES, STEPS, capture, downstream, moved, raw, site

from diffcheck.judging import localize as L
from diffcheck.report import registry
from diffcheck.report.localize import LocalizeReport, ratio_colour

ODD = "M<script>alert('x')</script>&\"é"


class Page(HTMLParser):
    """The heatmap cells (their attributes and text), the page's title and its whole text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.cells: list[dict] = []
        self.scripts = 0
        self.text: list[str] = []
        self.title = ""
        self._in: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "td" and "cell" in attrs.get("class", "").split():
            self.cells.append({**attrs, "classes": set(attrs["class"].split()), "label": ""})
        self._in.append(tag)

    def handle_endtag(self, tag):
        while self._in and self._in.pop() != tag:
            pass

    def handle_data(self, data):
        self.text.append(data)
        if self._in and self._in[-1] == "title":
            self.title += data
        if self._in and self._in[-1] == "td" and self.cells:
            self.cells[-1]["label"] += data

    def cell(self, step, site_label):
        found = [c for c in self.cells if c["data-step"] == str(step) and c["data-site"] == site_label]
        assert len(found) == 1, (step, site_label, len(found))
        return found[0]


def report_of(candidate, *, floors=None, case_id="M", step=None, timings=None):
    base = raw()
    loc = L.localize(capture(base, "J"), capture(candidate(base), case_id),
                     np.zeros(len(SITES)) if floors is None else floors, floor_replicas=("restart", "batch3"))
    return LocalizeReport(localization=loc, step=STEPS[-1] if step is None else step, around=len(STEPS) - 1,
                          onset_source="t* of M's stored run", timings=timings or {"J": 1.5, "M": 2.0})


def lost_attention(base):
    """Layer 1's attention goes wrong (relative error exactly 0.3) at the second captured step in sequence 1,
    and everything it reaches from there on."""
    return moved(base, downstream(1, 1, site(1, "self_attn")), 0.3)


def test_one_map_per_step_one_cell_per_site_and_the_first_beyond_outlined_and_labelled():
    page = Page(registry.render("html", report_of(lost_attention)))
    assert len(page.cells) == len(STEPS) * len(SITES)
    for step in STEPS:
        assert [c["data-site"] for c in page.cells if c["data-step"] == str(step)] == [
            L.site_label(*s) for s in SITES]
    first = [c for c in page.cells if "first" in c["classes"]]
    assert len(first) == 1
    cell = first[0]
    assert (cell["data-step"], cell["data-site"]) == (str(STEPS[1]), "layers.1.self_attn")
    assert cell["label"] == "1st" and {"beyond", "own"} <= cell["classes"]
    # The exact numbers: the injected error 0.3, the zero floor, the documented minimum as margin, their ratio.
    title = cell["title"]
    assert "FIRST BEYOND ITS FLOOR" in title and f"step {STEPS[1]}" in title
    assert "relative error 0.3 " in title and "floor 0 " in title and f"margin {L.MIN_RELATIVE_ERROR:g} " in title
    assert f"{0.3 / L.MIN_RELATIVE_ERROR:.6g} x margin" in title
    assert "in this op (judged, sequence 1)" in title
    # Nothing before it moved: its step's earlier sites and every site of the step before are bit-identical.
    before = SITES.index((1, "self_attn"))
    earlier = [c for c in page.cells if c["data-step"] == str(STEPS[1])][:before]
    earlier += [c for c in page.cells if c["data-step"] == str(STEPS[0])]
    assert all("beyond" not in c["classes"] and "bit-identical" in c["title"] for c in earlier)
    assert page.scripts == 0
    text = "".join(page.text)
    assert "first beyond its floor" in text and "layers.1.self_attn" in text
    assert "capture time: J 1.5s, M 2.0s" in text and "floor from restart, batch3" in text
    assert "onset" in text and "t* of M's stored run" in text


def test_what_follows_the_first_is_marked_inherited_and_the_attention_that_is_hit_again_is_own():
    page = Page(registry.render("html", report_of(lost_attention)))
    same_pass = page.cell(STEPS[1], "layers.1.post_attention_layernorm")
    assert {"beyond", "inherited"} <= same_pass["classes"] and "inherited" in same_pass["title"]
    for later in ("layers.1.residual", "layers.2.input_layernorm", "layers.2.self_attn", "layers.2.mlp"):
        assert "inherited" in page.cell(STEPS[1], later)["classes"], later
    # At the next step layer 1's attention is hit again while its input layernorm is inside: own, not inherited.
    again = page.cell(STEPS[2], "layers.1.self_attn")
    assert {"beyond", "own"} <= again["classes"]
    assert "beyond" not in page.cell(STEPS[2], "layers.1.input_layernorm")["classes"]
    # Every beyond cell is own or inherited, never both; the count of beyond cells matches the sites moved.
    beyond = [c for c in page.cells if "beyond" in c["classes"]]
    assert all(len({"own", "inherited"} & c["classes"]) == 1 for c in beyond)
    assert len(beyond) == len(downstream(1, 1, site(1, "self_attn")))


def test_the_worst_others_are_labelled_as_in_the_table():
    report = report_of(lost_attention)
    page = Page(registry.render("html", report))
    for n, f in enumerate(report.localization.worst, 1):
        cell = page.cell(f.step, f.site)
        assert cell["label"] == f"w{n}" and f"worst other site w{n}" in cell["title"]
        assert f"(judged, sequence {f.seq})" in cell["title"]


def test_odd_case_ids_are_escaped_everywhere():
    text = registry.render("html", report_of(lost_attention, case_id=ODD))
    assert "<script>" not in text and ODD not in text
    page = Page(text)
    assert page.scripts == 0
    assert ODD in page.title and ODD in "".join(page.text)


def test_nothing_beyond_its_floor_reads_as_such():
    page = Page(registry.render("html", report_of(lambda base: base.copy())))
    text = "".join(page.text)
    assert "nothing beyond its floor" in text and "0 of 16 sites beyond their floor" in text
    assert not [c for c in page.cells if {"first", "beyond"} & c["classes"]]
    assert all("inside its margin (bit-identical)" in c["title"] for c in page.cells)
    assert all(c["style"] == f"background-color:{ratio_colour(0.0)}" for c in page.cells)


def test_a_move_inside_its_floor_is_coloured_inside_and_its_numbers_shown():
    mlp = site(2, "mlp")
    base = raw()
    replica = moved(base, [(s, k, mlp) for s in range(SEQS) for k in range(len(STEPS))], 1e-3, seed=5)
    floors = L.site_floors(capture(base), [capture(replica)])
    page = Page(registry.render("html", report_of(lambda b: moved(b, [(0, 2, mlp)], 2e-3, seed=6), floors=floors)))
    cell = page.cell(STEPS[2], "layers.2.mlp")
    assert "beyond" not in cell["classes"] and "inside its margin" in cell["title"]
    assert "relative error 0.002 " in cell["title"] and "floor 0.001 " in cell["title"]
    assert "margin 0.004 " in cell["title"] and "0.5 x margin" in cell["title"]
    assert cell["style"] == f"background-color:{ratio_colour(0.5)}"


def test_a_site_not_captured_on_a_side_is_shown_as_such():
    base = raw()
    cand = capture(base.copy(), "M")
    cand.norm[:, 0, site(0, "mlp")] = np.nan
    loc = L.localize(capture(base, "J"), cand, np.zeros(len(SITES)))
    page = Page(registry.render("html", LocalizeReport(localization=loc, step=STEPS[-1], around=2,
                                                       onset_source="--step")))
    cell = page.cell(STEPS[0], "layers.0.mlp")
    assert "na" in cell["classes"] and "not captured" in cell["title"]


def test_the_colour_scale_is_blue_inside_the_margin_red_beyond_and_darker_further_out():
    def rgb(colour):
        return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))

    assert ratio_colour(0.0) == "#ffffff"
    inside = [rgb(ratio_colour(r)) for r in (1e-3, 1e-1, 1.0)]
    beyond = [rgb(ratio_colour(r)) for r in (2.0, 1e2, 1e4)]
    assert all(b > r for r, g, b in inside) and all(r > b for r, g, b in beyond)
    brightness = [sum(c) for c in inside + beyond[1:]]
    assert brightness == sorted(brightness, reverse=True)  # darker as the ratio grows, on each side
    assert ratio_colour(1e9) == ratio_colour(1e5)  # clamped at the scale's end


def test_localize_takes_html_and_it_is_checked_before_anything_runs(tmp_path):
    """--html is wired into `diffcheck localize`: asking for it and --json both on stdout is the registry's
    one-line usage error, before any suite, golden or engine is looked at."""
    from conftest import ROOT

    done = subprocess.run([sys.executable, "-m", "diffcheck", "localize", "M", "--step", "3", "--json", "-",
                           "--html", "-", "--goldens", str(tmp_path / "none")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("diffcheck: error: --json and --html both go to stdout ('-'): only one output "
                                   "can; give the others a FILE")
    helped = subprocess.run([sys.executable, "-m", "diffcheck", "localize", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert "--html FILE" in helped.stdout
