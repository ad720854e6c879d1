"""scripts/lm_baseline.py, the hand-written nanoGPT-style loop that a language-model search is set
against: on the CPU with a tiny GPT-2 it trains (the weights move, the loss is finite) and its
figures are the arithmetic of what it timed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT, assert_attends_as_nanogpt

pytest.importorskip("transformers")


def _script():
    spec = importlib.util.spec_from_file_location("lm_baseline", ROOT / "scripts" / "lm_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--model-config", "n_layer=1,n_embd=32,n_head=2", "--seq-len", "16", "--batch-size", "4",
        "--device", "cpu", "--no-compile", "--steps", "4", "--warmup", "2"]


@pytest.mark.slow
def test_the_loop_trains_and_its_figures_follow_from_its_step_time(tmp_path, monkeypatch):
    lm_baseline = _script()
    args = lm_baseline.parse_args([*TINY, "--out", str(tmp_path / "baseline.json")])
    built = {}
    real_build = lm_baseline.build

    def build(a):  # keep the model, to see that the loop trained it
        model, optimizer = real_build(a)
        built["model"], built["before"] = model, model.lm_head.weight.detach().clone()
        return model, optimizer

    monkeypatch.setattr(lm_baseline, "build", build)
    result = lm_baseline.run(args)
    assert result["final_loss"] == pytest.approx(result["final_loss"]) and result["final_loss"] > 0  # finite
    assert not built["model"].lm_head.weight.detach().equal(built["before"])  # AdamW stepped
    assert result["tokens_per_s"] == pytest.approx(4 * 16 / (result["step_ms"] / 1e3))
    assert result["samples_per_s"] * 16 == pytest.approx(result["tokens_per_s"])
    assert result["step_ms_p10"] <= result["step_ms"] <= result["step_ms_p90"]
    assert result["compile"] is False and result["steps"] == 4 and result["seq_len"] == 16
    lm_baseline.main([*TINY, "--out", str(tmp_path / "again.json")])
    assert json.loads((tmp_path / "again.json").read_text())["batch_size"] == 4


def test_bad_arguments_are_refused_with_what_to_give(capsys):
    lm_baseline = _script()
    with pytest.raises(SystemExit) as exc:
        lm_baseline.parse_args(["--seq-len", "1"])
    assert exc.value.code == 2
    assert "--seq-len must be >= 2" in capsys.readouterr().err


def test_its_attention_is_sdpa_with_is_causal_and_no_mask(monkeypatch):
    """nanoGPT's F.scaled_dot_product_attention(q, k, v, is_causal=True): no mask tensor, which
    SDPA's flash kernel refuses (transformers' own "sdpa" builds one while torch.compile traces),
    and the same logits as transformers' "sdpa"."""
    from autotune.workload.hub import causal_sdpa

    args = _script().parse_args(TINY)
    model, _ = _script().build(args)
    assert model.config._attn_implementation == causal_sdpa()
    assert_attends_as_nanogpt(model, "hf:gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2}, monkeypatch)
