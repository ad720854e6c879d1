"""A dying worker's reason names the error, not the last stack frame."""

from __future__ import annotations

from autotune.runner import _exit_description, salient_error

# the end of a real worker log on the H200 after a device-side assert (torch 2.11): the error comes
# first, then an abort with a C++ stack trace
ABORT_LOG = """\
/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1553: indexSelectLargeIndex: block: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.
terminate called after throwing an instance of 'c10::AcceleratorError'
  what():  CUDA error: device-side assert triggered
Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:44
frame #26: PyRun_SimpleStringFlags + 0x3e (0x6b40de in /opt/torch/.venv/bin/python3)
frame #31: _start + 0x25 (0x657a05 in /opt/torch/.venv/bin/python3)
"""


def test_the_error_line_is_the_reason():
    assert salient_error(ABORT_LOG) == "CUDA error: device-side assert triggered"
    assert "Assertion `srcIndex < srcSelectDimSize` failed" in salient_error(ABORT_LOG.replace("  what():  CUDA error: device-side assert triggered\n", ""))
    reason = salient_error("loading\nRuntimeError: CUDA error: an illegal memory access was encountered\nframe #1")
    assert reason == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_without_an_error_line_the_end_of_the_log_is_kept():
    assert salient_error("step 1\nstep 2\n" + "x" * 900, limit=50) == "x" * 50


def test_signals_are_named():
    assert _exit_description(-6) == "was killed by signal 6 (SIGABRT)"
    assert _exit_description(11) == "exited with code 11"
