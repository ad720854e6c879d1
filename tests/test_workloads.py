"""Workloads: torchvision names and 'pkg.module:factory', with errors that say how to fix them."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autotune
from autotune.workload.models import (
    WorkloadSpec,
    build,
    check_spec,
    logits,
    parse_input_shape,
    torchvision_models,
)

pytest.importorskip("torchvision")

FACTORIES = '''
import torch
from torch import nn

import autotune

NOT_CALLABLE = 42


def tiny_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))


def tiny_classifier(num_classes=1000):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))


def tiny_workload():
    def make_batch(batch_size, generator):
        x = torch.randn(batch_size, 5, generator=generator)
        return x, torch.randint(0, 3, (batch_size,), generator=generator)

    return autotune.Workload(model=nn.Linear(5, 3), make_batch=make_batch, input_shape=(5,), num_classes=3)


def returns_int():
    return 7
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of factories, importable as a user's own file would be."""
    name = f"user_factories_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_unknown_torchvision_name_suggests_close_match() -> None:
    with pytest.raises(autotune.WorkloadError) as info:
        build(WorkloadSpec(model="resnet5"))
    message = str(info.value)
    assert "resnet5" in message
    assert "resnet50" in message
    assert "`autotune models`" in message
    assert isinstance(info.value, autotune.AutotuneError)


def test_unimportable_module() -> None:
    with pytest.raises(autotune.WorkloadError) as info:
        build(WorkloadSpec(model="no_such_pkg_autotune.models:build"))
    message = str(info.value)
    assert "no_such_pkg_autotune.models" in message
    assert "PYTHONPATH" in message


def test_missing_attribute_suggests_close_name(factories: str) -> None:
    with pytest.raises(autotune.WorkloadError) as info:
        build(WorkloadSpec(model=f"{factories}:tiny_nett"))
    message = str(info.value)
    assert "'tiny_nett'" in message
    assert "did you mean" in message and "tiny_net" in message.split("did you mean", 1)[1]


def test_not_callable(factories: str) -> None:
    with pytest.raises(autotune.WorkloadError) as info:
        build(WorkloadSpec(model=f"{factories}:NOT_CALLABLE"))
    message = str(info.value)
    assert "NOT_CALLABLE" in message and "not callable" in message
    assert "nn.Module" in message  # says what it should be instead


def test_factory_returning_non_module(factories: str) -> None:
    with pytest.raises(autotune.WorkloadError) as info:
        build(WorkloadSpec(model=f"{factories}:returns_int"))
    message = str(info.value)
    assert "int" in message
    assert "nn.Module" in message and "autotune.Workload" in message


@pytest.mark.parametrize("target", [":build", "mymodule:"])
def test_malformed_target_shows_the_form(target: str) -> None:
    with pytest.raises(autotune.WorkloadError, match="package.module:factory"):
        check_spec(WorkloadSpec(model=target))


def test_factory_returning_module_builds(factories: str) -> None:
    workload = build(WorkloadSpec(model=f"{factories}:tiny_net", input_shape=(3, 8, 8), num_classes=10))
    assert isinstance(workload.model, nn.Module) and workload.model.training
    x, y = workload.batch(4, torch.Generator().manual_seed(0))
    assert workload.model(x).shape == (4, 10)
    assert workload.loss_fn(workload.model(x), y).isfinite()


def test_factory_with_num_classes_gets_them(factories: str) -> None:
    workload = build(WorkloadSpec(model=f"{factories}:tiny_classifier", input_shape=(3, 8, 8), num_classes=7))
    x, y = workload.batch(6, torch.Generator().manual_seed(0))
    assert workload.model(x).shape == (6, 7)
    assert int(y.max()) < 7


def test_factory_returning_workload_keeps_its_batches(factories: str) -> None:
    workload = build(WorkloadSpec(model=f"{factories}:tiny_workload"))
    assert isinstance(workload, autotune.Workload)
    assert workload.input_shape == (5,)  # not replaced by a default image shape
    x, y = workload.batch(9, torch.Generator().manual_seed(0))
    assert x.shape == (9, 5) and y.shape == (9,)
    assert int(y.min()) >= 0 and int(y.max()) < 3
    loss = workload.loss_fn(workload.model(x), y)
    assert loss.isfinite()


def test_torchvision_model_builds_with_requested_shape() -> None:
    workload = build(WorkloadSpec(model="resnet18", input_shape=(3, 32, 32), num_classes=10))
    assert workload.model.training
    assert workload.input_shape == (3, 32, 32) and workload.num_classes == 10
    assert workload.model.fc.out_features == 10
    # random initialisation, no pretrained weights: two builds differ
    other = build(WorkloadSpec(model="resnet18", input_shape=(3, 32, 32), num_classes=10))
    assert not torch.equal(workload.model.conv1.weight, other.model.conv1.weight)


def test_default_batch_is_random_with_labels_in_range() -> None:
    workload = autotune.Workload(model=nn.Identity(), input_shape=(3, 16, 16), num_classes=5)
    x, y = workload.batch(32, torch.Generator().manual_seed(0))
    assert x.shape == (32, 3, 16, 16) and x.dtype == torch.float32
    assert torch.isfinite(x).all()
    assert (x != 0).float().mean() > 0.99  # never zeros (which can run faster than real data)
    assert x.std() > 0.5
    assert y.shape == (32,) and y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) < 5
    assert len(set(y.tolist())) > 1
    # the generator decides the batch: same seed, same batch; other seed, other batch
    x2, y2 = workload.batch(32, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = workload.batch(32, torch.Generator().manual_seed(1))
    assert not torch.equal(x, x3)


def test_parse_input_shape() -> None:
    assert parse_input_shape("3x64x64") == (3, 64, 64)
    assert parse_input_shape("3X224X224") == (3, 224, 224)
    assert parse_input_shape("128") == (128,)


@pytest.mark.parametrize("text", ["3x", "abc", "0x2", "3x-1x4", ""])
def test_parse_input_shape_rejects(text: str) -> None:
    with pytest.raises(autotune.ConfigError) as info:
        parse_input_shape(text)
    assert isinstance(info.value, ValueError)
    assert repr(text) in str(info.value)
    assert "3x224x224" in str(info.value)  # shows a valid example


def test_torchvision_models_lists_classifiers_only() -> None:
    names = torchvision_models()
    assert "resnet50" in names and "vit_b_16" in names
    assert "fasterrcnn_resnet50_fpn" not in names
    assert "maskrcnn_resnet50_fpn" not in names
    assert "deeplabv3_resnet50" not in names
    assert names == sorted(names)


def test_logits_of_model_outputs() -> None:
    main, aux = torch.randn(2, 3), torch.randn(2, 3)
    assert logits(SimpleNamespace(logits=main, aux_logits=aux)) is main
    assert logits((main, aux)) is main
    assert logits(main) is main
    # torchvision's Inception output (a namedtuple with .logits)
    from torchvision.models.inception import InceptionOutputs

    assert logits(InceptionOutputs(main, aux)) is main
