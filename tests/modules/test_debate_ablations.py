"""The debate paper's ablations reach the loss: the pairwise-preference judge and Bob rewarded by ground truth
(B-judge, B-convince), through the real CLI on their configs and on the module with Alice's answers set by hand."""

import os

import lightning as L
import pytest
import torch
from helpers import ROOT
from helpers.debate import script_judge, tiny_debate_module

from alignment_games import train
from alignment_games.datamodules.prompts import collate_prompts, index_rows
from alignment_games.modules.algorithms.debate import Transcript, ply_rewards, split_reply
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.algorithms.verdicts import pair_indices, pair_shares
from alignment_games.modules.debate import DebateSelfPlay
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import DebateJudge, HFJudge, JudgeVotes, ProgrammaticJudge

CONFIGS = {
    "debate_pairwise.yaml": {"judging": "pairwise", "bob_reward": "constant_sum"},
    "debate_b_judge.yaml": {"judging": "verdict", "bob_reward": "b_judge"},
    "debate_b_convince.yaml": {"judging": "verdict", "bob_reward": "b_convince"},
}
SMALL = [
    "--data.init_args.num_prompts=40",
    "--model.init_args.sampling.max_new_tokens=16",
    "--model.init_args.reply_max_new_tokens=8",
]


class Spy:
    """Records every judge call (its transcripts, partners and vote shares) and every policy loss's advantages."""

    def __init__(self, monkeypatch):
        self.votes, self.losses, self.players = [], [], []
        vote, loss, generate = DebateJudge.vote, DebateSelfPlay.policy_loss, PolicyBank.generate

        def spy_vote(judge, transcripts, against=None):
            out = vote(judge, transcripts, against)
            self.votes.append((list(transcripts), against, out.shares))
            return out

        def spy_loss(module, rollout, advantages, old=None):
            self.losses.append((rollout, advantages.detach().clone()))
            return loss(module, rollout, advantages, old)

        def spy_generate(bank, player, *a, **kw):
            self.players.append(player)
            return generate(bank, player, *a, **kw)

        monkeypatch.setattr(DebateJudge, "vote", spy_vote)
        monkeypatch.setattr(DebateSelfPlay, "policy_loss", spy_loss)
        monkeypatch.setattr(PolicyBank, "generate", spy_generate)


def _expected_advantages(module, spy):
    """The advantages the option's rule gives the first training step, recomputed from what the judge returned."""
    hp, g = module.hparams, module.policy_gradient.group_size
    rollout, _ = spy.losses[0]
    transcripts, against, shares = spy.votes[0]
    if hp.judging == "pairwise":
        pairs = pair_indices(len(rollout.transcripts) // g, g)
        assert [rollout.transcripts[a] for a, _ in pairs] == transcripts
        assert against == [rollout.transcripts[b] for _, b in pairs]
        shares = pair_shares(shares, pairs)
    else:
        assert against is None and transcripts == rollout.transcripts
    rules = dict(word_limit=hp.word_limit, word_penalty_coef=hp.word_penalty_coef, bob_reward=hp.bob_reward)
    forked = [rollout.fork_plies[i // g] for i in range(len(transcripts) * (2 if against else 1))]
    rewards = [ply_rewards(t, s, **rules)[j].reward for t, s, j in zip(rollout.transcripts, shares, forked)]
    return module.policy_gradient.advantages(torch.tensor(rewards, dtype=torch.float32))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ablation_config_parses_with_its_option(config, capsys):
    with pytest.raises(SystemExit) as done:
        train.main(["fit", "--config", os.path.join(ROOT, "configs", config), "--print_config"])
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    for key, value in CONFIGS[config].items():
        assert f"    {key}: {value}\n" in out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ablation_config_trains_a_step_whose_loss_gets_the_options_rewards(config, tmp_path, monkeypatch, tiny_lm_dir):
    monkeypatch.chdir(tmp_path)
    spy = Spy(monkeypatch)
    args = ["fit", "--config", os.path.join(ROOT, "configs", config), "--trainer.fast_dev_run=true"]
    cli = train.main([*args, "--trainer.accelerator=cpu", *SMALL, f"--model.init_args.lm.name_or_path={tiny_lm_dir}"])
    assert cli.trainer.global_step > 0
    m = cli.model
    assert {k: m.hparams[k] for k in CONFIGS[config]} == CONFIGS[config]
    assert torch.equal(spy.losses[0][1], _expected_advantages(m, spy))
    if m.hparams.bob_reward != "constant_sum":  # Alice is the frozen reference, Bob the trained policy
        assert spy.players[:2] == [None, "policy"]
        assert set(spy.losses[0][0].chunks) == {1}  # only Bob's critique is forked and trained


def _module(tiny_lm_dir, **kw):
    return tiny_debate_module(tiny_lm_dir, **{"protocol": "debate_ab", "trainable_plies": ["critique"], **kw})


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = index_rows([{"prompt": p, "reference": r} for p, r in rows])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.parametrize("bob_reward", ["b_judge", "b_convince"])
def test_bob_ground_truth_rewards_reach_the_loss_and_differ_from_constant_sum(
    bob_reward, tiny_lm_dir, tmp_path, monkeypatch
):
    """Alice (the frozen reference) answers 5 to both problems: right on the first, wrong on the second."""
    L.seed_everything(0)
    spy = Spy(monkeypatch)
    generate = PolicyBank.generate

    def boxed_five(bank, player, *a, **kw):
        out = generate(bank, player, *a, **kw)
        if player is None:
            out.texts = ["So \\boxed{5}" for _ in out.texts]
        return out

    monkeypatch.setattr(PolicyBank, "generate", boxed_five)
    m = _module(tiny_lm_dir, bob_reward=bob_reward)
    rows = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]
    loader = torch.utils.data.DataLoader(_Rows(rows), batch_size=2, collate_fn=collate_prompts)
    kw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    L.Trainer(max_steps=1, limit_val_batches=0, **kw).fit(m, train_dataloaders=loader)
    rollout, advantages = spy.losses[0]
    assert [t.correct for t in rollout.transcripts] == [True, True, False, False]
    assert spy.players == [None, "policy"]
    assert torch.equal(advantages, _expected_advantages(m, spy))
    _, _, shares = spy.votes[0]
    bob = [ply_rewards(t, s, word_limit=100, bob_reward=bob_reward)[1] for t, s in zip(rollout.transcripts, shares)]
    constant_sum = [ply_rewards(t, s, word_limit=100)[1] for t, s in zip(rollout.transcripts, shares)]
    if bob_reward == "b_convince":  # Alice right: the judge's share for her; wrong: against her, as constant-sum
        assert [x.verdict for x in bob] == [shares[0], shares[1], 1 - shares[2], 1 - shares[3]]
        assert [x.verdict for x in bob[:2]] != [x.verdict for x in constant_sum[:2]]
    else:  # the tiny policy's critique states no readable verdict: 0, whatever the judge said
        assert [x.verdict for x in bob] == [0.0] * 4 != [x.verdict for x in constant_sum]


def test_pairwise_shares_reach_the_loss(tiny_lm_dir, tmp_path, monkeypatch):
    """Alice's rollouts are set by hand to a right and a wrong answer in each pair: the judge's pairwise shares (not
    its verdicts, and not the missing-answer override of the tiny policy's unboxed text) make the advantages."""
    L.seed_everything(0)
    spy = Spy(monkeypatch)
    generate = PolicyBank.generate

    def right_then_wrong(bank, player, *a, **kw):
        out = generate(bank, player, *a, **kw)
        out.texts = ["So \\boxed{5}" if i % 2 == 0 else "So \\boxed{6}" for i in range(len(out.texts))]
        return out

    monkeypatch.setattr(PolicyBank, "generate", right_then_wrong)
    judge = ProgrammaticJudge(skill=1.5, num_votes=7)
    m = _module(
        tiny_lm_dir,
        protocol="rlaif_a",
        judging="pairwise",
        trainable_plies=None,
        judge=judge,
        policy_gradient=PolicyGradient(group_size=4),
    )
    loader = torch.utils.data.DataLoader(_Rows([("What is 2 + 3?", "5")]), batch_size=1, collate_fn=collate_prompts)
    kw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    L.Trainer(max_steps=1, limit_val_batches=0, **kw).fit(m, train_dataloaders=loader)
    rollout, advantages = spy.losses[0]
    assert [t.correct for t in rollout.transcripts] == [True, False, True, False]
    transcripts, against, shares = spy.votes[0]
    assert len(transcripts) == len(against) == 2 and all(x > 0.5 for x in shares)  # the right answer mostly wins
    assert torch.equal(advantages, _expected_advantages(m, spy))
    assert (advantages[[0, 2]] > 0).all() and (advantages[[1, 3]] < 0).all()


def test_ablation_settings_are_refused_by_the_module(tiny_lm_dir):
    with pytest.raises(ValueError, match=r"bob_reward must be one of \('constant_sum', 'b_judge', 'b_convince'\)"):
        _module(tiny_lm_dir, bob_reward="ground_truth")
    with pytest.raises(ValueError, match=r"trainable_plies must be \['critique'\]"):
        _module(tiny_lm_dir, bob_reward="b_judge", trainable_plies=None)
    with pytest.raises(ValueError, match="judging must be one of"):
        _module(tiny_lm_dir, judging="pair")
    with pytest.raises(ValueError, match="protocol must be rlaif_a"):
        _module(tiny_lm_dir, judging="pairwise", trainable_plies=None)


class _VerdictOnly(DebateJudge):
    """A judge that rules on one transcript only (``pairwise`` False)."""

    def __call__(self, transcripts):
        return JudgeVotes(torch.ones((len(transcripts), self.num_votes)), [[] for _ in transcripts])


def test_pairwise_judging_needs_a_judge_that_compares(tiny_lm_dir):
    with pytest.raises(ValueError, match="judging: pairwise needs a judge that compares two answers; _VerdictOnly do"):
        _module(tiny_lm_dir, protocol="rlaif_a", judging="pairwise", trainable_plies=None, judge=_VerdictOnly())


def test_language_model_judge_compares_two_answers_named_alice_and_bob(tiny_lm_dir):
    """The LM judge's pairwise prompt holds both answers, the first as Alice's, and asks whose final answer is more
    likely correct; a scripted reader in place of ``generate`` (Alice when her solution holds 5) gives the votes."""
    judge = HFJudge(tiny_lm_dir, chain_of_thought=False, num_votes=3, sampling=Sampling(max_new_tokens=4))

    def alice_when_hers_is_five(text):
        first = text[text.index("Alice's solution:") : text.index("Bob's solution:")]
        return "Verdict: Alice" if "boxed{5}" in first else "Verdict: Bob"

    seen = script_judge(judge, alice_when_hers_is_five)
    right, wrong = (
        Transcript("2 + 3?", "5", "rlaif_a", [split_reply(f"So \\boxed{{{x}}}", required=False)]) for x in (5, 6)
    )
    out = judge.vote([right, wrong], against=[wrong, right])
    assert out.votes.tolist() == [[1.0] * 3, [0.0] * 3]
    for text, (first, second) in zip(seen, [("5", "6"), ("6", "5")]):
        assert text.index(f"boxed{{{first}}}") < text.index("Bob's solution:") < text.index(f"boxed{{{second}}}")
        assert "Decide whose FINAL answer is correct" in text
        assert "'Verdict: Alice' if Alice's final answer is more likely correct than Bob's, otherwise" in text
    assert judge.prompt(right) != judge.prompt(right, wrong)  # the verdict prompt is unchanged without a partner
    assert "Decide whether Alice's FINAL answer" in judge.prompt(right)
