"""The taps' pure parts: which rows of a forward pass are planned, the plugin variable, and localize's
captures stored beside the goldens (written once, verified, reused only under the key they were made with)."""

from __future__ import annotations

import numpy as np
import pytest

from diffcheck.core.errors import DataError


def test_planned_rows_maps_rows_to_requests_by_prompt_and_position():
    from diffcheck.engines.taps import planned_rows

    plan = {"a": (0, {10: 0, 11: 1}), "b": (1, {5: 2})}
    # a prefill of request "b" (positions 0..5) then a decode row of "a" (position 11) and one of "x" (unplanned)
    keys, starts, positions = ["b", "a", "x"], [0, 6, 7, 8], [0, 1, 2, 3, 4, 5, 11, 11]
    assert planned_rows(plan, keys, starts, positions) == [(5, 1, 2), (6, 0, 1)]
    assert planned_rows(plan, ["x"], [0, 1], [10]) == []


def test_plugin_env_adds_the_taps_module_once_after_the_cases_own():
    from diffcheck.engines.taps import PLUGIN_MODULE, plugin_env

    assert plugin_env({})["DIFFCHECK_PLUGIN_MODULES"] == PLUGIN_MODULE
    got = plugin_env({"DIFFCHECK_PLUGIN_MODULES": "toyplugin", "X": "1"})
    assert got == {"DIFFCHECK_PLUGIN_MODULES": f"toyplugin,{PLUGIN_MODULE}", "X": "1"}
    assert plugin_env(got) == got


def _capture(steps=(3, 4, 5), graph_steps=(4, 5)):
    from diffcheck.judging.localize import Capture, site_names

    rng = np.random.default_rng(7)
    n_sites = len(site_names(2))
    norm = rng.uniform(1, 2, size=(2, len(steps), n_sites))
    proj = rng.normal(size=(2, len(steps), n_sites, 64))
    return Capture(case_id="H", n_layers=2, steps=tuple(steps), norm=norm, proj=proj, graph_steps=tuple(graph_steps))


def test_a_stored_capture_is_reused_only_under_its_key_and_cut_to_the_steps_asked(tmp_path):
    from diffcheck import workspace
    from diffcheck.storage import store

    cap = _capture()
    path = workspace.capture_path(tmp_path, "s", "H", "J")
    assert path.name == "H.taps-J.npz"
    key = {"config": "c1", "golden": "g1"}
    workspace.store_capture(path, cap, key, engine={"cudagraph_mode": "FULL_DECODE_ONLY"})
    back = workspace.load_capture(path, key, (4, 5))
    assert back.steps == (4, 5) and back.graph_steps == (4, 5) and back.case_id == "H"
    np.testing.assert_array_equal(back.proj, cap.proj[:, 1:])
    np.testing.assert_array_equal(back.norm, cap.norm[:, 1:])
    assert workspace.load_capture(path, {"config": "c2", "golden": "g1"}, (4, 5)) is None  # another configuration
    assert workspace.load_capture(path, key, (2, 3)) is None  # a step it does not hold
    assert all(r.ok for r in store.verify_folder(path.parent))  # in the manifest, with its blake3


def test_a_modified_capture_file_is_refused_and_not_reused(tmp_path):
    from diffcheck import workspace
    from diffcheck.storage import store

    path = workspace.capture_path(tmp_path, "s", "H", "J")
    key = {"config": "c1", "golden": "g1"}
    workspace.store_capture(path, _capture(), key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="H.taps-J.npz"):
        store.read_arrays(path)
    assert workspace.load_capture(path, key, (4,)) is None
    bad = [r for r in store.verify_folder(path.parent) if not r.ok]
    assert len(bad) == 1 and "localize" in bad[0].message


def test_the_localization_says_which_steps_came_from_graph_replays():
    from diffcheck.judging import localize as L

    import dataclasses

    ref = dataclasses.replace(_capture(graph_steps=()), case_id="J")
    cand = _capture(graph_steps=(4, 5))
    loc = L.localize(ref, cand, np.zeros(ref.norm.shape[-1]), floor_replicas=())
    said = [n for n in loc.notes if "CUDA-graph replays" in n]
    assert said == ["H: step(s) 4, 5 read back from CUDA-graph replays (taps recorded in the graph); step(s) 3 ran eager"]
