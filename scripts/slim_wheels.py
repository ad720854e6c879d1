"""Cut the wheels in a folder (scripts/device_wheels.sh's .whl/) to what the GPU runs import, so that
they fit the device tool's carry: transformers' model packages other than the ones liger-kernel
imports (found in the liger wheel beside it) and what those import, plus KEEP_MODELS; bitsandbytes'
native libraries other than CUDA 13.0's and the CPU one; SQLAlchemy's compiled Cython modules, whose Python
sources it ships beside them and runs instead; timm's ImageNet label files (timm/data/_info), read only to
name classes. Each wheel's RECORD loses the lines of the files left out, so pip installs it as it is.

    python3 scripts/slim_wheels.py .whl
"""

from __future__ import annotations

import os
import re
import sys
import zipfile
from pathlib import Path

KEEP_MODELS = {"auto", "gpt2", "llama", "gemma", "mistral", "qwen2"}
"""transformers model types the project's tests and examples build (hf:gpt2, hf:llama...)."""
BNB_LIBRARY = re.compile(r"libbitsandbytes_(cuda130|cpu)\.so$")
"""bitsandbytes loads the library of the running torch's CUDA (torch.version.cuda "13.0": cuda130); the
GPU machine's torch is 2.11.0+cu130 (printed by every device call of 2026-12-06). CUDA 13.2's library
(3.9 MB) went along unused, and the device's carry (64 MiB with the checkout) was full."""
SQLALCHEMY_CYTHON = re.compile(r"^sqlalchemy/.*_cy\.cpython-[^/]*\.so$")
"""SQLAlchemy's Cython builds (2.7 MB of its 4.7 MB wheel): each has its ``_cy.py`` source in the wheel, which
Python imports where the build is absent (sqlalchemy.util._has_cython then says they are not compiled). A
study's storage is a few hundred trials; the device's carry was full again at e0290f6 (64 MiB with the
checkout, whose reports grow with each GPU row)."""
TIMM_INFO = "timm/data/_info/"
"""timm's ImageNet synset and label-name files (1.5 MB): ``timm.create_model`` never reads them (a ConvNeXt-T
built and stepped without them, on a CPU)."""
MODEL_NAMED = re.compile(rb"transformers\.models\.([a-z0-9_]+)")
"""A transformers model package named in Python source (an import, a monkey patch's target)."""


def rewrite(wheel: Path, keep) -> None:
    """``wheel`` with only the members ``keep(name)`` accepts (RECORD's lines likewise)."""
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if not keep(info.filename):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if keep(line.split(b",")[0].decode()))
            zo.writestr(info, data)
    os.replace(tmp, wheel)


def liger_models(folder: Path) -> set[str]:
    """The transformers model types liger-kernel's wheel names (transformers.models.<type>)."""
    found: set[str] = set()
    for wheel in folder.glob("liger_kernel-*.whl"):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.endswith(".py"):
                    found |= {m.decode() for m in MODEL_NAMED.findall(z.read(name))}
    return found


def model_closure(wheel: Path, wanted: set[str]) -> set[str]:
    """``wanted`` and every model package their modules import (relatively or by name)."""
    keep = set(wanted)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("transformers/models/") and n.endswith(".py")]
        while True:
            more = set()
            for name in names:
                parts = name.split("/")
                if len(parts) >= 4 and parts[2] in keep:
                    text = z.read(name)
                    more |= {m.decode() for m in re.findall(rb"from \.\.([a-z0-9_]+)", text)}
                    more |= {m.decode() for m in MODEL_NAMED.findall(text)}
            if more <= keep:
                return keep
            keep |= more


def main(folder: Path) -> None:
    for wheel in folder.glob("transformers-*.whl"):
        keep = model_closure(wheel, KEEP_MODELS | liger_models(folder))

        def kept(name: str, keep=keep) -> bool:
            parts = name.split("/")
            return not (len(parts) >= 4 and parts[:2] == ["transformers", "models"]) or parts[2] in keep

        rewrite(wheel, kept)
        print(f"{wheel.name}: {len(keep)} model types kept")
    for wheel in folder.glob("bitsandbytes-*.whl"):
        rewrite(wheel, lambda name: not name.endswith(".so") or BNB_LIBRARY.search(name) is not None)
        print(f"{wheel.name}: CUDA 13.0 and CPU libraries kept")
    for wheel in folder.glob("sqlalchemy-*.whl"):
        rewrite(wheel, lambda name: SQLALCHEMY_CYTHON.match(name) is None)
        print(f"{wheel.name}: its Python modules for the Cython ones")
    for wheel in folder.glob("timm-*.whl"):
        rewrite(wheel, lambda name: not name.startswith(TIMM_INFO))
        print(f"{wheel.name}: without the ImageNet label files")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".whl"))
