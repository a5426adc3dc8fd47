r"""A byte-level BPE tokenizer trained on the generated arithmetic task, digits one per token (2.8 times shorter)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from alignment_games.modules.algorithms.arithmetic import generate_problems, make_think_response
from alignment_games.modules.algorithms.checks import require_at_least
from alignment_games.modules.lm.models import SPECIAL_TOKENS, with_specials

# problems of the corpus: a seed no datamodule uses, so the tokenizer sees none of the held-out questions
CORPUS_SEED = 4_000_037


def task_corpus(num_problems: int = 5000, seed: int = CORPUS_SEED, max_steps: int = 6) -> list[str]:
    """Chat-rendered questions and think-style solutions of generated problems with 1 to ``max_steps`` operations.

    Raises:
        ValueError: for ``num_problems`` below 1 or ``max_steps`` below 1.
    """
    require_at_least(num_problems=(num_problems, 1))
    problems = generate_problems(num_problems, seed, 1, max_steps)
    chat = "system\nYou are a helpful assistant.\nuser\n{}\nassistant\n"
    return [t for p in problems for t in (chat.format(p.question), make_think_response(p))]


def build_task_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 768) -> Any:
    """Train a byte-level BPE on ``texts`` (default :func:`task_corpus`) with digits kept one per token.

    Args:
        texts: Training text; ``None``: :func:`task_corpus` with its defaults (deterministic).
        vocab_size: Entries in all: the 4 specials, the 256 byte symbols and the learnt merges.

    Raises:
        ValueError: for ``vocab_size`` below 260 (the specials and the byte alphabet).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    require_at_least(vocab_size=(vocab_size, len(SPECIAL_TOKENS) + len(alphabet)))
    core = Tokenizer(models.BPE(unk_token=None))
    # digits split first, one per piece, so no merge can join them; then GPT-2's byte-level word split
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator(task_corpus() if texts is None else texts, trainer=trainer)
    return with_specials(core)
