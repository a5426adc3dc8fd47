"""The multi-LLM pool's peer judges: a pool member scores one response 1–10, parsed or read off its distribution."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from alignment_games.modules.algorithms.checks import require_at_least, require_positive
from alignment_games.modules.algorithms.exp3 import SCORE_MAX, SCORE_MIN
from alignment_games.modules.algorithms.pool import (
    DEFAULT_JUDGE_TEMPLATE,
    DEFAULT_SCORE,
    agreement_score,
    fill_judge_template,
    final_answer,
    parse_judgement,
)
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.lm.text import pad_sequences
from alignment_games.modules.scorers.quoting import fit_judged, quote_judged

MODES = ("generate", "constrained", "solve", "reference")


@dataclass(frozen=True)
class PeerJudging:
    """How a pool member judges a response: the prompt it reads and how its 1–10 score is read off.

    Attributes:
        template: Judge prompt with ``{prompt}`` and ``{response}`` (App. G's by default).
        mode: ``"generate"`` (greedy answer parsed: JSON, regex, else 5.0, counted), ``"constrained"`` (the mean of
            the judge's distribution over the ten answers, for models too small to write JSON), ``"solve"`` (the judge
            solves the question and scores agreement with its answers) or ``"reference"`` (10 when the final answer
            matches the reference, else 1); the last two use no template or prefill.
        prefill: Text the judge's answer is started with (e.g. ``{"score": ``), also prepended before parsing.
        max_new_tokens: Tokens per generated judgement (per solution under ``solve``).
        samples: Solutions a ``solve`` judge writes per question (1: greedy; more are sampled and grade the score).
        temperature: Sampling temperature of a ``solve`` judge's solutions when ``samples`` > 1.

    Raises:
        ValueError: for an unknown mode, a template without both fields, or a non-positive count or temperature.
    """

    template: str = DEFAULT_JUDGE_TEMPLATE
    mode: str = "generate"
    prefill: str = ""
    max_new_tokens: int = 32
    samples: int = 1
    temperature: float = 0.7

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"judging.mode must be one of {MODES}, got {self.mode!r}")
        if "{prompt}" not in self.template or "{response}" not in self.template:
            raise ValueError("judging.template must contain {prompt} and {response}")
        require_at_least(**{"judging.max_new_tokens": (self.max_new_tokens, 1), "judging.samples": (self.samples, 1)})
        require_positive(**{"judging.temperature": self.temperature})

    @property
    def sampling(self) -> Sampling:
        """The judge's decode: ``max_new_tokens``, and ``temperature`` where sampled (``solve``, ``samples`` > 1)."""
        return Sampling(self.temperature, max_new_tokens=self.max_new_tokens)

    def user_message(self, instruction: str, response: str, special_tokens: Iterable[str] = ()) -> str:
        """The judge's user message for one (instruction, response), both quoted (:func:`quote_judged`)."""
        question = quote_judged(instruction, special_tokens) or "(empty)"
        return fill_judge_template(self.template, question, quote_judged(response, special_tokens) or "(empty)")

    def prompt(self, bank: PolicyBank, chat: Callable[[str], str], instruction: str, response: str) -> str:
        """``chat(user_message) + prefill``, only the response cut to ``bank.max_prompt_tokens`` (or warned)."""
        specials, budget = bank.tokenizer.all_special_tokens, bank.max_prompt_tokens
        render = lambda spans: chat(self.user_message(instruction, spans[0], specials)) + self.prefill  # noqa: E731
        # not strict: the players' budget too, where one too small for the template keeps the encoder's left cut
        return fit_judged(bank.tokenizer, render, [response], budget, "lm.max_prompt_tokens", strict=False)[0]


def encode_texts(
    bank: PolicyBank, prompts: Sequence[str], completions: Sequence[str], eos: bool = True, group_size: int = 1
) -> Rollout:
    """A :class:`Rollout` of given texts (EOS appended unless ``eos=False``), groups of ``group_size`` sharing a prompt.

    Raises:
        ValueError: when the rows do not come in groups of ``group_size`` with one prompt each.
    """
    if group_size > 1 and (
        len(prompts) % group_size or any(prompts[i] != prompts[i - i % group_size] for i in range(len(prompts)))
    ):
        raise ValueError(f"encode: the {len(prompts)} rows are not groups of {group_size} sharing one prompt")
    tok, enc, device = bank.tokenizer, bank.encode_prompts(prompts), next(bank.parameters()).device
    ids = [s + [tok.eos_token_id] * eos for s in tok(list(completions), add_special_tokens=False)["input_ids"]]
    comp = pad_sequences([s or [tok.pad_token_id] for s in ids], tok.pad_token_id)  # at least one column
    mask = comp["attention_mask"] * torch.tensor([[int(bool(s))] for s in ids], dtype=torch.long)
    seq = torch.cat([enc["input_ids"], comp["input_ids"]], dim=1).to(device)
    att = torch.cat([enc["attention_mask"], mask], dim=1).to(device)
    return Rollout(seq, att, enc["input_ids"].shape[1], mask.to(device), list(completions), group_size)


def peer_scores(bank: PolicyBank, judge: str, prompts: Sequence[str], judging: PeerJudging) -> list[tuple[float, bool]]:
    """Player ``judge``'s score in [1, 10] of each judge prompt, and whether it was read."""
    if not prompts:
        return []
    if judging.mode == "constrained":
        scores = _constrained(bank, judge, prompts, judging.prefill)
        return [(s, True) if math.isfinite(s) else (DEFAULT_SCORE, False) for s in scores]
    out = bank.generate(judge, list(prompts), 1, judging.sampling, greedy=True)
    return [(x.score, x.ok) for x in (parse_judgement(judging.prefill + t) for t in out.texts)]


def peer_scores_each(
    bank: PolicyBank, requests: Sequence[tuple[str, Sequence[str]]], judging: PeerJudging
) -> list[list[tuple[float, bool]]]:
    """:func:`peer_scores` of each ``(judge, prompts)`` request, generated judgements decoded in one batch."""
    if judging.mode != "generate":
        return [peer_scores(bank, judge, prompts, judging) for judge, prompts in requests]
    live = [(judge, list(prompts)) for judge, prompts in requests if prompts]
    outs = iter(bank.generate_each(live, 1, judging.sampling, greedy=True) if live else [])
    return [
        [(x.score, x.ok) for x in (parse_judgement(judging.prefill + t) for t in next(outs).texts)] if prompts else []
        for _, prompts in requests
    ]


def judge_prompts(
    bank: PolicyBank,
    chat: Callable[[str, str | None], str],
    instructions: Sequence[str],
    responses: Sequence[str],
    judging: PeerJudging,
) -> list[str]:
    """The judge prompt of each (instruction, response) (:meth:`PeerJudging.prompt`, without a system message)."""
    return [judging.prompt(bank, lambda user: chat(user, None), x, y) for x, y in zip(instructions, responses)]


def member_scores(
    bank: PolicyBank,
    judge: str,
    chat: Callable[[str, str | None], str],
    instructions: Sequence[str],
    responses: Sequence[str],
    judging: PeerJudging,
    system_prompt: str | None = None,
    references: Sequence[str | None] | None = None,
) -> list[tuple[float, bool]]:
    """Pool member ``judge``'s score in [1, 10] of each (instruction, response), and whether it was read.

    ``chat(user, system)`` formats the judge's prompt; ``system_prompt`` is the players' (a ``solve`` judge answers as a
    player does); ``references`` are needed in ``reference`` mode only.

    Raises:
        ValueError: in ``reference`` mode, naming the first instruction without a reference answer.
    """
    if judging.mode == "reference":
        if missing := [i for i, r in enumerate(references or [None] * len(instructions)) if r is None]:
            raise ValueError(
                f"judging.mode reference: instruction {missing[0]} ({instructions[missing[0]][:60]!r}) has no "
                "reference answer (data: reference_column)"
            )
        return [agreement_score(final_answer(y), [str(r)]) for y, r in zip(responses, references)]
    if judging.mode == "solve":
        questions = [chat(x, system_prompt) for x in instructions]
        return solve_scores(bank, judge, questions, responses, judging)
    return peer_scores(bank, judge, judge_prompts(bank, chat, instructions, responses, judging), judging)


def solve_scores(
    bank: PolicyBank, judge: str, questions: Sequence[str], responses: Sequence[str], judging: PeerJudging
) -> list[tuple[float, bool]]:
    """A ``solve`` judge's score of each response (:func:`agreement_score`), each distinct question solved once."""
    if len(questions) != len(responses):
        raise ValueError(f"solve_scores: {len(questions)} questions for {len(responses)} responses")
    if not questions:
        return []
    distinct, k = list(dict.fromkeys(questions)), judging.samples
    out = bank.generate(judge, distinct, k, judging.sampling, greedy=k == 1)
    own = {q: [final_answer(t) for t in out.texts[i * k : (i + 1) * k]] for i, q in enumerate(distinct)}
    return [agreement_score(final_answer(r), own[q]) for q, r in zip(questions, responses)]


@torch.no_grad()
def _constrained(bank: PolicyBank, judge: str, prompts: Sequence[str], prefill: str) -> list[float]:
    """Mean score under the judge's distribution over ``1`` … ``10``, each closed by ``}`` (JSON prefill) or EOS."""
    close = "}" if "{" in prefill else ""
    values = list(range(int(SCORE_MIN), int(SCORE_MAX) + 1))
    rows_p, rows_c = [p for p in prompts for _ in values], [f"{v}{close}" for _ in prompts for v in values]
    rollout = encode_texts(bank, rows_p, rows_c, eos=not close, group_size=len(values))
    lp = bank.logprobs(judge, rollout, temperature=1.0).view(len(prompts), len(values))
    probs = torch.softmax(lp.double(), dim=1)
    return (probs @ torch.tensor(values, dtype=torch.float64, device=probs.device)).tolist()
