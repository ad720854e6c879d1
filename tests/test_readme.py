"""The README's commands come in the promised order, and its training loop runs as written
(shrunk to a small model and images so it fits a CPU test)."""

from __future__ import annotations

import re

from autotune.deploy.config import TunedConfig
from autotune.deploy.space import SearchSpace
from conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_install_then_main_job_then_tests():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    lines = [line for line in first_block.splitlines() if line.strip()]
    assert lines[0].startswith("pip install")
    assert lines[1].startswith("autotune search")
    assert "pytest" in lines[2]
    assert "python3 -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_training_loop_runs_with_an_exported_config(tmp_path, capsys):
    space = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[4, 8], base_batch_size=4,
                        memory_formats=["contiguous", "channels_last"], thread_counts=[1, 2])
    cfg = TunedConfig.from_params({"precision.mode": "bf16", "batch_size.batch_size": 8,
                                   "memory_format.format": "channels_last", "threads.num_threads": 2}, space)
    path = tmp_path / "config.json"
    cfg.save(path)
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    shrink = {
        "reports/resnet50-h200/config.json": str(path),
        "resnet50(num_classes=1000)": "resnet18(num_classes=10)",
        "image_size=(3, 224, 224), num_classes=1000": "image_size=(3, 32, 32), num_classes=10",
        "size=2048": "size=32",
        "num_workers=4": "num_workers=0",
    }
    for old, new in shrink.items():
        assert old in code, f"the README's loop changed: {old!r} is gone; update this test"
        code = code.replace(old, new)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 2 and all(v == v for v in losses)  # two epochs, finite
