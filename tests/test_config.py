"""TunedConfig: save and load config.json, reject bad files with the fix, and train with it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import autotune
import strategies
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace

torchvision = pytest.importorskip("torchvision")

CPU_SPACE = SearchSpace(
    device="cpu",
    precisions=["fp32", "bf16"],
    batch_sizes=[4, 8, 16],
    base_batch_size=8,
    memory_formats=["contiguous", "channels_last"],
    thread_counts=[1, 2],
)


def cpu_params(**overrides) -> dict:
    params = {"precision.mode": "fp32", "batch_size.batch_size": 16, "memory_format.format": "contiguous",
              # one thread: two on a small, shared CI machine are often slower
              "threads.num_threads": 1}
    params.update(overrides)
    return params


@pytest.fixture(autouse=True)
def _seeded(restore_backend_flags):
    torch.manual_seed(0)


def saved_config(tmp_path: Path, params: dict | None = None, space: SearchSpace = CPU_SPACE) -> Path:
    path = tmp_path / "config.json"
    TunedConfig.from_params(params or cpu_params(), space).save(path)
    return path


def recipe_fields(cfg: TunedConfig) -> dict:
    fields = {f.name: getattr(cfg.recipe, f.name) for f in dataclasses.fields(cfg.recipe)}
    fields["model_transforms"] = [(t.func, t.args, t.keywords) if isinstance(t, functools.partial) else t
                                  for t in cfg.recipe.model_transforms]
    return fields


# save / load ------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    params = cpu_params(**{"precision.mode": "bf16", "threads.num_threads": 2,
                           "memory_format.format": "channels_last"})
    cfg = TunedConfig.from_params(params, CPU_SPACE)
    path = tmp_path / "config.json"
    cfg.save(path)

    loaded = autotune.load(path)
    assert loaded.knobs == cfg.knobs
    assert loaded.params == params
    assert loaded.batch_size == cfg.batch_size == 16
    assert loaded.device == "cpu"
    assert recipe_fields(loaded) == recipe_fields(cfg)
    assert loaded.recipe.autocast_dtype is torch.bfloat16
    assert loaded.recipe.memory_format is torch.channels_last
    assert loaded.recipe.backend_flags == {"num_threads": 2}
    assert loaded.notes == cfg.notes and any("learning rate" in n for n in loaded.notes)
    assert loaded.space == CPU_SPACE
    assert json.loads(path.read_text())["params"] == params


def test_load_a_folder_finds_config_json(tmp_path: Path) -> None:
    saved_config(tmp_path)
    cfg = autotune.load(tmp_path)
    assert cfg.batch_size == 16
    assert cfg.knobs == TunedConfig.from_params(cpu_params(), CPU_SPACE).knobs


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "config.json"
    with pytest.raises(autotune.ConfigError, match="no such file") as info:
        autotune.load(path)
    assert str(path) in str(info.value)
    assert "`autotune search`" in str(info.value)


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(autotune.ConfigError) as info:
        autotune.load(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"params": {"precision.mode": "fp32",')
    with pytest.raises(autotune.ConfigError, match="not valid JSON") as info:
        autotune.load(path)
    assert str(path) in str(info.value)


def test_json_without_params(tmp_path: Path) -> None:
    path = saved_config(tmp_path)
    data = json.loads(path.read_text())
    del data["params"]
    path.write_text(json.dumps(data))
    with pytest.raises(autotune.ConfigError, match="'params'") as info:
        autotune.load(path)
    assert str(path) in str(info.value)


def test_knobs_edited_by_hand_are_refused(tmp_path: Path) -> None:
    path = saved_config(tmp_path)
    data = json.loads(path.read_text())
    assert data["knobs"]["threads"]["num_threads"] == 1
    data["knobs"]["threads"]["num_threads"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(autotune.ConfigError, match="edited by hand") as info:
        autotune.load(path)
    assert str(path) in str(info.value)


def test_a_config_written_before_a_knob_existed_loads_with_its_default(tmp_path: Path) -> None:
    """A knob added in a later version is absent from older files; it replays to its default."""
    path = saved_config(tmp_path, cpu_params(**{"memory_format.format": "channels_last"}))
    data = json.loads(path.read_text())
    del data["knobs"]["cudnn"]
    path.write_text(json.dumps(data))
    cfg = autotune.load(path)
    assert cfg.knobs["cudnn"] == strategies.BY_NAME["cudnn"].default()
    assert cfg.recipe.memory_format is torch.channels_last


def test_a_missing_knob_that_is_not_at_its_default_is_refused(tmp_path: Path) -> None:
    path = saved_config(tmp_path, cpu_params(**{"threads.num_threads": 2}))
    data = json.loads(path.read_text())
    del data["knobs"]["threads"]
    path.write_text(json.dumps(data))
    with pytest.raises(autotune.ConfigError, match="edited by hand"):
        autotune.load(path)


def test_params_that_do_not_replay_are_refused(tmp_path: Path) -> None:
    path = saved_config(tmp_path)
    data = json.loads(path.read_text())
    del data["params"]["batch_size.batch_size"]
    path.write_text(json.dumps(data))
    with pytest.raises(autotune.ConfigError) as info:
        autotune.load(path)
    assert str(path) in str(info.value)


def test_cuda_config_on_a_cpu_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_space = SearchSpace(device="cuda", precisions=["fp32", "fp16"], batch_sizes=[32, 64],
                             base_batch_size=32, cudnn_benchmark=[False, True])
    params = {"precision.mode": "fp16", "grad_scaler.init_scale": 1024.0, "grad_scaler.growth_factor": 2.0,
              "grad_scaler.backoff_factor": 0.5, "grad_scaler.growth_interval": 1000,
              "batch_size.batch_size": 64, "cudnn.benchmark": True}
    path = saved_config(tmp_path, params, cuda_space)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, on any machine
    with pytest.raises(autotune.ConfigError, match="--device cpu") as info:
        autotune.load(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


# training with a loaded config -------------------------------------------------------------------


def load_cpu(tmp_path: Path, **overrides) -> TunedConfig:
    return autotune.load(saved_config(tmp_path, cpu_params(**overrides)))


def resnet18() -> nn.Module:
    return torchvision.models.resnet18(weights=None, num_classes=10)


def fixed_batch(batch_size: int = 4, shape=(3, 32, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, *shape, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)


def test_user_training_loop_reduces_loss(tmp_path: Path) -> None:
    cfg = load_cpu(tmp_path)
    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.scaled_lr(0.01), momentum=0.9)
    model, optimizer = cfg.prepare(model, optimizer)
    scaler = cfg.grad_scaler()
    assert not scaler.is_enabled()  # fp32 needs no loss scaling
    assert torch.get_num_threads() == 1  # prepare set the tuned switches for this process

    x, y = fixed_batch()
    losses = []
    for inputs, targets in cfg.loader([(x, y)] * 5):
        optimizer.zero_grad(set_to_none=True)
        with cfg.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    assert len(losses) == 5
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_train_step_fp32_reduces_loss(tmp_path: Path) -> None:
    cfg = load_cpu(tmp_path)
    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, nn.CrossEntropyLoss())
    x, y = fixed_batch()
    losses = [step(x, y).item() for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_train_step_bf16_autocasts_and_reduces_loss(tmp_path: Path) -> None:
    cfg = load_cpu(tmp_path, **{"precision.mode": "bf16"})
    assert not cfg.grad_scaler().is_enabled()  # bf16 keeps fp32's range: no loss scaling

    linear = nn.Linear(8, 4)
    with cfg.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert linear(torch.randn(2, 8)).dtype == torch.bfloat16
    assert linear(torch.randn(2, 8)).dtype == torch.float32  # only inside the block

    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, nn.CrossEntropyLoss())
    # batch 2: bf16 autocast on a CPU without native bf16 costs about a second per step
    x, y = fixed_batch(2)
    losses = [step(x, y).item() for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_fp32_config_does_not_autocast(tmp_path: Path) -> None:
    cfg = load_cpu(tmp_path)
    with cfg.autocast():
        assert nn.Linear(8, 4)(torch.randn(2, 8)).dtype == torch.float32


@pytest.mark.parametrize("batch", [4, 8, 16])
def test_scaled_lr(tmp_path: Path, batch: int) -> None:
    cfg = TunedConfig.from_params(cpu_params(**{"batch_size.batch_size": batch}), CPU_SPACE)
    assert cfg.batch_size == batch
    assert cfg.scaled_lr(0.1) == pytest.approx(0.1 * batch / CPU_SPACE.base_batch_size)


@pytest.mark.parametrize("multiple", [1, 8])
def test_channels_last_prepare_and_loader(tmp_path: Path, multiple: int) -> None:
    space = dataclasses.replace(CPU_SPACE, alignments=[1, 8])
    params = cpu_params(**{"memory_format.format": "channels_last", "channel_alignment.multiple": multiple})
    cfg = autotune.load(saved_config(tmp_path, params, space))
    assert cfg.knobs["channel_alignment"].multiple == multiple
    model = resnet18()
    reference = copy.deepcopy(model)
    params_before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = cfg.prepare(model, optimizer)

    conv_weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert conv_weights and all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights)
    assert not model.conv1.weight.is_contiguous()  # really converted, not trivially both
    # padding (conv1 has 3 input channels) keeps the same module and parameter objects
    assert getattr(model.conv1, "aligned_to", None) == ((8, 64) if multiple == 8 else None)

    # the optimizer built before prepare still holds, and updates, the prepared model's parameters
    assert all(a is b for a, b in zip(model.parameters(), params_before, strict=True))
    assert optimizer.param_groups[0]["params"][0] is model.conv1.weight

    x, y = fixed_batch()
    (inputs, targets), = list(cfg.loader([(x, y)]))
    assert inputs.is_contiguous(memory_format=torch.channels_last) and not inputs.is_contiguous()
    assert torch.equal(inputs, x) and torch.equal(targets, y)

    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    assert not torch.equal(model.conv1.weight, reference.conv1.weight)
    assert not torch.equal(model.fc.weight, reference.fc.weight)


def test_the_train_step_feeds_the_model_its_inputs_in_the_tuned_memory_format(tmp_path: Path) -> None:
    """A step called with a contiguous image batch (not through cfg.loader) runs the graph the search
    measured: its input in the tuned format. On an H100 the ResNet-50 recommendation's compile-cache.zip
    missed both of its graphs where the step got a contiguous batch, the input strides being part of the key."""
    cfg = autotune.load(saved_config(tmp_path, cpu_params(**{"memory_format.format": "channels_last"}), CPU_SPACE))
    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = cfg.prepare(model, optimizer)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous(
        memory_format=torch.channels_last) and not args[0].is_contiguous()))
    x, y = fixed_batch()
    assert x.is_contiguous()
    cfg.train_step(model, optimizer, nn.CrossEntropyLoss())(x, y)
    assert seen == [True]
    (tmp_path / "contiguous").mkdir()
    contiguous = autotune.load(saved_config(tmp_path / "contiguous", cpu_params(), CPU_SPACE))
    model = resnet18()
    model, optimizer = contiguous.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    contiguous.train_step(model, optimizer, nn.CrossEntropyLoss())(x, y)
    assert seen == [True, True]


def test_a_newer_format_is_refused_with_the_fix(tmp_path):
    space = SearchSpace(device="cpu", precisions=["fp32"], batch_sizes=[4, 8], base_batch_size=4)
    path = tmp_path / "config.json"
    TunedConfig.from_params({"batch_size.batch_size": 8}, space).save(path)
    data = json.loads(path.read_text())
    data["format"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(autotune.ConfigError, match="newer than this autotune reads.*upgrade"):
        autotune.load(path)


def test_a_config_from_another_torch_warns_what_differs(tmp_path):
    space = SearchSpace(device="cpu", precisions=["fp32"], batch_sizes=[4, 8], base_batch_size=4)
    path = tmp_path / "config.json"
    TunedConfig.from_params({"batch_size.batch_size": 8}, space,
                            info={"provenance": {"torch": "1.0.0"}}).save(path)
    with pytest.warns(UserWarning, match=r"torch 1\.0\.0 \(here "):
        cfg = autotune.load(path)
    assert cfg.batch_size == 8


# verify --set: the same configuration with one knob changed -------------------------------------

def _exported(tmp_path: Path) -> Path:
    """A config.json as a CPU search exports it for tiny_cnn: what `autotune verify` needs of it."""
    from autotune.trial.measure import MeasureSettings

    info = {"workload": {"model": "fake_models:tiny_cnn", "input_shape": [3, 32, 32], "num_classes": 10},
            "figures": {"samples_per_s": 1000.0},
            "measure": MeasureSettings(min_warmup_steps=2, max_warmup_s=2, min_steps=5, min_time_s=0.2).to_dict()}
    path = tmp_path / "config.json"
    TunedConfig.from_params(cpu_params(), CPU_SPACE, info=info).save(path)
    return path


def test_a_variant_changes_the_parameters_and_its_knobs_follow(tmp_path):
    from autotune.deploy.config import variant
    from autotune.errors import ConfigError

    path = _exported(tmp_path)
    data = variant(path, {"precision.mode": "bf16", "batch_size.batch_size": 8})
    assert data["params"] == {**cpu_params(), "precision.mode": "bf16", "batch_size.batch_size": 8}
    assert data["knobs"]["precision"]["mode"] == "bf16" and data["knobs"]["batch_size"]["batch_size"] == 8
    assert data["workload"]["model"] == "fake_models:tiny_cnn"  # the rest is the exported config's
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "config.json").write_text(json.dumps(data, default=str))
    assert autotune.load(tmp_path / "v").knobs["precision"].mode == "bf16"  # it loads as an export does
    with pytest.raises(ConfigError, match="no such parameter; it has batch_size.batch_size, memory_format"):
        variant(path, {"vocab_padding.multiple": 1})
    with pytest.raises(ConfigError, match="give a value this configuration's search offered"):
        variant(path, {"batch_size.batch_size": 12})


@pytest.mark.slow
def test_verify_measures_the_exported_config_and_a_variant_alternately(tmp_path):
    from conftest import run_cli

    path = _exported(tmp_path)
    proc = run_cli("verify", str(path), "--set", "memory_format.format=channels_last", "--repeat", "2")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["remeasured"]) == 2 and result["median"] > 0
    variant = result["variant"]
    assert variant["set"] == {"memory_format.format": "channels_last"} and len(variant["remeasured"]) == 2
    assert variant["ratio"] == pytest.approx(variant["median"] / result["median"])
    said = " ".join(proc.stderr.split())
    assert "with memory_format.format=channels_last: median" in said and "x the config as exported" in said
    bad = run_cli("verify", str(path), "--set", "memory_format.format", check=False)
    assert bad.returncode == 2 and "'memory_format.format' is not NAME=VALUE" in " ".join(bad.stderr.split())
