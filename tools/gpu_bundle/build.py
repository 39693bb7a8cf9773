"""Offline bundle: everything an air-gapped GPU machine needs to run diffcheck on a pinned vLLM.

Longer than 400 lines because the offline bundle's wheel closure, pieces and manifest form one build.

Built where a package registry is reachable (``make gpu-bundle``, i.e. ``python -m tools.gpu_bundle.build --out DIR``), used
where none is (``bash DIR/install.sh TARGET``). The target is described by a *base
package list* (what its Python already has; the default is the H200 image:
Python 3.12, torch 2.11.0+cu130, Triton 3.6, transformers 5.x) and the wheel tags
of that Python (cp312, manylinux x86-64).

What goes in, and why:

- the vLLM wheel, trimmed: the FA2 and MoE extensions, the ``vllm-rs`` binary and
  ``third_party/deep_gemm`` are dropped (a dense Llama on Triton or FA3 attention
  never loads them); ``vllm_flash_attn/_vllm_fa3_C.abi3.so`` stays (the model
  import fails without an FA extension). The trimmed wheel is re-zipped *stored*
  so that the outer xz compresses the shared objects (FA3: 153 MB -> ~11 MB);
- the closure of vLLM's and diffcheck's requirements (markers evaluated for the
  target, the extras requirements name followed) minus the base packages and minus
  `EXCLUDED` (large GPU-kernel packages that vLLM imports lazily and this use never
  reaches), with the version `OVERRIDES` that the H200 run needed;
- a diffcheck wheel built from this checkout;
- the model package's wheel (the GGUF), which ``diffcheck model prepare`` converts
  on the target (``install.sh`` points pip at it with PIP_NO_INDEX/PIP_FIND_LINKS).

Everything is one ``tar.xz`` split into pieces of at most ``piece_mib`` MiB, with a
``manifest.json`` holding the size, sha256 and blake3 of every piece and of the whole
archive (`diffcheck.storage.manifest`'s scheme, with the sha256 that ``install.sh``
checks: it reads ``name``, ``size`` and ``sha256`` with the target's bare python3). ``install.sh`` needs only bash and the target's python3: it verifies each
piece (sha256), reassembles, verifies the archive, installs with
``pip install --no-index --no-deps --target DIR``, prepares the model, checks that
vLLM and diffcheck import, and prints the PYTHONPATH to use.

This module knows pip, wheels and archives; it knows nothing about engines or runs.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from diffcheck import __version__
from diffcheck.core.errors import ConfigError, DataError, DiffcheckError
from diffcheck.storage import manifest as manifest_scheme

try:  # vLLM's dependencies bring packaging; pip always vendors it
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pragma: no cover - only without a standalone packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

Echo = Callable[[str], None]

FORMAT = 1
DEFAULT_VLLM_VERSION = "0.26.0"
DEFAULT_PIECE_MIB = 48  # the device tool carries at most 64 MiB a call, the working tree (11 MiB) included
ARCHIVE = "diffcheck-gpu-bundle.tar.xz"
MANIFEST = "manifest.json"
INSTALL_SCRIPT = "install.sh"
BASE_LIST = "base-packages.txt"
MODEL_ID = "smollm2-135m"
# install.sh imports these last: a missing shipped wheel shows there, not at the first engine start.
CHECK_IMPORTS = ("vllm", "vllm.entrypoints.llm", "vllm.v1.attention.backends.triton_attn", "diffcheck.cli")
# diffcheck's own requirements beside pyproject's: model conversion needs gguf (and accelerate).
DIFFCHECK_EXTRA_REQUIREMENTS = ("gguf>=0.10", "accelerate>=1.0")


@dataclass(frozen=True)
class Target:
    """The wheel tags and marker values of the machine the bundle is for."""

    python_version: str = "3.12"
    python_full_version: str = "3.12.3"
    platforms: tuple[str, ...] = tuple(
        [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
    )
    abis: tuple[str, ...] = ("cp312", "abi3", "none")

    def markers(self) -> dict[str, str]:
        env = dict(default_environment())
        env.update(python_version=self.python_version, python_full_version=self.python_full_version,
                   platform_machine="x86_64", sys_platform="linux", platform_system="Linux", os_name="posix",
                   implementation_name="cpython", platform_python_implementation="CPython", extra="")
        return env

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation", "cp"]
        for abi in self.abis:
            args += ["--abi", abi]
        for plat in self.platforms:
            args += ["--platform", plat]
        return args


# The H200 image (seen on the device, 2026-11). Versions
# where they were read there; a bare name means "present, version not read".
DEFAULT_BASE_PACKAGES = """\
# python 3.12.3 at /opt/torch/.venv/bin/python3 (torch 2.11.0+cu130, Triton 3.6): the device's
# package list read on the device 2026-11-17, versions from its pip list where one was read.
absl-py accelerate==1.15.0 aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch==0.18.1 build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x==14.2.0 cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch==1.15.2 grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub==1.33.0 humanize hypothesis idna imageio iniconfig
interface-meta jax==0.11.2 jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2 jaxlib==0.11.2 jaxtyping==0.3.11
jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy==2.5.2
numpyro==0.21.0 nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx==1.23.1 onnx-ir==1.0.0
onnxruntime==1.30.0 onnxscript==0.7.2 opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning==2.6.6 pyyaml regex requests rich sacrebleu safetensors==0.8.0 scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece==0.2.2 sentence-transformers==6.0.1 setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken==0.14.0 timm tokenizers==0.23.2 toolz torch==2.11.0
torchaudio==2.11.0 torchdiffeq==0.2.5 torch-geometric==2.8.0.post1 torchmetrics==1.9.0 torchvision==0.26.0
tqdm transformers==5.17.0 treescope triton==3.6.0 typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""

# Distributions never shipped, with the reason; their own requirements are not followed.
EXCLUDED: dict[str, str] = {
    "flashinfer-python": "FlashInfer kernels (GB-scale JIT cache); Triton/FA3 attention never imports it",
    "flashinfer-cubin": "FlashInfer kernels",
    "tilelang": "TileLang kernels, imported lazily by a few quantized paths",
    "nvidia-cutlass-dsl": "CuTe DSL, imported lazily by Blackwell/MLA kernels",
    "quack-kernels": "CuTe DSL kernels (needs nvidia-cutlass-dsl)",
    "tokenspeed-mla": "MLA kernels (DeepSeek-style attention)",
    "humming-kernels": "quantized GEMM kernels",
    "pynvvideocodec": "video decoding for multimodal inputs",
    "nvidia-cudnn-frontend": "cuDNN attention frontend, not used by Triton/FA3 attention",
}

# Versions chosen against a requirement, each seen failing on the H200 otherwise (name -> (specifier, why)).
OVERRIDES: dict[str, tuple[str, str]] = {
    "apache-tvm-ffi": (">=0.1.11,<0.2", "vLLM 0.26 pins 0.1.10, but xgrammar calls load_lib_module(extra_lib_paths=...), "
                       "which 0.1.10 lacks: `import vllm` fails; 0.1.15.post2 ran"),
}

# Members of the vLLM wheel that are dropped (path prefix -> reason).
VLLM_DROP: dict[str, str] = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FA2 extension (305 MB); Hopper uses FA3",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels; dense models never load them",
    "vllm/vllm-rs": "Rust front-end binary, not used by the offline engine",
    "vllm/third_party/deep_gemm/": "DeepGEMM (FP8 GEMM for DeepSeek-style models)",
}


# -- base packages ---------------------------------------------------------------------------------


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except ValueError:  # InvalidVersion is a ValueError
        return False
    return True


def parse_base_packages(text: str, *, source: str) -> dict[str, str | None]:
    """``name`` or ``name==version`` items, separated by blanks or lines (pip freeze output works).

    '#' starts a comment that runs to the end of the line.
    """
    out: dict[str, str | None] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        for item in raw.split("#", 1)[0].split():
            name, sep, version = item.partition("==")
            version = version.split("+")[0]
            if not name or (sep and not _is_version(version)) or any(c in name for c in "<>=!~;[@,"):
                raise ConfigError(f"{source}:{lineno}: {item!r} is not 'name' or 'name==version'")
            out[canonicalize_name(name)] = version or None
    if not out:
        raise ConfigError(f"{source}: no packages listed (one 'name' or 'name==version' per line)")
    return out


def load_base_packages(path: str | Path | None) -> tuple[dict[str, str | None], str]:
    if path is None:
        return parse_base_packages(DEFAULT_BASE_PACKAGES, source="the default H200 list"), DEFAULT_BASE_PACKAGES
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--base-packages {p}: no such file (one 'name' or 'name==version' per line)")
    text = p.read_text()
    return parse_base_packages(text, source=str(p)), text


# -- digests, pieces, manifest ---------------------------------------------------------------------


Digest = manifest_scheme.FileDigest  # size, blake3, sha256


@dataclass(frozen=True)
class Piece:
    name: str
    size: int
    sha256: str
    blake3: str

    @property
    def digest(self) -> Digest:
        return Digest(size=self.size, blake3=self.blake3, sha256=self.sha256)


def digest_file(path: Path) -> Digest:
    return manifest_scheme.digest_file(path, sha256=True)


def split_file(path: Path, out_dir: Path, *, piece_bytes: int) -> list[Piece]:
    """Cut `path` into ``<name>.000``, ``.001``, ... of at most `piece_bytes` each."""
    if piece_bytes <= 0:
        raise ConfigError(f"piece size must be positive, got {piece_bytes} bytes")
    pieces: list[Piece] = []
    with open(path, "rb") as src:
        index = 0
        while True:
            data = src.read(piece_bytes)
            if not data and index > 0:
                break
            name = f"{path.name}.{index:03d}"
            (out_dir / name).write_bytes(data)
            d = digest_file(out_dir / name)
            pieces.append(Piece(name=name, size=d.size, sha256=d.sha256, blake3=d.blake3))
            index += 1
            if len(data) < piece_bytes:
                break
    return pieces


def write_manifest(out_dir: Path, manifest: dict) -> Path:
    return manifest_scheme.write_json(out_dir / MANIFEST, manifest, indent=2, sort_keys=False)


def read_manifest(bundle_dir: Path) -> dict:
    path = bundle_dir / MANIFEST
    manifest = manifest_scheme.read_json(path, missing="no bundle manifest here (build one with `make gpu-bundle`)")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("pieces"), list):
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise DataError(f"{path}: field 'format' must be {FORMAT} with a 'pieces' list (found {found!r})")
    return manifest


def verify_pieces(bundle_dir: Path, manifest: dict) -> list[str]:
    """Problems with the pieces in `bundle_dir` (missing, wrong size or digest); empty when all are good."""
    recorded, found = {}, {}
    for entry in manifest["pieces"]:
        name = entry["name"]
        recorded[name] = Digest.from_entry(entry, where=f"{bundle_dir / MANIFEST} ({name})")
        if (bundle_dir / name).is_file():
            found[name] = digest_file(bundle_dir / name)
    order = {name: i for i, name in enumerate(recorded)}
    problems = manifest_scheme.compare(found, recorded, detail=False)
    return sorted(problems, key=lambda line: order[line.split(": ", 1)[0]])  # in piece order


def join_pieces(bundle_dir: Path, manifest: dict, out_path: Path) -> Digest:
    """Reassemble the archive from verified pieces and check it against the manifest."""
    problems = verify_pieces(bundle_dir, manifest)
    if problems:
        raise DataError(f"{bundle_dir / MANIFEST}: {len(problems)} bad piece(s): {'; '.join(problems)}")
    with open(out_path, "wb") as out:
        for entry in manifest["pieces"]:
            with open(bundle_dir / entry["name"], "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
    d = digest_file(out_path)
    want = Digest.from_entry(manifest["archive"], where=f"{bundle_dir / MANIFEST} (archive)")
    reason = manifest_scheme.mismatch(d, want)
    if reason:
        raise DataError(f"{out_path}: reassembled archive does not match the manifest's 'archive' entry ({reason})")
    return d


# -- wheels ----------------------------------------------------------------------------------------


def wheel_requirements(wheel: Path, *, target: Target, extras: frozenset[str] | set[str] = frozenset()) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on `target`, with the given extras of the wheel asked for."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise DataError(f"{wheel.name}: no .dist-info/METADATA")
        text = zf.read(meta).decode("utf-8", "replace")
    envs = [{**target.markers(), "extra": extra} for extra in ("", *sorted(extras))]
    reqs, seen = [], set()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if (req.marker is None or any(req.marker.evaluate(env) for env in envs)) and str(req) not in seen:
            seen.add(str(req))
            reqs.append(req)
    return reqs


def restore_stored(src: Path, dst: Path, *, drop: dict[str, str] | None = None) -> list[str]:
    """Copy a wheel as an uncompressed zip (so xz sees raw bytes), leaving out `drop` prefixes.

    RECORD loses the dropped entries, so what pip installs matches what RECORD lists.
    """
    drop = drop or {}
    dropped: list[str] = []
    tmp = dst.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if any(info.filename.startswith(prefix) for prefix in drop):
                dropped.append(info.filename)
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD") and drop:
                keep = [row for row in data.decode().splitlines()
                        if not any(row.startswith(prefix) for prefix in drop)]
                data = ("\n".join(keep) + "\n").encode()
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr  # keeps the executable bit of scripts
            out.compress_type = zipfile.ZIP_STORED
            zout.writestr(out, data)
    os.replace(tmp, dst)
    return dropped


def _pip(args: list[str], *, what: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.strip().splitlines()
        raise DataError(f"pip failed while {what}: {(errors or ['no output'])[-1]}")
    return res


def _download(specs: list[str], dest: Path, *, target: Target) -> None:
    """pip download --no-deps for the target's tags; one call for many specs (fast), else one by one."""
    base = ["download", "--no-deps", "-q", "-d", str(dest), *target.pip_args()]
    try:
        _pip(base + specs, what=f"downloading {len(specs)} wheel(s)")
        return
    except DataError:
        if len(specs) == 1:
            raise
    for spec in specs:
        _pip(base + [spec], what=f"downloading {spec}")


@dataclass
class Resolution:
    """The shipped wheels and why everything else was left out."""

    wheels: dict[str, Path] = field(default_factory=dict)  # canonical name -> wheel file
    extras: dict[str, set[str]] = field(default_factory=dict)  # name -> extras whose requirements were followed
    from_base: dict[str, str] = field(default_factory=dict)  # name -> "required spec; base version"
    excluded: dict[str, str] = field(default_factory=dict)  # name -> reason
    notes: list[str] = field(default_factory=list)


def resolve_closure(roots: list[Requirement], base: dict[str, str | None], *, dest: Path, target: Target,
                    echo: Echo, skip: set[str] | None = None) -> Resolution:
    """Download the requirement closure of `roots` that the target lacks, level by level.

    Extras a requirement names (``mistral_common[image]``) are followed. A version
    conflict keeps the wheel chosen first (breadth first: vLLM's own pins beat a
    dependency's wish) and is noted, except where `OVERRIDES` says otherwise.
    """
    res = Resolution()
    skip = set(skip or ())
    queue = list(roots)
    while queue:
        wanted: dict[str, Requirement] = {}
        deferred: list[Requirement] = []
        for req in queue:
            name = canonicalize_name(req.name)
            if name in skip:
                continue
            if name in EXCLUDED:
                res.excluded[name] = EXCLUDED[name]
                continue
            if name in base:
                have = base[name]
                if have is not None and req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                    res.notes.append(f"{name}: base has {have}, a requirement asks {req.specifier}")
                res.from_base[name] = f"{req.specifier or 'any'}; base {have or 'present'}"
                continue
            shipped = res.wheels.get(name)
            if shipped is not None:
                version = parse_wheel_filename(shipped.name)[1]
                if req.specifier and not req.specifier.contains(version, prereleases=True):
                    res.notes.append(f"{name}: shipping {version}, a requirement asks {req.specifier}")
                new_extras = set(req.extras) - res.extras.setdefault(name, set())
                if new_extras:
                    res.extras[name] |= new_extras
                    deferred += wheel_requirements(shipped, target=target, extras=new_extras)
                continue
            if name in wanted:
                deferred.append(req)  # checked against the chosen wheel on the next level
                continue
            spec = req.specifier
            if name in OVERRIDES:
                spec, why = OVERRIDES[name]
                res.notes.append(f"{name}: override {spec} instead of '{req.specifier}' ({why})")
            # Markers were evaluated for the target; pip must not see them (it would evaluate
            # them for *this* interpreter). Extras are followed here, not by pip (--no-deps).
            wanted[name] = Requirement(f"{name}{spec}")
            res.extras[name] = set(req.extras)
        queue = deferred
        if not wanted:
            continue
        echo(f"bundle: downloading {len(wanted)} wheel(s): {', '.join(sorted(wanted))}")
        before = set(dest.glob("*.whl"))
        _download([str(r) for r in wanted.values()], dest, target=target)
        for path in sorted(set(dest.glob("*.whl")) - before):
            name = canonicalize_name(parse_wheel_filename(path.name)[0])
            res.wheels[name] = path
            queue += wheel_requirements(path, target=target, extras=res.extras.get(name, set()))
        missing = sorted(set(wanted) - set(res.wheels))
        if missing:
            raise DataError(f"pip saved no wheel for {', '.join(missing)} (target cp{target.python_version})")
    res.notes = list(dict.fromkeys(res.notes))  # one line per conflict, however often it was met
    return res


def _repo_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(f"the bundle builder needs a source checkout (no pyproject.toml beside {root / 'diffcheck'})")
    return root


def _diffcheck_requirements() -> list[Requirement]:
    import tomllib

    project = tomllib.loads((_repo_root() / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]] + [Requirement(r) for r in DIFFCHECK_EXTRA_REQUIREMENTS]


# -- build -----------------------------------------------------------------------------------------


def build(out: Path, *, vllm_version: str = DEFAULT_VLLM_VERSION, base_packages: str | Path | None = None,
          piece_mib: int = DEFAULT_PIECE_MIB, target: Target = Target(), echo: Echo = print) -> dict:
    """Build the bundle into `out` (replacing a previous bundle there); returns the manifest."""
    from diffcheck.engines import models

    base, base_text = load_base_packages(base_packages)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob(f"{ARCHIVE}.*"), out / MANIFEST, out / INSTALL_SCRIPT, out / BASE_LIST]:
        old.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bundle-", dir=out) as tmp:
        tmp = Path(tmp)
        downloads, stage = tmp / "downloads", tmp / "stage"
        for d in (downloads, stage / "wheels", stage / "model"):
            d.mkdir(parents=True)

        echo(f"bundle: vllm=={vllm_version} for cp{target.python_version} manylinux x86-64")
        _download([f"vllm=={vllm_version}"], downloads, target=target)
        vllm_wheel = next(downloads.glob("vllm-*.whl"))
        roots = wheel_requirements(vllm_wheel, target=target) + _diffcheck_requirements()
        res = resolve_closure(roots, base, dest=downloads, target=target, echo=echo, skip={"vllm", "diffcheck"})

        dropped = restore_stored(vllm_wheel, stage / "wheels" / vllm_wheel.name, drop=VLLM_DROP)
        for path in res.wheels.values():
            restore_stored(path, stage / "wheels" / path.name)
        echo("bundle: building the diffcheck wheel from this checkout")
        _pip(["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "own"), str(_repo_root())],
             what="building the diffcheck wheel")
        own = next((tmp / "own").glob("diffcheck-*.whl"))
        restore_stored(own, stage / "wheels" / own.name)

        spec = models.KNOWN_MODELS[MODEL_ID]
        echo(f"bundle: model {MODEL_ID} ({spec.package})")
        _pip(["download", "--no-deps", "-q", "-d", str(stage / "model"), spec.package], what=f"downloading {spec.package}")

        manifest = package(stage, out, piece_bytes=piece_mib << 20, echo=echo, fields={
            "vllm_version": vllm_version,
            "target": asdict(target),
            "model": {"id": MODEL_ID, "package": spec.package},
            "check_imports": list(CHECK_IMPORTS),
            "vllm_dropped": {prefix: {"reason": why, "members": sum(m.startswith(prefix) for m in dropped)}
                             for prefix, why in VLLM_DROP.items()},
            "from_base": res.from_base,
            "excluded": res.excluded,
            "notes": res.notes,
        })
    (out / BASE_LIST).write_text(base_text)
    return manifest


def package(stage: Path, out: Path, *, piece_bytes: int, fields: dict, echo: Echo = print) -> dict:
    """Pack `stage` (its wheels/ and model/ folders) into pieces, manifest.json and install.sh in `out`.

    `fields` are merged into the manifest: ``model`` ({"id": ...} or None: install.sh prepares
    that model) and ``check_imports`` (modules install.sh imports last) steer install.sh.
    """
    subdirs = [d for d in ("wheels", "model") if (stage / d).is_dir()]
    contents = []
    for sub in subdirs:
        for path in sorted((stage / sub).glob("*.whl")):
            name, version, *_ = parse_wheel_filename(path.name)
            contents.append({"file": f"{sub}/{path.name}", "name": str(name), "version": str(version),
                             "size": path.stat().st_size})
    raw = sum(c["size"] for c in contents)
    echo(f"bundle: {len(contents)} files, {raw / 2**20:.0f} MiB before xz; compressing")
    with tempfile.TemporaryDirectory(prefix=".pack-", dir=out) as tmp:
        archive = Path(tmp) / ARCHIVE
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            for sub in subdirs:
                tar.add(stage / sub, arcname=sub)
        digest = digest_file(archive)
        pieces = split_file(archive, out, piece_bytes=piece_bytes)
    shutil.copyfile(Path(__file__).with_name(INSTALL_SCRIPT), out / INSTALL_SCRIPT)
    (out / INSTALL_SCRIPT).chmod(0o755)
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "diffcheck_version": __version__,
        "model": None,
        "check_imports": [],
        **fields,
        "archive": {"name": ARCHIVE, **digest.entry(), "uncompressed_files_size": raw},
        "pieces": [asdict(p) for p in pieces],
        "contents": contents,
    }
    write_manifest(out, manifest)
    echo(f"bundle: {out}: {len(pieces)} piece(s), {digest.size / 2**20:.1f} MiB in all; install with "
         f"`bash {INSTALL_SCRIPT} TARGET_DIR` beside the pieces")
    return manifest


# -- command line ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.gpu_bundle.build --out DIR`` (build) or ``--verify DIR`` (check the pieces)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.gpu_bundle.build", description=(
        "Build an offline bundle for an air-gapped GPU machine: trimmed vLLM, missing wheels, diffcheck, "
        "the model and install.sh. On the target: put the pieces, manifest.json and install.sh in one "
        "folder and run `bash install.sh TARGET_DIR`."))
    parser.add_argument("--out", type=Path, default=Path("dist/gpu-bundle"),
                        help="folder for the pieces, manifest.json and install.sh (a previous bundle there is replaced)")
    parser.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help="vLLM release to ship")
    parser.add_argument("--base-packages", default=None,
                        help="what the target's Python already has: 'name' or 'name==version' per line (default: the H200 image)")
    parser.add_argument("--piece-mib", type=int, default=DEFAULT_PIECE_MIB, help="largest piece in MiB")
    parser.add_argument("--verify", type=Path, default=None, metavar="DIR",
                        help="check an existing bundle's pieces against its manifest and build nothing")
    args = parser.parse_args(argv)
    try:
        if args.verify is not None:
            manifest = read_manifest(args.verify)
            problems = verify_pieces(args.verify, manifest)
            for line in problems:
                print(f"bad: {line}")
            total = sum(p["size"] for p in manifest["pieces"])
            print(f"{args.verify}: {len(manifest['pieces'])} piece(s), {total / 2**20:.1f} MiB, "
                  f"vllm {manifest.get('vllm_version')}: " + ("all verified" if not problems else f"{len(problems)} bad"))
            return 0 if not problems else 1
        build(args.out, vllm_version=args.vllm_version, base_packages=args.base_packages, piece_mib=args.piece_mib)
    except DiffcheckError as exc:
        print(f"gpu-bundle: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
