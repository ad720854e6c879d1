"""The search's probe worker (autotune.trial.work.probe): it builds the model where its trials do
(an hf: model on the GPU), runs its forwards there, and says where its seconds went."""

from __future__ import annotations

import pytest
import torch

from autotune.trial import work as worker

TINY_LLAMA = {"model": "hf:llama", "seq_len": 16,
              "model_config": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 1000}}


def test_the_probe_builds_on_its_device_and_says_where_its_seconds_went(monkeypatch):
    """On the H200 the 1B Llama's probe built it on the CPU (17-26 s of the probe's 47 s): it is
    built on the probe's device now, as a trial builds it."""
    built = []
    real = worker.build

    def build(spec, *, init_device="cpu"):
        built.append(init_device)
        return real(spec, init_device=init_device)

    monkeypatch.setattr(worker, "build", build)
    result = worker.probe({"mode": "probe", "device": "cpu", "workload": TINY_LLAMA, "check_compile": False})
    assert built == ["cpu"]

    class Built(Exception):
        pass

    def on_gpu(spec, *, init_device="cpu"):  # a CUDA probe here: what it asks for, no GPU needed
        built.append(init_device)
        raise Built

    monkeypatch.setattr(worker, "build", on_gpu)
    with pytest.raises(Built):
        worker.probe({"mode": "probe", "device": "cuda", "workload": TINY_LLAMA, "check_compile": False})
    assert built == ["cpu", "cuda"]
    assert set(result["seconds"]) == {"build", "forward"} and all(v >= 0 for v in result["seconds"].values())
    assert result["num_parameters"] > 0 and result["lm_head"]["vocab"] == 1000


def test_inputs_follow_the_model_to_its_device():
    model = torch.nn.Linear(4, 2, device="meta")
    moved = worker.on_device_of(model, {"ids": torch.zeros(2, 4), "rest": [torch.ones(1), 3]})
    assert moved["ids"].device.type == "meta" and moved["rest"][0].device.type == "meta" and moved["rest"][1] == 3
    cpu = torch.nn.Linear(4, 2)
    x = torch.zeros(2, 4)
    assert worker.on_device_of(cpu, x) is x


@pytest.mark.gpu
def test_on_a_gpu_the_probe_builds_an_hf_model_there_and_runs_its_forwards_there():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    result = worker.probe({"mode": "probe", "device": "cuda", "workload": TINY_LLAMA, "check_compile": True})
    assert result["sdpa_calls"] > 0 and result["lm_head"]["fusable"] in (True, False)
    assert "sdpa_probe_error" not in result, result.get("sdpa_probe_error")
    assert set(result["seconds"]) == {"build", "forward", "compile_check"}


def test_the_memory_probe_looks_between_the_batch_that_fit_and_the_one_that_did_not(monkeypatch):
    """It steps at 1 and 8 (each new batch is a new cudnn.benchmark search on a ConvNet); where 8 does
    not fit, at the powers of two between, up to the first that does not either: the memory model
    knows the family does not fit at 4 (a 1B Llama's eager step fits one sequence under 24 GiB)."""
    import strategies
    from autotune.space import SearchSpace
    from autotune.search import plain_recipe
    from autotune.trial.measure import MeasureSettings
    from optuna.trial import FixedTrial

    space = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[1, 2, 4, 8], base_batch_size=8)
    knobs = strategies.knobs_to_dict(strategies.sample(FixedTrial(plain_recipe.params(space, 1)), space))
    request = {"mode": "memory", "space": space.to_dict(), "knobs": knobs,
               "workload": {"model": "fake_models:tiny_cnn", "input_shape": [3, 16, 16], "num_classes": 4},
               "measure": MeasureSettings.for_device("cpu").to_dict(), "seed": 0, "batches": [1, 8]}
    tried = []

    def peak_at(step, workload, cfg, batch, seed):
        tried.append(batch)
        return None if batch >= 4 else 1000 * batch

    held_at = []

    def forward_held(step, workload, cfg, batches, seed):
        held_at.append(batches)
        return {str(b): 10 * b for b in batches}

    monkeypatch.setattr(worker, "peak_at", peak_at)
    monkeypatch.setattr(worker, "forward_held", forward_held)
    result = worker.probe_memory(request)
    assert tried == [1, 8, 2, 4]
    assert result["peaks"] == {"1": 1000, "2": 2000} and result["does_not_fit_at"] == 4
    # two peaks near the limit: the smaller one's is the optimizer's phase (the 1B Llama's at 1 and 2 under
    # 24 GiB on the H100 gave 1.42 GiB a sample, where its forward keeps 2.48), so the forward is measured
    # from the smallest batch to twice the largest that fit
    assert held_at == [[1, 4]] and result["forward_held"] == {"1": 10, "4": 40}

    # every batch fits: the peaks' line is a sample's, and the forward is not measured apart
    tried.clear()
    monkeypatch.setattr(worker, "peak_at", lambda step, workload, cfg, batch, seed: 1000 * batch)
    result = worker.probe_memory(request)
    assert result["does_not_fit_at"] is None and "forward_held" not in result and held_at == [[1, 4]]
