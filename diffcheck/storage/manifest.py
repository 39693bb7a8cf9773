"""Integrity manifests: one scheme for every file diffcheck writes and later trusts.

The scheme. A manifest maps a file's name to its size and blake3 digest (`FileDigest`),
plus its sha256 where a reader without blake3 checks the file. It is written atomically
(`write_json`: a temp file in the same folder, fsync, ``os.replace``, fsync of the folder)
and every read checks the file against it; a mismatch is one `DataError` line naming the
file, ``<path>: <what differs>; <how to fix it>`` (`check`, `compare`). The size is
compared first: "N bytes, manifest says M" says more than two digests do.

Its users, and what each keeps on disk:

- prepared models (``diffcheck.engines.models``): ``diffcheck-model.json`` holds
  ``"files": {relative name: {"size", "blake3"}}`` in this module's spelling, beside
  ``"digest"``, the folder digest that names the model in runs and ledger keys (kept, so
  recorded goldens keep their model identity). A manifest without ``"files"`` (prepared
  by an older diffcheck) is checked by ``"digest"`` alone.
- the GPU bundle (``tools.gpu_bundle.build``): ``manifest.json``'s ``"pieces"`` and
  ``"archive"`` entries are ``{"name", "size", "sha256", "blake3"}``, this module's
  spelling with the sha256: ``install.sh`` checks the pieces with the target's bare
  python3 (``hashlib``, no blake3) and reads exactly those names.
- the golden store (``diffcheck.storage.store``): ``<suite>/MANIFEST.json`` entries say
  ``"bytes"`` and ``"file_blake3"`` for the size and the blake3 (`STORE_KEYS`): the
  committed goldens (goldens/default, goldens/gpu-h200) are written so, and renaming
  the keys would refuse every committed golden. Its entries add content digests and
  the two-phase ``"pending"`` entry of an in-flight write, which stay the store's.
- kernel results (``diffcheck_kernels.results``) use the atomic write only. Why not a
  manifest: their digest lives inside the Parquet file (key-value metadata) and covers
  the canonical JSON of header and rows, so a results file verifies on its own when it
  is copied alone between machines (CUDA results come back from the GPU machine as one
  file), and the committed goldens/kernels files verify as they are. A folder manifest
  would be a second file to keep in step, for no protection the in-file digest lacks.

Pure standard library at import; blake3 is imported when a digest is computed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffcheck.core.errors import DataError

STORE_KEYS = {"size": "bytes", "blake3": "file_blake3"}  # the golden store's committed spelling
_CHUNK = 1 << 22


@dataclass(frozen=True)
class FileDigest:
    """What a manifest records about one file; sha256 only where a blake3-less reader checks it."""

    size: int
    blake3: str
    sha256: str | None = None

    def entry(self, keys: Mapping[str, str] | None = None) -> dict:
        """The manifest entry (``{"size", "blake3"[, "sha256"]}``); `keys` renames fields (`STORE_KEYS`)."""
        keys = keys or {}
        out = {keys.get("size", "size"): self.size, keys.get("blake3", "blake3"): self.blake3}
        if self.sha256 is not None:
            out[keys.get("sha256", "sha256")] = self.sha256
        return out

    @classmethod
    def from_entry(cls, entry: Any, *, where: str, keys: Mapping[str, str] | None = None) -> "FileDigest":
        """Parse an entry written by `entry`; a malformed one is a one-line DataError about `where`."""
        keys = keys or {}
        size_key, b3_key, sha_key = (keys.get(k, k) for k in ("size", "blake3", "sha256"))
        if not isinstance(entry, Mapping):
            raise DataError(f"{where}: manifest entry must be an object, got {type(entry).__name__}")
        size, b3, sha = entry.get(size_key), entry.get(b3_key), entry.get(sha_key)
        if not isinstance(size, int) or isinstance(size, bool) or not isinstance(b3, str) or (
                sha is not None and not isinstance(sha, str)):
            raise DataError(f"{where}: manifest entry needs an integer '{size_key}' and a hex '{b3_key}' "
                            f"(found {', '.join(sorted(map(str, entry))) or 'no fields'})")
        return cls(size=size, blake3=b3, sha256=sha)


# -- digests -----------------------------------------------------------------------------------------


def _hashers(sha256: bool):
    import blake3

    return blake3.blake3(), (hashlib.sha256() if sha256 else None)


def digest_bytes(data: bytes, *, sha256: bool = False) -> FileDigest:
    b3, sha = _hashers(sha256)
    b3.update(data)
    if sha is not None:
        sha.update(data)
    return FileDigest(size=len(data), blake3=b3.hexdigest(), sha256=sha.hexdigest() if sha is not None else None)


def digest_file(path: str | Path, *, sha256: bool = False, feed: Callable[[bytes], Any] | None = None) -> FileDigest:
    """Stream `path` once; `feed` also gets every chunk (a caller's aggregate digest, same pass)."""
    b3, sha = _hashers(sha256)
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            b3.update(chunk)
            if sha is not None:
                sha.update(chunk)
            if feed is not None:
                feed(chunk)
            size += len(chunk)
    return FileDigest(size=size, blake3=b3.hexdigest(), sha256=sha.hexdigest() if sha is not None else None)


# -- checks ------------------------------------------------------------------------------------------


def mismatch(got: FileDigest, want: FileDigest, *, detail: bool = True) -> str | None:
    """Why a file whose digest is `got` is not the one `want` records, or None; `detail` adds the digests."""
    if got.size != want.size:
        return f"{got.size} bytes, manifest says {want.size}"
    for algo in ("blake3", "sha256"):
        expected, found = getattr(want, algo), getattr(got, algo)
        if expected is not None and found is not None and found != expected:
            return "digest differs from the manifest" + (
                f" ({algo} {found[:12]}.., manifest {expected[:12]}..)" if detail else "")
    return None


def check(path: str | Path, got: FileDigest, want: FileDigest, *, fix: str = "") -> None:
    """Raise the one-line DataError ``<path>: <what differs>[; fix]`` unless `got` matches `want`."""
    reason = mismatch(got, want)
    if reason:
        raise DataError(f"{path}: {reason}" + (f"; {fix}" if fix else ""))


def verify_file(path: str | Path, want: FileDigest, *, fix: str = "") -> FileDigest:
    """Digest `path` (with sha256 when `want` has one) and `check` it; a missing file is refused too."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: missing (the manifest lists it)" + (f"; {fix}" if fix else ""))
    got = digest_file(path, sha256=want.sha256 is not None)
    check(path, got, want, fix=fix)
    return got


def compare(found: Mapping[str, FileDigest], recorded: Mapping[str, FileDigest], *,
            detail: bool = True) -> list[str]:
    """``"<name>: <problem>"`` for each file missing, unlisted or different; empty when all match."""
    problems = []
    for name in sorted(set(found) | set(recorded)):
        if name not in found:
            problems.append(f"{name}: missing")
        elif name not in recorded:
            problems.append(f"{name}: not in the manifest")
        else:
            reason = mismatch(found[name], recorded[name], detail=detail)
            if reason:
                problems.append(f"{name}: {reason}")
    return problems


def build(folder: str | Path, names: Iterable[str], *, sha256: bool = False) -> dict[str, FileDigest]:
    """The digests of `names` (relative to `folder`), ready for `entries`."""
    return {name: digest_file(Path(folder) / name, sha256=sha256) for name in names}


def entries(digests: Mapping[str, FileDigest], keys: Mapping[str, str] | None = None) -> dict[str, dict]:
    return {name: d.entry(keys) for name, d in sorted(digests.items())}


def parse_entries(raw: Any, *, where: str, keys: Mapping[str, str] | None = None) -> dict[str, FileDigest]:
    if not isinstance(raw, Mapping):
        raise DataError(f"{where}: expected an object mapping file names to entries")
    return {name: FileDigest.from_entry(entry, where=f"{where} ({name})", keys=keys) for name, entry in raw.items()}


# -- files -------------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, *, opener: Callable = open) -> None:
    """Write `data` to `path` all or nothing: ``.<name>.<pid>.tmp`` beside it, fsync, replace, fsync the folder.

    `opener` opens the temp file (the store's crash tests inject a half write through it).
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with opener(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def write_json(path: str | Path, data: Any, *, indent: int = 1, sort_keys: bool = True) -> Path:
    """A manifest (or any JSON document) written atomically, newline-terminated.

    ASCII only (non-ASCII escaped): install.sh's ``json.load(open(...))`` decodes with the
    target's locale encoding, which may not be UTF-8.
    """
    path = Path(path)
    atomic_write(path, (json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n").encode("ascii"))
    return path


def read_json(path: str | Path, *, missing: str | None = None, fix: str = "") -> Any:
    """The JSON in `path`; absent: None, or the DataError ``<path>: <missing>`` when `missing` is given.

    Unreadable or invalid JSON is a one-line DataError naming the file, with `fix` appended.
    """
    path = Path(path)
    tail = f"; {fix}" if fix else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing is None:
            return None
        raise DataError(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc}){tail}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DataError(f"{path}: not valid JSON ({exc}){tail}") from None
