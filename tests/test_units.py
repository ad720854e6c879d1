"""What one sample is: tokens/s derived from samples/s for a language model, nothing for others."""

import math
import sys

from autotune.workload.units import Units
from conftest import ROOT


def test_tokens_per_s_is_samples_per_s_times_the_sequence_length():
    lm = Units.from_dict({"sample_unit": "sequence", "tokens_per_sample": 1024})
    assert lm.has_tokens and lm.tokens_per_s(12.5) == 12800.0
    assert lm.with_tokens({"samples_per_s": 2.0, "step_time_ms": 5.0}) == {
        "samples_per_s": 2.0, "step_time_ms": 5.0, "tokens_per_s": 2048.0}
    # a trial without a rate (failed, pruned) has no tokens/s either
    assert lm.tokens_per_s(None) is None and lm.tokens_per_s(math.nan) is None
    assert lm.with_tokens({}) == {}


def test_images_and_older_searches_have_no_tokens():
    for units in (Units(), Units.from_dict(None), Units.from_dict({"sample_unit": "image"})):
        assert not units.has_tokens
        assert units.tokens_per_s(100.0) is None
        assert units.with_tokens({"samples_per_s": 100.0}) == {"samples_per_s": 100.0}
    assert Units.from_dict(None).sample_unit == "sample"
    assert Units.from_dict(Units(sample_unit="sequence", tokens_per_sample=16).to_dict()) == Units("sequence", 16)


def test_the_gpt_style_yield_workloads_declare_their_tokens(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("yield_models", None)
    import yield_models

    tiny = yield_models.gpt_lm_tiny()
    assert tiny.sample_unit == "sequence" and tiny.tokens_per_sample == 32 == tiny.input_shape[0]
    assert yield_models.odd_mlp_tiny().tokens_per_sample is None
