"""The findings rules, one by one: each fires past its threshold only, says what it saw, and
suggests only values the search space offers."""

from __future__ import annotations

import pytest

from autotune.search.findings import derive

OFFERED = {"memory_format.format": ["contiguous", "channels_last"], "batch_size.batch_size": [64, 128, 256, 512],
           "cuda_graphs.enabled": [False, True], "streams.num_streams": [1, 2],
           "precision.mode": ["fp32", "tf32", "fp16", "bf16"], "channel_alignment.multiple": [1, 8],
           "compile.mode": ["off", "default"]}


def knobs(**over):
    base = {"precision": {"mode": "fp16"}, "memory_format": {"format": "contiguous"}, "streams": {"num_streams": 1},
            "batch_size": {"batch_size": 128}, "cuda_graphs": {"enabled": False}, "compile": {"mode": "off"}}
    for key, value in over.items():
        base[key] = value
    return base


def profile(**shares):
    return {"steps": 3, "layout_share": 0.0, "idle_share": 0.0, "memcpy_share": 0.0, "other_gemm_conv_share": 0.0,
            "elementwise_share": 0.0, "copy_overlap": None, **shares}


def rules(found):
    return [f.rule for f in found]


def test_nothing_to_say_about_a_clean_profile():
    assert derive(profile(), {}, knobs(), offered=OFFERED) == []


def test_layout_conversions_suggest_channels_last():
    [f] = derive(profile(layout_share=0.38), None, knobs(), offered=OFFERED)
    assert f.rule == "layout" and "38% of GPU time" in f.text and "channels_last" in f.text
    assert f.suggest == {"memory_format.format": "channels_last"}
    assert derive(profile(layout_share=0.04), None, knobs(), offered=OFFERED) == []


def test_layout_conversions_left_with_channels_last_explain_without_suggesting():
    [f] = derive(profile(layout_share=0.10), None, knobs(memory_format={"format": "channels_last"}), offered=OFFERED)
    assert f.suggest == {} and "still" in f.text


def test_an_idle_gpu_suggests_a_larger_batch_and_cuda_graphs():
    [f] = derive(profile(idle_share=0.31, launches_per_step=640), None, knobs(), offered=OFFERED)
    assert f.rule == "idle" and "idle 31%" in f.text and "640 launches" in f.text
    assert f.suggest == {"batch_size.batch_size": 256, "cuda_graphs.enabled": True}


def test_an_idle_gpu_at_the_largest_batch_with_graphs_on_only_explains():
    [f] = derive(profile(idle_share=0.2), None, knobs(batch_size={"batch_size": 512}, cuda_graphs={"enabled": True}),
                 offered=OFFERED)
    assert f.suggest == {} and "would help" not in f.text


def test_serial_copies_suggest_a_side_stream_and_overlapped_ones_are_reported():
    [f] = derive(profile(memcpy_share=0.12, copy_overlap=0.0), None, knobs(), offered=OFFERED)
    assert f.suggest == {"streams.num_streams": 2} and "12%" in f.text
    [g] = derive(profile(memcpy_share=0.01, copy_overlap=0.9), None, knobs(streams={"num_streams": 2}), offered=OFFERED)
    assert g.rule == "copies-hidden" and "90%" in g.text
    [h] = derive(profile(memcpy_share=0.2, copy_overlap=0.3), None, knobs(streams={"num_streams": 2}), offered=OFFERED)
    assert "side stream does not hide" in h.text and h.suggest == {}


def test_fp32_gemms_without_tensor_cores_suggest_a_lower_precision():
    [f] = derive(profile(other_gemm_conv_share=0.6), None, knobs(precision={"mode": "fp32"}), offered=OFFERED)
    assert f.rule == "no-tensor-cores" and f.suggest == {"precision.mode": "bf16"}
    only_fp16 = dict(OFFERED, **{"precision.mode": ["fp32", "fp16"]})
    [g] = derive(profile(other_gemm_conv_share=0.6), None, knobs(precision={"mode": "fp32"}), offered=only_fp16)
    assert g.suggest == {"precision.mode": "fp16"}


def test_misaligned_layers_under_fp16_suggest_padding():
    [f] = derive(profile(other_gemm_conv_share=0.25), None, knobs(), offered=OFFERED,
                 misaligned=["Linear(1001->4097)", "Conv2d(3->61)"])
    assert f.rule == "misaligned" and "Linear(1001->4097)" in f.text
    assert f.suggest == {"channel_alignment.multiple": 8}


def test_elementwise_heavy_eager_steps_suggest_compile():
    [f] = derive(profile(elementwise_share=0.45), None, knobs(), offered=OFFERED)
    assert f.suggest == {"compile.mode": "default"}
    assert derive(profile(elementwise_share=0.45), None, knobs(compile={"mode": "default"}), offered=OFFERED) == []


def test_power_cap_and_thermal_throttling():
    energy = {"avg_power_w": 699.6, "max_temperature_c": 87, "throttle": {"power_cap": 0.6, "hw_thermal": 0.1}}
    found = derive(None, energy, knobs(), offered=OFFERED)
    assert rules(found) == ["power-cap", "thermal"]
    assert "power-capped at 700 W for 60%" in found[0].text and "87 C" in found[1].text
    assert derive(None, {"throttle": {"power_cap": 0.1}}, knobs()) == []


@pytest.mark.parametrize("param,value", [("memory_format.format", "channels_last"), ("streams.num_streams", 2)])
def test_no_suggestion_outside_the_space(param, value):
    narrow = {k: ([v for v in vs if v != value]) for k, vs in OFFERED.items()}
    found = derive(profile(layout_share=0.3, memcpy_share=0.2), None, knobs(), offered=narrow)
    assert all(f.suggest.get(param) != value for f in found)


def test_a_compile_that_compiled_nothing_is_said():
    knobs = {"compile": {"mode": "default"}}
    found = derive(None, None, knobs, figures={"compiled_graphs": 0})
    assert [f.rule for f in found] == ["compile-inert"] and "ran eagerly" in found[0].text
    assert derive(None, None, knobs, figures={"compiled_graphs": 3}) == []
    assert derive(None, None, {"compile": {"mode": "off"}}, figures={"compiled_graphs": 0}) == []


DDP_OFFERED = {**OFFERED, "ddp.bucket_cap_mb": [10, 25, 50, 100], "ddp.gradient_as_bucket_view": [False, True],
               "ddp.static_graph": [False, True]}


def ddp_figures(efficiency):
    return {"ddp_world_size": 2, "scaling_efficiency": efficiency, "per_gpu_samples_per_s": 8_853 * efficiency / 0.703,
            "single_gpu_samples_per_s": 12_591}


def test_a_ddp_step_that_scales_badly_suggests_ddps_own_settings():
    ddp = {"world_size": 2, "bucket_cap_mb": 25, "gradient_as_bucket_view": False, "static_graph": False}
    found = derive(None, None, knobs(ddp=ddp), offered=DDP_OFFERED, figures=ddp_figures(0.703))
    assert rules(found) == ["ddp-scaling"]
    assert found[0].suggest == {"ddp.bucket_cap_mb": 100, "ddp.gradient_as_bucket_view": True, "ddp.static_graph": True}
    assert "70% of its speed alone" in found[0].text and "(8,853 vs 12,591 samples/s)" in found[0].text
    # compiled: static_graph is not offered with torch.compile (pytorch/pytorch#93672)
    compiled = derive(None, None, knobs(ddp=ddp, compile={"mode": "default"}), offered=DDP_OFFERED,
                      figures=ddp_figures(0.6))
    assert "ddp.static_graph" not in compiled[0].suggest
    # everything on already: said, with what is left to try, nothing to queue
    tuned = {"world_size": 2, "bucket_cap_mb": 100, "gradient_as_bucket_view": True, "static_graph": True}
    found = derive(None, None, knobs(ddp=tuned), offered=DDP_OFFERED, figures=ddp_figures(0.8))
    assert found[0].suggest == {} and "larger batch per GPU" in found[0].text
    # at or above the threshold, or without DDP: nothing
    assert derive(None, None, knobs(ddp=ddp), offered=DDP_OFFERED, figures=ddp_figures(0.9)) == []
    assert derive(None, None, knobs(), offered=OFFERED, figures={"scaling_efficiency": 0.5}) == []
