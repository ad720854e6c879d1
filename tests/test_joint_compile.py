"""A whole-model compile's step computes its forward and its loss as one compiled graph, as nanoGPT's
loop does (scripts/joint_compile_bench.py measured why: the logits' gradient then reuses their
buffer, a logits-sized buffer less at the step's peak), and trains as the eager step does.

CPU only: Inductor's C++ backend, tiny language models; CPU autocast stands in for the GPU's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from autotune.deploy import runtime
from autotune.recipe import Recipe
from autotune.deploy.runtime import GRAPH_WARMUP_STEPS, TrainStep, joint_compile
from autotune.workload.hub import causal_lm_loss

VOCAB, WIDTH, SEQ = 512, 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class TinyLM(nn.Module):
    """Embedding, two repeated blocks (what a regional compile compiles), an LM head; returns a tuple
    as a model with extra outputs does (``logits`` takes its first)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h), h


def batches(n: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
            for _ in range(n)]


def make_step(model: nn.Module, **recipe_fields) -> TrainStep:
    recipe = Recipe(device="cpu", **recipe_fields)
    model = runtime.prepare_model(model, recipe)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), causal_lm_loss, recipe)


def train(model: nn.Module, steps: int = 3, **recipe_fields) -> tuple[list[float], TrainStep]:
    """``steps`` optimizer steps of ``model`` (changed in place), its losses, and the step."""
    step = make_step(model, **recipe_fields)
    per_step = recipe_fields.get("accumulation_steps", 1)
    return [float(step(x, y)) for x, y in batches(steps * per_step)], step


def assert_trains_alike(compiled: nn.Module, eager: nn.Module, losses: list[float], reference: list[float],
                        *, rtol: float, atol: float) -> None:
    assert losses == pytest.approx(reference, rel=rtol, abs=atol)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}.grad: {m}")
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


# which recipes compile forward and loss together -------------------------------------------------


def test_only_a_whole_model_compile_with_the_frameworks_loss_in_one_process_is_joint() -> None:
    assert joint_compile(Recipe(device="cpu", compile_mode="default"))
    assert joint_compile(Recipe(device="cuda", compile_mode="reduce-overhead", cuda_graphs=False))
    assert not joint_compile(Recipe(device="cpu"))
    assert not joint_compile(Recipe(device="cpu", compile_mode="regional"))
    assert not joint_compile(Recipe(device="cuda", compile_mode="default", loss_kernel="fused_linear"))
    assert not joint_compile(Recipe(device="cuda", compile_mode="default", ddp={"bucket_cap_mb": 25}))


def test_the_step_compiles_forward_and_loss_in_the_recipes_mode(monkeypatch) -> None:
    """reduce-overhead and max-autotune keep their CUDA graphs and kernel search for the joint graph:
    the function is compiled in the recipe's mode, not the loss's default (no compile runs here)."""
    calls: list[tuple[str, str | None]] = []

    def spy(fn=None, *, mode=None, **kwargs):
        calls.append((getattr(fn, "__name__", type(fn).__name__), mode))
        return fn

    monkeypatch.setattr(torch, "compile", spy)
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        calls.clear()
        step = TrainStep(TinyLM(), torch.optim.SGD(TinyLM().parameters(), lr=0.1), causal_lm_loss,
                         Recipe(device="cpu", compile_mode=mode))
        assert ("forward_loss", mode) in calls
        assert step.forward_loss is not step.loss_fn
    calls.clear()
    TrainStep(TinyLM(), torch.optim.SGD(TinyLM().parameters(), lr=0.1), causal_lm_loss,
              Recipe(device="cpu", compile_mode="regional"))
    assert [name for name, _ in calls] == ["causal_lm_loss"]  # the loss apart, as before


def test_a_cuda_graph_modes_loss_is_a_copy_the_next_replay_cannot_overwrite(monkeypatch) -> None:
    """Under reduce-overhead the joint graph's loss lives in cudagraph trees' pool until the next
    step's replay; the step hands back a copy (eager here: torch.compile replaced by the function)."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    outputs: list[torch.Tensor] = []
    for mode, copied in (("reduce-overhead", True), ("default", False)):
        step = make_step(TinyLM(), compile_mode=mode)
        forward_loss = step.forward_loss
        step.forward_loss = lambda x, y: outputs.append(forward_loss(x, y)) or outputs[-1]
        loss = step(*batches(1)[0])
        same = loss.untyped_storage().data_ptr() == outputs[-1].untyped_storage().data_ptr()
        assert same is not copied, mode


# one graph, the same training ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_compiled_step_traces_its_model_and_loss_as_one_graph() -> None:
    """The model compiled in place by prepare_model is inlined into the step's compiled function:
    one graph, no break (apart, as before, the model's graph and the loss's made two)."""
    model = TinyLM()
    step = make_step(model, compile_mode="default")
    assert model._compiled_call_impl is not None  # user code calling model(x) still gets the compiled model
    x, y = batches(1)[0]
    step(x, y)
    assert graphs() == 1
    assert sum(counters["graph_break"].values()) == 0
    step(x, y)
    assert graphs() == 1  # and no recompile in the next step


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_joint_step_trains_as_the_eager_step(dtype) -> None:
    torch.manual_seed(0)
    eager_model = TinyLM()
    compiled_model = copy.deepcopy(eager_model)
    reference, _ = train(eager_model, autocast_dtype=dtype)
    losses, _ = train(compiled_model, autocast_dtype=dtype, compile_mode="default")
    assert graphs() == 1
    # bf16: the same bf16 matmuls; Inductor's fused softmax and norms round apart from eager's
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if dtype is None else {"rtol": 1e-3, "atol": 1e-5}
    assert_trains_alike(compiled_model, eager_model, losses, reference, **tolerance)


@pytest.mark.slow
def test_accumulated_micro_batches_use_the_joint_graph() -> None:
    torch.manual_seed(0)
    eager_model = TinyLM()
    compiled_model = copy.deepcopy(eager_model)
    reference, _ = train(eager_model, steps=2, accumulation_steps=2)
    losses, step = train(compiled_model, steps=2, accumulation_steps=2, compile_mode="default")
    assert graphs() == 1 and step._micro == 0
    assert_trains_alike(compiled_model, eager_model, losses, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_regional_compile_keeps_its_loss_apart_and_trains_as_eager() -> None:
    torch.manual_seed(0)
    eager_model = TinyLM()
    compiled_model = copy.deepcopy(eager_model)
    reference, _ = train(eager_model)
    losses, step = train(compiled_model, compile_mode="regional")
    assert not hasattr(step.forward_loss, "_torchdynamo_orig_callable")  # not compiled itself: the blocks are
    assert all(block._compiled_call_impl is not None for block in compiled_model.blocks)
    assert graphs() == 2  # one block graph (both blocks share it) and the loss's
    assert_trains_alike(compiled_model, eager_model, losses, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_the_whole_step_graph_path_runs_the_joint_graph(no_op_cuda_graphs) -> None:
    """cuda_graphs' warm-up and capture run the joint function (CUDA's stream and graph objects
    replaced by no-ops on this CPU), with autocast's weight cache off in both: one graph, no
    recompile inside the capture."""

    step = make_step(TinyLM(), autocast_dtype=torch.bfloat16, compile_mode="default", cuda_graphs=True)
    assert step.num_setup_steps == GRAPH_WARMUP_STEPS + 1
    for x, y in batches(GRAPH_WARMUP_STEPS + 1):
        step(x, y)
    assert step.graph is not None and step._static_loss is not None
    assert graphs() == 1
