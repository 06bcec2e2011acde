"""Token selection from logits: greedy at temperature 0, else sampling from softmax(logits / T)."""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[.., V] logits -> fp32 probabilities at ``temperature`` (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """[B, V] -> [B] int64. Temperature 0 is argmax; otherwise an exact draw from softmax(l / T).

    Draws with ``torch.multinomial`` and the given generator, so a seeded run is reproducible.
    """
    if temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = probs_from_logits(logits, temperature)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
