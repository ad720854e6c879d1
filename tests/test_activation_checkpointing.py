"""activation_checkpointing: a model with every (or every k-th) repeated block checkpointed trains as
the model without: the same loss, gradients and buffers in FP32, with dropout, under autocast and
compiled; the blocks it says it recomputes are recomputed in the backward pass and no others;
transformers and timm models go through their own API; the search offers it where the model has
repeated blocks on a GPU; autotune.load replays it and the exports carry it."""

from __future__ import annotations

import copy
import io
import json
import warnings
from typing import Any, Callable

import optuna
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import strategies
from autotune.deploy.config import TunedConfig, load
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.activation_checkpointing import (ActivationCheckpointing, checkpoint_blocks, find_blocks,
                                                 hf_training_args, is_checkpointed, num_blocks)

STRATEGY = strategies.BY_NAME["activation_checkpointing"]
CUDA_SPACE = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[8, 16], base_batch_size=8,
                         cuda_graphs=[False, True], choices={"activation_checkpointing": [0, 1, 2]})


# tiny models of each kind ------------------------------------------------------------------------


class Block(nn.Module):
    """A residual block with LayerNorm, BatchNorm and dropout, called with a keyword argument."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm, self.bn = nn.LayerNorm(width), nn.BatchNorm1d(width)
        self.fc1, self.fc2, self.drop = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x))))) * scale + self.bn(x)


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, width), nn.Linear(width, 3)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, scale=self.scale)
        return self.head(x)


def hf_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    fields = ({"n_layer": 3, "n_embd": 32, "n_head": 2} if kind == "gpt2" else  # GPT-2's dropouts are 0.1
              {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
               "num_key_value_heads": 1, "attention_dropout": 0.1})
    config = transformers.AutoConfig.for_model(kind, vocab_size=101, **fields)
    return transformers.AutoModelForCausalLM.from_config(config)


def timm_model(name: str, **kwargs: Any) -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(name, num_classes=10, **kwargs)


def tv_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(32, 8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64,
                                               dropout=0.1, attention_dropout=0.1, num_classes=10)


def timm_vit() -> nn.Module:
    return timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, drop_rate=0.1,
                      proj_drop_rate=0.1, attn_drop_rate=0.1)


IMAGES = (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 7]))
SMALL_IMAGES = (IMAGES[0][:, :, :16, :16], IMAGES[1])  # a ResNet's step on a CPU: 0.3-1 s at 32 x 32
TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(0))
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, torch.Tensor]]] = {
    "net": (Net, (torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2]))),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), SMALL_IMAGES),
    "torchvision_vit": (tv_vit, IMAGES),
    "timm_vit": (timm_vit, IMAGES),
    "timm_resnet18": (lambda: timm_model("resnet18"), SMALL_IMAGES),
    "gpt2": (lambda: hf_model("gpt2"), (TOKENS[:, :-1], TOKENS[:, 1:])),
    "llama": (lambda: hf_model("llama"), (TOKENS[:, :-1], TOKENS[:, 1:])),
}


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out = getattr(out, "logits", out)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *, seed: int = 1,
               blocks: list[nn.Module] | None = None) -> dict[str, Any]:
    """One forward and backward from a fixed RNG state: the loss, every gradient and buffer, and
    which of ``blocks`` ran again in the backward pass (a module inside it did: its recompute)."""
    ran: set[int] = set()
    backward = [False]
    hooks = [m.register_forward_hook(lambda *_, i=i: ran.add(i) if backward[0] else None)
             for i, block in enumerate(blocks or []) for m in block.modules() if m is not block]
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, *batch)
    backward[0] = True
    loss.backward()
    for hook in hooks:
        hook.remove()
    return {"loss": loss.detach(), "recomputed": sorted(ran),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def assert_same_step(got: dict[str, Any], want: dict[str, Any], atol: float = 0.0) -> None:
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=atol)
    assert got["grads"].keys() == want["grads"].keys() and got["buffers"].keys() == want["buffers"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=atol, msg=name)
    for name, buffer in want["buffers"].items():
        torch.testing.assert_close(got["buffers"][name], buffer, rtol=0, atol=0, msg=name)


# what it checkpoints ------------------------------------------------------------------------------


def test_finds_the_repeated_blocks_of_torchvision_timm_and_transformers_models():
    kinds = lambda model: sorted({type(b).__name__ for b in find_blocks(model)})  # noqa: E731
    with torch.device("meta"):  # their structure only: no weights to initialise
        resnet, resnet50, mobilenet, vit = (torchvision.models.resnet18(), torchvision.models.resnet50(),
                                            torchvision.models.mobilenet_v2(), torchvision.models.vit_b_16())
    assert len(find_blocks(resnet)) == 8 and kinds(resnet) == ["BasicBlock"]  # layer1..layer4, 2 each
    assert [len(find_blocks(m)) for m in (resnet50, mobilenet)] == [16, 17]
    assert len(find_blocks(vit)) == 12 and kinds(vit) == ["EncoderBlock"]  # not its MLP's Linear layers
    assert kinds(timm_vit()) == ["Block"] and num_blocks(timm_vit()) == 3
    # timm's ConvNeXt stages are modules of their own: the blocks inside them are the blocks
    with torch.device("meta"):
        convnext = timm_model("convnext_atto")
    assert len(find_blocks(convnext)) == 12 and kinds(convnext) == ["ConvNeXtBlock"]
    assert num_blocks(hf_model("gpt2")) == num_blocks(hf_model("llama")) == 3  # their decoder layers
    assert num_blocks(Net()) == 4
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_blocks(mlp) == [] and num_blocks(mlp) == 0  # layers, no blocks
    with pytest.raises(ConfigError, match="activation_checkpointing.every 0"):
        checkpoint_blocks(mlp, 1)


@pytest.mark.parametrize("name, every", [("net", 1), ("net", 2), ("net", 3), ("resnet18", 1), ("resnet18", 2),
                                         ("torchvision_vit", 1), ("timm_vit", 1), ("timm_vit", 2), ("timm_resnet18", 1),
                                         ("gpt2", 1), ("gpt2", 2), ("gpt2", 3), ("llama", 1), ("llama", 2)])
def test_checkpointed_step_equals_the_plain_step_and_recomputes_every_kth_block(name: str, every: int):
    make, batch = MODELS[name]
    torch.manual_seed(0)
    plain = make()
    model = checkpoint_blocks(copy.deepcopy(plain), every)
    blocks = find_blocks(plain)
    want = train_step(plain, batch, blocks=blocks)
    got = train_step(model, batch, blocks=find_blocks(model))
    assert want["recomputed"] == []
    assert got["recomputed"] == list(range(0, len(blocks), every))
    assert_same_step(got, want)  # bit for bit, buffers (BatchNorm's running statistics) included
    if "resnet" not in name:  # the others drop out (another RNG state, other gradients): it was restored
        other = train_step(plain, batch, seed=2)["grads"]
        assert any(not torch.equal(grad, want["grads"][n]) for n, grad in other.items())


def test_dropout_masks_are_those_of_the_forward_pass():
    """Dropout inside a checkpointed block draws the same mask in its recompute (the RNG state is
    restored), even when the RNG advanced in between: the gradients are the plain model's."""
    make, batch = MODELS["net"]
    torch.manual_seed(0)
    plain = make()
    model = checkpoint_blocks(copy.deepcopy(plain), 1)
    steps = []
    for m in (plain, model):
        torch.manual_seed(5)
        m.zero_grad()
        loss = loss_of(m, *batch)
        torch.rand(1000)  # the RNG moves on before the backward pass
        loss.backward()
        steps.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*steps):
        assert torch.equal(a, b)


def test_recompute_runs_under_the_forward_autocast():
    make, batch = MODELS["gpt2"]
    torch.manual_seed(0)
    plain = make()
    model = checkpoint_blocks(copy.deepcopy(plain), 1)
    steps = []
    for m in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the backward pass runs outside it
            steps.append(train_step(m, batch, blocks=find_blocks(m)))
    assert steps[1]["recomputed"] == [0, 1, 2]
    assert steps[1]["loss"].dtype == torch.float32
    assert_same_step(steps[1], steps[0])


def test_evaluation_and_no_grad_run_the_blocks_as_written():
    make, (x, _) = MODELS["net"]
    torch.manual_seed(0)
    plain = make()
    model = checkpoint_blocks(copy.deepcopy(plain), 1)
    model.eval(), plain.eval()
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    model.train(), plain.train()
    with torch.no_grad():
        torch.manual_seed(3)
        a = model(x)
        torch.manual_seed(3)
        torch.testing.assert_close(a, plain(x), rtol=0, atol=0)


# in place: checkpoints, copies, pickles, applied twice --------------------------------------------


def test_in_place_same_state_dict_copies_pickles_and_twice_is_once():
    with torch.device("meta"):
        resnet = checkpoint_blocks(torchvision.models.resnet18(), 2)
    assert [is_checkpointed(b) for b in find_blocks(resnet)] == [True, False] * 4  # layerN.0: the first of 2
    assert isinstance(resnet.layer1[0], torchvision.models.resnet.BasicBlock)
    assert "activation checkpointing" in repr(resnet.layer1[0]) and "activation" not in repr(resnet.layer1[1])
    torch.manual_seed(0)
    plain = Net(depth=6)
    model = copy.deepcopy(plain)
    params = list(model.parameters())
    assert checkpoint_blocks(model, 2) is model and list(model.parameters()) == params
    assert model.state_dict().keys() == plain.state_dict().keys()
    model.load_state_dict(plain.state_dict())
    checkpoint_blocks(model, 2)  # again: the same blocks, none checkpointed twice
    assert [is_checkpointed(b) for b in model.blocks] == [True, False] * 3 and num_blocks(model) == 6
    batch = MODELS["net"][1]
    want = train_step(plain, batch)
    for copied in (copy.deepcopy(model), torch.load(_saved(model), weights_only=False), model):
        assert [is_checkpointed(b) for b in copied.blocks] == [True, False] * 3
        got = train_step(copied, batch, blocks=list(copied.blocks))
        assert got["recomputed"] == [0, 2, 4]
        assert_same_step(got, want)


def _saved(model: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, pickled: its checkpointed classes by name
    buffer.seek(0)
    return buffer


# transformers and timm: their own API ----------------------------------------------------------------


def test_transformers_layers_checkpoint_through_their_own_api():
    model = checkpoint_blocks(hf_model("llama"), 2)
    layers = model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True]
    assert not any(is_checkpointed(m) for m in model.modules())  # no class swapped
    assert layers[0]._gradient_checkpointing_func.keywords["use_reentrant"] is False
    assert model.config.use_cache is False  # as the Trainer trains (a cache would be turned off each step)
    # a transformers without every_n_layers: every layer enabled, then every k-th kept
    old = hf_model("gpt2")
    enable = old.activation_checkpointing_enable
    old.activation_checkpointing_enable = lambda activation_checkpointing_kwargs=None: enable(
        activation_checkpointing_kwargs=activation_checkpointing_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable, renamed since
        checkpoint_blocks(old, 2)
    assert [layer.gradient_checkpointing for layer in old.transformer.h] == [True, False, True]
    assert old.transformer.h[0]._gradient_checkpointing_func.keywords["use_reentrant"] is False


def test_timm_checkpoints_every_block_itself_unless_it_has_batchnorm_or_reentrant_checkpoints(monkeypatch):
    timm = pytest.importorskip("timm")
    vit = checkpoint_blocks(timm_vit(), 1)
    assert vit.grad_checkpointing and not any(is_checkpointed(m) for m in vit.modules())
    every_2nd = checkpoint_blocks(timm_vit(), 2)  # not timm's `every`: segments of 2, each recomputed
    assert not every_2nd.grad_checkpointing and [is_checkpointed(b) for b in every_2nd.blocks] == [True, False, True]
    # timm's recompute would update BatchNorm's running statistics again: the blocks checkpoint here
    resnet = checkpoint_blocks(timm_model("resnet18"), 1)
    assert not resnet.grad_checkpointing and all(is_checkpointed(b) for b in find_blocks(resnet))
    monkeypatch.setattr(timm.layers.config, "_USE_REENTRANT_CKPT", True)
    reentrant = checkpoint_blocks(timm_vit(), 1)
    assert not reentrant.grad_checkpointing and all(is_checkpointed(b) for b in reentrant.blocks)


# torch.compile ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_checkpoints_are_traced_into_the_graph_with_the_same_gradients():
    """Dynamo traces each checkpointed block as a checkpoint region of one graph (no graph break),
    for the generic path and for transformers' layers; AOTAutograd (Inductor's front end) then
    gives the eager gradients and updates BatchNorm's statistics once."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    make, batch = MODELS["gpt2"]
    torch.manual_seed(0)
    model = checkpoint_blocks(make(), 2)
    recorder = EagerAndRecordGraphs()
    loss_of(torch.compile(model, backend=recorder, fullgraph=True), *batch).backward()
    assert sum(g.code.count("tag_activation_checkpoint(") for g in recorder.graphs) == 2  # layers 0 and 2
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = Net()
    for m in plain.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model = checkpoint_blocks(copy.deepcopy(plain), 1)
    model.compile(backend="aot_eager", fullgraph=True)  # in place, as cfg.prepare compiles
    batch = MODELS["net"][1]
    for _ in range(2):  # the running statistics after two steps
        want, got = train_step(plain, batch), train_step(model, batch)
    assert_same_step(got, want, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_checkpointed_model_trains_as_the_plain_one_with_inductor():
    """Compiled with Inductor (in place, as cfg.prepare compiles), three SGD steps: the checkpointed
    model's losses, gradients and BatchNorm statistics are the compiled plain model's within 1e-6,
    and the eager model's within Inductor's own rounding."""
    torch.manual_seed(0)
    eager = Net()
    for m in eager.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # Inductor draws its own random numbers
    plain, model = copy.deepcopy(eager), checkpoint_blocks(copy.deepcopy(eager), 1)
    plain.compile()
    model.compile()
    x, y = MODELS["net"][1]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, plain, model)]
    for _ in range(3):
        steps = []
        for m, optimizer in zip((eager, plain, model), optimizers):
            steps.append(train_step(m, (x, y)))
            optimizer.step()
        assert_same_step(steps[2], steps[1], atol=1e-6)
        torch.testing.assert_close(steps[2]["loss"], steps[0]["loss"], rtol=1e-5, atol=1e-5)
        for name, grad in steps[0]["grads"].items():
            torch.testing.assert_close(steps[2]["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    torch._dynamo.reset()


# the knob: offered, sampled, seeded, described, replayed -----------------------------------------


def test_offered_on_a_gpu_for_a_model_with_repeated_blocks(recwarn):
    offer = lambda device, probe: STRATEGY.offer(None, device, probe, {})  # noqa: E731
    assert offer("cuda", {"checkpoint_blocks": 16}) == {"choices": {"activation_checkpointing": [0, 1, 2]}}
    assert offer("cuda", {"checkpoint_blocks": 1}) == {"choices": {"activation_checkpointing": [0, 1]}}
    assert offer("cpu", {"checkpoint_blocks": 16}) == {}  # nothing caps a CPU's memory
    assert not recwarn.list
    with pytest.warns(UserWarning, match="activation checkpointing is not searched: the model has no repeated blocks"):
        assert offer("cuda", {"checkpoint_blocks": 0}) == {}
    with pytest.warns(UserWarning, match="the probe did not count"):
        assert offer("cuda", {}) == {}
    assert not STRATEGY.applies(SearchSpace(device="cuda"))


def test_the_probe_counts_the_blocks():
    from autotune.trial.work import probe

    request = {"device": "cpu", "workload": {"model": "resnet18", "input_shape": [3, 16, 16], "num_classes": 10}}
    assert probe(request)["checkpoint_blocks"] == 8
    assert probe({**request, "workload": {"model": "fake_models:tiny_lm"}})["checkpoint_blocks"] == 0  # one block


def test_sampled_never_with_cuda_graphs_replayed_seeded_off_and_described():
    seen = set()
    for seed in range(40):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        knobs = strategies.sample(trial, CUDA_SPACE)
        every = knobs["activation_checkpointing"].every
        if knobs["cuda_graphs"].enabled:  # checkpoint's RNG save and restore cannot be captured
            assert every == 0 and "activation_checkpointing.every" not in trial.params
        else:
            assert trial.params["activation_checkpointing.every"] == every
            seen.add(every)
        assert strategies.sample(optuna.trial.FixedTrial(dict(trial.params)), CUDA_SPACE) == knobs
        transforms = [t for t in strategies.build_recipe(knobs, "cuda").model_transforms
                      if getattr(t, "func", None) is checkpoint_blocks]
        assert [t.keywords for t in transforms] == ([{"every": every}] if every else [])
    assert seen == {0, 1, 2}
    for tuned in (False, True):
        assert strategies.seed_params(CUDA_SPACE, tuned=tuned)["activation_checkpointing.every"] == 0
    assert "activation_checkpointing.every" not in strategies.seed_params(SearchSpace(device="cuda"), tuned=True)
    words = [STRATEGY.words({"every": k}) for k in (0, 1, 2, 3)]
    assert words == ["", "checkpointing every block", "checkpointing every 2nd block", "checkpointing every 3rd block"]
    described = [strategies.describe({"precision": {"mode": "bf16"}, "activation_checkpointing": {"every": k}})
                 for k in (0, 2)]
    assert "checkpointing" not in described[0] and described[1] == described[0] + ", checkpointing every 2nd block"
    assert [k.key for k in strategies.report_knobs()].count("activation_checkpointing") == 1
    with pytest.raises(ValueError, match="activation_checkpointing.every"):
        ActivationCheckpointing.Config(every=-1)


def test_autotune_load_replays_it_and_trains_as_measured(tmp_path):
    space = SearchSpace(device="cpu", batch_sizes=[6], base_batch_size=6,
                        choices={"activation_checkpointing": [0, 1, 2]})
    TunedConfig.from_params({"activation_checkpointing.every": 2}, space).save(tmp_path / "config.json")
    cfg = load(tmp_path / "config.json")
    assert cfg.knobs["activation_checkpointing"].every == 2 and "activation_checkpointing: every=2" in cfg.describe()
    assert json.loads((tmp_path / "config.json").read_text())["knobs"]["activation_checkpointing"] == {"every": 2}
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    model, optimizer = cfg.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert [is_checkpointed(b) for b in model.blocks] == [True, False, True, False]
    step = cfg.train_step(model, optimizer, F.cross_entropy)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = MODELS["net"][1]
    for _ in range(3):
        torch.manual_seed(1)
        loss = step(x, y)
        torch.manual_seed(1)
        plain_optimizer.zero_grad()
        want = F.cross_entropy(plain(x), y)
        want.backward()
        plain_optimizer.step()
        assert torch.equal(loss, want.detach())
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


# exports --------------------------------------------------------------------------------------------


def _exports(every: int) -> dict[str, Any]:
    from autotune.deploy.exports import accelerate_config, lightning_settings

    space = SearchSpace(device="cpu", choices={"activation_checkpointing": [0, 1, 2]})
    cfg = TunedConfig.from_params({"activation_checkpointing.every": every}, space)
    hf, hf_left = cfg.hf_training_args()
    lightning = lightning_settings(cfg)
    left = {"hf": hf_left, "lightning": lightning["unsupported"], "accelerate": accelerate_config(cfg).unsupported}
    return {"hf": hf, "applies": lightning["callback"]["applies"],
            "left": {k: {u["setting"]: u for u in v} for k, v in left.items()}}


@pytest.mark.parametrize("every", [0, 1, 2])
def test_exports_carry_it_or_say_the_line_of_code(every: int):
    transformers = pytest.importorskip("transformers")
    out = _exports(every)
    want = {"use_reentrant": False, **({"every_n_layers": every} if every > 1 else {})}
    assert hf_training_args(every) == (({"activation_checkpointing": True, "activation_checkpointing_kwargs": want}
                                        if every else {}), None)
    assert {k: v for k, v in out["hf"].items() if "checkpointing" in k} == hf_training_args(every)[0]
    args = transformers.TrainingArguments(output_dir="unused", **out["hf"])
    assert args.activation_checkpointing is bool(every)
    assert out["applies"]["activation_checkpointing.every"] == every  # the Lightning callback applies it
    assert "activation_checkpointing.every" not in out["left"]["hf"] | out["left"]["lightning"]
    if every:
        why = out["left"]["accelerate"]["activation_checkpointing.every"]["why"]
        assert f"strategies.activation_checkpointing.checkpoint_blocks(model, every={every})" in why
    else:
        assert "activation_checkpointing.every" not in out["left"]["accelerate"]


def test_a_transformers_without_every_n_layers_exports_every_kth_as_a_line_of_code(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr("strategies.activation_checkpointing._hf_every_n_layers", lambda: False)
    out = _exports(2)
    assert not any("checkpointing" in k for k in out["hf"])
    assert "checkpoint_blocks(model, every=2)" in out["left"]["hf"]["activation_checkpointing.every"]["why"]
    assert _exports(1)["hf"]["activation_checkpointing"] is True  # every layer: no every_n_layers needed


@pytest.mark.slow
def test_the_hf_trainer_checkpoints_the_layers_the_export_says(tmp_path):
    transformers = pytest.importorskip("transformers")
    kwargs = {**_exports(2)["hf"], "per_device_train_batch_size": 2}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                                          logging_strategy="no", **kwargs)
    model = hf_model("gpt2")
    data = [{"input_ids": TOKENS[0, :-1], "labels": TOKENS[0, :-1]} for _ in range(4)]
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert [layer.gradient_checkpointing for layer in model.transformer.h] == [True, False, True]
    assert model.transformer.h[0]._gradient_checkpointing_func.keywords["use_reentrant"] is False


@pytest.mark.slow
def test_the_lightning_callback_checkpoints_the_lightning_modules_blocks():
    pl = pytest.importorskip("lightning.pytorch")
    from autotune.deploy.lightning_callback import AutotuneCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

    space = SearchSpace(device="cpu", choices={"activation_checkpointing": [0, 1, 2]})
    callback = AutotuneCallback(TunedConfig.from_params({"activation_checkpointing.every": 2}, space).recipe)
    module = Module()
    callback.setup(None, module, "fit")
    assert [is_checkpointed(b) for b in module.net.blocks] == [True, False, True, False]


# on a GPU -------------------------------------------------------------------------------------------


def _gpu_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """One FP32 training step's loss and its peak memory above what was allocated before it."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1)
    loss = loss_of(model, *batch)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
def test_on_a_gpu_every_block_checkpointed_keeps_well_under_the_activation_memory_with_the_same_loss():
    """GPT-2 shaped (4 layers, width 256, 8 sequences of 512 tokens), a small vocabulary so that the
    blocks' activations, not the logits, are what a step keeps; FP32 with TF32 off."""
    from autotune.recipe import backend_flags

    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("gpt2", n_layer=4, n_embd=256, n_head=4, n_positions=512,
                                               vocab_size=1024)
    tokens = torch.randint(0, 1024, (8, 513), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    with backend_flags({"matmul_fp32_precision": "ieee"}):
        torch.manual_seed(0)
        plain = transformers.AutoModelForCausalLM.from_config(config).cuda()
        plain.config.use_cache = False  # as the checkpointed model trains
        model = checkpoint_blocks(copy.deepcopy(plain), 1)
        for m in (plain, model):
            _gpu_step(m, batch)  # a first step each: cuBLAS workspaces and first allocations are not its own
        (want, plain_peak), (got, peak) = _gpu_step(plain, batch), _gpu_step(model, batch)
    print(f"activation peak: {plain_peak / 2**20:.0f} MiB plain, {peak / 2**20:.0f} MiB checkpointed")
    assert peak < 0.7 * plain_peak
    assert torch.equal(got, want)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_on_a_gpu_compiled_checkpointing_trains_and_keeps_less(mode: str):
    """torch.compile, and its CUDA-graph mode (cudagraph trees capture the compiled recompute):
    three steps run (compile, record, replay), the loss is the eager checkpointed model's, and the
    compiled step keeps less than the compiled step without checkpointing (the peak of the three:
    a replay allocates nothing, its memory was the recording's)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("gpt2", n_layer=4, n_embd=256, n_head=4, n_positions=512,
                                               vocab_size=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    tokens = torch.randint(0, 1024, (8, 513), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).cuda()
    plain.config.use_cache = False
    eager = checkpoint_blocks(copy.deepcopy(plain), 1)
    model = checkpoint_blocks(copy.deepcopy(plain), 1)
    for m in (plain, model):
        m.compile(mode=mode)
    peaks = {}
    for name, m in (("plain", plain), ("checkpointed", model)):
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            loss, peak = _gpu_step(m, batch)
            peaks[name] = max(peak, peaks.get(name, 0))
        assert torch.isfinite(loss)
    want, _ = _gpu_step(eager, batch)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    print(f"compiled {mode} peak: {peaks['plain'] / 2**20:.0f} MiB plain, {peaks['checkpointed'] / 2**20:.0f} MiB "
          "checkpointed")
    assert peaks["checkpointed"] < 0.8 * peaks["plain"]
    torch._dynamo.reset()


def test_checkpointing_has_its_own_accuracy_check():
    """Issue 36, item 3: recomputed activations go through the FP32-referenced gate as a precision does,
    so a checkpointed configuration does not share its precision's verdict; off, it keys as before."""
    from autotune.accuracy.settings import describe_numerics, numerics_key

    bf16 = {"precision": {"mode": "bf16"}}
    every = {**bf16, "activation_checkpointing": {"every": 1}}
    second = {**bf16, "activation_checkpointing": {"every": 2}}
    assert len({numerics_key(bf16), numerics_key(every), numerics_key(second)}) == 3
    assert numerics_key({**bf16, "activation_checkpointing": {"every": 0}}) == numerics_key(bf16)
    assert describe_numerics(every) == "bf16, checkpointing every block"
    assert describe_numerics(second) == "bf16, checkpointing every 2 blocks"
