"""Shape-aware profiling: the profile window names the layers whose GEMMs and convolutions run on
widths that are not multiples of 8, with their share of the step; the finding says so and queues
the padding that fixes them (channel_alignment, and vocab_padding for a vocabulary's head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import optuna
import pytest
import torch
from torch import nn

import strategies
from autotune.search import queue
from autotune.space import SearchSpace
from autotune.report.render import write_report
from autotune.search.findings import derive
from autotune.search.objective import Objective
from autotune.search.steering import offered
from autotune.trial.gemm_shapes import dims, misaligned, model_layers
from autotune.trial.profile import ProfileTrace, analyze, record
from strategies.base import Strategy
from strategies.channel_alignment import align_channels

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _train_step(model: nn.Module, x: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def _odd_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 37), nn.ReLU(), nn.Linear(37, 1001))


def test_a_cpu_window_names_the_odd_linear_with_its_dims_and_share():
    model = _odd_mlp()
    trace = record(_train_step(model, torch.randn(32, 64)), 2, device="cpu", model=model)
    profile = analyze(trace)
    records = {r["layer"]: r for r in profile["misaligned_gemms"]}
    # Linear(128 -> 37) and Linear(37 -> 1001) are off the multiple of 8; Linear(64 -> 128) is not
    assert set(records) == {"2", "4"}, profile["misaligned_gemms"]
    assert records["4"]["dims"] == [37, 1001] and records["2"]["dims"] == [128, 37]
    assert records["4"]["kind"] == "linear" and records["4"]["multiple"] == 8 and not records["4"]["vocab"]
    assert records["4"]["op"] in ("aten::linear", "aten::mm")  # forward or backward, whichever took longer
    assert all(0 < r["share"] <= 1 for r in records.values())
    assert 0 < profile["misaligned_share"] <= 1
    assert profile["misaligned_share"] == pytest.approx(sum(r["share"] for r in records.values()))
    # the largest share first; JSON round trip of the trace keeps the analysis
    assert [r["share"] for r in profile["misaligned_gemms"]] == sorted(
        (r["share"] for r in profile["misaligned_gemms"]), reverse=True)
    again = analyze(ProfileTrace.from_dict(trace.to_dict()))
    assert again["misaligned_gemms"] == profile["misaligned_gemms"]


def test_padded_layers_and_windows_without_shapes_report_nothing_misaligned():
    model = align_channels(_odd_mlp(), 8)  # the channel_alignment knob: GEMMs on widths 40 and 1008
    trace = record(_train_step(model, torch.randn(32, 64)), 1, device="cpu", model=model)
    assert analyze(trace)["misaligned_gemms"] == [] and analyze(trace)["misaligned_share"] == 0
    plain = record(_train_step(_odd_mlp(), torch.randn(32, 64)), 1, device="cpu", shapes=False)
    assert plain.ops is None and "misaligned_gemms" not in analyze(plain)


def test_the_dimensions_of_gemm_and_convolution_ops():
    assert dims("aten::linear", [[4, 16, 37], [1001, 37], [1001]]) == ("gemm", [64, 1001, 37])
    assert dims("aten::addmm", [[1001], [32, 37], [37, 1001], [], []]) == ("gemm", [32, 1001, 37])
    assert dims("aten::bmm", [[12, 64, 37], [12, 37, 64]]) == ("gemm", [64, 64, 37])
    assert dims("aten::convolution", [[8, 3, 32, 32], [61, 3, 3, 3], [61], [], [], [], [], [], []]) == ("conv", [3, 61])
    assert dims("aten::convolution_backward", [[8, 61, 32, 32], [8, 3, 32, 32], [61, 3, 3, 3], []]) == ("conv", [3, 61])
    assert dims("aten::conv_transpose2d", [[8, 16, 4, 4], [16, 5, 3, 3]]) == ("conv", [16, 5])
    assert dims("aten::mm", [[32]]) is None


def test_layers_are_named_through_wrappers_and_a_tied_head_is_the_vocabulary():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(1001, 48)
            self.conv = nn.Conv1d(48, 48, 3, groups=4)  # grouped: not something padding fixes
            self.proj = nn.Linear(48, 48)

        def forward(self, idx):
            return self.proj(self.wte(idx)) @ self.wte.weight.T  # the head shares the embedding's weight

    wrapped = nn.Module()
    wrapped.add_module("module", LM())  # as DistributedDataParallel names it
    assert model_layers(wrapped) == [["wte", "embedding", 48, 1001, True], ["proj", "linear", 48, 48, False]]
    # the tied head's GEMM (tokens x 48) @ (48 x 1001) is the embedding's, and on a vocabulary
    ops = [["aten::matmul", [[2, 16, 48], [48, 1001]], 9_000, 3],
           ["aten::linear", [[2, 16, 48], [48, 48], [48]], 1_000, 3]]
    found = misaligned(ops, model_layers(wrapped), 8, 20_000)
    assert found["misaligned_gemms"] == [{"layer": "wte", "kind": "embedding", "op": "aten::matmul", "dims": [48, 1001],
                                          "share": 0.45, "multiple": 8, "vocab": True}]
    # an untied head: a Linear of the embedding's widths, named first, and padding Linear widths reaches it
    head = model_layers(wrapped) + [["lm_head", "linear", 48, 1001, True]]
    [untied] = misaligned(ops[:1], head, 8, 20_000)["misaligned_gemms"]
    assert (untied["layer"], untied["kind"], untied["vocab"]) == ("lm_head, wte", "linear", True)
    # dimensions that fit an aligned layer (48 -> 48) and a misaligned one are the misaligned one's
    fits_both = misaligned([["aten::mm", [[1001, 48], [48, 48]], 700, 1]], head, 8, 1_000)["misaligned_gemms"]
    assert [(r["layer"], r["dims"]) for r in fits_both] == [("lm_head, wte", [48, 1001])]
    # an unmatched op keeps its own dimensions
    unmatched = misaligned([["aten::bmm", [[8, 40, 20], [8, 20, 40]], 500, 1]], [], 8, 1_000)["misaligned_gemms"]
    assert unmatched == [{"layer": None, "kind": "gemm", "op": "aten::bmm", "dims": [40, 40, 20], "share": 0.5,
                          "multiple": 8, "vocab": False}]


class _Kineto:
    """A Kineto event as ``prof.profiler.kineto_results.events()`` yields it, with what
    gemm_shapes reads: thread, shapes, and the correlation ids that link a kernel to its op."""

    def __init__(self, name, start, dur, *, thread=1, shapes=(), corr=0, linked=0, cuda=False):
        self._name, self._start, self._dur, self._thread = name, start, dur, thread
        self._shapes, self._corr, self._linked, self._cuda = [list(s) for s in shapes], corr, linked, cuda

    def name(self):
        return self._name

    def device_type(self):
        from torch.autograd import DeviceType

        return DeviceType.CUDA if self._cuda else DeviceType.CPU

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._start + self._dur

    def duration_ns(self):
        return self._dur

    def start_thread_id(self):
        return self._thread

    def shapes(self):
        return self._shapes

    def correlation_id(self):
        return self._corr

    def linked_correlation_id(self):
        return self._linked


def test_on_a_gpu_an_op_counts_the_kernels_it_and_the_gemms_inside_it_launched():
    from autotune.trial.gemm_shapes import collect

    linear = [[32, 37], [1001, 37], [1001]]
    events = [
        _Kineto("ProfilerStep#1", 0, 1000),
        _Kineto("aten::linear", 10, 200, shapes=linear, corr=1),
        _Kineto("aten::_to_copy", 12, 6, corr=2),  # autocast's cast of the weight: not GEMM time
        _Kineto("aten::addmm", 20, 170, shapes=[[1001], [32, 37], [37, 1001], [], []], corr=3),
        _Kineto("cudaLaunchKernel", 30, 5, corr=4, linked=3),
        _Kineto("aten::mm", 300, 100, thread=2, shapes=[[1001, 32], [32, 37]], corr=5),  # the backward's thread
        _Kineto("cast_kernel", 40, 5, cuda=True, linked=2),
        _Kineto("sm90_xmma_gemm_bf16bf16", 50, 120, cuda=True, linked=3),
        _Kineto("sm90_xmma_gemm_bf16bf16", 420, 80, cuda=True, linked=5),
    ]
    ops, host_ns = collect(events, on_gpu=True)
    assert sorted(ops) == [["aten::linear", linear, 120, 1], ["aten::mm", [[1001, 32], [32, 37]], 80, 1]]
    assert host_ns == 1000
    layers = model_layers(nn.Sequential(nn.Linear(37, 1001)))
    [record] = misaligned(ops, layers, 8, 1000)["misaligned_gemms"]
    assert record == {"layer": "0", "kind": "linear", "op": "aten::linear", "dims": [37, 1001], "share": 0.2,
                      "multiple": 8, "vocab": False}
    # on a CPU the same ops count their own time: their duration less their children's (linear's
    # less the cast and the addmm, the addmm's less its launch)
    cpu_ops, _ = collect(events, on_gpu=False)
    own = (200 - 6 - 170) + (170 - 5)
    assert sorted(cpu_ops) == [["aten::linear", linear, own, 1], ["aten::mm", [[1001, 32], [32, 37]], 100, 1]]


# --- the finding, on planted trial records (no profiling) -----------------------------------------

HEAD = {"layer": "lm_head", "kind": "linear", "op": "aten::addmm", "dims": [512, 50257], "share": 0.31, "multiple": 8,
        "vocab": True}
FC = {"layer": "blocks.0.fc, blocks.1.fc and 4 more", "kind": "linear", "op": "aten::mm", "dims": [512, 1001],
      "share": 0.04, "multiple": 8, "vocab": False}
ATTN = {"layer": None, "kind": "gemm", "op": "aten::bmm", "dims": [256, 256, 37], "share": 0.02, "multiple": 8,
        "vocab": False}
OFFERED = {"precision.mode": ["fp32", "fp16", "bf16"], "channel_alignment.multiple": [1, 8]}


def _profile(records: list[dict[str, Any]], share: float | None = None) -> dict[str, Any]:
    return {"steps": 3, "layout_share": 0.0, "idle_share": 0.0, "memcpy_share": 0.0, "other_gemm_conv_share": 0.0,
            "elementwise_share": 0.0, "copy_overlap": None, "misaligned_gemms": records, "alignment_multiple": 8,
            "misaligned_share": sum(r["share"] for r in records) if share is None else share}


def _knobs(mode: str = "bf16", alignment: int = 1, **more: Any) -> dict[str, Any]:
    return {"precision": {"mode": mode}, "channel_alignment": {"multiple": alignment}, **more}


def test_the_finding_names_the_layers_their_dims_and_share_and_the_padding_that_fixes_them():
    [f] = derive(_profile([HEAD, FC, ATTN]), None, _knobs(), offered=OFFERED)
    assert f.rule == "misaligned-gemms"
    assert f.text.startswith("37% of GPU time is in GEMMs/convolutions whose widths are not multiples of 8, "
                             "which bf16 Tensor Cores need: lm_head (512x50257) 31%, ")
    assert "blocks.0.fc, blocks.1.fc and 4 more (512x1001) 4%" in f.text and "aten::bmm 256x256x37 2%" in f.text
    assert f.text.endswith("Conv/Linear widths padded to 8 (channel_alignment) would align them")
    assert f.suggest == {"channel_alignment.multiple": 8}


def test_the_vocabulary_is_padded_to_64_where_the_space_has_vocab_padding():
    with_vocab = dict(OFFERED, **{"vocab_padding.multiple": [1, 64]})
    [f] = derive(_profile([HEAD, FC]), None, _knobs("fp16"), offered=with_vocab)
    assert f.suggest == {"channel_alignment.multiple": 8, "vocab_padding.multiple": 64}
    assert "and the vocabulary padded to 64 (vocab_padding)" in f.text
    # a head tied to the embedding is no Linear: only the vocabulary's padding reaches it
    tied = dict(HEAD, layer="wte", kind="embedding")
    [g] = derive(_profile([tied]), None, _knobs("fp16"), offered=with_vocab)
    assert g.suggest == {"vocab_padding.multiple": 64}
    # already padded: nothing left to queue, the finding still explains
    [h] = derive(_profile([tied]), None, _knobs("fp16", vocab_padding={"multiple": 64}), offered=with_vocab)
    assert h.suggest == {} and h.text.endswith("no knob of this search pads them")


def test_no_finding_below_the_threshold_in_fp32_or_without_a_profiled_window():
    assert derive(_profile([FC], share=0.04), None, _knobs(), offered=OFFERED) == []
    assert derive(_profile([HEAD]), None, _knobs("fp32"), offered=OFFERED) == []
    assert derive(dict(_profile([HEAD]), steps=0), None, _knobs(), offered=OFFERED) == []
    # padded to 8 already and still misaligned (an attention bmm, say): explained, nothing suggested
    [f] = derive(_profile([dict(ATTN, share=0.2)]), None, _knobs(alignment=8), offered=OFFERED)
    assert f.suggest == {} and "aten::bmm 256x256x37 20%" in f.text
    # FP8 asks for 16, and channel_alignment offers it
    [g] = derive(_profile([dict(FC, share=0.1, multiple=16)]), None, _knobs("fp8", alignment=8),
                 offered=dict(OFFERED, **{"channel_alignment.multiple": [1, 8, 16]}))
    assert "not multiples of 16" in g.text and g.suggest == {"channel_alignment.multiple": 16}


# --- steering: the finding queues the padded configuration ------------------------------------------


class _VocabPadding(Strategy):
    """The contract of strategies/vocab_padding.py (name, field, choices in SearchSpace.choices), for a
    checkout that does not have that module yet: only the parameter is sampled, nothing is applied."""

    name = "vocab_padding"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        multiple: int = 1

    def offer(self, options, device, probe, offered) -> dict[str, Any]:
        return {"choices": {self.name: [1, 64]}}

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(multiple=self.choose(trial, "multiple", space.choices.get(self.name, [1])))

    def apply(self, config: Config, recipe) -> None:
        pass


@pytest.fixture
def vocab_padding_knob(monkeypatch):
    if "vocab_padding" not in strategies.BY_NAME:
        knob = _VocabPadding()
        monkeypatch.setattr(strategies, "REGISTRY", [*strategies.REGISTRY, knob])
        monkeypatch.setitem(strategies.BY_NAME, knob.name, knob)


def _space(**extra: Any) -> SearchSpace:
    return SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[64, 128], alignments=[1, 8],
                       **extra)


def _explain(space: SearchSpace, profile: dict[str, Any]) -> tuple[optuna.Study, list[dict[str, Any]]]:
    """A bf16 trial at channel multiple 1 explained by ``profile``; the study and what it queued."""
    study = optuna.create_study(direction="maximize")
    params = {"precision.mode": "bf16", "batch_size.batch_size": 64, "channel_alignment.multiple": 1,
              **({"vocab_padding.multiple": 1} if "vocab_padding" in space.choices else {})}
    trial = study.ask()
    for name, value in params.items():
        trial.suggest_categorical(name, [value])
    trial.set_user_attr("knobs", strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial(params), space)))
    objective = Objective(space=space, workload={}, measure={}, input_on_device=False, seed=0, trial_timeout_s=60)
    objective._explain(trial, {"status": "ok", "figures": {"loss_finite": True}, "profile": profile})
    waiting = queue.queued(study)
    return study, [t.system_attrs["fixed_params"] for t in waiting]


def test_steering_queues_channel_alignment_and_the_vocabulary_padding(vocab_padding_knob):
    space = _space(choices={"vocab_padding": [1, 64]})
    assert offered(space)["vocab_padding.multiple"] == [1, 64]
    study, [queued] = _explain(space, _profile([HEAD, FC]))
    assert queued["channel_alignment.multiple"] == 8 and queued["vocab_padding.multiple"] == 64
    assert queued["precision.mode"] == "bf16" and queued["batch_size.batch_size"] == 64
    rules = study.trials[0].user_attrs["finding_rules"]
    assert [r["rule"] for r in rules] == ["misaligned-gemms"] and "lm_head (512x50257) 31%" in rules[0]["text"]


def test_steering_without_vocab_padding_in_the_space_queues_channel_alignment_alone():
    space = _space()
    assert "vocab_padding.multiple" not in offered(space)
    _, [queued] = _explain(space, _profile([HEAD, FC]))
    assert queued["channel_alignment.multiple"] == 8 and "vocab_padding.multiple" not in queued


def test_a_share_below_the_threshold_queues_nothing(vocab_padding_knob):
    study, queued = _explain(_space(choices={"vocab_padding": [1, 64]}), _profile([dict(HEAD, share=0.03)]))
    assert queued == [] and "findings" not in study.trials[0].user_attrs


def test_the_report_lists_the_finding_under_its_kind(tmp_path):
    space = _space()
    study, _ = _explain(space, _profile([HEAD, FC]))
    study.tell(study.trials[0].number, 5000.0)
    trial = study.trials[0]
    study2 = optuna.create_study(direction="maximize")
    study2.set_user_attr("device", "cuda")
    study2.set_user_attr("workload", {"model": "gpt", "input_shape": None, "num_classes": 1000})
    study2.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE, value=5000.0, params=trial.params, distributions=trial.distributions,
        user_attrs={**trial.user_attrs, "role": "baseline", "status": "ok",
                    "figures": {"samples_per_s": 5000.0, "step_time_ms": 12.8, "spread": 0.01,
                                "peak_memory_bytes": 2**30},
                    "timing": {"worker_start_s": 1.0, "wall_s": 5.0}}))
    md = write_report(study2, tmp_path, None)["report.md"].read_text()
    findings = md.split("## Findings")[1].split("\n## ")[0]
    assert "**GEMM/conv widths off the Tensor Core multiple:** 35% of GPU time is in GEMMs/convolutions" in findings
    assert "lm_head (512x50257) 31%" in findings
