#!/usr/bin/env bash
# The wheels the GPU machine lacks for the optional knobs and hub models (transformers, timm,
# bitsandbytes, liger-kernel, torchao), added to .whl/ by ../shared/device/prepare.sh and cut to fit the
# device tool's 64 MiB carry (the tracked tree is about 34 MB of it): transformers keeps the model
# types liger-kernel imports at its import (and what they import) plus gpt2, 4.5 MB instead of 13.8;
# bitsandbytes keeps its CUDA 13 and CPU libraries, 7 MB instead of 43. huggingface_hub 2.x needs
# httpx2 and its dependencies, which the GPU image does not have.
#
#   bash scripts/device_wheels.sh        # from the project root, on this machine; then carry [".whl"]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/device/prepare.sh transformers timm tokenizers safetensors huggingface-hub tqdm filelock fsspec \
  typer-slim bitsandbytes liger-kernel torchao httpx2 httpcore2 anyio idna truststore h11 certifi sniffio click \
  typing-extensions > /dev/null
python3 scripts/slim_wheels.py .whl
du -sh .whl
