"""Synthetic preference oracles: label any triplet (x, y, y′) as the paper's gold oracle does (App. E.1, §5.3.2)."""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.algorithms.checks import require_at_least
from alignment_games.modules.scorers.quoting import fit_judged, quote_judged
from alignment_games.modules.scorers.remote import RemoteClient
from alignment_games.modules.training.faults import call_with_timeout

_COUNTERS = ("invalid_verdicts", "timeouts", "unlabelled_rows")
_EQUATION = re.compile(r"(-?\d+)\s*([+\-*×x])\s*(-?\d+)\s*=\s*(-?\d+)")


def _check_lengths(**seqs: Sequence) -> int:
    lengths = {k: len(v) for k, v in seqs.items() if v is not None}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"oracle inputs must have equal lengths, got {lengths}")
    return next(iter(lengths.values()), 0)


def sampling_state(
    count_name: str, count: int, seed: int, timeout_s: float | None
) -> tuple[float | None, torch.Generator]:
    """The checked time limit and the seeded generator of an oracle or judge that samples ``count`` verdicts a row.

    Raises:
        ValueError: naming ``count_name`` when ``count`` < 1, or ``timeout_s`` unless positive and finite or ``None``.
    """
    require_at_least(**{count_name: (count, 1)})
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    return (None if timeout_s is None else float(timeout_s)), torch.Generator().manual_seed(seed)


def check_placeholders(template: str, keys: Sequence[str]) -> None:
    """Raise a ``ValueError`` naming the first of ``keys`` (such as ``"{prompt}"``) missing from a judge template."""
    if (missing := next((key for key in keys if key not in template), None)) is not None:
        raise ValueError(f"judge template must contain {missing}")


def load_frozen_causal_lm(
    model: str, dtype: str, trust_remote_code: bool, load_in_4bit: bool = False
) -> tuple[Any, Any]:
    """``(tokenizer, model)`` of a frozen causal-LM judge: left padding, no gradients (``"auto"``: bf16 on CUDA)."""
    from alignment_games.modules.lm.models import load_model, load_tokenizer

    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code, padding_side="left")
    lm = load_model(
        model, task="causal_lm", dtype=dtype, trust_remote_code=trust_remote_code, load_in_4bit=load_in_4bit
    ).eval()
    lm.requires_grad_(False)
    return tokenizer, lm


class PreferenceOracle(ABC):
    """A source of preference verdicts.

    Args:
        num_queries: Order-randomised queries per label: 1 is a binary label (training data, App. E.1); §5.3.2 uses 11.
        seed: Seed of the order randomisation and of the verdict sampling (and of a remote judge's requests).
        timeout_s: Seconds one ``first_wins_probability`` call may take (``None``: no limit; late verdicts are invalid).

    Attributes:
        invalid_verdicts: Verdicts that were not a probability, left out of the labels.
        timeouts: Verdicts abandoned because their call came too late, left out as well.
        unlabelled_rows: Rows of which no query gave a valid verdict: their label is NaN.
        last_rows: The same three counts per row of the latest :meth:`label` call (to count items once across ranks).
    """

    def __init__(self, num_queries: int = 1, seed: int = 0, timeout_s: float | None = None) -> None:
        self.num_queries = num_queries
        self.timeout_s, self.generator = sampling_state("num_queries", num_queries, seed, timeout_s)
        self.invalid_verdicts = self.timeouts = self.unlabelled_rows = 0
        self.last_rows: dict[str, Tensor] = {}

    @abstractmethod
    def first_wins_probability(
        self, prompts: Sequence[str], firsts: Sequence[str], seconds: Sequence[str], references: Sequence[str] | None
    ) -> Tensor:
        """Probability that the response shown first is judged better, one per row (float64)."""

    def label(
        self,
        prompts: Sequence[str],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        references: Sequence[str] | None = None,
    ) -> Tensor:
        """Mean of the valid a ≻ b verdicts of ``num_queries`` order-randomised queries (§5.3.2); else NaN, counted."""
        n = _check_lengths(prompts=prompts, responses_a=responses_a, responses_b=responses_b, references=references)
        wins, valid, late_queries = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), 0
        for _ in range(self.num_queries):
            swap = torch.rand(n, generator=self.generator) < 0.5
            pairs = [(b, a) if s else (a, b) for a, b, s in zip(responses_a, responses_b, swap.tolist())]
            firsts, seconds = [p[0] for p in pairs], [p[1] for p in pairs]
            p_first, late = call_with_timeout(
                self.first_wins_probability, self.timeout_s, prompts, firsts, seconds, references
            )
            if late:
                self.timeouts += n
                late_queries += 1
                p_first, ok = torch.full((n,), 0.5, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)
            else:
                p_first, ok = self._checked(p_first, n)
            # drawn for every row, valid or not, so that an invalid verdict leaves the other rows' draws unchanged
            first_wins = torch.rand(n, generator=self.generator, dtype=torch.float64) < p_first
            wins += (torch.where(swap, ~first_wins, first_wins) & ok).double()
            valid += ok.double()
        unlabelled = valid == 0
        self.unlabelled_rows += int(unlabelled.sum())
        self.last_rows = {
            "invalid_verdicts": self.num_queries - late_queries - valid.long(),
            "timeouts": torch.full((n,), late_queries, dtype=torch.long),
            "unlabelled_rows": unlabelled.long(),
        }
        return torch.where(unlabelled, torch.full_like(wins, math.nan), wins / valid.clamp(min=1.0))

    def _checked(self, p_first: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The verdicts and which are valid; an invalid one is counted and replaced by ½ for the sampling only."""
        p_first = torch.as_tensor(p_first, dtype=torch.float64).reshape(-1)
        if p_first.numel() != n:
            raise ValueError(f"{type(self).__name__} returned {p_first.numel()} verdicts for {n} rows")
        bad = ~torch.isfinite(p_first) | (p_first < 0) | (p_first > 1)
        self.invalid_verdicts += int(bad.sum())
        # ½ keeps the sampling defined; a NaN would silently award the comparison to the response shown second
        return torch.where(bad, torch.full_like(p_first, 0.5), p_first), ~bad

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator and the counters, for a checkpoint (tensors and ints: ``weights_only`` loadable)."""
        return {"generator": self.generator.get_state(), **self._counts()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, so a resumed run draws and counts as the uninterrupted one.

        Raises:
            KeyError: naming the entry ``state`` lacks.
        """
        if (missing := next((k for k in ("generator", *_COUNTERS) if k not in state), None)) is not None:
            raise KeyError(f"oracle state lacks {missing!r}")
        self.generator.set_state(state["generator"])
        for key in _COUNTERS:
            setattr(self, key, int(state[key]))

    @property
    def protocol(self) -> str:
        """How a label is made: ``"binary"`` (one verdict, the paper's training labels) or ``"query_mean"`` (§5.3.2)."""
        return "binary" if self.num_queries == 1 else "query_mean"

    def summary(self) -> dict[str, Any]:
        """What a report says of this oracle: its class, label protocol, queries per label and what was left out."""
        head = {"oracle": type(self).__name__, "protocol": self.protocol, "num_queries": self.num_queries}
        return {**head, **self._counts()}

    def _counts(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in _COUNTERS}


def solution_score(
    response: str,
    reference: str | None,
    reference_words: int | None = None,
    w_final: float = 2.0,
    w_steps: float = 1.0,
    w_missing: float = 0.5,
    w_length: float = 2.0,
) -> float:
    """Quality score of a worked math solution, the programmatic oracle's notion of better.

    ``w_final·[answer correct] + w_steps·(share of equations a∘b=c that hold, 1 without any) − w_missing·[no boxed
    answer] − w_length·(words beyond reference_words)/100``.
    """
    final = extract_final_answer(response)
    correct = final is not None and reference is not None and answers_match(final, reference)
    eqs = [(int(a), op, int(b), int(c)) for a, op, b, c in _EQUATION.findall(response)]
    ok = sum((a + b if op == "+" else a - b if op == "-" else a * b) == c for a, op, b, c in eqs)
    step_share = ok / len(eqs) if eqs else 1.0
    extra = max(0, len(response.split()) - reference_words) if reference_words is not None else 0
    return w_final * correct + w_steps * step_share - w_missing * (final is None) - w_length * extra / 100.0


class ProgrammaticOracle(PreferenceOracle):
    """Offline oracle for checkable math answers: ``P*(y≻y′) = σ(β (s(y) − s(y′)))`` with :func:`solution_score`.

    Args:
        beta: Inverse temperature of P*; larger is a more decisive oracle.
        **oracle: :class:`PreferenceOracle`'s arguments (``num_queries``, ``seed``, ``timeout_s``).
    """

    def __init__(self, beta: float = 10.0, **oracle: Any) -> None:
        super().__init__(**oracle)
        if not math.isfinite(beta) or beta <= 0:
            raise ValueError(f"beta must be positive and finite, got {beta}")
        self.beta = beta

    def true_preference(
        self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str], references: Sequence[str]
    ) -> Tensor:
        """Exact P*(a ≻ b | x), float64; the shortest boxed solution to a prompt is the length yardstick."""
        if references is None:
            raise ValueError("ProgrammaticOracle needs reference answers (references=None)")
        _check_lengths(prompts=prompts, responses_a=responses_a, responses_b=responses_b, references=references)
        # The shortest solution to a prompt in this call is the length yardstick of the padding term.
        shortest: dict[str, int] = {}
        for x, a, b in zip(prompts, responses_a, responses_b):
            for r in (a, b):
                if extract_final_answer(r) is not None:
                    shortest[x] = min(shortest.get(x, 10**9), len(r.split()))
        diffs = [
            solution_score(a, ref, shortest.get(x)) - solution_score(b, ref, shortest.get(x))
            for x, a, b, ref in zip(prompts, responses_a, responses_b, references)
        ]
        return torch.sigmoid(self.beta * torch.tensor(diffs, dtype=torch.float64))

    @override
    def first_wins_probability(self, prompts, firsts, seconds, references):
        return self.true_preference(prompts, firsts, seconds, references)


_FIELD = re.compile(r"\{(prompt|first|second)\}")
_JUDGE_TEMPLATE = (
    "You are comparing two responses to the same request. Reply with the single letter of the better response.\n\n"
    "[Request]\n{prompt}\n\n[Response A]\n{first}\n\n[Response B]\n{second}\n\nThe better response is"
)


class PromptedOracle(PreferenceOracle):
    """An LLM judge's comparison prompt, shared by :class:`LLMJudgeOracle` and :class:`RemoteJudgeOracle`.

    Args:
        template: Prompt with ``{prompt}``, ``{first}`` and ``{second}`` placeholders.
        max_length: Tokens per query (see :meth:`prompt`).
        **oracle: :class:`PreferenceOracle`'s arguments (``num_queries``, ``seed``, ``timeout_s``).
    """

    tokenizer: Any

    def __init__(self, template: str = _JUDGE_TEMPLATE, max_length: int = 2048, **oracle: Any) -> None:
        super().__init__(**oracle)
        check_placeholders(template, ("{prompt}", "{first}", "{second}"))
        self.template, self.max_length = template, max_length

    def render(self, prompt: str, first: str, second: str) -> str:
        """The template filled in one pass, the texts quoted (:func:`quote_judged`) so none forges a line."""
        texts = {"prompt": prompt, "first": first, "second": second}
        values = {k: quote_judged(v, self.tokenizer.all_special_tokens) or "(empty)" for k, v in texts.items()}
        return _FIELD.sub(lambda m: values[m.group(1)], self.template)

    def prompt(self, prompt: str, first: str, second: str) -> str:
        """:meth:`render` within ``max_length`` tokens: the responses' middles are cut, never the request or question.

        Raises:
            ValueError: when the template and the request alone exceed ``max_length``.
        """
        budget = self.max_length - self.tokenizer.num_special_tokens_to_add()
        return fit_judged(self.tokenizer, lambda s: self.render(prompt, *s), [first, second], budget, "max_length")[0]


class LLMJudgeOracle(PromptedOracle):
    """Zero-shot LLM judge: P(first better) = p("A") / (p("A") + p("B")) at the next token, batched.

    Args:
        model: Hub name or local path of a causal LM (loaded frozen, through
          :func:`alignment_games.modules.lm.models.load_model`).
        batch_size: Queries per forward pass.
        dtype: Weights dtype; ``"auto"``: bfloat16 with CUDA, else float32 (:func:`load_frozen_causal_lm`).
        trust_remote_code: Off unless the config turns it on.
        **prompting: :class:`PromptedOracle`'s arguments.
    """

    def __init__(
        self, model: str, batch_size: int = 8, dtype: str = "auto", trust_remote_code: bool = False, **prompting: Any
    ) -> None:
        super().__init__(**prompting)
        self.batch_size = batch_size
        self.tokenizer, self.model = load_frozen_causal_lm(model, dtype, trust_remote_code)
        self.tokenizer.truncation_side = "left"
        self.choice_ids = [self.tokenizer(x, add_special_tokens=False)["input_ids"][-1] for x in (" A", " B")]

    @torch.inference_mode()
    @override
    def first_wins_probability(self, prompts, firsts, seconds, references):
        texts = [self.prompt(x, a, b) for x, a, b in zip(prompts, firsts, seconds)]
        out, device, size = [], next(self.model.parameters()).device, self.batch_size
        for i in range(0, len(texts), size):
            batch = texts[i : i + size]
            enc = self.tokenizer(batch, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
            enc = enc.to(device)
            # the last position only: the whole sequence's logits over a real vocabulary would be gigabytes
            logits = self.model(**enc, logits_to_keep=1).logits[:, -1, self.choice_ids].double()
            out.append(torch.softmax(logits, dim=-1)[:, 0].cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


_LETTER = re.compile(r"^\W*(?:(?i:the\s+better\s+response\s+is|response)\W*)?([AB])(?![A-Za-z])")


def read_letter(text: str) -> str | None:
    """``"A"`` or ``"B"`` when a reply opens with that letter (``A``, ``" B."``, ``"Response A"``), else ``None``."""
    match = _LETTER.match(text)
    return match.group(1) if match else None


class RemoteJudgeOracle(RemoteClient, PromptedOracle):
    """:class:`LLMJudgeOracle`'s comparison sent to an OpenAI-compatible chat-completions server.

    Chat servers do not all return next-token probabilities, so ``P(first better)`` is the share of ``samples`` replies
    opening with ``A`` (:func:`read_letter`); unreadable replies are left out, and none readable is a NaN verdict.

    Args:
        samples: Replies per query.
        temperature: Sampling temperature of the replies.
        max_tokens: Tokens per reply (the letter needs one or two). **remote:
        :class:`~alignment_games.modules.scorers.remote.RemoteClient`'s arguments (the server, its tokenizer, how many
        queries at once), then :class:`PromptedOracle`'s (the template is sent as the user message).
    """

    def __init__(self, samples: int = 1, temperature: float = 1.0, max_tokens: int = 8, **remote: Any) -> None:
        require_at_least(samples=(samples, 1), max_tokens=(max_tokens, 1), temperature=(temperature, 0))
        super().__init__(**remote)
        self.samples, self.temperature, self.max_tokens = samples, float(temperature), max_tokens

    @override
    def first_wins_probability(self, prompts, firsts, seconds, references):
        texts, shares = [self.prompt(x, a, b) for x, a, b in zip(prompts, firsts, seconds)], []
        for replies in self.ask_each(texts, self.samples, self.temperature, 1.0, self.max_tokens):
            read = [x for x in (read_letter(t) for t in replies if t is not None) if x is not None]
            shares.append(sum(x == "A" for x in read) / len(read) if read else math.nan)
        return torch.tensor(shares, dtype=torch.float64)
