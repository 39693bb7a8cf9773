"""The one integrity-manifest scheme (diffcheck.storage.manifest) and its users' on-disk spellings."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import blake3
import pytest

from diffcheck.core.errors import DataError
from diffcheck.storage import manifest

ROOT = Path(__file__).resolve().parents[1]


def test_digest_of_a_file_and_of_its_bytes_agree(tmp_path):
    data = os.urandom(5 << 20)  # more than one read chunk
    (tmp_path / "f").write_bytes(data)
    fed = []
    d = manifest.digest_file(tmp_path / "f", sha256=True, feed=fed.append)
    assert d == manifest.digest_bytes(data, sha256=True)
    assert (d.size, d.blake3, d.sha256) == (len(data), blake3.blake3(data).hexdigest(), hashlib.sha256(data).hexdigest())
    assert b"".join(fed) == data
    assert manifest.digest_bytes(data).sha256 is None


def test_entries_round_trip_in_both_spellings():
    d = manifest.digest_bytes(b"abc", sha256=True)
    assert d.entry() == {"size": 3, "blake3": d.blake3, "sha256": d.sha256}
    store = manifest.digest_bytes(b"abc").entry(manifest.STORE_KEYS)
    assert store == {"bytes": 3, "file_blake3": d.blake3}
    assert manifest.FileDigest.from_entry(store, where="x", keys=manifest.STORE_KEYS) == manifest.digest_bytes(b"abc")
    assert manifest.parse_entries(manifest.entries({"a": d}), where="m") == {"a": d}
    with pytest.raises(DataError, match=r"^m \(a\): manifest entry needs an integer 'size' and a hex 'blake3'"):
        manifest.parse_entries({"a": {"size": "3"}}, where="m")


def test_a_mismatch_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"0123456789")
    want = manifest.digest_file(path, sha256=True)
    assert manifest.verify_file(path, want) == want
    path.write_bytes(b"012345678")
    with pytest.raises(DataError) as info:
        manifest.verify_file(path, want, fix="rebuild it")
    assert info.value.message == f"{path}: 9 bytes, manifest says 10; rebuild it"
    path.write_bytes(b"0123456780")
    with pytest.raises(DataError, match=rf"^{path}: digest differs from the manifest \(blake3 \w{{12}}\.\., manifest "):
        manifest.verify_file(path, want)
    # sha256 alone differing (a blake3-less reader's digest) is caught too
    forged = manifest.FileDigest(size=10, blake3=manifest.digest_bytes(b"0123456780").blake3, sha256=want.sha256)
    assert "sha256" in manifest.mismatch(manifest.digest_file(path, sha256=True), forged)
    path.unlink()
    with pytest.raises(DataError, match=rf"^{path}: missing \(the manifest lists it\)"):
        manifest.verify_file(path, want)


def test_compare_names_missing_unlisted_and_changed_files():
    a, b = manifest.digest_bytes(b"a"), manifest.digest_bytes(b"b")
    assert manifest.compare({"x": a, "y": b}, {"x": a, "y": b}) == []
    assert manifest.compare({"x": b, "z": a}, {"x": a, "y": b}, detail=False) == [
        "x: digest differs from the manifest", "y: missing", "z: not in the manifest"]


def test_json_is_written_atomically_and_read_back_or_refused(tmp_path):
    path = tmp_path / "m.json"
    manifest.write_json(path, {"b": 1, "a": "é"})
    assert path.read_bytes().isascii() and json.loads(path.read_text()) == {"a": "é", "b": 1}
    assert not list(tmp_path.glob(".*.tmp"))
    assert manifest.read_json(tmp_path / "absent.json") is None
    with pytest.raises(DataError, match=r"absent.json: no manifest here$"):
        manifest.read_json(tmp_path / "absent.json", missing="no manifest here")
    path.write_text("{half")
    with pytest.raises(DataError, match=r"m.json: not valid JSON \(.*\); fix it$"):
        manifest.read_json(path, fix="fix it")


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "m.json"
    manifest.write_json(path, {"v": 1})

    def failing(file, mode):
        f = open(file, mode)
        f.write = lambda data: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return f

    with pytest.raises(OSError):
        manifest.atomic_write(path, b'{"v": 2}', opener=failing)
    assert json.loads(path.read_text()) == {"v": 1} and not list(tmp_path.glob(".*.tmp"))


# -- the users ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", ["gpu-h200"])  # goldens/default is machine-local (make golden), not committed
def test_committed_goldens_still_verify(suite):
    from diffcheck.storage import store

    results = store.verify_folder(ROOT / "goldens" / suite)
    assert results and all(r.ok for r in results), [r.message for r in results if not r.ok]


def test_committed_kernel_results_still_verify():
    pytest.importorskip("pyarrow")
    from diffcheck_kernels.results import read_parquet

    for name in ("cpu", "cuda"):
        assert read_parquet(ROOT / "goldens" / "kernels" / f"{name}.parquet").rows


def _fake_model(root: Path, *, with_files: bool = True) -> Path:
    """A prepared-looking model folder, its manifest written as `models.prepare` writes it."""
    from diffcheck.engines import models

    folder = models.model_dir("smollm2-135m", root)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"num_hidden_layers": 1}')
    (folder / "model.safetensors").write_bytes(os.urandom(1000))
    digest, files = models._scan(folder)
    data = {"id": "smollm2-135m", "digest": digest}
    if with_files:
        data["files"] = manifest.entries(files)
    manifest.write_json(folder / models.MANIFEST, data)
    return folder


def test_a_prepared_model_names_the_file_that_differs(tmp_path):
    from diffcheck.engines import models

    folder = _fake_model(tmp_path)
    assert models.resolve("smollm2-135m", root=tmp_path).digest == models.folder_digest(folder)
    (folder / "model.safetensors").write_bytes(os.urandom(999))
    with pytest.raises(DataError) as info:
        models.resolve("smollm2-135m", root=tmp_path)
    assert info.value.message == (
        f"{folder}: model files do not match their digest (model.safetensors: 999 bytes, manifest says 1000); "
        "run `diffcheck model prepare smollm2-135m --force`")
    (folder / "extra.bin").write_bytes(b"x")
    with pytest.raises(DataError, match=r"\(extra.bin: not in the manifest and 1 more\)"):
        models.resolve("smollm2-135m", root=tmp_path)


def test_a_model_prepared_by_an_older_diffcheck_is_checked_by_its_folder_digest(tmp_path):
    from diffcheck.engines import models

    folder = _fake_model(tmp_path, with_files=False)
    assert models.resolve("smollm2-135m", root=tmp_path).digest == models.folder_digest(folder)
    (folder / "config.json").write_text("{}")
    with pytest.raises(DataError, match="model files do not match their digest .*--force"):
        models.resolve("smollm2-135m", root=tmp_path)
    (folder / models.MANIFEST).write_text("{oops")
    with pytest.raises(DataError, match=r"diffcheck-model.json: not valid JSON .*--force`$"):
        models.resolve("smollm2-135m", root=tmp_path)


def test_the_bundle_manifest_keeps_what_install_sh_reads(tmp_path):
    from tools.gpu_bundle import build as bundle

    archive = tmp_path / "a.tar.xz"
    archive.write_bytes(os.urandom(300))
    out = tmp_path / "out"
    out.mkdir()
    pieces = bundle.split_file(archive, out, piece_bytes=128)
    bundle.write_manifest(out, {"format": bundle.FORMAT, "archive": {"name": archive.name,
                                                                    **bundle.digest_file(archive).entry()},
                                "pieces": [p.__dict__ for p in pieces]})
    raw = json.loads((out / bundle.MANIFEST).read_text())  # as install.sh reads it: plain json, hashlib
    for p in raw["pieces"]:
        data = (out / p["name"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (p["size"], p["sha256"])
    assert raw["archive"]["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert bundle.verify_pieces(out, bundle.read_manifest(out)) == []
