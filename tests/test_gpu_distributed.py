"""--gpus on a real multi-GPU machine, and the CUDA -> NVML index mapping on real GPUs.

    python3 -m pytest -q -m gpu tests/test_gpu_distributed.py -s
"""

from __future__ import annotations

import json
import subprocess
import sys

import optuna
import pytest
import torch

from autotune.search.distributed import GPU_ATTR
from conftest import run_cli, subprocess_env

pytestmark = pytest.mark.gpu

_MAPPING = """
import json, pynvml, torch
from autotune.trial.gpus import nvml_index
i = nvml_index(0)
pynvml.nvmlInit()
bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId
bus = bus.decode() if isinstance(bus, bytes) else bus
p = torch.cuda.get_device_properties(0)
print(json.dumps({"nvml_index": i, "nvml_bus": bus.lower(), "cuda_bus": f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0", "name": p.name}))
"""


def test_each_pinned_gpu_is_found_in_nvml_by_its_pci_bus_id():
    """A worker pinned to GPU k (CUDA_VISIBLE_DEVICES=k, so CUDA calls it 0) samples NVML device
    of the same PCI bus, whatever the order; with the GPUs listed in reverse too."""
    count = torch.cuda.device_count()
    env = subprocess_env()
    for visible in [str(k) for k in range(count)] + [",".join(str(k) for k in reversed(range(count)))]:
        out = subprocess.run([sys.executable, "-c", _MAPPING], env={**env, "CUDA_VISIBLE_DEVICES": visible},
                             capture_output=True, text=True, check=True).stdout
        found = json.loads(out.strip().splitlines()[-1])
        print(f"CUDA_VISIBLE_DEVICES={visible}: {found}")
        assert found["nvml_bus"] == found["cuda_bus"]


def test_gpus_all_runs_one_worker_per_gpu_in_parallel(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs or more (nvidia-h200-x2)")
    out = tmp_path / "out"
    run_cli("search", "--model", "resnet18", "--gpus", "all", "--trials", str(2 * torch.cuda.device_count() + 2),
            "--no-accuracy-check", "--no-compile", "--min-measure-time", "1", "--early-stop-below", "0",
            "--out", str(out), timeout=1800)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    measured = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE
                and "duplicate_of" not in t.user_attrs]
    by_gpu: dict[str, list] = {}
    for t in measured:
        by_gpu.setdefault(t.system_attrs.get(GPU_ATTR), []).append(t)
    for gpu, trials in sorted(by_gpu.items()):
        rates = ", ".join(f"#{t.number} {t.user_attrs['figures']['samples_per_s']:,.0f}/s" for t in trials)
        print(f"GPU {gpu}: {len(trials)} trials: {rates}")
    assert set(by_gpu) == {str(i) for i in range(torch.cuda.device_count())}
    # trials of different GPUs overlapped in time: they ran in parallel
    spans = sorted((t.datetime_start, t.datetime_complete) for t in measured)
    assert any(b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert (out / "config.json").exists()
