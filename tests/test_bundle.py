"""The offline bundle's own logic on small fake files: base lists, pieces, manifest,
verification, wheel trimming, requirement closure and install.sh end to end.

The real download (vLLM, ~80 wheels, the model) is exercised by `make gpu-bundle`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.gpu_bundle import build as bundle
from diffcheck.core.errors import ConfigError, DataError

try:
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover
    from pip._vendor.packaging.requirements import Requirement


def make_wheel(folder: Path, name: str, version: str, *, requires: list[str] = (), files: dict | None = None) -> Path:
    """A minimal, installable pure-Python wheel."""
    files = dict(files or {f"{name}/__init__.py": f"VERSION = {version!r}\n"})
    stem = name.replace("-", "_")  # wheel file and dist-info names escape '-'
    dist = f"{stem}-{version}.dist-info"
    meta = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    files[f"{dist}/METADATA"] = "\n".join(meta) + "\n"
    files[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{path},," for path in files] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


# -- base package lists ----------------------------------------------------------------------------


def test_base_list_parses_names_versions_comments_and_local_versions():
    text = "# the image\ntorch==2.11.0+cu130  Pillow\n\nTyping_Extensions==4.12.2 # trailing comment\n"
    assert bundle.parse_base_packages(text, source="x") == {
        "torch": "2.11.0", "pillow": None, "typing-extensions": "4.12.2"}


@pytest.mark.parametrize("bad", ["torch>=2.11", "vllm[all]", "numpy==", "a==1;b"])
def test_base_list_refuses_specifiers_with_file_and_line(bad):
    with pytest.raises(ConfigError, match=r"base\.txt:2: .* is not 'name' or 'name==version'"):
        bundle.parse_base_packages(f"numpy\n{bad}\n", source="base.txt")


def test_base_list_refuses_an_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no packages listed"):
        bundle.load_base_packages(tmp_path / "empty.txt")
    with pytest.raises(ConfigError, match="no such file"):
        bundle.load_base_packages(tmp_path / "missing.txt")


def test_default_base_list_loads_like_a_file_holding_it(tmp_path):
    base, text = bundle.load_base_packages(None)
    (tmp_path / "base.txt").write_text(text)
    assert bundle.load_base_packages(tmp_path / "base.txt") == (base, text)


# -- pieces and manifest -----------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "expected"), [(3500, [1000, 1000, 1000, 500]), (3000, [1000, 1000, 1000]), (0, [0])])
def test_split_then_join_reproduces_the_archive(tmp_path, size, expected):
    archive = tmp_path / "a.tar.xz"
    archive.write_bytes(os.urandom(size))
    out = tmp_path / "out"
    out.mkdir()
    pieces = bundle.split_file(archive, out, piece_bytes=1000)
    assert [p.size for p in pieces] == expected
    assert [p.name for p in pieces] == [f"a.tar.xz.{i:03d}" for i in range(len(expected))]
    digest = bundle.digest_file(archive)
    manifest = {"format": bundle.FORMAT, "archive": {"name": "a.tar.xz", **digest.__dict__},
                "pieces": [p.__dict__ for p in pieces]}
    joined = bundle.join_pieces(out, manifest, tmp_path / "joined")
    assert (tmp_path / "joined").read_bytes() == archive.read_bytes()
    assert joined == digest


def _pieces(tmp_path: Path, data: bytes, piece_bytes: int = 100) -> tuple[Path, dict]:
    archive = tmp_path / "b.bin"
    archive.write_bytes(data)
    out = tmp_path / "pieces"
    out.mkdir()
    pieces = bundle.split_file(archive, out, piece_bytes=piece_bytes)
    manifest = {"format": bundle.FORMAT, "archive": {"name": "b.bin", **bundle.digest_file(archive).__dict__},
                "pieces": [p.__dict__ for p in pieces]}
    bundle.write_manifest(out, manifest)
    return out, manifest


def test_verify_names_missing_truncated_and_altered_pieces(tmp_path):
    out, manifest = _pieces(tmp_path, os.urandom(450))
    assert bundle.verify_pieces(out, manifest) == []
    (out / "b.bin.000").unlink()
    (out / "b.bin.001").write_bytes((out / "b.bin.001").read_bytes()[:-1])
    altered = bytearray((out / "b.bin.002").read_bytes())
    altered[7] ^= 0x01
    (out / "b.bin.002").write_bytes(bytes(altered))
    problems = bundle.verify_pieces(out, manifest)
    assert problems == ["b.bin.000: missing", "b.bin.001: 99 bytes, manifest says 100",
                        "b.bin.002: digest differs from the manifest"]
    with pytest.raises(DataError, match="3 bad piece"):
        bundle.join_pieces(out, manifest, tmp_path / "joined")


def test_join_refuses_an_archive_digest_that_differs(tmp_path):
    out, manifest = _pieces(tmp_path, os.urandom(250))
    manifest["archive"]["sha256"] = "0" * 64
    with pytest.raises(DataError, match="does not match the manifest"):
        bundle.join_pieces(out, manifest, tmp_path / "joined")


def test_read_manifest_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no bundle manifest"):
        bundle.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99, "pieces": []}))
    with pytest.raises(DataError, match="manifest.json: field 'format' must be 1"):
        bundle.read_manifest(tmp_path)


def test_verify_command_reports_bad_pieces(tmp_path):
    out, _ = _pieces(tmp_path, os.urandom(300))
    assert bundle.main(["--verify", str(out)]) == 0
    (out / "b.bin.001").write_bytes(b"x" * 100)
    assert bundle.main(["--verify", str(out)]) == 1


# -- wheels --------------------------------------------------------------------------------------------


def test_restore_stored_drops_members_and_their_record_rows(tmp_path):
    src = make_wheel(tmp_path, "pkg", "1.0", files={
        "pkg/__init__.py": "x = 1\n", "pkg/big_fa2.so": "A" * 5000, "pkg/third_party/deep/a.h": "B" * 100})
    dst = tmp_path / "out.whl"
    dropped = bundle.restore_stored(src, dst, drop={"pkg/big_fa2.so": "why", "pkg/third_party/deep/": "why"})
    assert sorted(dropped) == ["pkg/big_fa2.so", "pkg/third_party/deep/a.h"]
    with zipfile.ZipFile(dst) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert zf.read("pkg/__init__.py") == b"x = 1\n"
        assert "pkg/big_fa2.so" not in zf.namelist()
        record = zf.read("pkg-1.0.dist-info/RECORD").decode()
    assert "big_fa2" not in record and "deep/a.h" not in record and "pkg/__init__.py" in record


def test_wheel_requirements_evaluates_markers_for_the_target_not_this_interpreter(tmp_path):
    wheel = make_wheel(tmp_path, "root", "1.0", requires=[
        'six>=1.16; python_version > "3.11"',  # true on the 3.12 target even when this runs on 3.11
        'old-only; python_version < "3.10"',
        'winonly; sys_platform == "win32"',
        'extra-dep; extra == "server"',
        "plain<2",
    ])
    names = [r.name for r in bundle.wheel_requirements(wheel, target=bundle.Target())]
    assert names == ["six", "plain"]
    with_extra = [r.name for r in bundle.wheel_requirements(wheel, target=bundle.Target(), extras={"server"})]
    assert with_extra == ["six", "extra-dep", "plain"]


def test_closure_skips_base_and_excluded_and_notes_conflicts(tmp_path, monkeypatch):
    graph = {
        "alpha": ("1.0", ["beta>=2", "torch==2.11.0", "flashinfer-python==0.6"]),
        "beta": ("2.5", ["gamma<1", "numpy<2.4"]),
        "gamma": ("0.9", ["beta<2.1"]),  # conflicts with the beta already chosen
    }
    calls = []

    def fake_download(specs, dest, *, target):
        calls.append(sorted(specs))
        for spec in specs:
            name = Requirement(spec).name
            version, requires = graph[name]
            make_wheel(dest, name, version, requires=requires)

    monkeypatch.setattr(bundle, "_download", fake_download)
    dest = tmp_path / "dl"
    dest.mkdir()
    res = bundle.resolve_closure([Requirement("alpha")], {"torch": "2.11.0", "numpy": "2.5.2"}, dest=dest,
                                 target=bundle.Target(), echo=lambda _msg: None)
    assert sorted(res.wheels) == ["alpha", "beta", "gamma"]
    assert calls == [["alpha"], ["beta>=2"], ["gamma<1"]]
    assert res.excluded == {"flashinfer-python": bundle.EXCLUDED["flashinfer-python"]}
    assert set(res.from_base) == {"torch", "numpy"}
    assert "numpy: base has 2.5.2, a requirement asks <2.4" in res.notes
    assert "beta: shipping 2.5, a requirement asks <2.1" in res.notes


def test_closure_follows_named_extras_and_applies_overrides(tmp_path, monkeypatch):
    graph = {
        "root": ("1.0", ["lib[lang]>=1", "ffi==0.1.10"]),
        "lib": ("1.2", ['country-data; extra == "lang"', 'unused; extra == "other"']),
        "other": ("1.0", ["lib[other]"]),
        "country-data": ("26.2", []),
        "unused": ("1.0", []),
        "ffi": ("0.1.15", []),
    }
    asked = []

    def fake_download(specs, dest, *, target):
        asked.extend(specs)
        for spec in specs:
            name = Requirement(spec).name
            make_wheel(dest, name, graph[name][0], requires=graph[name][1])

    monkeypatch.setattr(bundle, "_download", fake_download)
    monkeypatch.setitem(bundle.OVERRIDES, "ffi", (">=0.1.11", "seen failing"))
    res = bundle.resolve_closure([Requirement("root")], {}, dest=tmp_path, target=bundle.Target(),
                                 echo=lambda _m: None)
    assert sorted(res.wheels) == ["country-data", "ffi", "lib", "root"]  # 'unused' needs an extra nobody asked for
    assert "ffi>=0.1.11" in asked and "lib>=1" in asked  # pip sees neither extras nor the overridden pin
    assert any(n.startswith("ffi: override >=0.1.11 instead of '==0.1.10'") for n in res.notes)


def test_closure_follows_an_extra_asked_for_after_the_wheel_was_chosen(tmp_path, monkeypatch):
    graph = {"root": ("1.0", ["lib", "mid"]), "mid": ("1.0", ["lib[lang]"]),
             "lib": ("1.0", ['country-data; extra == "lang"']), "country-data": ("1.0", [])}
    monkeypatch.setattr(bundle, "_download", lambda specs, dest, *, target: [
        make_wheel(dest, Requirement(s).name, graph[Requirement(s).name][0], requires=graph[Requirement(s).name][1])
        for s in specs])
    res = bundle.resolve_closure([Requirement("root")], {}, dest=tmp_path, target=bundle.Target(),
                                 echo=lambda _m: None)
    assert sorted(res.wheels) == ["country-data", "lib", "mid", "root"]


def test_closure_fails_when_pip_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle, "_download", lambda specs, dest, *, target: None)
    with pytest.raises(DataError, match="pip saved no wheel for ghost"):
        bundle.resolve_closure([Requirement("ghost")], {}, dest=tmp_path, target=bundle.Target(), echo=lambda _m: None)


# -- install.sh end to end --------------------------------------------------------------------------


def _fake_bundle(tmp_path: Path) -> Path:
    stage = tmp_path / "stage"
    (stage / "wheels").mkdir(parents=True)
    make_wheel(stage / "wheels", "dcfakeone", "1.0", files={"dcfakeone/__init__.py": "NAME = 'one'\n" + "#" * 4000})
    make_wheel(stage / "wheels", "dcfaketwo", "2.0")
    out = tmp_path / "bundle"
    out.mkdir()
    bundle.package(stage, out, piece_bytes=700, echo=lambda _m: None,
                   fields={"model": None, "check_imports": ["dcfakeone", "dcfaketwo"]})
    return out


def _install(out: Path, dest: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, HOME=str(dest.parent))
    return subprocess.run(["bash", str(out / bundle.INSTALL_SCRIPT), str(dest)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_install_script_verifies_installs_and_prints_the_pythonpath(tmp_path):
    out = _fake_bundle(tmp_path)
    manifest = bundle.read_manifest(out)
    assert len(manifest["pieces"]) >= 2  # the archive really was cut
    dest = tmp_path / "target"
    res = _install(out, dest)
    assert res.returncode == 0, res.stderr
    assert f"PYTHONPATH={dest}/site" in res.stdout
    assert "imported dcfakeone,dcfaketwo" in res.stdout
    assert (dest / "site" / "dcfakeone" / "__init__.py").read_text().startswith("NAME = 'one'")
    assert f'export PYTHONPATH="{dest}/site' in (dest / "env.sh").read_text()


def test_install_script_refuses_a_corrupt_piece(tmp_path):
    out = _fake_bundle(tmp_path)
    first = out / bundle.read_manifest(out)["pieces"][0]["name"]
    first.write_bytes(b"\0" * first.stat().st_size)
    res = _install(out, tmp_path / "target")
    assert res.returncode != 0
    assert f"{first.name}: size or sha256 differs from manifest.json" in res.stderr
    assert not (tmp_path / "target" / "site").exists()
