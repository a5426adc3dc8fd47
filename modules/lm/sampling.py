"""How a family samples its policies' completions: one argument group for every family (``sampling:`` in configs)."""

from __future__ import annotations

from dataclasses import dataclass

from alignment_games.modules.algorithms.checks import require_at_least, require_in_range, require_positive


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
        require_positive(**{"sampling.temperature": self.temperature})
        require_in_range("sampling.top_p", self.top_p, 0, 1, open_low=True)
        require_at_least(**{"sampling.max_new_tokens": (self.max_new_tokens, 1)})
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bound = f"[0, max_new_tokens={self.max_new_tokens}]"
            raise ValueError(f"sampling.min_new_tokens must be in {bound}, got {self.min_new_tokens}")

    def check_fits(self, prompt_tokens: int, max_positions: int | None, model: str) -> None:
        """Refuse a decode whose longest prompt plus ``max_new_tokens`` passes the model's positions.

        Rotary models run on past ``max_position_embeddings`` without a word, into positions they never trained on.

        Raises:
            ValueError: naming ``sampling.max_new_tokens``, the prompt tokens and ``max_position_embeddings``.
        """
        if max_positions is not None and prompt_tokens + self.max_new_tokens > max_positions:
            raise ValueError(
                f"sampling.max_new_tokens={self.max_new_tokens} + {prompt_tokens} prompt tokens (the longest prompt, "
                f"after lm.max_prompt_tokens) = {prompt_tokens + self.max_new_tokens} passes the "
                f"max_position_embeddings={max_positions} of {model}; lower sampling.max_new_tokens or "
                "lm.max_prompt_tokens"
            )
