#!/usr/bin/env python
"""Pack wheels into one xz-compressed site-packages tree for the lent GPU machine.

    python scripts/device_site.py OUT.tar.xz WHEEL_OR_DIR...

A device call carries at most 64 MiB, the tracked tree included. The wheels the notebooks,
the server and the kernel breakdown need together are ~46 MB as wheels (each file deflated
on its own) and do not fit beside the tree, so earlier sessions split them over two calls.
Unpacked and compressed as one solid xz stream they take about half that, because Python
sources repeat across files (plotly's generated validators most of all), so every notebook
runs with one carry. The device side needs no pip:

    mkdir -p /tmp/site && tar -xJf .whl_site/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD

Unpacking follows the wheel layout: ``*.data/purelib`` and ``platlib`` join the root,
``data`` files keep their prefix-relative paths (ipykernel's kernelspec under share/),
``scripts`` go to bin/. Left out, since nothing runs them headless on the device: test
folders, byte code and JupyterLab front-end extensions (share/jupyter/labextensions,
nbextensions).
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DROPPED_DIRS = ("tests", "__pycache__")
DROPPED_DATA = ("share/jupyter/labextensions", "share/jupyter/nbextensions")


def wheel_paths(items: list[str]) -> list[Path]:
    """Every ``.whl`` named, or inside a folder named, sorted by name within each folder."""
    found: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found += sorted(path.glob("*.whl"))
        elif path.suffix == ".whl" and path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"device_site: {item} is neither a .whl file nor a folder of them")
    if not found:
        raise SystemExit("device_site: no wheels given")
    return found


def unpack_wheel(wheel: Path, root: Path) -> None:
    """Install one wheel's files under ``root`` the way ``pip install --target`` lays them out."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root)
    for data in root.glob("*.data"):
        for part in data.iterdir():
            if part.name == "headers":
                continue
            target = root / "bin" if part.name == "scripts" else root
            shutil.copytree(part, target, dirs_exist_ok=True)
        shutil.rmtree(data)


def strip_unused(root: Path) -> None:
    """Remove what a headless kernel never imports (see the module docstring)."""
    for rel in DROPPED_DATA:
        shutil.rmtree(root / rel, ignore_errors=True)
    for name in DROPPED_DIRS:
        for path in sorted(root.rglob(name), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def pack(root: Path, out: Path) -> None:
    """One solid xz stream (preset 9 extreme): small enough to carry beside the tree."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as stream:
        with tarfile.open(fileobj=stream, mode="w") as tar:
            for path in sorted(root.iterdir()):
                tar.add(path, arcname=path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .tar.xz to write")
    parser.add_argument("wheels", nargs="+", help=".whl files or folders of them")
    args = parser.parse_args(argv)
    wheels = wheel_paths(args.wheels)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for wheel in wheels:
            unpack_wheel(wheel, root)
        strip_unused(root)
        pack(root, args.out)
    size_mb = args.out.stat().st_size / 1e6
    print(f"device_site: {len(wheels)} wheels -> {args.out} ({size_mb:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
