"""Models by name from transformers (hf:TYPE) and timm (timm:NAME), built offline, and a whole CPU
search of a tiny hf:gpt2 whose exported config trains the same model through autotune.load."""

import json
import sys

import pandas as pd
import pytest
import torch

import autotune
from autotune.errors import ConfigError, WorkloadError
from autotune.search.options import SearchConfig
from autotune.workload.hub import parse_model_config
from autotune.workload.models import WorkloadSpec, build, logits
from conftest import assert_attends_as_nanogpt, run_cli

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2}
TINY_FLAG = "n_layer=1,n_embd=32,n_head=2"


def _train_step(workload, batch_size=2):
    """One SGD step of the workload's own batch and loss; the loss, before the step."""
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.01)
    x, y = workload.batch(batch_size, torch.Generator().manual_seed(0))
    loss = workload.loss_fn(logits(workload.model(x)), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return x, y, loss


# a llama or mistral of one layer with grouped key/value heads: 4 query heads share 2
TINY_GQA = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": 100}


@pytest.mark.parametrize("model, overrides", [("hf:gpt2", TINY), ("hf:llama", TINY_GQA)])
def test_hf_causal_models_attend_with_is_causal_and_no_mask(model, overrides, monkeypatch):
    """The search's hf: causal LMs call SDPA as nanoGPT does (is_causal=True, no mask tensor, which
    its flash kernel refuses and transformers' own "sdpa" builds under torch.compile), and compute
    the logits transformers' "sdpa" computes."""
    from autotune.workload.hub import CAUSAL_SDPA

    workload = build(WorkloadSpec(model=model, model_config=dict(overrides), seq_len=16))
    assert workload.model.config._attn_implementation == CAUSAL_SDPA
    assert_attends_as_nanogpt(workload.model, model, overrides, monkeypatch)


def test_a_sliding_window_shorter_than_the_sequence_keeps_the_models_own_attention():
    """Mistral attends within a window: is_causal alone would attend further back, so its own
    attention (and its mask) stays where the window is shorter than --seq-len."""
    from autotune.workload.hub import CAUSAL_SDPA

    short = build(WorkloadSpec(model="hf:mistral", model_config={**TINY_GQA, "sliding_window": 8}, seq_len=16))
    assert short.model.config._attn_implementation != CAUSAL_SDPA
    wide = build(WorkloadSpec(model="hf:mistral", model_config={**TINY_GQA, "sliding_window": 16}, seq_len=16))
    assert wide.model.config._attn_implementation == CAUSAL_SDPA


def test_hf_gpt2_builds_offline_and_trains_a_step(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
    spec = WorkloadSpec(model="hf:gpt2", model_config=dict(TINY), seq_len=16)
    workload = build(spec)
    assert workload.model.config.n_layer == 1 and workload.model.config.n_embd == 32
    assert workload.model.config.vocab_size == 50257  # the type's default, not overridden
    assert workload.model.training
    x, y, loss = _train_step(workload)
    assert x.dtype == torch.long and x.shape == (2, 16) and y.shape == (2, 16)
    assert int(x.max()) < 50257
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.isfinite(loss)
    # random logits over 50,257 tokens: the loss starts near ln(50257)
    assert abs(loss.item() - torch.log(torch.tensor(50257.0)).item()) < 1.0
    assert workload.sample_unit == "sequence" and workload.tokens_per_sample == 16
    assert spec.short_name == "gpt2"


def test_language_models_train_with_nanogpts_adamw_and_image_models_with_sgd():
    """A trial's optimizer is the workload's: an hf: model's step times include AdamW's update (the
    hand-written baseline's optimizer, scripts/lm_baseline.py), a torchvision model's SGD's."""
    lm = build(WorkloadSpec(model="hf:gpt2", model_config=dict(TINY), seq_len=8))
    opt = lm.optimizer(lm.model)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 6e-4 and opt.defaults["betas"] == (0.9, 0.95)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(lm.model.parameters()))
    cnn = build(WorkloadSpec(model="resnet18", input_shape=(3, 32, 32), num_classes=10))
    assert type(cnn.optimizer(cnn.model)) is torch.optim.SGD


def test_hf_loss_works_under_autocast():
    workload = build(WorkloadSpec(model="hf:gpt2", model_config=dict(TINY), seq_len=8))
    x, y = workload.batch(2, torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = logits(workload.model(x))
        loss = workload.loss_fn(out, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_seq_len_defaults_to_1024_and_a_longer_one_is_refused():
    workload = build(WorkloadSpec(model="hf:gpt2", model_config=dict(TINY)))
    assert workload.tokens_per_sample == 1024 and workload.input_shape == (1024,)
    short = build(WorkloadSpec(model="hf:gpt2", model_config={**TINY, "n_positions": 64}))
    assert short.tokens_per_sample == 64  # clipped to the model's longest sequence
    with pytest.raises(ConfigError, match=r"--seq-len 2048 is longer than hf:gpt2 allows \(1024 positions\)"):
        build(WorkloadSpec(model="hf:gpt2", model_config=dict(TINY), seq_len=2048))


def test_model_config_values_are_parsed():
    assert parse_model_config("n_layer=2, n_embd=64,resid_pdrop=0.0,tie_word_embeddings=false,"
                              "activation_function=gelu_new,bos_token_id=none") == {
        "n_layer": 2, "n_embd": 64, "resid_pdrop": 0.0, "tie_word_embeddings": False,
        "activation_function": "gelu_new", "bos_token_id": None}
    with pytest.raises(ConfigError, match="'n_layer' is not NAME=VALUE"):
        parse_model_config("n_layer")


def test_an_unknown_model_config_field_names_the_close_ones():
    with pytest.raises(ConfigError, match=r"gpt2 configurations have no field 'n_layers'; did you mean n_layer"):
        build(WorkloadSpec(model="hf:gpt2", model_config={"n_layers": 1}))
    # an attribute_map alias is a field too (num_hidden_layers is n_layer for gpt2)
    workload = build(WorkloadSpec(model="hf:gpt2", model_config={"num_hidden_layers": 1, "n_embd": 32, "n_head": 2},
                                  seq_len=4))
    assert workload.model.config.n_layer == 1


def test_an_unknown_model_type_or_timm_name_gets_close_matches():
    with pytest.raises(WorkloadError, match="'gtp2' is not a transformers causal language model type; did you mean gpt2"):
        build(WorkloadSpec(model="hf:gtp2"))
    with pytest.raises(WorkloadError, match="timm has no model 'resnet19'; did you mean resnet18"):
        build(WorkloadSpec(model="timm:resnet19"))


@pytest.mark.parametrize("module, model, extra", [("transformers", "hf:gpt2", "hf"), ("timm", "timm:resnet18", "timm")])
def test_a_missing_library_names_its_extra(monkeypatch, module, model, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import transformers` now raises ImportError
    with pytest.raises(WorkloadError) as exc:
        build(WorkloadSpec(model=model))
    assert str(exc.value) == f"--model {model} needs {module}: pip install 'autotune[{extra}]'"


def test_model_config_and_seq_len_are_for_hf_models_only():
    with pytest.raises(ConfigError, match="--model-config overrides the configuration of an hf: model"):
        SearchConfig(workload=WorkloadSpec(model="resnet18", model_config={"n_layer": 1}))
    with pytest.raises(ConfigError, match="--seq-len sets the sequence length of an hf: model"):
        SearchConfig(workload=WorkloadSpec(model="timm:resnet18", seq_len=16))
    with pytest.raises(ConfigError, match="--seq-len must be at least 1, got 0"):
        SearchConfig(workload=WorkloadSpec(model="hf:gpt2", seq_len=0))


def test_timm_resnet18_builds_with_its_classes_and_default_input_size():
    workload = build(WorkloadSpec(model="timm:resnet18", num_classes=10))
    assert workload.input_shape == (3, 224, 224)  # from its pretrained configuration
    small = build(WorkloadSpec(model="timm:resnet18", num_classes=10, input_shape=(3, 32, 32)))
    x, y, loss = _train_step(small, batch_size=4)
    assert x.shape == (4, 3, 32, 32) and int(y.max()) < 10
    assert small.model(x).shape == (4, 10)
    assert torch.isfinite(loss)
    assert small.tokens_per_sample is None and WorkloadSpec(model="timm:resnet18").short_name == "resnet18"


def test_spec_round_trips_and_old_dicts_still_load():
    spec = WorkloadSpec(model="hf:gpt2", model_config=dict(TINY), seq_len=16)
    assert WorkloadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    old = WorkloadSpec.from_dict({"model": "resnet50", "input_shape": None, "num_classes": 1000})
    assert old.model_config == {} and old.seq_len is None


def test_a_bad_model_config_field_is_refused_by_the_cli(tmp_path, cli_main):
    proc = cli_main("search", "--model", "hf:gpt2", "--model-config", "n_layers=1", "--device", "cpu",
                    "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert "no field 'n_layers'; did you mean n_layer" in " ".join(proc.stderr.split())  # rich wraps lines
    assert not (tmp_path / "o" / "study.db").exists()


@pytest.mark.slow
def test_accuracy_takes_the_search_model_options(cli_main):
    """`autotune accuracy` builds the workload a search would: an hf: model's --model-config and
    --seq-len reach it (the H200's FP8-against-bf16 check of hf:gpt2 is run this way)."""
    bad = cli_main("accuracy", "--model", "hf:gpt2", "--model-config", "n_layers=1", "--device", "cpu")
    assert bad.returncode == 2 and "no field 'n_layers'; did you mean n_layer" in " ".join(bad.stderr.split())
    proc = cli_main("accuracy", "--model", "hf:gpt2", "--model-config", TINY_FLAG, "--seq-len", "16",
                    "--device", "cpu", "--precisions", "fp32,bf16", "--accuracy-steps", "10", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["mode"] for r in result["rows"]] == ["fp32", "bf16"]
    assert all(r["verdict"] == "passed" and r["steps"] == 10 for r in result["rows"]), result["rows"]


@pytest.mark.slow
def test_cpu_search_of_a_tiny_gpt2_reports_tokens_and_its_config_trains(tmp_path):
    """The whole pipeline on a language model: search -> config.json, trials.csv and the report
    with tokens/s -> autotune.load trains the same model."""
    out = tmp_path / "out"
    proc = run_cli("search", "--model", "hf:gpt2", "--model-config", TINY_FLAG, "--seq-len", "16",
                   "--device", "cpu", "--trials", "3", "--no-accuracy-check", "--early-stop-below", "0",
                   "--batch-size", "4", "--min-measure-time", "0.3", "--out", str(out), timeout=300)
    assert "tokens/s" in proc.stderr  # the trial lines and the summary table
    data = json.loads((out / "config.json").read_text())
    assert data["units"] == {"sample_unit": "sequence", "tokens_per_sample": 16}
    assert data["workload"]["model_config"] == TINY and data["workload"]["seq_len"] == 16
    for figures in (data["figures"], data["baseline"]["figures"]):
        assert figures["tokens_per_s"] == pytest.approx(figures["samples_per_s"] * 16)
    trials = pd.read_csv(out / "trials.csv")
    done = trials[trials["state"] == "COMPLETE"]
    assert len(done) >= 1
    assert (done["tokens_per_s"] - done["samples_per_s"] * 16).abs().max() < 1e-6
    report = (out / "report.md").read_text()
    assert "| samples/s | tokens/s |" in report and "tokens/s (16 tokens a sequence)" in report
    assert "AutoConfig.for_model('gpt2', use_cache=False, n_layer=1, n_embd=32, n_head=2)" in report
    assert "tokens/s" in (out / "report.html").read_text()

    # the user's side, as the report's snippet says: the same tiny model through the exported config
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotune.workload.hub import causal_lm_loss

    cfg = autotune.load(out / "config.json")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", use_cache=False, **TINY))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.scaled_lr(0.01))
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, causal_lm_loss)
    tokens = torch.randint(0, 50257, (cfg.batch_size, 17), generator=torch.Generator().manual_seed(0))
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 2
    losses = [float(step(x, y)) for x, y in cfg.loader(batches)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    # verify re-measures it, in tokens/s too, and A/B's a knob on it
    proc = run_cli("verify", str(out), "--set", "threads.num_threads=1", timeout=300)
    said = " ".join(proc.stderr.split())
    assert "tokens/s)" in said and "with threads.num_threads=1: median" in said


def test_a_transformers_without_the_attention_interfaces_keeps_its_own_attention(monkeypatch):
    """A transformers whose attention interfaces cannot be had still builds the model, with its own attention."""
    from autotune.workload import hub

    def missing():
        raise ImportError("cannot import name 'AttentionMaskInterface' from 'transformers'")

    monkeypatch.setattr(hub, "causal_sdpa", missing)
    workload = build(WorkloadSpec(model="hf:gpt2", model_config=dict(TINY), seq_len=16))
    assert workload.model.config._attn_implementation != hub.CAUSAL_SDPA
