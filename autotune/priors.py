"""The search's priors: what a knob is expected to give, cost or hold before this search measures it.

One table, read by the planner (autotune.search.planner) and its proposers and models: the plain
recipe's neighbours (autotune.search.neighbours), the memory knobs (autotune.search.levers), the
memory model (autotune.search.memory), the cost of a trial (autotune.search.walls) and eager
screening (autotune.search.screening). Each row is one belief: the knob (an Optuna parameter, or the
quantity it is about), the knob's value it concerns, which quantity it gives, the number, what the
number means, and ``source``: the report under reports/ it was measured in, with the GPU it was
measured on. A row measured outside a report folder (a benchmark script's run), or not measured at
all (``means`` then says so), points at the section of reports/measurement-log.md that says where it
comes from. A search's own measurements replace these as it makes them: a prior is what the planner
goes by until then.

To change a belief, change its row and its source together; the tests check that every source
exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOG = "reports/measurement-log.md"
"""Where each measurement behind a row is told in full, and where the rows no run measured say why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Prior:
    """One belief of the search, and where it was measured."""

    knob: str
    """The Optuna parameter it is about ("compile.mode"), or the thing it is about where no parameter
    names it ("trial": any configuration)."""
    value: Any
    """The knob's value it concerns (a move's, a memory knob's); a pair (before, after) for one value
    against another; None for every value but the untuned one."""
    what: str
    """The quantity: "speed" (over the plain recipe's value of the knob), "compile cost" (seconds of a
    compile against a default-mode one's) and so on; the code looks a row up by (knob, value, what)."""
    prior: float
    means: str
    """What the number says, and how it was derived from the measurement."""
    source: str
    """The report it was measured in: a path under reports/ (a folder or a file)."""
    measured_on: str = ""
    """The GPU it was measured on; empty for a row no run measured."""


def _log(section: str) -> str:
    return f"{LOG}#{section}"


PRIORS: tuple[Prior, ...] = (
    # -- the one-knob moves and the memory knobs: speed over the plain recipe's value of the knob -----
    Prior(knob="vocab_padding.multiple", value=64, what="speed", prior=1.04,
          means="a vocabulary padded to a multiple of 64, eager: a share of the 1.27x eager GPT-2 ran with its "
                "Linear widths padded to 8", source="reports/gpt2-h200", measured_on="H200"),
    Prior(knob="vocab_padding.multiple", value=64, what="compiled speed", prior=0.99,
          means="the same where both sides compile: Inductor already pads a GEMM's odd dimension; GPT-2's compiled "
                "plain recipe measured 0.986-0.988x padded (1.012x in another verify)",
          source="reports/search-yield/h100-2b09a74", measured_on="H100"),
    Prior(knob="compile.mode", value="max-autotune-no-cudagraphs", what="speed", prior=1.02,
          means="Inductor's autotuned GEMM and Triton configurations: assumed, not measured",
          source=_log("assumed-priors")),
    Prior(knob="precision.mode", value="fp16", what="speed", prior=1.01,
          means="fp16 for bf16: fp16 beat bf16 for ResNet-50 at batch 1,024", source=_log("precision"),
          measured_on="H200"),
    Prior(knob="precision.mode", value="fp8", what="speed", prior=1.0,
          means="none: the planner's prior for fp8 is fp8_speed, from the model's sizes (the rows of "
                "'fp8 gemm speed' below)", source=_log("assumed-priors")),
    Prior(knob="streams.num_streams", value=2, what="speed", prior=1.0,
          means="none: the planner's prior for a side stream is streams_factor, from the copies the bar's "
                "profile measured ('copy overlap' below)", source=_log("assumed-priors")),
    Prior(knob="cuda_graphs.enabled", value=True, what="speed", prior=1.02,
          means="the whole step in one CUDA graph, no launch gaps: assumed, and bounded by the share of the "
                "step the GPU sat idle where a profile measured it", source=_log("assumed-priors")),
    Prior(knob="depthwise_conv.input_grad", value="flipped", what="speed", prior=1.07,
          means="ConvNeXt-T's compiled plain-recipe step: 1.072x at batch 256, 1.077x at 768; a model with fewer "
                "depthwise layers gains less, which its trial measures", source="reports/depthwise-h100",
          measured_on="H100"),
    Prior(knob="stem_conv.stem", value="space_to_depth", what="speed", prior=1.037,
          means="ResNet-50's compiled plain-recipe step at batch 1,024 with its stem padded to 8 channels; scaled "
                "by a model's stem share against 'measured stem share' (neighbours.stem_speed)",
          source="reports/stem-h100", measured_on="H100"),
    Prior(knob="compile.mode", value="reduce-overhead", what="speed", prior=1.02,
          means="compiled with CUDA graphs (cudagraph trees): assumed, bounded like a CUDA graph's",
          source=_log("assumed-priors")),
    Prior(knob="compile.mode", value="regional", what="speed", prior=0.77,
          means="each repeated block compiled once, against the whole-model compile: 0.96x on ViT-B/16, 0.61x "
                "on GPT-2", source="reports/search-yield/h200-3445a3e", measured_on="H200"),
    Prior(knob="llm_kernels.kernels", value="liger", what="speed", prior=1.05,
          means="liger's layer kernels: a modest share of the up to 20% its README claims for its kernels "
                "together on HF LLMs; a claim, not measured here", source=_log("assumed-priors")),
    Prior(knob="optimizer_state.state", value="8bit-bnb", what="speed", prior=0.72,
          means="bitsandbytes' 8-bit AdamW at the same batch, as a ratio, where the model's size is not known: "
                "the 1B Llama's compiled step at batch 4, 101.4 ms against fused AdamW's 73.5",
          source="reports/search-yield/h200-b092e42/llama-24gib-5m", measured_on="H200"),
    Prior(knob="optimizer_state.state", value="8bit", what="speed", prior=0.5,
          means="torchao's 8-bit AdamW: 122 ms a step on the 1B Llama's parameters against fused AdamW's 11, "
                "for a step of about 75 ms", source=_log("memory-knobs"), measured_on="H200"),
    Prior(knob="loss_kernel.kernel", value="fused_linear", what="speed", prior=0.92,
          means="liger's fused linear cross-entropy: fitted, with the checkpointing rows, to the two memory-knob "
                "trials of a 1B Llama search under 24 GiB", source="reports/search-yield/h200-3445a3e/llama-24gib-5m",
          measured_on="H200"),
    Prior(knob="activation_checkpointing.every", value=2, what="speed", prior=0.93,
          means="every 2nd block's forward recomputed in backward: fitted as the fused loss's row",
          source="reports/search-yield/h200-3445a3e/llama-24gib-5m", measured_on="H200"),
    Prior(knob="activation_checkpointing.every", value=1, what="speed", prior=0.85,
          means="every block's forward recomputed in backward: fitted as the fused loss's row",
          source="reports/search-yield/h200-3445a3e/llama-24gib-5m", measured_on="H200"),
    Prior(knob="allocator.expandable_segments", value=True, what="speed", prior=1.0,
          means="the same kernels on memory mapped as it is needed: assumed, not measured (a steady step maps "
                "no new pages)", source=_log("assumed-priors")),

    # -- the memory knobs: their cost a step and what they save -------------------------------------
    Prior(knob="optimizer_state.state", value="8bit-bnb", what="step seconds per parameter",
          prior=27.9e-3 / 1.2358e9,
          means="seconds bitsandbytes' 8-bit AdamW adds to every optimizer step, per parameter, whatever the "
                "batch: 27.9 ms for the 1B Llama's 1,235,814,400 parameters",
          source="reports/search-yield/h200-b092e42/llama-24gib-5m", measured_on="H200"),
    Prior(knob="optimizer_state.state", value="8bit", what="step seconds per parameter",
          prior=(122e-3 - 11e-3) / 1.2358e9,
          means="the same for torchao's 8-bit AdamW: 122 ms against fused AdamW's 11 on the 1B Llama",
          source=_log("memory-knobs"), measured_on="H200"),
    Prior(knob="optimizer_state.state", value=None, what="bytes saved per parameter", prior=5.97,
          means="AdamW's two FP32 states are 8 bytes a parameter, 8-bit ones 2.03 (the 1B Llama shape: 9.21 GiB "
                "against 2.34)", source=_log("memory-knobs"), measured_on="H200"),
    Prior(knob="loss_kernel.kernel", value="fused_linear", what="bytes saved per logit", prior=1.0,
          means="a compiled loss still holds the bf16 logits (0.98 GiB for 4 x 1,024 tokens of a 128,256 "
                "vocabulary), liger's fused linear cross-entropy 0.49 GiB: about one byte a logit",
          source=_log("memory-knobs"), measured_on="H200"),
    Prior(knob="activation_checkpointing.every", value=2, what="per-sample share", prior=0.43,
          means="share of a compiled sample's bytes kept with every 2nd block checkpointed (a sample also holds "
                "what lies outside the blocks: a 1B Llama's logits); 0.56 GiB against the plain recipe's 1.57",
          source="reports/search-yield/h200-3445a3e/llama-24gib-5m", measured_on="H200"),
    Prior(knob="activation_checkpointing.every", value=1, what="per-sample share", prior=0.17,
          means="the same with every block checkpointed: 0.14 GiB against 1.57 (rounded up)",
          source="reports/search-yield/h200-3445a3e/llama-24gib-5m", measured_on="H200"),

    # -- compiling: its gain, and what a compile costs ------------------------------------------------
    Prior(knob="compile.mode", value="default", what="speed over eager", prior=1.3,
          means="torch.compile's gain over eager before this search measured one: 1.12-1.20 for ResNet-50 in "
                "fp16, 1.44 in bf16, 1.6-2.2 for the language models", source="reports/resnet50-h200-compile",
          measured_on="H200"),
    Prior(knob="compile.mode", value=None, what="gain spread", prior=0.05,
          means="how much more compiling may give one configuration than another of the same precision and "
                "compile mode: the compiled-to-eager ratios of one search spread by 4.4% at most",
          source="reports/search-yield/h200-3445a3e/gpt2-5m", measured_on="H200"),
    Prior(knob="compile.mode", value="default", what="compile seconds", prior=60.0,
          means="a first compile's seconds before this run measured one, for a model of 'leaf modules' modules "
                "(ResNet-50 compiled in 58-66 s); scaled by a model's own count", source="reports/resnet50-h200-8m",
          measured_on="H200"),
    Prior(knob="compile.mode", value="default", what="leaf modules", prior=126,
          means="ResNet-50's leaf modules: the model 'compile seconds' was measured on",
          source="reports/resnet50-h200-8m", measured_on="H200"),
    Prior(knob="compile.mode", value="default", what="least compile seconds", prior=15.0,
          means="the least a first compile is expected to take, however few modules: assumed",
          source=_log("assumed-priors")),
    Prior(knob="compile.mode", value="max-autotune-no-cudagraphs", what="compile cost", prior=7.0,
          means="a compile's seconds against the default mode's: max-autotune benchmarks 17-21 kernel candidates "
                "for every convolution and matmul, 10-22 s each on ResNet-50. A lower bound: ResNet-50 at batch "
                "1024 was still compiling after 262 s, its default compile 41-48 s (6.4x beyond the eager "
                "trial's part), and a trial cut by the budget measures nothing; ViT-B/16 finished in 175 s against "
                "52.6 s (3.3x)", source="reports/warm-start-h100-e2adee6", measured_on="H100"),
    Prior(knob="compile.mode", value="max-autotune", what="compile cost", prior=7.0,
          means="as max-autotune-no-cudagraphs", source="reports/warm-start-h100-e2adee6", measured_on="H100"),
    Prior(knob="compile.mode", value="regional", what="compile cost", prior=0.4,
          means="one block compiled: a 24-layer LM took 13.6 s to its first two steps against 57.5 s for the "
                "whole model", source=_log("compile"), measured_on="H200"),
    Prior(knob="precision.mode", value="fp8", what="compile cost", prior=1.6,
          means="a compile's seconds in fp8 against bf16's: torchao's float8 traces a cast and a scale around "
                "every eligible Linear; a 12-layer causal LM measured 1.5-1.7x",
          source="reports/search-yield/h200-6b8b65c", measured_on="H200"),
    Prior(knob="compile.mode", value=None, what="cached compile share", prior=0.15,
          means="a compile loaded from Inductor's cache as a share of the cold compile it repeats (GPT-2: 3.7 s "
                "against 25.4; its regional compile 2.6 against 10.5)",
          source="reports/search-yield/h200-3445a3e/gpt2-5m", measured_on="H200"),
    Prior(knob="accuracy check", value="cuda", what="run set-up steps", prior=12,
          means="a parity run's build, a calibration's move of the weights and its first step (gradients kept or "
                "compared tensor by tensor), in steps of the run's own pace: the median of 14 runs of ResNet-50's "
                "and a 1B Llama's checks was 12 (6 to 34), their paces tenfold apart (the GPU's first calls, not "
                "the model, set it); planned without it, the Llama's checks took 78 s of a 45 s share",
          source="reports/warm-start-h100-e2adee6", measured_on="H100"),
    Prior(knob="accuracy check", value="cpu", what="run set-up steps", prior=1,
          means="the same on a 2-core CPU: ResNet-50's runs took 0.2-0.5 of a step (one step, rounded up)",
          source="reports/resnet50-cpu-10m"),
    Prior(knob="accuracy check", value="cuda", what="later check over its plan", prior=1.8,
          means="a configuration's check once the FP32 reference is trained, against the plan's figure for it (FP32's "
                "pace and set-up): the 1B Llama's recommendation (fp8 feed-forward layers, 8-bit Adam, every block "
                "recomputed) took 18.0 s against 10.2 planned, its first step 5.2 s where FP32's took 0.6 to 1.5; "
                "the plan counts a configuration's run, in the first verdict and in one later check, at this multiple "
                "(ResNet-50's later checks ran 5x their plan, but so did its first verdict: its pace at batch 16, not "
                "the configuration). Since GPU spare workers import Inductor ahead, that check took 11.3 s against 9.8 "
                "(reports/rows-h100-5dcdacb): the prior keeps the largest multiple seen",
          source="reports/warm-start-h100-6f4d128", measured_on="H100"),
    Prior(knob="accuracy check", value="cpu", what="later check over its plan", prior=1.2,
          means="the same on a CPU, where a configuration's kernels are not compiled on their first call: assumed",
          source=_log("assumed-priors")),
    Prior(knob="trial", value="cut", what="cost over its seconds", prior=2.0,
          means="a trial the budget cut after T seconds (its compile still going) costs at least 2T: the median "
                "total of a scale-free duration seen lasting T; not measured",
          source=_log("assumed-priors")),
    Prior(knob="trial", value=None, what="seconds", prior=10.0,
          means="a trial's seconds before any trial was measured (a compile's prior comes on top): assumed",
          source=_log("assumed-priors")),

    # -- precision ------------------------------------------------------------------------------------
    Prior(knob="precision.mode", value=("fp32", "16"), what="speed over", prior=2.0,
          means="16-bit autocast (fp16, bf16, fp8 alike) over FP32: the guides' 2x for AMP (ResNet-50 on an "
                "RTX 4090, 842 -> 1,882 img/s); not measured here", source=_log("precision")),
    Prior(knob="precision.mode", value=("tf32", "16"), what="speed over", prior=1.3,
          means="16-bit autocast over TF32: assumed", source=_log("precision")),
    Prior(knob="precision.mode", value=("fp32", "tf32"), what="speed over", prior=1.5,
          means="TF32 over FP32: assumed", source=_log("precision")),
    Prior(knob="precision.mode", value="fp8", what="gemm speed", prior=1.73,
          means="fp8's speed over bf16 on Linear layers of 'full width' and more, compiled: a 2-layer Llama of "
                "hidden size 4,096 (80% of its parameters in such layers) ran 1.51x bf16 at batch 64, 1.73x on "
                "that share by Amdahl's law", source="reports/llama-fp8-h200", measured_on="H200"),
    Prior(knob="precision.mode", value="fp8", what="full width", prior=4096,
          means="the layer width from which fp8's matmuls give 'gemm speed'", source="reports/llama-fp8-h200",
          measured_on="H200"),
    Prior(knob="precision.mode", value="fp8", what="narrow gemm speed", prior=0.744,
          means="fp8's speed over bf16 on the eligible layers of a narrow model, compiled: ConvNeXt-T (90.5% of "
                "its parameters in layers of mean width 585) ran 0.76x bf16, 0.744x on that share: float8's "
                "casts and scales cost about the same per element whatever the width",
          source="reports/search-yield/h100-b9cc902/convnext_tiny-16gib-5m", measured_on="H100"),
    Prior(knob="precision.mode", value="fp8", what="narrow width", prior=585,
          means="the width 'narrow gemm speed' was measured at",
          source="reports/search-yield/h100-b9cc902/convnext_tiny-16gib-5m", measured_on="H100"),
    Prior(knob="precision.mode", value="fp8", what="knee width", prior=2048,
          means="from this width up fp8's gain is on the line to 'gemm speed' at 'full width'; below it, on the "
                "line down to 'narrow gemm speed': the 1B Llama (width 2,006) ran fp8 about 1.38x its bf16 twin, "
                "the upper line's value", source="reports/search-yield/h100-de94c74/llama-24gib-6m",
          measured_on="H100"),

    # -- the batch ------------------------------------------------------------------------------------
    Prior(knob="batch_size.batch_size", value="samples", what="half-speed batch", prior=16,
          means="the batch at which a step runs at half its large-batch throughput (samples/s at batch b taken "
                "as b / (b + half)): 16 images gives ResNet-50's 256 -> 512 about 3%", source=_log("batch"),
          measured_on="H200"),
    Prior(knob="batch_size.batch_size", value="tokens", what="half-speed batch", prior=1024,
          means="the same for a language model, in tokens (one sequence of GPT-2's): a 1B Llama's batch "
                "1 -> 2 about 33% (the hand-written loop under 24 GiB: 34,656 tokens/s at 1, 45,784 at 2)",
          source="reports/search-yield/h200-plain-recipe", measured_on="H200"),

    # -- what a profile bounds ------------------------------------------------------------------------
    Prior(knob="stem_conv.stem", value="space_to_depth", what="measured stem share", prior=0.0289,
          means="the stem's share of the multiply-adds (strategies.stem_conv.stem_share) of the model the stem's "
                "'speed' row was measured on (torchvision's ResNet-50 at 224x224)", source="reports/stem-h100",
          measured_on="H100"),
    Prior(knob="streams.num_streams", value=2, what="copy overlap", prior=0.82,
          means="the share of a step's host-to-device copy time a side stream hides under compute: ResNet-50's "
                "fp16 eager trials with 2 streams overlapped 74% at batch 256, 90% at 1,024 (copy_overlap)",
          source="reports/search-yield/h200-b092e42/resnet50-5m", measured_on="H200"),

    # -- memory ---------------------------------------------------------------------------------------
    Prior(knob="precision.mode", value="fp32", what="activation factor", prior=2.0,
          means="how much more a sample holds in FP32 than under the probed 16-bit autocast: its activations "
                "are twice bf16's (the fixed part is the same in every mode)", source=_log("memory-model")),
    Prior(knob="precision.mode", value="tf32", what="activation factor", prior=2.0,
          means="as FP32's", source=_log("memory-model")),
    Prior(knob="compile.mode", value=None, what="compiled sample share", prior=0.65,
          means="a compiled step's bytes per sample as a share of the eager step's the memory probe measured: "
                "the 1B Llama's compiled hand-written loop held 1.57 GiB a sample, its eager forward 2.48 (0.63); "
                "GPT-2's about 0.45", source="reports/search-yield/h100-b1bcd84/llama-24gib-6m", measured_on="H100"),
    Prior(knob="optimizer.implementation", value="foreach", what="bytes per parameter", prior=4.0,
          means="what a foreach Adam/AdamW step allocates a parameter and a fused one does not: a new FP32 "
                "tensor (torch._foreach_sqrt of the second moments)", source=_log("memory-model"),
          measured_on="H200"),
    Prior(knob="allocator.expandable_segments", value=True, what="gap slack", prior=0.05,
          means="what expandable segments leave reserved above the allocated peak, as a share of it (2 MiB "
                "pages, a pool per stream, freed blocks kept mapped): assumed; how far the gap closes is not "
                "measured", source=_log("assumed-priors")),
)
"""Every prior of the search, by topic."""

_BY_KEY: dict[tuple[str, Any, str], Prior] = {(p.knob, p.value, p.what): p for p in PRIORS}
assert len(_BY_KEY) == len(PRIORS), "two priors share a (knob, value, what)"

_MISSING = object()


def prior(knob: str, value: Any, what: str, default: Any = _MISSING) -> float:
    """The prior of ``knob`` at ``value`` for the quantity ``what``; ``default`` where the table has none
    (a KeyError without one)."""
    row = _BY_KEY.get((knob, value, what))
    if row is not None:
        return row.prior
    if default is _MISSING:
        raise KeyError(f"no prior for {knob}={value!r} ({what}) in autotune.priors.PRIORS")
    return default


def table(what: str) -> dict[tuple[str, Any], float]:
    """(knob, value) -> prior of every row of the quantity ``what``, in the table's order."""
    return {(p.knob, p.value): p.prior for p in PRIORS if p.what == what}


def values(knob: str, what: str) -> dict[Any, float]:
    """value -> prior of ``knob``'s rows of the quantity ``what``, in the table's order."""
    return {p.value: p.prior for p in PRIORS if p.knob == knob and p.what == what}
