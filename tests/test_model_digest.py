"""Any model: a model folder or a cached Hugging Face hub id, identified by the CONTENTS of its files.

No engine: the folders here are tiny fake models (a config, a weights file, a tokenizer).
What is checked is the identity diffcheck derives from them: the model digest, and through
it whether a golden is up to date and which ledger key a run gets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diffcheck import cases
from diffcheck.engines import models
from diffcheck.core.errors import ConfigError
from diffcheck import workspace
from diffcheck.storage import ledger, manifest, store
from diffcheck.storage.identity import vllm_source_state
from factories import make_run, write_suite


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A digest cache of this test's own (never the user's)."""
    monkeypatch.setenv("DIFFCHECK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}))
    (folder / "model.safetensors").write_bytes(os.urandom(64 * 1024))
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (folder / "README.md").write_text("# a model card\n")
    return folder


def rewrite_byte(path: Path, at: int, *, keep_mtime: bool = False) -> None:
    """Flip one byte in place (same size); the mtime moves on by a second unless `keep_mtime`."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(data)
    mtime = st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(st.st_atime_ns, mtime))
    assert path.stat().st_size == st.st_size


def suite_case(tmp_path: Path, model: str):
    path = write_suite(tmp_path / "cases", name="anymodel", model=model,
                       sampling={"max_tokens": 4, "logprobs": 4}, engine={"dtype": "float32"})
    return cases.get_case(cases.load_suite(path), "J")


def golden_for(case, digest: str, root: Path) -> Path:
    """A golden recorded from `case` with model digest `digest` by this machine's engine."""
    run = make_run([[1, 2, 3]], suite=case.suite, case_id=case.id, model={"id": "m", "digest": digest},
                   engine=vllm_source_state(), source={"config_digest": cases.config_digest(case)})
    path = store.run_path(root, case.suite, case.id)
    store.write_run(path, run)
    return path


def count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = manifest.digest_file

    def spy(path, **kw):
        reads.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(manifest, "digest_file", spy)
    return reads


def test_one_byte_rewritten_in_place_makes_the_golden_stale_and_changes_the_ledger_key(tmp_path):
    folder = fake_model(tmp_path / "tiny")
    case = suite_case(tmp_path, str(folder))
    before = models.resolve_case(case).digest
    path = golden_for(case, before, tmp_path / "goldens")
    assert workspace.golden_up_to_date(path, case) is not None  # same config, engine and model
    key_before = workspace.ledger_key(case)

    rewrite_byte(folder / "model.safetensors", 1234)
    after = models.resolve_case(case).digest
    assert after != before
    assert workspace.golden_up_to_date(path, case) is None
    assert workspace.ledger_key(case) != key_before

    rewrite_byte(folder / "model.safetensors", 1234)  # the byte back: the same model again
    assert models.resolve_case(case).digest == before
    assert workspace.ledger_key(case) == key_before


def test_every_model_file_counts_and_documentation_does_not(tmp_path):
    folder = fake_model(tmp_path / "tiny")
    digest = models.resolve(str(folder)).digest
    (folder / "README.md").write_text("# another model card\n")
    assert models.resolve(str(folder)).digest == digest
    for name in ("config.json", "tokenizer.json"):
        rewrite_byte(folder / name, 2)
        changed = models.resolve(str(folder)).digest
        assert changed != digest
        rewrite_byte(folder / name, 2)
    (folder / "generation_config.json").write_text("{}")
    assert models.resolve(str(folder)).digest != digest
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer.json").rename(folder / "tokenizer2.json")  # same bytes, another name
    assert models.resolve(str(folder)).digest != digest


def test_digests_are_cached_by_file_stamp_and_a_rewrite_is_read_again(tmp_path, monkeypatch, own_cache):
    folder = fake_model(tmp_path / "tiny")
    reads = count_reads(monkeypatch)
    first = models.resolve(str(folder)).digest
    assert sorted(reads) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (own_cache / models.DIGEST_CACHE).is_file()
    reads.clear()
    assert models.resolve(str(folder)).digest == first and reads == []  # answered from the cache
    rewrite_byte(folder / "model.safetensors", 7)
    assert models.resolve(str(folder)).digest != first and reads == ["model.safetensors"]
    reads.clear()
    # Rewritten again with its mtime put back: the inode's change time still moved, so it is read again.
    rewrite_byte(folder / "model.safetensors", 7, keep_mtime=True)
    assert models.resolve(str(folder)).digest == first and reads == ["model.safetensors"]


def test_a_damaged_digest_cache_is_ignored(tmp_path, own_cache):
    folder = fake_model(tmp_path / "tiny")
    digest = models.resolve(str(folder)).digest
    (own_cache / models.DIGEST_CACHE).write_text("{not json")
    assert models.resolve(str(folder)).digest == digest
    assert json.loads((own_cache / models.DIGEST_CACHE).read_text())["version"] == 1


def test_a_copied_prepared_folder_is_checked_against_its_manifest(tmp_path):
    folder = fake_model(tmp_path / "prepared")
    digest, files = models._scan(folder)
    manifest.write_json(folder / models.MANIFEST, {"id": "x", "digest": digest, "files": manifest.entries(files)})
    assert models.resolve(str(folder)).digest == digest  # the recorded identity
    rewrite_byte(folder / "model.safetensors", 99)
    with pytest.raises(Exception, match=r"model.safetensors: digest differs from the manifest.*delete"):
        models.resolve(str(folder))


def hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache entry as huggingface_hub lays it out: blobs, a snapshot of links, refs/main."""
    import hashlib

    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hub_id_in_the_local_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    folder = fake_model(tmp_path / "plain")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "README.md"}
    snapshot = hub_cache(hub, "acme/tiny-llama", files)
    got = models.resolve("acme/tiny-llama")
    assert got.path == snapshot and got.id == "acme/tiny-llama"
    assert got.digest == models.resolve(str(folder)).digest  # contents decide, not where they live
    blob = (snapshot / "model.safetensors").resolve()
    rewrite_byte(blob, 5)
    assert models.resolve("acme/tiny-llama").digest != got.digest


def test_a_hub_id_not_in_the_cache_is_one_line_naming_the_suite_and_field(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ConfigError, match=r"'acme/absent' is not in the local Hugging Face cache") as info:
        models.resolve("acme/absent")
    assert "\n" not in info.value.message and "never downloads" in info.value.message
    case = suite_case(tmp_path, "acme/absent")
    with pytest.raises(ConfigError) as info:
        workspace.golden_up_to_date(golden_for(case, "d", tmp_path / "goldens"), case)
    message = info.value.message
    assert message.startswith(str(cases.display_path(case.source)) + ": case 'J': model: model 'acme/absent'")
    assert "\n" not in message


def test_neither_id_nor_path_nor_hub_id_says_what_is_valid(tmp_path):
    with pytest.raises(ConfigError, match=r"neither a known id \(smollm2-135m\), an existing path, nor a Hugging "
                                          r"Face hub id"):
        models.resolve(str(tmp_path / "no" / "such" / "folder"))
