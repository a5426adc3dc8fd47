"""The debate paper's ablations reach the loss: the pairwise-preference judge and its matched baseline, Bob rewarded
by ground truth (B-judge, B-convince), the step-by-step format, ties and a frozen critic, through the real CLI on
their configs and on the module with the players' replies and the judge's votes set by hand (hand rewards and
advantages)."""

import math
import os
import re

import lightning as L
import pytest
import torch
import yaml
from helpers import ROOT
from helpers.debate import script_judge, tiny_debate_module

from alignment_games import train
from alignment_games.datamodules.prompts import collate_prompts, index_rows
from alignment_games.modules.algorithms.debate import Transcript, split_reply
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.debate import DebateSelfPlay
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import DebateJudge, HFJudge, JudgeVotes

CONFIGS = {
    "debate_pairwise.yaml": {"judging": "pairwise", "bob_reward": "constant_sum"},
    "debate_pairwise_baseline.yaml": {"judging": "verdict", "bob_reward": "constant_sum"},
    "debate_b_judge.yaml": {"judging": "verdict", "bob_reward": "b_judge"},
    "debate_b_convince.yaml": {"judging": "verdict", "bob_reward": "b_convince"},
    "debate_steps.yaml": {"step_chars": 100, "frozen_critic": False},
    "debate_ties.yaml": {"step_chars": None, "frozen_critic": False},
    "debate_frozen_critic.yaml": {"frozen_critic": True, "trainable_plies": ["answer"]},
}
SMALL = [
    "--data.init_args.num_prompts=40",
    "--model.init_args.sampling.max_new_tokens=16",
    "--model.init_args.reply_max_new_tokens=8",
]


class Spy:
    """Records every judge call (transcripts, partners, votes), generate call (player, prompts), the rewards and each
    policy loss's advantages."""

    def __init__(self, monkeypatch):
        self.votes, self.losses, self.generated, self.rewards = [], [], [], []
        vote, loss, generate, rewards = DebateJudge.vote, DebateSelfPlay.policy_loss, PolicyBank.generate, None
        rewards = DebateSelfPlay.rewards

        def spy_vote(judge, transcripts, against=None):
            out = vote(judge, transcripts, against)
            self.votes.append((list(transcripts), against, out))
            return out

        def spy_loss(module, rollout, advantages, old=None):
            self.losses.append((rollout, advantages.detach().clone()))
            return loss(module, rollout, advantages, old)

        def spy_generate(bank, player, prompts, *a, **kw):
            self.generated.append((player, list(prompts)))
            return generate(bank, player, prompts, *a, **kw)

        def spy_rewards(module, transcripts, shares):
            out = rewards(module, transcripts, shares)
            self.rewards.append([[x.reward for x in row] for row in out])
            return out

        monkeypatch.setattr(DebateJudge, "vote", spy_vote)
        monkeypatch.setattr(DebateSelfPlay, "policy_loss", spy_loss)
        monkeypatch.setattr(PolicyBank, "generate", spy_generate)
        monkeypatch.setattr(DebateSelfPlay, "rewards", spy_rewards)

    @property
    def players(self):
        return [player for player, _ in self.generated]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ablation_config_parses_with_its_option(config, capsys):
    with pytest.raises(SystemExit) as done:
        train.main(["fit", "--config", os.path.join(ROOT, "configs", config), "--print_config"])
    assert done.value.code in (0, None)
    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    assert {k: model[k] for k in CONFIGS[config]} == CONFIGS[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ablation_config_trains_a_step_with_its_rule(config, tmp_path, monkeypatch, tiny_lm_dir):
    monkeypatch.chdir(tmp_path)
    spy = Spy(monkeypatch)
    args = ["fit", "--config", os.path.join(ROOT, "configs", config), "--trainer.fast_dev_run=true"]
    cli = train.main([*args, "--trainer.accelerator=cpu", *SMALL, f"--model.init_args.lm.name_or_path={tiny_lm_dir}"])
    assert cli.trainer.global_step > 0
    m = cli.model
    assert {k: m.hparams[k] for k in CONFIGS[config]} == CONFIGS[config]
    rollout, _ = spy.losses[0]
    trained = {"debate_b_judge.yaml": [1], "debate_b_convince.yaml": [1], "debate_frozen_critic.yaml": [0]}
    assert sorted(rollout.chunks) == trained.get(config, sorted(set(rollout.fork_plies)))
    frozen = {"debate_b_judge.yaml": [None, "policy"], "debate_frozen_critic.yaml": ["policy", None]}
    if config in frozen or config == "debate_b_convince.yaml":  # the frozen reference (None) plays one side
        assert spy.players[:2] == frozen.get(config, frozen["debate_b_judge.yaml"])
    problems = len(rollout.transcripts) // m.policy_gradient.group_size
    judgments = spy.votes[0][2].votes.numel()  # the training step's judge call
    if config.startswith("debate_pairwise"):  # matched: 2 pairs × 7 votes, or 2 rollouts × 7 votes, a problem
        assert judgments / problems == 14
    if config == "debate_ties.yaml":  # 128 votes, a tie each with probability ≥ 0.30: some are ties
        assert (spy.votes[0][2].votes == 0.5).any()
    if config == "debate_steps.yaml":  # Alice's prompt states the cap
        assert all("numbered steps of at most 100 characters" in p for p in spy.generated[0][1])


def _module(tiny_lm_dir, **kw):
    return tiny_debate_module(tiny_lm_dir, **{"protocol": "debate_ab", "trainable_plies": ["critique"], **kw})


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = index_rows([{"prompt": p, "reference": r} for p, r in rows])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class _Table(DebateJudge):
    """A judge whose votes are a function of the transcript (and, pairwise, its partner)."""

    pairwise = True

    def __init__(self, votes, ties=False):
        super().__init__(num_votes=len(votes(None, None)))
        self.table, self.ties = votes, ties

    def __call__(self, transcripts, against=None):
        rows = [self.table(t, o) for t, o in zip(transcripts, against or [None] * len(transcripts))]
        return JudgeVotes(torch.tensor(rows, dtype=torch.float32), [[] for _ in transcripts])


def _train_step(module, rows, monkeypatch, *replies, steps=1):
    """Train ``steps`` steps of one problem batch each; the k-th generate call of a step answers ``replies[k]`` (one
    list, cycled over the rows: the forked ply's rows are [problem, branch])."""
    generate, calls = PolicyBank.generate, []

    def scripted(bank, player, prompts, *a, **kw):
        out = generate(bank, player, prompts, *a, **kw)
        texts = replies[len(calls) % len(replies)]
        calls.append(player)
        out.texts = [texts[i % len(texts)] for i in range(len(out.texts))]
        return out

    monkeypatch.setattr(PolicyBank, "generate", scripted)
    spy = Spy(monkeypatch)
    loader = torch.utils.data.DataLoader(_Rows(rows), batch_size=len(rows) // steps, collate_fn=collate_prompts)
    kw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    L.Trainer(max_steps=steps, limit_val_batches=0, **kw).fit(module, train_dataloaders=loader)
    return spy


RIGHT, WRONG = "So \\boxed{5}", "So \\boxed{6}"  # the answers to "What is 2 + 3?"
G4 = PolicyGradient(group_size=4)


@pytest.fixture
def seeded(tmp_path, monkeypatch):
    L.seed_everything(0)
    monkeypatch.chdir(tmp_path)  # where a trainer would write


@pytest.mark.usefixtures("seeded")
@pytest.mark.parametrize("bob_reward", ["b_judge", "b_convince"])
def test_bob_ground_truth_rewards_reach_the_loss_on_hand_values(bob_reward, tiny_lm_dir, monkeypatch):
    """Alice (the frozen reference) answers 5 to both problems: right on the first, wrong on the second. Bob's four
    branches rule Alice, Bob, Alice, Alice; the judge gives Alice 6 of 8 votes after "Verdict: Alice", 2 after Bob."""
    rows = [("What is 2 + 3?", "5"), ("What is 3 + 3?", "6")]
    judge = _Table(
        lambda t, _: [1.0] * 6 + [0.0] * 2 if t is None or "Alice" in t.visible("critique") else [1, 1] + [0] * 6
    )
    m = _module(tiny_lm_dir, bob_reward=bob_reward, judge=judge, policy_gradient=G4)
    bob = ["Verdict: Alice", "Verdict: Bob", "Verdict: Alice", "Verdict: Alice"]
    spy = _train_step(m, rows, monkeypatch, ["So \\boxed{5}"], bob)
    assert spy.players == [None, "policy"]  # Alice the frozen reference, Bob the policy
    bob_rewards = [r[1] for r in spy.rewards[0]]
    _, advantages = spy.losses[0]
    if bob_reward == "b_judge":  # 1 for a ruling that matches the checker: right on problem 1, wrong on problem 2
        assert bob_rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
        # group [1, 0, 1, 1]: mean 0.75, sd 0.5: (r − 0.75) / 0.5001
        hand = [0.49990, -1.49970, 0.49990, 0.49990, -0.49990, 1.49970, -0.49990, -0.49990]
    else:  # the judge's share for the true verdict: r when Alice is right, 1 − r when wrong
        assert bob_rewards == [0.75, 0.25, 0.75, 0.75, 0.25, 0.75, 0.25, 0.25]
        # group [0.75, 0.25, 0.75, 0.75]: mean 0.625, sd 0.25: (r − 0.625) / 0.2501
        hand = [0.49980, -1.49940, 0.49980, 0.49980, -0.49980, 1.49940, -0.49980, -0.49980]
    assert advantages.tolist() == pytest.approx(hand, abs=1e-5)


@pytest.mark.usefixtures("seeded")
def test_pairwise_shares_reach_the_loss_on_hand_values(tiny_lm_dir, monkeypatch):
    """Alice's four rollouts are right, wrong, right, wrong; the judge gives 6 of 7 votes to the right one of a pair."""
    judge = _Table(lambda t, o: [1.0] * 6 + [0.0] if t is None or t.correct else [0.0] * 6 + [1.0])
    m = _module(
        tiny_lm_dir, protocol="rlaif_a", judging="pairwise", trainable_plies=None, judge=judge, policy_gradient=G4
    )
    spy = _train_step(m, [("What is 2 + 3?", "5")], monkeypatch, [RIGHT, WRONG])
    transcripts, against, _ = spy.votes[0]
    assert len(transcripts) == len(against) == 2 and {t.correct for t in transcripts + against} == {True, False}
    assert [r[0] for r in spy.rewards[0]] == pytest.approx([6 / 7, 1 / 7, 6 / 7, 1 / 7])
    # mean 0.5, deviations ±5/14 = ±0.357143, sd sqrt(4 · 0.127551 / 3) = 0.412393: ±0.357143 / 0.412493
    assert spy.losses[0][1].tolist() == pytest.approx([0.865815, -0.865815, 0.865815, -0.865815], abs=1e-5)


@pytest.mark.usefixtures("seeded")
def test_pairwise_order_is_a_seeded_coin_that_a_resumed_run_draws_again(tiny_lm_dir, monkeypatch):
    """Four steps of one problem (two pairs a step): which rollout is shown first is drawn per step, the same again
    from the step counter a checkpoint restores (here: a fresh module told it has seen 2 batches)."""
    judge = _Table(lambda t, o: [1.0])

    def firsts(spy):  # per step, the branch shown first in each pair
        return [[t.replies[0].raw for t in transcripts] for transcripts, _, _ in spy.votes]

    rows = [(f"What is {k} + 1?", str(k + 1)) for k in range(4)]
    kw = dict(protocol="rlaif_a", judging="pairwise", trainable_plies=None, judge=judge, policy_gradient=G4)
    branches = ["b0", "b1", "b2", "b3"]
    whole = firsts(_train_step(_module(tiny_lm_dir, **kw), rows, monkeypatch, branches, steps=4))
    assert all(len(step) == 2 for step in whole) and len(whole) == 4
    shown_second = [step for step in whole if step != ["b0", "b2"]]
    assert shown_second  # with seed 0 some pair is shown in the other order (each step's orders: 1/4 to be unflipped)
    resumed = _module(tiny_lm_dir, **kw)
    resumed.load_game_state({"counters": {"batches_seen": 2}})
    assert firsts(_train_step(resumed, rows[2:], monkeypatch, branches, steps=2)) == whole[2:]


@pytest.mark.usefixtures("seeded")
def test_step_format_rewards_reach_the_loss_on_hand_values(tiny_lm_dir, monkeypatch):
    """step_chars 20: numbered steps within the cap keep the judge's 6 of 8; free text, or a step of 25 characters,
    −1."""
    ok, long = "1. 2 + 3 = 5\n2. So \\boxed{5}", "1. Adding 2 and 3 gives 5\n2. So \\boxed{5}"
    judge = _Table(lambda t, _: [1.0] * 6 + [0.0] * 2)
    prompt = "{problem} Answer in numbered steps of at most {step_chars} characters."
    m = _module(
        tiny_lm_dir, trainable_plies=["answer"], step_chars=20, alice_prompt=prompt, judge=judge, policy_gradient=G4
    )
    spy = _train_step(m, [("What is 2 + 3?", "5")], monkeypatch, [ok, RIGHT, ok, long], ["Fine."])
    assert "What is 2 + 3? Answer in numbered steps of at most 20 characters." in spy.generated[0][1][0]
    assert [r[0] for r in spy.rewards[0]] == [0.75, -1.0, 0.75, -1.0]
    # mean −0.125, deviations ±0.875, sd sqrt(4 · 0.765625 / 3) = 1.010363: ±0.875 / 1.010463
    assert spy.losses[0][1].tolist() == pytest.approx([0.865940, -0.865940, 0.865940, -0.865940], abs=1e-5)
    with pytest.raises(ValueError, match=r"step_chars \(20\) is stated by alice_prompt's \{step_chars\} and only"):
        _module(tiny_lm_dir, trainable_plies=["answer"], step_chars=20)
    with pytest.raises(ValueError, match=r"step_chars \(None\) is stated by alice_prompt's"):
        _module(tiny_lm_dir, trainable_plies=["answer"], alice_prompt=prompt)
    with pytest.raises(ValueError, match="step_chars must be at least 1, got 0"):
        _module(tiny_lm_dir, trainable_plies=["answer"], step_chars=0, alice_prompt=prompt)


@pytest.mark.usefixtures("seeded")
@pytest.mark.parametrize("ties", [True, False])
def test_tie_votes_reach_the_loss_only_from_a_judge_that_may_tie(ties, tiny_lm_dir, monkeypatch):
    """A right answer gets 5 votes for Alice, 2 ties and 1 for Bob; a wrong one 4 ties and 4 for Bob. With ties a tie
    is half a vote each: 0.75 and 0.25; without, the ties are no votes (invalid): 5/6 and 0."""

    def votes(t, _):
        return [1.0] * 5 + [0.5, 0.5, 0.0] if t is None or t.correct else [0.5] * 4 + [0.0] * 4

    m = _module(tiny_lm_dir, trainable_plies=["answer"], judge=_Table(votes, ties=ties), policy_gradient=G4)
    spy = _train_step(m, [("What is 2 + 3?", "5")], monkeypatch, [RIGHT, WRONG, WRONG, WRONG], ["Fine."])
    alice = [r[0] for r in spy.rewards[0]]
    assert alice == pytest.approx([0.75, 0.25, 0.25, 0.25] if ties else [5 / 6, 0.0, 0.0, 0.0])
    assert spy.votes[0][2].invalid == (0 if ties else 2 + 3 * 4)
    if ties:  # mean 0.375, deviations 0.375 and −0.125, sd 0.25: / 0.2501
        assert spy.losses[0][1].tolist() == pytest.approx([1.49940, -0.49980, -0.49980, -0.49980], abs=1e-5)


@pytest.mark.usefixtures("seeded")
def test_a_frozen_critic_is_the_reference_and_alice_trains_on_hand_values(tiny_lm_dir, monkeypatch):
    """Bob's critique comes from the frozen reference (player None), only Alice's answer is forked; the judge gives a
    right answer 7 of 8 votes and a wrong one 1 of 8, the constant-sum reward."""
    judge = _Table(lambda t, _: [1.0] * 7 + [0.0] if t is None or t.correct else [1.0] + [0.0] * 7)
    m = _module(tiny_lm_dir, trainable_plies=["answer"], frozen_critic=True, judge=judge, policy_gradient=G4)
    spy = _train_step(m, [("What is 2 + 3?", "5")], monkeypatch, [RIGHT, WRONG, WRONG, WRONG], ["It is wrong."])
    assert spy.players == ["policy", None]
    rollout, advantages = spy.losses[0]
    assert list(rollout.chunks) == [0]  # only the answer ply trains
    assert spy.rewards[0] == [[0.875, 0.125], [0.125, 0.875], [0.125, 0.875], [0.125, 0.875]]
    # Alice's group [0.875, 0.125, 0.125, 0.125]: mean 0.3125, sd 0.375: (r − 0.3125) / 0.3751
    assert advantages.tolist() == pytest.approx([1.49960, -0.49987, -0.49987, -0.49987], abs=1e-5)
    with pytest.raises(ValueError, match="frozen_critic: Bob is the frozen reference"):
        _module(tiny_lm_dir, trainable_plies=None, frozen_critic=True)


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


def test_language_model_judge_offers_a_tie_and_reads_a_reply_written_to_it(tiny_lm_dir):
    """With ``ties`` the LM judge's instructions quote a tie verdict; a reader answering with the last verdict the
    prompt quotes votes 0.5 (a tie); the same reply to a judge without ties is no vote."""
    judge = HFJudge(tiny_lm_dir, chain_of_thought=False, num_votes=3, sampling=Sampling(max_new_tokens=4), ties=True)
    seen = script_judge(judge, lambda text: re.findall(r"'(Verdict: \w+)'", text)[-1])
    t = Transcript("2 + 3?", "5", "debate_ab", [split_reply(x, required=False) for x in ("\\boxed{5}", "Fine.")])
    out = judge.vote([t])
    assert re.findall(r"'(Verdict: \w+)'", seen[0]) == ["Verdict: Alice", "Verdict: Bob", "Verdict: Tie"]
    assert out.votes.tolist() == [[0.5] * 3] and out.verdicts == ["tie"] and out.invalid == 0
    judge.ties = False
    assert math.isnan(judge.read_vote("Verdict: Tie")) and judge.read_vote("Verdict: Bob") == 0.0
