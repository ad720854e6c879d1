"""What one sample of a workload is, and the rates derived from samples/s: a language model's
sample is a sequence of ``tokens_per_sample`` tokens, so its tokens/s is samples/s times that.

samples/s stays the search's objective; tokens/s is shown next to it wherever samples/s is shown
for a language model (terminal, report, trials.csv, config.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ATTR = "units"
"""The study's user attribute (and config.json's key) holding Units.to_dict()."""


@dataclass(frozen=True)
class Units:
    """A workload's sample unit and, for token sequences, the tokens in one sample."""

    sample_unit: str = "sample"
    tokens_per_sample: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Units":
        """From a probe's result, a study's attribute or config.json; None (a search made before
        units were recorded): plain samples."""
        data = data or {}
        tokens = data.get("tokens_per_sample")
        return cls(sample_unit=str(data.get("sample_unit") or "sample"),
                   tokens_per_sample=int(tokens) if tokens else None)

    def to_dict(self) -> dict[str, Any]:
        return {"sample_unit": self.sample_unit, "tokens_per_sample": self.tokens_per_sample}

    @property
    def has_tokens(self) -> bool:
        return self.tokens_per_sample is not None

    def tokens_per_s(self, samples_per_s: Any) -> float | None:
        """samples/s times the tokens in a sample; None without tokens or without a rate."""
        if not self.has_tokens or samples_per_s is None:
            return None
        try:
            rate = float(samples_per_s)
        except (TypeError, ValueError):
            return None
        return None if rate != rate else rate * self.tokens_per_sample  # NaN: a trial without a rate

    def with_tokens(self, figures: dict[str, Any]) -> dict[str, Any]:
        """A copy of a trial's figures with tokens_per_s added when the samples are token sequences."""
        rate = self.tokens_per_s(figures.get("samples_per_s"))
        return figures if rate is None else {**figures, "tokens_per_s": rate}
