"""How a family samples its policies' completions: one argument group for every family (``sampling:`` in configs)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Sampling"]


@dataclass(frozen=True)
class Sampling:
    """Temperature, nucleus and length of the sampled completions a family trains on.

    Each family gives its own default; a config overrides single fields (``--model.init_args.sampling.top_p 0.9``).

    Attributes:
        temperature: Softmax temperature of sampling and of the log-probabilities (> 0).
        top_p: Nucleus mass in (0, 1].
        max_new_tokens: Tokens per sampled completion (≥ 1).
        min_new_tokens: Tokens generated before EOS is allowed (0: none).

    Raises:
        ValueError: for a value out of range, naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bound = f"[0, max_new_tokens={self.max_new_tokens}]"
            raise ValueError(f"sampling.min_new_tokens must be in {bound}, got {self.min_new_tokens}")
