"""The profile analysis: kernel categories from real H200 kernel names, and the window arithmetic
(shares of wall time, idle gaps, copy overlap, kernels per step) on hand-made timelines."""

from __future__ import annotations

import pytest

from autotune.search.findings import derive
from autotune.trial.profile import GpuEvent, ProfileTrace, analyze, classify, load_fixture
from conftest import ROOT

# names as they appear in a ResNet-50 trace recorded on the H200 (torch 2.11, cuDNN 9.19)
REAL_NAMES = {
    "sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize256x64x8_stage3_warpsize2x2x1_g1_ffma_"
    "aligna4_alignc4_execute_kernel__5x_cudnn": "other_gemm_conv",
    "sm80_xmma_gemm_cf32cf32_f32f32_cf32_tn_n_tilesize64x64x8_stage3_warpsize2x2x1_ffma_aligna8_alignc8_execute_"
    "kernel__5x_cublas": "other_gemm_conv",
    "void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int, int, int, float const*, int)": "other_gemm_conv",
    "void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int, float const*)": "other_gemm_conv",
    "void implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, false, false, true>(int, int)": "other_gemm_conv",
    "void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 128, true, 1>(float, float, float, float)": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >":
        "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<3>>":
        "elementwise",
    "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)0>":
        "layout",
    "void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false, (cudnnKernelDataType_t)0>":
        "layout",
    "void flip_filter<float, float>(float*, float const*, int, int, int, int)": "layout",
    # Tensor Core kernels: half/bf16/tf32 operands, MMA instructions
    "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cudnn": "tensor_core",
    "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel": "tensor_core",
    "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn": "tensor_core",
    "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": "tensor_core",
    "triton_poi_fused__native_batch_norm_legit_functional_relu_0": "elementwise",
    # a compiled step (bf16, channels_last): Triton's fused kernels are named after the ops they fuse,
    # convolution_backward included, and stay elementwise; cuDNN's CUTLASS wgrad says "NoPermute"
    "triton_poi_fused__native_batch_norm_legit_functional_add_convolution_backward_native_batch_norm_backward_"
    "threshold_backward_63": "elementwise",
    "triton_red_fused__native_batch_norm_legit_functional_add_native_batch_norm_backward_threshold_backward_62":
        "elementwise",
    "_ZN17cutlass__5x_cudnn6KernelINS_4conv6kernel23ImplicitGemmConvolutionINS1_11threadblock22ImplicitGemmMulti"
    "stageINS_4gemm9GemmShapeILi64ELi128ELi32EEENS4_52Conv2dWgradOutputGradientTileAccessIteratorOptimizedINS_11"
    "MatrixShapeILi64ELi32EEENS_10bfloat16_tENS_9transform29PitchLinearWarpRakedThreadMapINS_16PitchLinearShape"
    "ILi64ELi32EEELi128ENSF_ILi8ELi4EEELi8EEENS_12AlignedArrayISC_Li8ELi16EEEEENS_4warp11MmaTensorOpINS7_ILi32E"
    "Li64ELi32EEENSO_9NoPermuteELb0EEEEEvNT_6ParamsE": "tensor_core",
}


@pytest.mark.parametrize("name,category", REAL_NAMES.items())
def test_kernel_categories(name, category):
    assert classify(name) == category


def _k(name, start, dur, stream=7, kind="kernel"):
    return GpuEvent(name, kind, stream, start, dur)


def test_shares_add_up_with_idle_gaps():
    # two steps of 100 ns each: a 40 ns Tensor Core conv, 20 ns of batch norm, a 10 ns transpose, 30 ns idle
    events = []
    for base in (0, 100):
        events += [_k("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwc", base, 40),
                   _k("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float>", base + 40, 20),
                   _k("void at::native::transpose_kernel<float>", base + 60, 10)]
    events.append(_k("void at::native::vectorized_elementwise_kernel<add>", 199, 1))
    result = analyze(ProfileTrace(steps=2, events=events, launches=8))
    assert result["tensor_core_share"] == pytest.approx(80 / 200)
    assert result["elementwise_share"] == pytest.approx(41 / 200)
    assert result["layout_share"] == pytest.approx(20 / 200)
    assert result["idle_share"] == pytest.approx(59 / 200)
    assert result["kernels_per_step"] == 3.5 and result["launches_per_step"] == 4
    assert result["tensor_core_of_gemm_conv"] == 1.0
    assert result["top_kernels"][0]["category"] == "tensor_core"
    assert result["top_kernels"][0]["calls_per_step"] == 1


def test_copy_overlap_and_exposed_copy_time():
    events = [
        _k("sm80_xmma_gemm_f16f16_f16f32_f32_tensor16x8x16", 0, 100, stream=7),
        # half of this copy runs under the kernel (a side stream), half after it
        _k("Memcpy HtoD (Pinned -> Device)", 50, 100, stream=21, kind="memcpy"),
    ]
    result = analyze(ProfileTrace(steps=1, events=events))
    assert result["copy_overlap"] == pytest.approx(0.5)
    assert result["memcpy_share"] == pytest.approx(50 / 150)
    assert result["idle_share"] == pytest.approx(0.0)
    assert result["h2d_ms_per_step"] == pytest.approx(100 / 1e6)
    assert result["streams"] == 2


def test_a_serial_copy_does_not_overlap():
    events = [_k("Memcpy HtoD (Pinned -> Device)", 0, 30, kind="memcpy"), _k("sgemm_128x64", 30, 70)]
    result = analyze(ProfileTrace(steps=1, events=events))
    assert result["copy_overlap"] == 0.0 and result["memcpy_share"] == pytest.approx(0.3)
    assert result["other_gemm_conv_share"] == pytest.approx(0.7) and result["tensor_core_share"] == 0


def test_kernels_on_concurrent_streams_never_exceed_the_wall_time():
    events = [_k("sm80_xmma_gemm_f16f16_tensor16x8x16", 0, 100, stream=7),
              _k("sm80_xmma_gemm_f16f16_tensor16x8x16", 0, 100, stream=8)]
    result = analyze(ProfileTrace(steps=1, events=events))
    assert result["tensor_core_share"] == pytest.approx(1.0)


def test_a_window_without_gpu_activity_says_so():
    assert "no GPU activity" in analyze(ProfileTrace(steps=3))["note"]


def test_round_trip_through_json():
    trace = ProfileTrace(steps=2, events=[_k("a", 0, 5), _k("Memcpy HtoD", 5, 5, kind="memcpy")], launches=3,
                         meta={"gpu": "NVIDIA H200"})
    again = ProfileTrace.from_dict(trace.to_dict())
    assert again == trace


# real windows recorded on the H200 (scripts/record_profiles.py; torch 2.11, cuDNN 9.19) -----------

FIXTURES = ROOT / "tests" / "fixtures"


def _fixture(name):
    trace = load_fixture(FIXTURES / f"profile-{name}.json.gz")
    step_ms = trace.meta["batch"] / trace.meta["timed_samples_per_s"] * 1e3
    return trace, analyze(trace, step_time_ms=step_ms)


def test_true_fp32_resnet50_runs_no_tensor_core_kernel():
    trace, a = _fixture("resnet50-fp32-nchw")
    assert trace.meta["gpu"] == "NVIDIA H200" and trace.steps == 3
    assert a["tensor_core_share"] == 0 and a["other_gemm_conv_share"] > 0.5
    assert 600 < a["kernels_per_step"] < 800 and a["launches_per_step"] == a["kernels_per_step"]
    found = derive(a, trace.meta["nvml"], {"precision": {"mode": "fp32"}},
                   offered={"precision.mode": ["fp32", "tf32", "fp16", "bf16"]})
    assert [f.rule for f in found] == ["no-tensor-cores"] and found[0].suggest == {"precision.mode": "bf16"}


def test_fp16_in_nchw_spends_its_time_converting_layouts():
    trace, a = _fixture("resnet50-fp16-nchw")
    assert a["layout_share"] > 0.10 and a["tensor_core_of_gemm_conv"] > 0.95
    names = [k["name"] for k in a["top_kernels"] if k["category"] == "layout"]
    assert any("nchwToNhwc" in n for n in names)
    found = derive(a, trace.meta["nvml"], {"precision": {"mode": "fp16"}, "memory_format": {"format": "contiguous"}},
                   offered={"memory_format.format": ["contiguous", "channels_last"]})
    assert "layout" in [f.rule for f in found]
    assert next(f for f in found if f.rule == "layout").suggest == {"memory_format.format": "channels_last"}


def test_channels_last_removes_the_conversions_and_the_side_stream_overlaps_copies():
    _, nchw = _fixture("resnet50-fp16-nchw")
    _, cl = _fixture("resnet50-fp16-cl-2streams")
    assert cl["layout_share"] < 0.01 < nchw["layout_share"]
    assert cl["streams"] == 2 and cl["copy_overlap"] > 0.1 and nchw["copy_overlap"] == 0.0
    assert cl["kernels_per_step"] < nchw["kernels_per_step"]


def test_the_profiler_slowdown_is_kept_out_of_the_idle_share():
    trace, timed = _fixture("resnet50-fp16-cl-2streams")
    profiled = analyze(trace)
    # under the profiler the host lags and the GPU waits longer between kernels
    assert profiled["profiled_step_ms"] > timed["gpu_time_per_step_ms"]
    assert profiled["idle_share"] > timed["idle_share"] > 0
    assert timed["busy_ms_per_step"] == pytest.approx(profiled["busy_ms_per_step"])


def test_a_small_vit_batch_is_launch_bound_and_its_gemms_use_tensor_cores():
    trace, a = _fixture("vit_b_16-bf16")
    assert a["tensor_core_share"] > 0.1 and a["tensor_core_of_gemm_conv"] > 0.9
    assert a["idle_share"] > 0.4
    found = derive(a, trace.meta["nvml"], {"precision": {"mode": "bf16"}, "batch_size": {"batch_size": 32},
                                          "cuda_graphs": {"enabled": False}, "compile": {"mode": "off"}},
                   offered={"batch_size.batch_size": [32, 64], "cuda_graphs.enabled": [False, True]})
    idle = next(f for f in found if f.rule == "idle")
    assert idle.suggest == {"batch_size.batch_size": 64, "cuda_graphs.enabled": True}


def test_the_nvml_window_recorded_with_the_fixture_is_real():
    trace, _ = _fixture("resnet50-fp16-cl-2streams")
    nvml = trace.meta["nvml"]
    assert nvml["energy_source"] == "energy counter" and 100 < nvml["avg_power_w"] <= 700
    assert nvml["num_samples"] > 10 and nvml["throttled"] is False


def test_a_compiled_step_keeps_the_gpu_busy_and_is_power_bound():
    # trial 2 of a ResNet-50 search on the H200: bf16 + channels_last + compile, batch 512, 7,194 img/s
    trace, a = _fixture("resnet50-bf16-cl-compile")
    assert a["idle_share"] < 0.05  # Triton's kernels are work, not idle time
    assert a["elementwise_share"] > 0.4 and a["tensor_core_of_gemm_conv"] > 0.95
    assert a["layout_share"] < 0.02 and a["copy_overlap"] > 0.5
    found = derive(a, trace.meta["nvml"], {"precision": {"mode": "bf16"}, "batch_size": {"batch_size": 512},
                                          "compile": {"mode": "default"}, "cuda_graphs": {"enabled": False}},
                   offered={"batch_size.batch_size": [256, 512, 1024], "cuda_graphs.enabled": [False, True]})
    assert [f.rule for f in found] == ["power-cap"] and "SM clock 1,887 MHz" in found[0].text


class _Event:
    """A Kineto event as ``prof.profiler.kineto_results.events()`` yields it."""

    def __init__(self, name, cuda, start=0, dur=0, annotation=False):
        self._name, self._cuda, self._start, self._dur, self._annotation = name, cuda, start, dur, annotation

    def name(self):
        return self._name

    def device_type(self):
        from torch.autograd import DeviceType

        return DeviceType.CUDA if self._cuda else DeviceType.CPU

    def device_resource_id(self):
        return 7

    def start_ns(self):
        return self._start

    def duration_ns(self):
        return self._dur

    def is_user_annotation(self):
        return self._annotation


class _Profiler:
    def __init__(self, events):
        self.profiler = type("P", (), {"kineto_results": type("R", (), {"events": lambda _self: events})()})()


def test_kernels_named_like_a_host_range_are_work_and_gpu_ranges_are_not():
    from autotune.trial.profile import from_profiler

    triton = "triton_poi_fused__native_batch_norm_legit_functional_relu_0"
    events = [_Event(triton, cuda=False, start=0, dur=50),  # inductor's host-side range around the launch
              _Event("cuLaunchKernel", cuda=False, start=1, dur=2),
              _Event(triton, cuda=True, start=10, dur=40),
              _Event("ProfilerStep#1", cuda=True, start=0, dur=100, annotation=True),
              _Event("Optimizer.step#SGD.step", cuda=True, start=60, dur=30, annotation=True),
              _Event("Memcpy HtoD (Pinned -> Device)", cuda=True, start=55, dur=5)]
    trace = from_profiler(_Profiler(events), steps=1)
    assert [(e.name, e.kind) for e in trace.events] == [(triton, "kernel"), ("Memcpy HtoD (Pinned -> Device)", "memcpy")]
    assert trace.launches == 1
