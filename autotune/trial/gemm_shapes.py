"""The GEMM and convolution shapes of a profiled window: which layers compute on widths that are not
multiples of 8 (fp16/bf16 Tensor Cores; 16 for FP8), and their share of the step.

cuBLAS and cuDNN run their Tensor Core kernels on fp16/bf16 operands only when the leading
dimensions are multiples of 8 elements (16 bytes); otherwise they pick slower kernels or pad
internally. The profile window records the input shapes of its ops (``record_shapes=True``); each
GEMM or convolution op is read here as its dimensions (M, N, K of a GEMM, input and output channels
of a convolution) with its own time (the GPU time of the kernels it launched; CPU time on a CPU),
and matched to the model's layers by their widths, which the trial process knows: a Linear's
(in_features, out_features) are two of its GEMMs' three dimensions, forward and backward alike; a
Conv's (in_channels, out_channels) are the channels of its convolutions. A layer the
channel_alignment knob padded computes on its padded widths, and is matched by those.

Only small, JSON-ready lists leave the trial process: :func:`collect` (the ops, aggregated by name
and shapes) and :func:`model_layers` (the layers' widths), which :func:`misaligned` turns into the
profile's ``misaligned_gemms`` and ``misaligned_share``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Iterable

GEMM_OPS = {  # op -> the indices of its two matrix operands in its inputs
    "aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::matmul": (0, 1), "aten::_scaled_mm": (0, 1),
    "aten::addmm": (1, 2), "aten::baddbmm": (1, 2), "aten::_addmm_activation": (1, 2),
    "aten::linear": (0, 1),  # its weight is (out, in): the GEMM is x @ W.T
}
_CONV = re.compile(r"^aten::(conv(1d|2d|3d|_transpose\dd)|_?convolution(_backward)?|cudnn_convolution\w*|"
                   r"mkldnn_convolution\w*|_slow_conv\w*|slow_conv\w*|miopen_convolution\w*|_nnpack\w*)$")
TOP = 5
"""Misaligned layers (or unmatched ops) listed in the profile, the largest shares first."""
_WRAPPERS = ("_orig_mod.", "module.")  # torch.compile's and DDP's wrappers: not part of a layer's name


def is_gemm_or_conv(name: str) -> bool:
    return name in GEMM_OPS or bool(_CONV.match(name))


def collect(events: Iterable[Any], on_gpu: bool) -> tuple[list[list[Any]], int]:
    """The GEMM/conv ops of a profiled window and the host time of its steps, from the profiler's
    Kineto events (``prof.profiler.kineto_results.events()`` of a window recorded with
    ``record_shapes=True``).

    An op nested in another (``aten::linear`` -> ``aten::addmm``, ``aten::conv2d`` ->
    ``aten::cudnn_convolution``) is counted with the outermost one, whose shapes say the most: its
    own time is added to it (on a GPU, its kernels', which Kineto links to the innermost op that
    launched them; on a CPU, its duration less its children's), so nothing is counted twice and the
    ops around them (casts, views) are not counted. Read here rather than through ``prof.events()``,
    whose parse of every event into a tree costs about 20 times as much (1.3 s against 0.07 s for a
    3-step ResNet-18 window on a shared 2-core VM). Returns ``[[op, shapes, time_ns, calls], ...]``
    and the steps' host time in ns."""
    from torch.autograd import DeviceType

    by_thread: dict[int, list[Any]] = {}
    kernel_ns: dict[int, int] = {}
    for ev in events:
        if ev.device_type() == DeviceType.CPU:
            by_thread.setdefault(ev.start_thread_id(), []).append(ev)
        elif on_gpu and ev.linked_correlation_id() > 0:
            kernel_ns[ev.linked_correlation_id()] = kernel_ns.get(ev.linked_correlation_id(), 0) + ev.duration_ns()
    ops: dict[tuple[str, str], list[Any]] = {}
    host_ns = 0
    for thread_events in by_thread.values():
        host_ns += _nest(thread_events, ops, kernel_ns if on_gpu else None)
    return [entry for entry in ops.values() if entry[1]], host_ns


def _nest(events: list[Any], ops: dict[tuple[str, str], list[Any]], kernel_ns: dict[int, int] | None) -> int:
    """Walk one thread's CPU events as the tree their time ranges make, adding each GEMM/conv op's own
    time to the entry of its outermost GEMM/conv ancestor in ``ops``; returns the ProfilerStep ranges' time."""
    events.sort(key=lambda e: (e.start_ns(), -e.end_ns()))
    stack: list[list[Any]] = []  # [end_ns, event, children's time, key of the entry it counts in]
    host_ns = 0

    def close(end: int, ev: Any, children_ns: int, key: tuple[str, str] | None) -> None:
        if key is not None:
            own = kernel_ns.get(ev.correlation_id(), 0) if kernel_ns is not None else ev.duration_ns() - children_ns
            ops[key][2] += own

    for ev in events:
        while stack and stack[-1][0] <= ev.start_ns():
            close(*stack.pop())
        if stack:
            stack[-1][2] += ev.duration_ns()
        name = ev.name()
        if name.startswith("ProfilerStep#"):
            host_ns += ev.duration_ns()
        key = None
        if is_gemm_or_conv(name):
            key = next((entry[3] for entry in stack if entry[3] is not None), None)
            if key is None:  # the outermost: its shapes name the entry
                shapes = [list(shape) for shape in ev.shapes()]
                key = (name, repr(shapes))
                ops.setdefault(key, [name, shapes, 0, 0])[3] += 1
        stack.append([ev.end_ns(), ev, 0, key])
    while stack:
        close(*stack.pop())
    return host_ns


def model_layers(model: Any) -> list[list[Any]]:
    """``[[name, kind, in, out, vocab], ...]``: the model's Linear, Conv (ungrouped) and Embedding
    layers with the widths they compute on. An Embedding's are (embedding_dim, num_embeddings), as
    a head tied to it multiplies by its weight; ``vocab`` marks a layer whose width is the
    vocabulary (an Embedding's size): the head or the embedding of a language model."""
    from torch import nn
    from torch.nn.modules.conv import _ConvNd

    layers: list[list[Any]] = []
    for name, layer in model.named_modules():
        while name.startswith(_WRAPPERS):
            name = name.split(".", 1)[1]
        if isinstance(layer, nn.Linear):
            widths, kind = (layer.in_features, layer.out_features), "linear"
        elif isinstance(layer, _ConvNd) and layer.groups == 1:
            widths, kind = (layer.in_channels, layer.out_channels), "conv"
        elif isinstance(layer, nn.Embedding):
            widths, kind = (layer.embedding_dim, layer.num_embeddings), "embedding"
        else:
            continue
        widths = tuple(getattr(layer, "aligned_to", None) or widths)  # channel_alignment's padded widths
        layers.append([name or type(layer).__name__, kind, int(widths[0]), int(widths[1]), False])
    vocab = {out for _, kind, _, out, _ in layers if kind == "embedding"}
    for entry in layers:
        entry[4] = entry[3] in vocab
    return layers


def dims(op: str, shapes: list[list[int]]) -> tuple[str, list[int]] | None:
    """``("gemm", [M, N, K])`` or ``("conv", [in_channels, out_channels])`` of one op, from its input
    shapes; None where they are not those of a GEMM or a convolution."""
    if op in GEMM_OPS:
        i, j = GEMM_OPS[op]
        if len(shapes) <= j or len(shapes[i]) < 2 or len(shapes[j]) < 1:
            return None
        a, b = shapes[i], shapes[j]
        m, k = math.prod(a[:-1]) if op == "aten::linear" else a[-2], a[-1]
        n = b[0] if op == "aten::linear" else b[-1]
        return "gemm", [int(m), int(n), int(k)]
    if len(shapes) < 2 or len(shapes[0]) < 3 or len(shapes[1]) < 3:
        return None
    if op.endswith("_backward") or "backward" in op:
        # (grad_output, input, weight, ...): channels of the input, and of the output (the weight's first)
        if len(shapes) < 3 or len(shapes[1]) < 3 or len(shapes[2]) < 3:
            return None
        return "conv", [int(shapes[1][1]), int(shapes[2][0])]
    if "transpose" in op:  # its weight is (in, out / groups, ...)
        return "conv", [int(shapes[0][1]), int(shapes[1][1])]
    return "conv", [int(shapes[0][1]), int(shapes[1][0])]


def _match(kind: str, found: list[int], layers: list[list[Any]]) -> list[list[Any]]:
    """The layers whose widths these dimensions are: a Linear's (or tied Embedding's) in and out are
    two of a GEMM's three dimensions; a Conv's are the convolution's channels."""
    if kind == "conv":
        return [layer for layer in layers if layer[1] == "conv" and [layer[2], layer[3]] == found]
    have = Counter(found)
    return [layer for layer in layers
            if layer[1] in ("linear", "embedding") and not Counter([layer[2], layer[3]]) - have]


def misaligned(ops: list[list[Any]], layers: list[list[Any]], multiple: int, span_ns: float,
               top: int = TOP) -> dict[str, Any]:
    """The profile's ``misaligned_gemms`` (the ``top`` largest: layer, op, dims, share, multiple, and
    whether the layer is the vocabulary's) and ``misaligned_share`` (all of them together), of a
    window of ``span_ns``. A GEMM matched to layers is misaligned when their widths are (what
    padding them fixes); one matched to none when its N or K is (the leading dimensions of its
    operands); a convolution when its channels are."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for op, shapes, time_ns, _calls in ops:
        read = dims(op, shapes)
        if read is None:
            continue
        kind, found = read
        candidates = _match(kind, found, layers)
        # of the layers these dimensions fit, the misaligned ones (an aligned layer of two of the same
        # widths does not hide them); a Linear head before the Embedding it shares its widths with
        matched = sorted((layer for layer in candidates if layer[2] % multiple or layer[3] % multiple),
                         key=lambda layer: layer[1] == "embedding")
        if not matched and (candidates or not any(w % multiple for w in (found[1:] if kind == "gemm" else found))):
            continue
        key = (tuple(layer[0] for layer in matched),) if matched else (op, tuple(found))
        group = groups.setdefault(key, {"names": [layer[0] for layer in matched], "ops": Counter(),
                                        "dims": [matched[0][2], matched[0][3]] if matched else found,
                                        "kind": matched[0][1] if matched else kind,
                                        "vocab": any(layer[4] for layer in matched), "time_ns": 0})
        group["ops"][op] += time_ns
        group["time_ns"] += time_ns
    span = max(float(span_ns), 1.0)
    ranked = sorted(groups.values(), key=lambda g: -g["time_ns"])
    records = [{"layer": _names(g["names"]), "kind": g["kind"], "op": g["ops"].most_common(1)[0][0],
                "dims": g["dims"], "share": min(1.0, g["time_ns"] / span), "multiple": multiple, "vocab": g["vocab"]}
               for g in ranked[:top]]
    return {"misaligned_gemms": records, "alignment_multiple": multiple,
            "misaligned_share": min(1.0, sum(g["time_ns"] for g in ranked) / span)}


def _names(names: list[str]) -> str | None:
    """Layers of the same widths, as one name: the first two, then how many more."""
    if not names:
        return None
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
