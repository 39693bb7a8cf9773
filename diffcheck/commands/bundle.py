"""`diffcheck bundle`: build (or verify) an offline bundle for an air-gapped GPU machine.

Thin CLI over `diffcheck.bundle`; see that module for what goes in and why.
"""

from __future__ import annotations

import click


@click.command(name="bundle")
@click.option("--out", type=click.Path(file_okay=False), default="dist/gpu-bundle", show_default=True,
              help="Folder for the pieces, manifest.json and install.sh (a previous bundle there is replaced).")
@click.option("--vllm-version", default=None, help="vLLM release to ship (default 0.26.0: it pins torch 2.11, the H200 image's).")
@click.option("--base-packages", type=click.Path(dir_okay=False), default=None,
              help="What the target's Python already has: 'name' or 'name==version' per line (pip freeze works). "
                   "Default: the H200 image.")
@click.option("--piece-mib", type=click.IntRange(1, 4096), default=None, help="Largest piece in MiB (default 56).")
@click.option("--verify", "verify_dir", type=click.Path(file_okay=False), default=None,
              help="Check an existing bundle's pieces against its manifest (size, sha256, blake3) and build nothing.")
def bundle(out, vllm_version, base_packages, piece_mib, verify_dir):
    """Build an offline bundle: trimmed vLLM, missing wheels, diffcheck, the model, install.sh.

    On the target: copy the pieces, manifest.json and install.sh into one folder and
    run `bash install.sh TARGET_DIR`; it prints the PYTHONPATH to use.
    """
    from pathlib import Path

    from diffcheck import bundle as bundlemod

    if verify_dir is not None:
        folder = Path(verify_dir)
        manifest = bundlemod.read_manifest(folder)
        problems = bundlemod.verify_pieces(folder, manifest)
        for line in problems:
            click.echo(f"bad: {line}")
        total = sum(p["size"] for p in manifest["pieces"])
        click.echo(f"{folder}: {len(manifest['pieces'])} piece(s), {total / 2**20:.1f} MiB, vllm {manifest.get('vllm_version')}: "
                   + ("all verified" if not problems else f"{len(problems)} bad"))
        return 0 if not problems else 1
    bundlemod.build(
        Path(out),
        vllm_version=vllm_version or bundlemod.DEFAULT_VLLM_VERSION,
        base_packages=base_packages,
        piece_mib=piece_mib or bundlemod.DEFAULT_PIECE_MIB,
        echo=click.echo,
    )
    return 0
