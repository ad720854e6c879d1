"""Exports to Hugging Face, Lightning and accelerate: each real library loads the export and trains
two steps on a CPU with a tiny model, the exported settings in effect; GPU-only settings are checked
in the export's contents; whatever a target cannot express is listed, never dropped."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotune.deploy.config import TunedConfig
from autotune.deploy.exports import require
from autotune.space import SearchSpace
from autotune.errors import ConfigError

# a CPU search's space: bf16 autocast, padding, channels_last, threads, the fused optimizer, and a
# global batch of 8 made of micro-batches of 4 (two accumulated per optimizer step)
CPU_SPACE = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[4, 8], global_batch_size=8,
                        base_batch_size=8, alignments=[1, 8], memory_formats=["contiguous", "channels_last"],
                        thread_counts=[1, 2], optimizer_implementations=["plain", "fused"])
CPU_PARAMS = {"precision.mode": "bf16", "batch_size.batch_size": 4, "channel_alignment.multiple": 8,
              "memory_format.format": "channels_last", "threads.num_threads": 1, "optimizer.implementation": "fused"}

# a GPU search's best: fp16 with a tuned GradScaler, compile, cudnn.benchmark, two streams, in-place zero_grad
GPU_SPACE = SearchSpace(device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"], batch_sizes=[256, 512],
                        base_batch_size=256, memory_formats=["contiguous", "channels_last"], stream_counts=[1, 2],
                        cudnn_benchmark=[False, True], optimizer_implementations=["foreach", "fused"],
                        zero_grad_set_to_none=[True, False], compile_modes=["off", "max-autotune-no-cudagraphs"])
GPU_PARAMS = {"precision.mode": "fp16", "grad_scaler.init_scale": 1024.0, "grad_scaler.growth_factor": 2.0,
              "grad_scaler.backoff_factor": 0.5, "grad_scaler.growth_interval": 2000, "batch_size.batch_size": 512,
              "memory_format.format": "channels_last", "cudnn.benchmark": True, "streams.num_streams": 2,
              "optimizer.implementation": "fused", "optimizer.set_to_none": False,
              "compile.mode": "max-autotune-no-cudagraphs"}


@pytest.fixture(autouse=True)
def _seeded(restore_backend_flags):
    torch.manual_seed(0)


@pytest.fixture
def cpu_cfg() -> TunedConfig:
    return TunedConfig.from_params(CPU_PARAMS, CPU_SPACE)


@pytest.fixture
def gpu_cfg() -> TunedConfig:
    return TunedConfig.from_params(GPU_PARAMS, GPU_SPACE)


class TinyNet(nn.Module):
    """A 6-channel conv (padded to 8 by the config) and a head; records what its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Linear(6, 4)
        self.seen: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(F.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1).flatten(1))
        self.seen.append({"batch": x.shape[0], "channels_last": x.is_contiguous(memory_format=torch.channels_last),
                          "dtype": logits.dtype, "device": x.device.type,
                          "weight_channels_last": self.conv.weight.is_contiguous(memory_format=torch.channels_last)})
        return logits


def unsupported_settings(items: list[dict]) -> set[str]:
    assert all(set(u) == {"setting", "value", "why"} and u["why"] for u in items)
    return {u["setting"] for u in items}


# Hugging Face ------------------------------------------------------------------------------------


class HFNet(TinyNet):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:  # the Trainer's calling convention
        logits = super().forward(x)
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


@pytest.mark.slow
def test_hf_trainer_runs_two_steps_with_the_exported_arguments(cpu_cfg: TunedConfig, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    kwargs, unsupported = cpu_cfg.hf_training_args()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to="none",
                                          save_strategy="no", logging_strategy="no", **kwargs)
    model = HFNet()
    data = [{"x": torch.randn(3, 8, 8), "labels": torch.tensor(i % 4)} for i in range(32)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()

    assert trainer.state.global_step == 2
    assert args.bf16 and not args.fp16 and args.use_cpu
    assert args.per_device_train_batch_size == 4 and args.gradient_accumulation_steps == 2
    # 2 optimizer steps of 2 accumulated micro-batches of 4, each forward under bf16 autocast
    assert [s["batch"] for s in model.seen] == [4] * 4
    assert {s["dtype"] for s in model.seen} == {torch.bfloat16}
    assert trainer.optimizer.param_groups[0]["fused"] is True  # optim="adamw_torch_fused"
    # what TrainingArguments has no option for is listed, with what to do instead
    assert unsupported_settings(unsupported) == {"memory_format.format", "channel_alignment.multiple",
                                                 "threads.num_threads"}


def test_hf_export_of_a_gpu_config(gpu_cfg: TunedConfig) -> None:
    transformers = pytest.importorskip("transformers")
    kwargs, unsupported = gpu_cfg.hf_training_args()
    # every key is a TrainingArguments field (fp16 and tf32 themselves need a GPU to construct)
    assert set(kwargs) <= {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert kwargs["fp16"] and not kwargs["bf16"] and kwargs["tf32"]
    assert kwargs["torch_compile"] and kwargs["torch_compile_mode"] == "max-autotune-no-cudagraphs"
    assert kwargs["optim"] == "adamw_torch_fused" and kwargs["per_device_train_batch_size"] == 512
    assert kwargs["dataloader_pin_memory"] is True and kwargs["dataloader_drop_last"] is True
    assert unsupported_settings(unsupported) == {"memory_format.format", "cudnn.benchmark", "streams.num_streams",
                                                 "optimizer.set_to_none", "grad_scaler"}
    assert next(u for u in unsupported if u["setting"] == "grad_scaler")["value"] == {"init_scale": 1024.0}


# Lightning ---------------------------------------------------------------------------------------


def lightning_module(pl):
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyNet()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Module()


@pytest.mark.slow
def test_lightning_trainer_runs_two_steps_with_the_exported_precision_and_callback(cpu_cfg: TunedConfig) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    exp = cpu_cfg.lightning()
    module = lightning_module(pl)
    trainer = pl.Trainer(**exp.trainer_kwargs, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,)))
    trainer.fit(module, torch.utils.data.DataLoader(data, **exp.dataloader_kwargs))

    assert trainer.global_step == 2 and exp.precision == trainer.precision == "bf16-mixed"
    assert trainer.accumulate_grad_batches == 2 and exp.callback in trainer.callbacks
    net = module.net
    assert [s["batch"] for s in net.seen] == [4] * 4
    assert {s["dtype"] for s in net.seen} == {torch.bfloat16}
    # the callback: channels_last parameters and inputs, padded conv (same parameters), threads, fused SGD
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(s["channels_last"] for s in net.seen)
    assert type(net.conv).__name__ == "AlignedConv2d" and net.conv.aligned_to == (8, 8)
    assert net.conv.weight.shape == (6, 3, 3, 3)
    assert torch.get_num_threads() == 1
    assert trainer.optimizers[0].param_groups[0]["fused"] is True
    assert exp.unsupported == []


def test_lightning_export_of_a_gpu_config(gpu_cfg: TunedConfig, tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    exp = gpu_cfg.lightning()
    assert exp.precision == "16-mixed"
    assert exp.trainer_kwargs["benchmark"] is True and exp.trainer_kwargs["accelerator"] == "gpu"
    assert exp.callback.recipe.grad_scaler["init_scale"] == 1024.0  # set on the Trainer's scaler at fit start
    assert exp.callback.recipe.compile_mode == "max-autotune-no-cudagraphs"
    assert unsupported_settings(exp.unsupported) == {"streams.num_streams", "optimizer.set_to_none"}
    files, unsupported = gpu_cfg.export("lightning", tmp_path)
    data = json.loads(files[0].read_text())
    assert files == [tmp_path / "lightning.json"] and data["trainer"]["precision"] == "16-mixed"
    assert data["callback"]["applies"]["memory_format"] == "channels_last" and data["unsupported"] == unsupported


def test_lightning_export_lists_no_layer_swap_since_its_callback_applies_every_model_transform(tmp_path: Path) -> None:
    """Every layer-swapping knob (strategies.base.LayerSwap: the stem, the depthwise convolutions, any
    added later) is a model transform of the recipe, which the callback applies: lightning.json leaves
    it out of what it cannot express and names the transform, where the HF export lists it."""
    import strategies
    from strategies.base import LayerSwap

    swaps = [s for s in strategies.REGISTRY if isinstance(s, LayerSwap)]
    assert {s.name for s in swaps} >= {"stem_conv", "depthwise_conv"}
    space = dataclasses.replace(GPU_SPACE, choices={s.name: list(s.choices) for s in swaps})
    framework = {s.param(s.field): "framework" for s in swaps}
    for knob in swaps:
        setting = knob.param(knob.field)
        cfg = TunedConfig.from_params({**GPU_PARAMS, **framework, setting: knob.swapped}, space)
        files, unsupported = cfg.export("lightning", tmp_path / knob.name)
        data = json.loads(files[0].read_text())
        assert unsupported_settings(data["unsupported"]) == {"streams.num_streams", "optimizer.set_to_none"}, setting
        transform = knob.transform
        assert f"{transform.__module__}.{transform.__name__}" in data["callback"]["applies"]["model_transforms"]
        assert setting in unsupported_settings(cfg.hf_training_args().unsupported)


class SwapNet(nn.Module):
    """A strided stem convolution and a depthwise one: what stem_conv and depthwise_conv swap."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 4, stride=2, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.depthwise(torch.relu(self.stem(x))), 1).flatten(1))


class RecipeReads:
    """A recipe that records which of its fields are read."""

    def __init__(self, recipe) -> None:
        self.__dict__.update(recipe=recipe, names=set())

    def __getattr__(self, name: str):
        self.names.add(name)
        return getattr(self.recipe, name)


@pytest.mark.slow
def test_lightning_callback_swaps_the_stem_and_depthwise_layers_and_applies_what_the_export_says() -> None:
    """The callback in a real fit: the stem and depthwise convolutions swapped, nothing listed; the
    recipe fields it reads are those the Lightning export counts as the callback's."""
    pl = pytest.importorskip("lightning.pytorch")
    from autotune.deploy.exports import LIGHTNING_CALLBACK_FIELDS
    from strategies.depthwise_conv import FlippedGradConv2d
    from strategies.stem_conv import SpaceToDepthConv2d

    space = SearchSpace(device="cpu", batch_sizes=[4], choices={"stem_conv": ["framework", "space_to_depth"],
                                                                "depthwise_conv": ["framework", "flipped"]})
    cfg = TunedConfig.from_params({"stem_conv.stem": "space_to_depth", "depthwise_conv.input_grad": "flipped"}, space)
    exp = cfg.lightning()
    assert exp.unsupported == []
    reads = RecipeReads(exp.callback.recipe)
    exp.callback.recipe = reads

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = SwapNet()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = Module()
    trainer = pl.Trainer(**exp.trainer_kwargs, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,)))
    trainer.fit(module, torch.utils.data.DataLoader(data, **exp.dataloader_kwargs))
    assert trainer.global_step == 2
    assert type(module.net.stem) is SpaceToDepthConv2d and type(module.net.depthwise) is FlippedGradConv2d
    assert reads.names - {"device"} == LIGHTNING_CALLBACK_FIELDS


# accelerate --------------------------------------------------------------------------------------

ACCELERATE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.nn.functional as F
    from accelerate import Accelerator

    kw = json.load(open(sys.argv[1]))
    accelerator = Accelerator(**kw["accelerator_kwargs"])
    dynamo = accelerator.state.dynamo_plugin
    out = {"mixed_precision": accelerator.mixed_precision, "cpu": accelerator.device.type == "cpu",
           "dynamo_backend": str(dynamo.backend), "dynamo_mode": dynamo.mode}
    if sys.argv[2] == "train":
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
        inner = []  # the Linear's own output: accelerate hands the model's outputs back in float32
        model[1].register_forward_hook(lambda module, args, output: inner.append(str(output.dtype)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, **kw["optimizer_kwargs"])
        data = torch.utils.data.TensorDataset(torch.randn(32, 12), torch.randint(0, 4, (32,)))
        loader = torch.utils.data.DataLoader(data, **kw["dataloader_kwargs"])
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        steps, batches = 0, []
        for x, y in loader:
            with accelerator.accumulate(model):
                logits = model(x)
                batches.append(len(x))
                accelerator.backward(F.cross_entropy(logits.float(), y))
                optimizer.step()
                steps += accelerator.sync_gradients
                optimizer.zero_grad()
            if steps == 2:
                break
        out.update(steps=steps, dtypes=sorted(set(inner)), batches=batches, fused=optimizer.param_groups[0]["fused"])
    print("RESULT " + json.dumps(out))
""")


def accelerate_launch(folder: Path, mode: str) -> dict:
    script = folder / "train.py"
    script.write_text(ACCELERATE_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(folder / "accelerate_config.yaml"), str(script), str(folder / "accelerate_kwargs.json"),
                           mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.slow  # `accelerate launch` in a child process
def test_accelerate_launch_trains_two_steps_with_the_exported_config(cpu_cfg: TunedConfig, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    files, unsupported = cpu_cfg.export("accelerate", tmp_path)
    assert files == [tmp_path / "accelerate_config.yaml", tmp_path / "accelerate_kwargs.json"]
    result = accelerate_launch(tmp_path, "train")
    assert result["mixed_precision"] == "bf16" and result["cpu"] and result["dynamo_backend"].endswith("NO")
    assert result["steps"] == 2 and result["batches"] == [4] * 4 and result["dtypes"] == ["torch.bfloat16"]
    assert result["fused"] is True
    assert unsupported_settings(unsupported) == {"memory_format.format", "channel_alignment.multiple",
                                                 "threads.num_threads"}
    assert "# not expressible here: memory_format.format" in files[0].read_text()


@pytest.mark.slow  # `accelerate launch` in a child process
def test_accelerate_launch_reads_the_compile_mode_of_a_gpu_config(gpu_cfg: TunedConfig, tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    exp = gpu_cfg.accelerate_config()
    assert exp.config["mixed_precision"] == "fp16" and exp.config["use_cpu"] is False
    assert unsupported_settings(exp.unsupported) == {"memory_format.format", "cudnn.benchmark", "streams.num_streams",
                                                     "optimizer.set_to_none", "precision.tf32", "grad_scaler"}
    # the launcher on this CPU machine: the same file with use_cpu, to read its dynamo settings
    exp.config.update(use_cpu=True, mixed_precision="no")
    (tmp_path / "accelerate_config.yaml").write_text(require("pyyaml", "yaml").safe_dump(exp.config))
    (tmp_path / "accelerate_kwargs.json").write_text(json.dumps({"accelerator_kwargs": exp.accelerator_kwargs}))
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(tmp_path / "accelerate_config.yaml")).dynamo_config["dynamo_mode"] == \
        "max-autotune-no-cudagraphs"
    result = accelerate_launch(tmp_path, "inspect")
    assert result["dynamo_backend"].endswith("INDUCTOR") and result["dynamo_mode"] == "max-autotune-no-cudagraphs"
    assert accelerate.__version__


# the command line and a missing framework ---------------------------------------------------------


@pytest.mark.parametrize("target, written", [("hf", ["hf_training_args.json"]), ("lightning", ["lightning.json"]),
                                             ("accelerate", ["accelerate_config.yaml", "accelerate_kwargs.json"])])
def test_export_command_writes_the_files_and_prints_what_is_not_expressible(
        cpu_cfg: TunedConfig, tmp_path: Path, cli_main, target: str, written: list[str]) -> None:
    pytest.importorskip("yaml")
    cpu_cfg.save(tmp_path / "config.json")
    proc = cli_main("export", str(tmp_path), "--to", target)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout: one JSON line; stderr: the same in words
    assert result["files"] == [str(tmp_path / name) for name in written]
    for name in written:
        assert (tmp_path / name).exists() and f"wrote {tmp_path / name}" in proc.stderr
    if target != "lightning":  # the Lightning callback applies all three
        assert unsupported_settings(result["unsupported"]) == {"memory_format.format", "channel_alignment.multiple",
                                                               "threads.num_threads"}
        assert "not expressible memory_format.format = channels_last" in proc.stderr
    else:
        assert result["unsupported"] == [] and "every tuned setting is expressed" in proc.stderr
    if target == "hf":
        assert json.loads((tmp_path / "hf_training_args.json").read_text())["training_args"] == \
            cpu_cfg.hf_training_args().training_args


def test_a_missing_framework_names_the_package_to_install(monkeypatch) -> None:
    for name in ("lightning", "lightning.pytorch"):  # what `import lightning` sees when it is not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match="pip install lightning"):
        require("lightning", "lightning.pytorch")


def test_a_gpu_config_exports_on_a_machine_without_a_gpu(tmp_path: Path, cli_main) -> None:
    """Exporting translates data: the committed H200 configuration exports here (autotune.load would refuse it)."""
    root = Path(__file__).resolve().parent.parent
    shutil.copy(root / "reports" / "resnet50-h200-compile" / "config.json", tmp_path / "config.json")
    proc = cli_main("export", str(tmp_path), "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    exported = json.loads((tmp_path / "hf_training_args.json").read_text())
    recorded = json.loads((tmp_path / "config.json").read_text())["knobs"]
    assert exported["training_args"]["fp16"] is (recorded["precision"]["mode"] == "fp16")
    assert exported["training_args"]["per_device_train_batch_size"] == recorded["batch_size"]["batch_size"]
    assert {u["setting"] for u in exported["unsupported"]} >= {"memory_format.format"}


def test_hf_export_keeps_the_optimizer_class_that_was_measured(gpu_cfg: TunedConfig) -> None:
    """Issue 36: a search measured with SGD exported optim='adamw_torch_fused', and the change was not
    listed among what TrainingArguments cannot express. config.json records the class the trials
    stepped; an AdamW keeps its optim name, any other class is listed with how to keep it."""
    sgd = TunedConfig.from_params(GPU_PARAMS, GPU_SPACE, info={"optimizer": {"class": "torch.optim.sgd.SGD"}})
    kwargs, unsupported = sgd.hf_training_args()
    assert "optim" not in kwargs
    entry = next(u for u in unsupported if u["setting"] == "optimizer.class")
    assert entry["value"] == "torch.optim.sgd.SGD"
    assert "Trainer(optimizers=(optimizer, None))" in entry["why"] and "fused=True" in entry["why"]
    adamw = TunedConfig.from_params(GPU_PARAMS, GPU_SPACE, info={"optimizer": {"class": "torch.optim.adamw.AdamW"}})
    kwargs, unsupported = adamw.hf_training_args()
    assert kwargs["optim"] == "adamw_torch_fused" and "optimizer.class" not in unsupported_settings(unsupported)
    # a config.json from before the class was recorded: as before
    assert gpu_cfg.hf_training_args()[0]["optim"] == "adamw_torch_fused"
