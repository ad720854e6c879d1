"""Small models for end-to-end tests, importable as --model fake_models:NAME (tests/ on PYTHONPATH)."""

from __future__ import annotations

import os

import torch
from torch import nn


def tiny_cnn(num_classes: int = 10) -> nn.Module:
    """A few conv layers: fast on two CPU cores, still has convs for memory_format to act on."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )


def tiny_depthwise_cnn(num_classes: int = 10) -> nn.Module:
    """tiny_cnn with a ConvNeXt-style 7x7 depthwise convolution (stride 1) and a stride-2 one (not the
    depthwise_conv knob's)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 7, padding=3, groups=16), nn.GELU(),
        nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16), nn.Conv2d(16, 32, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )


class _Wrapped(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def tiny_cnn_module(num_classes: int = 10) -> nn.Module:
    """tiny_cnn inside a module with a forward of its own: torch 2.11 on the H200 compiled 0 graphs
    for a bare nn.Sequential (its forward is torch's own code), and a user's model has its own."""
    return _Wrapped(num_classes)


class _OOMAbove(nn.Module):
    """Raises the error PyTorch raises when a batch does not fit, for batches >= limit."""

    def __init__(self, limit: int, num_classes: int) -> None:
        super().__init__()
        self.limit = limit
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} GiB (test model)")
        return self.net(x)


def oom_above_16(num_classes: int = 10) -> nn.Module:
    return _OOMAbove(17, num_classes)


def oom_above_32(num_classes: int = 10) -> nn.Module:
    return _OOMAbove(33, num_classes)


class _CrashUnderAutocast(nn.Module):
    """Kills its process (as a segfault would) when run under autocast."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            os._exit(9)
        return self.net(x)


def crash_under_autocast(num_classes: int = 10) -> nn.Module:
    return _CrashUnderAutocast(num_classes)


class _Slow(nn.Module):
    """Each step sleeps, so a test can kill the search while a trial is running."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.05)
        return self.net(x)


def slow_cnn(num_classes: int = 10) -> nn.Module:
    return _Slow(num_classes)


class _FasterCompiled(nn.Module):
    """tiny_cnn whose eager forward sleeps and whose compiled one does not (TorchDynamo traces
    torch.compiler.is_compiling() as True, so the sleep is not in its graph): a search with --compile
    recommends compiling it."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            import time

            time.sleep(0.1)
        return self.net(x)


def faster_compiled(num_classes: int = 10) -> nn.Module:
    return _FasterCompiled(num_classes)


def not_a_model():
    return 42


class _DeviceAssert(nn.Module):
    """Triggers a device-side assert (a sticky CUDA error: only a new process recovers)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            index = torch.tensor([10**6], device=x.device)
            x = x.flatten()[index].reshape(1, 1, 1, 1).expand_as(x) + x
        return self.net(x)


def device_assert_under_autocast(num_classes: int = 10) -> nn.Module:
    return _DeviceAssert(num_classes)


class _OddWidths(nn.Module):
    """Linear widths that are not multiples of 8 (Tensor Cores want them padded)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 1001), nn.ReLU(), nn.Linear(1001, 4097),
                                 nn.ReLU(), nn.Linear(4097, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def fp8_mlp(num_classes: int = 10) -> nn.Module:
    """An MLP on 3x32x32 images whose hidden Linear layers have widths that are multiples of 16, so
    FP8 (torchao's Float8Linear) can train them; tiny_cnn has none."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


def dropout_mlp(num_classes: int = 10) -> nn.Module:
    """An MLP with dropout (0.5) between its layers, as transformers' models have it (0.1)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, num_classes))


def odd_widths(num_classes: int = 10) -> nn.Module:
    return _OddWidths(num_classes)


def marks_its_build(num_classes: int = 10) -> nn.Module:
    """tiny_cnn that leaves a file at $AUTOTUNE_TEST_MARKER when built: proves whether a probe ran."""
    marker = os.environ.get("AUTOTUNE_TEST_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write("built\n")
    return tiny_cnn(num_classes)


_BUILDS = 0


def leaves_state(num_classes: int = 10) -> nn.Module:
    """tiny_cnn whose build changes process-wide state (torch's threads, a module global) after
    noting what it found at $AUTOTUNE_TEST_MARKER ("PID BUILDS THREADS"): a worker that inherited
    an earlier worker's state would show it."""
    global _BUILDS
    marker = os.environ.get("AUTOTUNE_TEST_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()} {_BUILDS} {torch.get_num_threads()}\n")
    _BUILDS += 1
    torch.set_num_threads(1)
    return tiny_cnn(num_classes)


def hangs(num_classes: int = 10) -> nn.Module:
    """A build that never ends (a model waiting on something that never comes)."""
    import time

    time.sleep(3600)
    return tiny_cnn(num_classes)


# accuracy checks: models that are numerically broken on purpose ---------------------------------

def tiny_loss_cnn(num_classes: int = 10):
    """tiny_cnn with its loss scaled by 1e-6: the logit gradients (~1e-8) underflow in fp16
    (smallest subnormal 6e-8) unless a GradScaler scales them up; fp32 and bf16 keep them, and
    AdamW does not care about their size, so those train normally."""
    import autotune

    def loss_fn(out, y):
        return 1e-6 * nn.functional.cross_entropy(out, y)

    return autotune.Workload(model=tiny_cnn(num_classes), loss_fn=loss_fn, input_shape=(3, 32, 32),
                             num_classes=num_classes)


class _FastButBrokenUnderAutocast(nn.Module):
    """Logits offset by 2**16 in the head's bias: softmax ignores a common offset, so FP32 trains
    normally, but a bf16/fp16 head rounds logits to steps of 512 and learns nothing, unless
    fp32_layers keeps the head in FP32. FP32's forward sleeps 3 ms a sample, so the broken
    configurations are the fastest ones a search sees where the CPU's bf16 is fast. A CPU without
    native bf16 emulates it, and on a busy 2-core machine bf16 ran slower than FP32: no bf16
    configuration came near the frontier, none was checked, and a test whose premise is that the
    fastest one breaks training failed. With FAKE_FP32_SLOWER=K in the environment, FP32's forward
    sleeps K times what a bf16 forward took when the model was built instead (3 ms a sample at least):
    a training step is about three forwards in either precision, so K=6 makes FP32's step at least
    twice bf16's on any CPU, at the cost of slower FP32 runs."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)
        with torch.no_grad():
            self.net[-1].bias.fill_(2.0**16)
        slower = float(os.environ.get("FAKE_FP32_SLOWER") or 0)
        self.sleep_per_sample = max(0.003, slower * self._bf16_forward_per_sample_s() if slower else 0.0)

    def _bf16_forward_per_sample_s(self) -> float:
        import time

        x = torch.randn(8, 3, 32, 32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            self.net(x)  # the first call picks its kernels
            started = time.perf_counter()
            for _ in range(3):
                self.net(x)
        return (time.perf_counter() - started) / (3 * x.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            import time

            time.sleep(self.sleep_per_sample * x.shape[0])
        return self.net(x)


def broken_head_under_autocast(num_classes: int = 10) -> nn.Module:
    return _FastButBrokenUnderAutocast(num_classes)


# whole-search outcomes: models that fail every configuration ------------------------------------

class _Segfaults(nn.Module):
    """Dies of SIGSEGV in its forward, as a broken extension would."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import ctypes

        ctypes.string_at(0)  # reads address 0
        return self.net(x)


def segfaults(num_classes: int = 10) -> nn.Module:
    return _Segfaults(num_classes)


class _NanLoss(nn.Module):
    """Its output is NaN in every precision, FP32 included: the model is broken, not the knobs."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * float("nan")


def nan_loss(num_classes: int = 10) -> nn.Module:
    return _NanLoss(num_classes)


class _SlowToEvaluate(nn.Module):
    """Trains at a tiny CNN's speed plus a short sleep a step, but evaluates slowly: only the accuracy
    check evaluates (its held-out set, in eval mode), so the speed trials stay short while the check
    outlasts any short budget."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = tiny_cnn(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.02 if self.training else 1.0)
        return self.net(x)


def slow_check_cnn(num_classes: int = 10) -> nn.Module:
    return _SlowToEvaluate(num_classes)


# language models: SDPA attention and a vocabulary off a multiple of 64 -----------------------------

class TinyLM(nn.Module):
    """A one-block causal LM calling ``scaled_dot_product_attention``, its head tied to the token
    embedding (``head.weight is embed.weight``), as GPT-2's is."""

    def __init__(self, vocab_size: int = 1003, seq_len: int = 16, width: int = 32, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(seq_len, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's: a loss near log(vocab) at the start

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        x = self.embed(tokens) + self.pos(torch.arange(seq, device=tokens.device))
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attended.transpose(1, 2).reshape(batch, seq, -1)
        return self.head(self.norm(x + self.mlp(x)))


def tiny_lm(num_classes: int = 1003):
    """TinyLM as an autotune.Workload: random token sequences, next-token cross-entropy (``num_classes``
    is the CLI's; the vocabulary stays 1,003 so that it is off a multiple of 64)."""
    import autotune

    vocab, seq_len = 1003, 16

    def make_batch(batch_size: int, generator: torch.Generator):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return autotune.Workload(model=TinyLM(vocab, seq_len), make_batch=make_batch, loss_fn=loss_fn,
                             input_shape=(seq_len,), num_classes=vocab)
