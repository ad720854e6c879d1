"""The framework exports of a GPU configuration, run by the real frameworks on the GPU (pytest -m gpu):
fp16 with a tuned GradScaler, channels_last, cudnn.benchmark and the fused optimizer, in effect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autotune.deploy.config import TunedConfig
from test_exports import GPU_PARAMS, GPU_SPACE, HFNet, accelerate_launch, lightning_module

pytestmark = pytest.mark.gpu

# the GPU config of test_exports, eager (a compile of a 6-channel net says nothing about the export)
EAGER = {**GPU_PARAMS, "compile.mode": "off"}


@pytest.fixture
def cfg(restore_backend_flags) -> TunedConfig:
    torch.manual_seed(0)
    return TunedConfig.from_params(EAGER, GPU_SPACE)


def test_hf_trainer_trains_in_fp16_on_the_gpu(cfg: TunedConfig, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    kwargs, _ = cfg.hf_training_args()
    kwargs["per_device_train_batch_size"] = 8  # the tuned 512 is for ResNet-50; the settings are the point
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to="none",
                                          save_strategy="no", logging_strategy="no", **kwargs)
    model = HFNet()
    data = [{"x": torch.randn(3, 8, 8), "labels": torch.tensor(i % 4)} for i in range(32)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2 and args.fp16
    assert {s["dtype"] for s in model.seen} == {torch.float16}
    assert trainer.optimizer.param_groups[0]["fused"] is True


def test_lightning_trains_in_fp16_with_the_callback_on_the_gpu(cfg: TunedConfig) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    exp = cfg.lightning()
    module = lightning_module(pl)
    benchmark_seen = []
    module.net.register_forward_hook(lambda *args: benchmark_seen.append(torch.backends.cudnn.benchmark))
    trainer = pl.Trainer(**exp.trainer_kwargs, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,)))
    loader_kwargs = {**exp.dataloader_kwargs, "batch_size": 8}
    trainer.fit(module, torch.utils.data.DataLoader(data, **loader_kwargs))
    assert trainer.global_step == 2 and trainer.precision == "16-mixed"
    net = module.net
    assert {s["dtype"] for s in net.seen} == {torch.float16}
    # as the net trained (the Trainer's teardown moves the module back to the CPU after fit)
    assert {s["device"] for s in net.seen} == {"cuda"} and all(s["weight_channels_last"] for s in net.seen)
    assert all(s["channels_last"] for s in net.seen) and all(benchmark_seen)
    assert trainer.optimizers[0].param_groups[0]["fused"] is True
    # the tuned GradScaler reached the Trainer's scaler: it started at 1024 (only an overflow lowers it),
    # not at PyTorch's 65536
    assert trainer.precision_plugin.scaler.get_scale() <= 1024.0


@pytest.mark.slow
def test_accelerate_launch_trains_in_fp16_on_the_gpu(cfg: TunedConfig, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    cfg.export("accelerate", tmp_path)
    kwargs_file = tmp_path / "accelerate_kwargs.json"
    kwargs = json.loads(kwargs_file.read_text())
    # the tuned 512 with drop_last would leave no batch of the 32 samples; the settings are the point
    kwargs["dataloader_kwargs"]["batch_size"] = 8
    kwargs_file.write_text(json.dumps(kwargs))
    result = accelerate_launch(tmp_path, "train")
    assert result["mixed_precision"] == "fp16" and not result["cpu"] and result["steps"] == 2
    assert result["dtypes"] == ["torch.float16"] and result["fused"] is True


def test_the_loss_scale_is_the_tuned_one(cfg: TunedConfig) -> None:
    """fp16's GradScaler starts at the tuned init_scale (1024), not PyTorch's 65536."""
    scaler = cfg.grad_scaler()
    model = torch.nn.Linear(4, 4).cuda()
    with cfg.autocast():
        loss = F.mse_loss(model(torch.randn(2, 4, device="cuda")), torch.zeros(2, 4, device="cuda"))
    assert scaler.get_scale() == 1024.0 and torch.isfinite(scaler.scale(loss))
