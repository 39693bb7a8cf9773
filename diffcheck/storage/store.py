"""The golden store: runs as Parquet files, checked by blake3 digests.

Knows folders, file names, integrity and concurrency; the bytes of one file
(layout, logprob codes, encodings, content digests) are store_format.py's, and this
module re-exports its public names. Knows nothing about engines, verdicts or
rendering. One Parquet file per (suite, case, kind)::

    <root>/<suite>/<case>.parquet               golden (kind=generate, role=reference)
    <root>/<suite>/<case>.run.parquet           a candidate's recorded run (pytest-regressions' .obtained)
    <root>/<suite>/<case>.forced-<ref>.parquet  candidate teacher-forced along golden <ref>
    <root>/<suite>/<case>.scored-<ref>.parquet  candidate run scored by reference engine <ref>
    <root>/<suite>/<case>.taps-<ref>.npz        localize's per-layer capture along golden <ref> (write_arrays)
    <root>/<suite>/MANIFEST.json                {filename: entry}, entry keys below

A file is plain Parquet (one row per generated token, logprobs as integer
float16-like codes with 6 mantissa bits, per-sequence facts on each sequence's
first row); see store_format.py for the columns and the exact decoding. ``content_digest(run) ==
content_digest(read_run(path))`` after ``write_run(path, run)``, and a
re-recording of the same output reproduces it.

Integrity. Every read hashes the file and checks it against its entry in the
folder's MANIFEST.json when that exists; a file an existing manifest does not
list is refused. Truncated, non-Parquet and foreign (no diffcheck metadata)
files are refused, as are other schema versions: a newer one asks for a newer
diffcheck, an older one (schema 1: float16 logprobs, sequences as JSON metadata)
for a re-recording, because converting it would round its logprobs twice and no
longer match a fresh recording exactly. Every refusal is a `DataError` with one
line, ``<path>: <what failed>``.

Manifest entry: file_blake3, content_blake3, output_blake3, schema_version,
bytes, case_id, kind, role, n_tokens, created; plus ``pending`` (an entry) while
a write is in flight. The file part (size and blake3, their check and its
one-line refusal, the atomic writes) is `diffcheck.storage.manifest`'s scheme,
spelled ``bytes``/``file_blake3`` here because committed goldens are. Writes are two-phase so that a writer killed at any point
leaves a consistent folder: (1) record the new entry as ``pending`` beside the
committed one, (2) write a temp file in the folder, fsync, ``os.replace``,
(3) commit the pending entry. A file matching either the committed or the
pending entry verifies. The manifest itself is rewritten by temp + replace under
``MANIFEST.json.lock`` (writers wait for it); a second writer of the same run
file is refused with `LockedError` (non-blocking ``fcntl.flock`` on
``<file>.lock``, naming the holder's pid). A lock file exists only while it is
held: its holder removes it before letting go (`_flock` says how the unlink race
is avoided), so none is left beside the goldens. One left by a writer killed
while holding it is unheld and holds that writer's pid; the next write in the
folder removes it, and any temp file of the killed write (`_sweep`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from diffcheck.storage import codec as _format
from diffcheck.storage import manifest as _manifest
from diffcheck.core.errors import ConfigError, DataError, LockedError
from diffcheck.storage.codec import (  # noqa: F401  (the public API lives here too)
    LOGPROB_MANTISSA_BITS, SCHEMA_VERSION, content_digest, output_digest, quantize, quantize_logprobs)
from diffcheck.core.types import Run, RunMeta

MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # cases.py's id rule


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    ok: bool
    message: str = ""


# -- paths ---------------------------------------------------------------------------------------


def run_path(root: str | Path, suite: str, case_id: str, *, kind: str = "generate",
             role: str = "reference", reference: str | None = None) -> Path:
    """Where a run lives. ``reference`` names the golden a forced/scored run derives from."""
    for what, value in (("suite", suite), ("case id", case_id)) + ((("reference", reference),) if reference else ()):
        if not isinstance(value, str) or not _NAME.match(value):
            raise ConfigError(f"{what} '{value}' cannot name a golden file (valid: letters, digits, '_', '.', '-'; "
                              "starting with a letter or digit)")
    folder = Path(root) / suite
    if kind == "generate":
        if role not in ("reference", "candidate"):
            raise ConfigError(f"role '{role}' is not valid (valid: reference, candidate)")
        return folder / (f"{case_id}.parquet" if role == "reference" else f"{case_id}.run.parquet")
    if kind in ("forced", "scored"):
        if not reference:
            raise ConfigError(f"a {kind} run needs the reference golden it derives from (reference=...)")
        return folder / f"{case_id}.{kind}-{reference}.parquet"
    raise ConfigError(f"kind '{kind}' is not valid (valid: generate, forced, scored)")


def _rerecord_hint(path: Path) -> str:
    """The command that re-creates a file, from its name (its content may be unreadable)."""
    suite = path.parent.name
    flag = "" if suite == "default" else f" --suite {suite}"
    name = path.name[: -len(".parquet")] if path.name.endswith(".parquet") else path.name
    m = re.match(r"(.+)\.taps-[^/]+\.npz\Z", name)
    if m:
        return f"delete it; `diffcheck localize{flag}` captures it again"
    m = re.match(r"(.+)\.(forced|scored)-[^/]+\Z", name)
    if m:
        return f"re-create it with `diffcheck compare {m.group(1)}{flag}`"
    if name.endswith(".run"):
        return f"re-record it with `diffcheck run {name[:-4]}{flag}`"
    return f"re-record with `diffcheck golden record {name}{flag} --update`"


# -- file content --------------------------------------------------------------------------------


def _open_parquet(path: Path, data: bytes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: not a readable Parquet file, truncated or corrupt ({first})") from None


def _decode(path: Path, data: bytes) -> Run:
    return _format.decode(str(path), _open_parquet(path, data), rerecord=_rerecord_hint(path))


# -- manifest ------------------------------------------------------------------------------------


def _load_manifest(folder: Path) -> dict | None:
    mpath = folder / MANIFEST
    data = _manifest.read_json(mpath, fix="restore it from version control or re-record")
    if data is None:
        return None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise DataError(f"{mpath}: expected a JSON object mapping file names to entry objects")
    return data


def _effective_entry(raw: dict, file_hash: str | None) -> dict | None:
    """The committed entry, or the pending one when the file on disk is the pending write's."""
    committed = {k: v for k, v in raw.items() if k != "pending"} or None
    pending = raw.get("pending")
    if pending and file_hash is not None and file_hash == pending.get("file_blake3") and (
            not committed or committed.get("file_blake3") != file_hash):
        return dict(pending)
    return committed


def manifest_entry(path: str | Path) -> dict | None:
    """The manifest's entry for a file (the in-flight write's when the file is already that one)."""
    path = Path(path)
    manifest = _load_manifest(path.parent)
    if manifest is None or path.name not in manifest:
        return None
    raw = manifest[path.name]
    file_hash = None
    if raw.get("pending") and path.exists():
        file_hash = _manifest.digest_bytes(path.read_bytes()).blake3
    return _effective_entry(raw, file_hash)


def _atomic_write(path: Path, data: bytes) -> None:
    # `open` is looked up here, at call time: the crash tests replace this module's `open`.
    _manifest.atomic_write(path, data, opener=open)


def _remove_stale_temps(folder: Path, name: str) -> None:
    """Temp files of `name` left by killed writers; only called while holding that name's lock."""
    for p in folder.glob(f".{name}.*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()


def _linked_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the file `path` names now (not one unlinked from there)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


@contextlib.contextmanager
def _flock(lock_path: Path, *, blocking: bool, target: Path) -> Iterator[None]:
    """Hold `lock_path` exclusively (``fcntl.flock``); the file exists only while it is held.

    The holder writes its pid into the file and removes the file before letting go, so no
    lock file is left beside the goldens. The unlink race: an acquirer may open the file just
    before its holder removes it and then lock that removed file, which no longer excludes
    anyone; so after its flock it checks that its file is still the one `lock_path` names
    (same inode) and otherwise starts over. Only a holder removes the file, so once the check
    passes the file stays linked until its release. A writer killed while holding leaves the
    file behind, unheld: the next writer takes it over and removes it (`_sweep`).
    """
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as exc:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise LockedError(f"{target}: another writer holds {lock_path.name} (pid {holder}); "
                              "wait for it to finish") from None
        if _linked_at(fd, lock_path):
            break
        os.close(fd)  # its holder removed it between our open and our flock: take the one there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            if _linked_at(fd, lock_path):  # ours unless someone deleted it by hand meanwhile
                os.unlink(lock_path)  # while still held: a waiter on it sees it gone and starts over
        except OSError:
            pass
        finally:
            os.close(fd)  # releases the flock


_TEMP = re.compile(r"\.(?P<name>.+)\.\d+\.tmp\Z")  # manifest.atomic_write's temp file names


def _sweep(folder: Path, listed) -> None:
    """Lock and temp files that killed writers left.

    Called under the manifest lock. Each file's leftovers are removed while holding its lock
    (non-blocking: a live writer of that file keeps its own), so an in-flight temp file is
    never touched. Every unheld lock file goes, listed or not: a writer killed after taking its
    file's lock and before the manifest named the file left one (seen under load); temp files
    exist only after the manifest names their file.
    """
    stale: dict[str, list[Path]] = {}
    with os.scandir(folder) as it:
        for e in it:
            if e.name.endswith(".lock") and e.name != f"{MANIFEST}.lock":
                stale.setdefault(e.name[:-len(".lock")], [])
            elif (m := _TEMP.match(e.name)) and m["name"] in listed:
                stale.setdefault(m["name"], []).append(folder / e.name)
    for name, temps in stale.items():
        try:
            with _flock(folder / f"{name}.lock", blocking=False, target=folder / name):
                for t in temps:
                    with contextlib.suppress(OSError):
                        t.unlink()
        except LockedError:
            continue  # a live writer of that file (this process's own write among them)


def _update_manifest(folder: Path, change) -> None:
    """Read-modify-write MANIFEST.json under its lock; `change(entries) -> None` edits in place."""
    with _flock(folder / f"{MANIFEST}.lock", blocking=True, target=folder / MANIFEST):
        _remove_stale_temps(folder, MANIFEST)
        manifest = _load_manifest(folder) or {}
        _sweep(folder, manifest.keys() - {MANIFEST})
        change(manifest)
        text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
        _atomic_write(folder / MANIFEST, text.encode())


# -- public read/write --------------------------------------------------------------------------


def write_run(path: str | Path, run: Run) -> str:
    """Write a run atomically, record it in the folder's manifest; return its content digest."""
    path = Path(path)
    stored = _format.stored_steps(run, where=str(path))
    digest = _format.content_digest_of(run, stored)
    data = _format.encode(run, stored)
    entry = {
        **_manifest.digest_bytes(data).entry(_manifest.STORE_KEYS), "content_blake3": digest,
        "output_blake3": output_digest(run), "schema_version": _format.SCHEMA_VERSION,
        "case_id": run.meta.case_id, "kind": run.meta.kind,
        "role": run.meta.role, "n_tokens": run.n_tokens,
        "created": run.meta.created or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    _write_entry(path, data, entry)
    return digest


def _write_entry(path: Path, data: bytes, entry: dict) -> None:
    """`data` to `path` atomically, two-phase in the folder's manifest (pending, then committed)."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    with _flock(folder / f"{path.name}.lock", blocking=False, target=path):
        _remove_stale_temps(folder, path.name)

        def begin(m):  # keep the committed entry: the old file must still verify until the replace
            m[path.name] = {**{k: v for k, v in m.get(path.name, {}).items() if k != "pending"}, "pending": entry}

        def commit(m):
            m[path.name] = entry

        _update_manifest(folder, begin)
        _atomic_write(path, data)
        _update_manifest(folder, commit)


def write_arrays(path: str | Path, arrays: dict, meta: dict) -> str:
    """Named numpy arrays and a JSON-able `meta` as one ``.npz`` file, written and recorded in the
    folder's manifest like a run; returns the file's blake3."""
    import numpy as np

    path = Path(path)
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()},
             __meta__=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8))
    data = buf.getvalue()
    digest = _manifest.digest_bytes(data)
    entry = {**digest.entry(_manifest.STORE_KEYS), "kind": str(meta.get("kind", "arrays")),
             "case_id": str(meta.get("case_id", "")),
             "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    _write_entry(path, data, entry)
    return digest.blake3


def read_arrays(path: str | Path) -> tuple[dict, dict]:
    """(arrays, meta) of a file `write_arrays` wrote, verified against the manifest."""
    import numpy as np

    path = Path(path)
    data = _read_verified(path, verify=True)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode())
    except (ValueError, KeyError, OSError) as exc:
        raise DataError(f"{path}: not an arrays file diffcheck wrote ({exc})") from None
    return arrays, meta


def _read_verified(path: Path, *, verify: bool) -> bytes:
    """The file's bytes, checked against the manifest (retrying once across a concurrent write)."""
    for attempt in range(2):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: not found") from None
        except IsADirectoryError:
            raise DataError(f"{path}: is a directory, not a run file") from None
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror})") from None
        if not verify:
            return data
        manifest = _load_manifest(path.parent)
        if manifest is None:
            return data
        if path.name not in manifest:
            raise DataError(f"{path}: not in manifest {path.parent / MANIFEST}; it was not recorded in this "
                            f"folder — {_rerecord_hint(path)}")
        got = _manifest.digest_bytes(data)
        entry = _effective_entry(manifest[path.name], got.blake3)
        if entry is None:  # only an aborted write's pending entry, which this file is not
            if attempt == 0:
                continue
            raise DataError(f"{path}: {MANIFEST} holds only an unfinished write's entry for it, and this file is not "
                            f"that write's; {_rerecord_hint(path)}")
        want = _manifest.FileDigest.from_entry(entry, where=f"{path.parent / MANIFEST} ({path.name})",
                                               keys=_manifest.STORE_KEYS)
        if _manifest.mismatch(got, want) is None:
            return data
        if attempt == 0:
            continue  # a writer may have replaced the file between our two reads
        _manifest.check(path, got, want, fix=f"the file was modified after recording — {_rerecord_hint(path)}")
    raise AssertionError("unreachable")


def read_run(path: str | Path, *, verify: bool = True) -> Run:
    """Read a run; float32/int32 numpy columns. ``verify=False`` skips only the manifest check."""
    path = Path(path)
    return _decode(path, _read_verified(path, verify=verify))


def read_meta(path: str | Path) -> RunMeta:
    """The run's meta without decoding step data; the file is still verified."""
    path = Path(path)
    pf = _open_parquet(path, _read_verified(path, verify=True))
    return _format.parse_kv(str(path), pf.metadata.metadata, rerecord=_rerecord_hint(path))[0]


def verify_folder(folder: str | Path) -> list[VerifyResult]:
    """Check every run file of a suite folder: manifest digest, format, schema, content digest."""
    folder = Path(folder)
    try:
        manifest = _load_manifest(folder)
    except DataError as exc:
        return [VerifyResult(folder / MANIFEST, False, exc.message)]
    files = sorted(p for p in [*folder.glob("*.parquet"), *folder.glob("*.npz")] if p.is_file())
    results = []
    if manifest is None:
        return [VerifyResult(p, False, f"{p}: no {MANIFEST} in {folder}; cannot check its blake3") for p in files]
    for p in files:
        try:
            if p.suffix == ".npz":  # an arrays file (localize's captures): its digest and that it reads
                read_arrays(p)
                results.append(VerifyResult(p, True, ""))
                continue
            run = _decode(p, _read_verified(p, verify=True))
            entry = manifest_entry(p) or {}
            got = content_digest(run)
            if entry.get("content_blake3") != got:
                raise DataError(f"{p}: content digest {got[:8]}.. differs from the manifest's "
                                f"{str(entry.get('content_blake3'))[:8]}..; {_rerecord_hint(p)}")
            results.append(VerifyResult(p, True, ""))
        except DataError as exc:
            results.append(VerifyResult(p, False, exc.message))
    present = {p.name for p in files}
    for name, raw in sorted(manifest.items()):
        committed = {k: v for k, v in raw.items() if k != "pending"}
        if name not in present and committed:  # a pending-only entry is a new file whose write was aborted
            results.append(VerifyResult(folder / name, False,
                                        f"{folder / name}: listed in {MANIFEST} but missing; {_rerecord_hint(folder / name)}"))
    return results
