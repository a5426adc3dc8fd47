"""The pool's judges: solving and reference-guided judges, and generated judgements decoded in one batch per bank."""

from types import SimpleNamespace

import pytest
import torch
from helpers.pool_settings import SMALL
from helpers.pool_settings import judging as _judging
from helpers.pool_settings import lm as _lm
from helpers.threads import one_torch_thread

from alignment_games.modules.algorithms.pool import final_answer
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.pool import StackelbergPool
from alignment_games.modules.scorers.peer_judges import PeerJudging, member_scores, solve_scores


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield


class _SolvingBank:
    """A bank double that records its ``generate`` calls and answers question ``q`` with the texts given for it."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def generate(self, player, prompts, k, sampling, greedy=False):
        self.calls.append((player, list(prompts), k, sampling, greedy))
        return SimpleNamespace(texts=[t for q in prompts for t in self.answers[q][:k]])


def test_solve_scores_solve_each_question_once_and_grade_by_agreement():
    bank = _SolvingBank({"q1": ["so \\boxed{4}", "\\boxed{4}", "\\boxed{5}", "7"], "q2": ["none", "", "x", "y"]})
    judging = PeerJudging(mode="solve", samples=4, temperature=0.9, max_new_tokens=16)
    out = solve_scores(bank, "m2", ["q1", "q2", "q1", "q1"], ["\\boxed{4}", "4", "it is 7", "no idea"], judging)
    assert out == [(1 + 9 * 2 / 4, True), (5.0, False), (1 + 9 / 4, True), (1.0, True)]
    (call,) = bank.calls  # one call, each distinct question once, sampled
    assert call == ("m2", ["q1", "q2"], 4, Sampling(0.9, max_new_tokens=16), False)
    greedy = _SolvingBank({"q1": ["\\boxed{4}"]})
    assert solve_scores(greedy, "m0", ["q1"], ["4"], PeerJudging(mode="solve")) == [(10.0, True)]
    assert greedy.calls[0][4] is True  # one solution: greedy, as the paper's judges score
    with pytest.raises(ValueError, match="2 questions for 1 responses"):
        solve_scores(bank, "m2", ["q1", "q2"], ["4"], judging)


def test_a_solving_judge_scores_against_its_own_greedy_answer(tiny_lm_dir):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=PeerJudging(mode="solve", max_new_tokens=12), **SMALL)
    question = "1+2=?"
    chat = module.chat("m0", question, module.hparams.system_prompt)
    own = final_answer(module.bank("m0").generate("m0", [chat], 1, Sampling(max_new_tokens=12), greedy=True).texts[0])
    scores = module.judge("m0", [question, question], [f"\\boxed{{{own}}}", "no answer here"])
    if own is None:  # the random model wrote no number: it cannot judge
        assert scores == [(5.0, False), (5.0, False)]
    else:
        assert scores == [(10.0, True), (1.0, True)]


def test_reference_guided_judges_score_the_final_answer_against_the_reference(tiny_lm_dir):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=PeerJudging(mode="reference"), **SMALL)
    replies = ["so \\boxed{7}", "7.0", "\\boxed{8}", ""]
    assert module.judge("m0", ["q"] * 4, replies, ["7", "7", "7", "7"]) == [(10.0, True)] * 2 + [(1.0, True)] * 2
    with pytest.raises(ValueError, match="instruction 1 .* no reference answer"):
        module.judge("m0", ["a", "b"], ["1", "2"], ["1", None])
    with pytest.raises(ValueError, match="reference_column"):
        module.judge("m0", ["a"], ["1"])


def _spy_generate(bank):
    """Record the ``player`` argument of every ``bank.generate`` call."""
    calls, real = [], bank.generate

    def generate(player, *args, **kwargs):
        calls.append(player if isinstance(player, str) or player is None else list(player))
        return real(player, *args, **kwargs)

    bank.generate = generate
    return calls


def test_the_players_answer_and_judge_in_one_decode_each(tiny_lm_dir):
    """One base: the answers of all players are one decode, the generated judgements of all judges another, and a
    judge's scores are those of its own decode (greedy)."""
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging(), **SMALL)
    (bank,) = module.banks
    with torch.no_grad():
        for i, p in enumerate(module.player_names):
            for w in bank.player_parameters(p):
                w.add_(0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(i)))
    calls = _spy_generate(bank)
    torch.manual_seed(0)
    out = module.respond_all({"m0": ["1+2=?", "2+2=?"], "m2": ["3+3=?"]}, 2)
    assert calls == [["m0", "m0", "m2"]] and [out[p].sequences.shape[0] for p in ("m0", "m2")] == [4, 2]
    calls.clear()
    asked = {p: (["1+2=?", "5-1=?"], [f"{i}", f"reply {p}"], None) for i, p in enumerate(module.player_names)}
    together = module.judge_all(asked)
    assert calls == [["m0", "m0", "m1", "m1", "m2", "m2"]]
    calls.clear()
    for p, (xs, ys, _) in asked.items():
        chat = lambda user, system, p=p: module.chat(p, user, system)  # noqa: E731
        assert together[p] == member_scores(bank, p, chat, xs, ys, module.judging, module.hparams.system_prompt)
    assert calls == ["m0", "m1", "m2"]
