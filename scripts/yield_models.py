"""The two workloads of scripts/search_yield.py that torchvision does not have, importable as
``--model yield_models:NAME`` with scripts/ on PYTHONPATH (search_yield.py puts it there):

- ``gpt_lm``: a GPT-style causal language model (token inputs, a 50,257-token vocabulary as GPT-2's,
  6 layers, d_model 512, 8 heads, sequences of 256 tokens), attention through
  ``torch.nn.functional.scaled_dot_product_attention``, trained on next-token cross-entropy;
  returned as an :class:`autotune.Workload` since its inputs are token ids, not images.
- ``odd_mlp``: an MLP whose widths are not multiples of 8 (1000 -> 3001 -> 2999 -> 1000 classes),
  where Tensor Cores need padding (the ``channel_alignment`` knob).

``gpt_lm_tiny`` and ``odd_mlp_tiny`` are the same architectures small enough for a 2-core CPU
(tests, and the CPU example in reports/search-yield). ``--model`` calls a factory with
``num_classes`` at most, so sizes are fixed per factory rather than passed as arguments.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary: odd, so the head's width is misaligned for Tensor Cores


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (the class name says "Attention", which is how the
    ``fp32_layers`` knob finds attention layers)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        assert d_model % num_heads == 0, "d_model must divide into the heads"
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each around a residual."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``num_layers`` blocks, a final LayerNorm and the vocabulary
    head (the model's last ``nn.Linear``: the ``fp32_layers`` head). The head is not tied to the
    token embedding, so padding the head's width never touches the embedding."""

    def __init__(self, *, vocab_size: int, seq_len: int, d_model: int, num_layers: int, num_heads: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # GPT-2's initialisation: a trainable start, so the accuracy check's loss curve means something
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position: (batch, seq, vocab) logits, (batch, seq) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _lm_workload(*, vocab_size: int, seq_len: int, d_model: int, num_layers: int, num_heads: int):
    import autotune

    model = GPT(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, num_layers=num_layers, num_heads=num_heads)

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # one random sequence of seq_len + 1 tokens per sample: inputs and the same shifted by one
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    # a sample is a sequence of seq_len tokens: the search reports tokens/s next to samples/s
    return autotune.Workload(model=model, make_batch=make_batch, loss_fn=lm_loss, input_shape=(seq_len,),
                             num_classes=vocab_size, sample_unit="sequence", tokens_per_sample=seq_len)


def gpt_lm():
    """GPT-style LM: vocabulary 50,257, 6 layers, d_model 512, 8 heads, 256 tokens (about 70M parameters)."""
    return _lm_workload(vocab_size=GPT2_VOCAB, seq_len=256, d_model=512, num_layers=6, num_heads=8)


def gpt_lm_tiny():
    """The same architecture for a CPU: vocabulary 1,003 (odd, so the head is still misaligned),
    2 layers, d_model 64, 4 heads, 32 tokens."""
    return _lm_workload(vocab_size=1003, seq_len=32, d_model=64, num_layers=2, num_heads=4)


def _mlp(widths: list[int], num_classes: int):
    import autotune

    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], num_classes))
    return autotune.Workload(model=nn.Sequential(*layers), input_shape=(widths[0],), num_classes=num_classes)


def odd_mlp(num_classes: int = 1000):
    """MLP 1000 -> 3001 -> 2999 -> num_classes (1000 by default): no width a multiple of 8 but the ends."""
    return _mlp([1000, 3001, 2999], num_classes)


def odd_mlp_tiny():
    """MLP 100 -> 301 -> 299 -> 10 classes, for a CPU (no ``num_classes`` argument: the CLI's
    default of 1000 would make the head the largest layer)."""
    return _mlp([100, 301, 299], 10)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # autotune, from a checkout
    for factory in (gpt_lm, gpt_lm_tiny, odd_mlp, odd_mlp_tiny):
        made = factory()
        print(f"{factory.__name__}: {num_parameters(made.model) / 1e6:.1f}M parameters, "
              f"input {made.input_shape}, {made.num_classes} classes, {math.prod(made.input_shape)} values a sample")
