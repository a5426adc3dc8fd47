"""The multi-LLM pool module (modules/pool.py) on a tiny random Qwen2: bad input, counted behaviour, training."""

import dataclasses
import json
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.nan_after import NaNAfter
from helpers.pool_settings import SMALL
from helpers.pool_settings import judging as _judging
from helpers.pool_settings import lm as _lm
from helpers.provenance import check_provenance
from helpers.threads import one_torch_thread
from lightning.pytorch.loggers import CSVLogger

from alignment_games.callbacks import EloRating
from alignment_games.datamodules.pool import InstructionPoolDataModule, split_pool
from alignment_games.datamodules.prompts import PromptSource
from alignment_games.modules.algorithms.exp3 import CompositeReward
from alignment_games.modules.algorithms.pool import Matchmaking, ReputationWeighting, final_answer
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.distributed.collectives import local_batches, shared_rows
from alignment_games.modules.evaluation.pool_figures import make_pool_figures, write_pool_artifacts
from alignment_games.modules.games.pool_followers import FollowerTraining
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.pool import StackelbergPool
from alignment_games.modules.scorers.peer_judges import PeerJudging, encode_texts


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tiny model's ops are too small to gain from more, and on a shared CPU two spinning
    threads made this file 8x slower (143 s against 17 s, both measured under the same load)."""
    with one_torch_thread():
        yield


@pytest.fixture
def short_pool(tmp_path):
    """Eight short arithmetic questions (short sequences keep the byte-level tiny model fast)."""
    path = tmp_path / "pool.jsonl"
    rows = [{"question": f"{a}+{a + 1}=?", "answer": str(2 * a + 1)} for a in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _data(path, iterations_per_epoch=1):
    return InstructionPoolDataModule(
        source=PromptSource(path=str(path), prompt_column="question", reference_column="answer"),
        val_fraction=0.25,
        batch_size=4,
        iterations_per_epoch=iterations_per_epoch,
    )


def _fit(module, data, epochs=1, limit_val_batches=0, tmp_path=None, callbacks=()):
    L.seed_everything(0)  # sampling (an empty response is a non-tied pair) must not vary from run to run
    trainer = make_trainer(tmp_path, list(callbacks), max_epochs=epochs, limit_val_batches=limit_val_batches)
    trainer.fit(module, datamodule=_data(data))
    return trainer


def _adapters(module):
    return {n: p.detach().clone() for n, p in module.banks.named_parameters() if p.requires_grad}


def _frozen(module):
    return {n: p.detach().clone() for n, p in module.banks.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("m", [2, 0])
def test_a_pool_without_a_non_competing_judge_is_refused(m, tiny_lm_dir):
    with pytest.raises(ValueError, match="no non-competing judge"):
        StackelbergPool(lm=_lm(tiny_lm_dir), num_players=m)


def test_bad_options_name_the_field(tiny_lm_dir):
    with pytest.raises(ValueError, match="leader"):
        StackelbergPool(lm=_lm(tiny_lm_dir), leader="greedy")


@pytest.mark.parametrize(
    ("group", "kwargs", "message"),
    [
        (PeerJudging, {"mode": "vibes"}, "judging.mode"),
        (PeerJudging, {"template": "{prompt} only"}, "judging.template"),
        (PeerJudging, {"samples": 0}, "judging.samples"),
        (PeerJudging, {"temperature": 0.0}, "judging.temperature"),
        (PeerJudging, {"max_new_tokens": 0}, "judging.max_new_tokens"),
        (Sampling, {"temperature": 0.0}, "sampling.temperature"),
        (Sampling, {"top_p": 1.5}, "sampling.top_p"),
        (Matchmaking, {"uniform_share": 1.2}, "uniform_share"),
        (Matchmaking, {"num_candidates": 0}, "num_candidates"),
        (CompositeReward, {"bandwidth": 0.0}, "bandwidth"),
        (CompositeReward, {"difficulty_weight": -0.1}, "difficulty_weight"),
        (FollowerTraining, {"algorithm": "ppo"}, "followers.algorithm"),
        (FollowerTraining, {"dpo_pairs": "some"}, "followers.dpo_pairs"),
        (FollowerTraining, {"lr": -1e-3}, "followers.lr"),
        (FollowerTraining, {"pairwise": {"loss_type": "rpo", "alpha": -1.0}}, "pairwise.alpha"),
        (FollowerTraining, {"pairwise": {"nll": 1.0}}, r"followers.pairwise: unknown field\(s\) \['nll'\]"),
        (FollowerTraining, {"algorithm": "grpo", "policy_gradient": {"group_size": 1}}, "policy_gradient.group_size"),
        (ReputationWeighting, {"rule": "elo"}, "reputation.rule"),
        (ReputationWeighting, {"scale": -400.0}, "reputation.scale"),
    ],
)
def test_bad_argument_groups_name_the_field(group, kwargs, message):
    with pytest.raises(ValueError, match=message):
        group(**kwargs)


def test_argument_groups_reach_the_game_and_the_checkpoint(tiny_lm_dir):
    """The groups' fields drive the game, and hparams hold them as plain values (nothing a checkpoint must unpickle)."""
    match = Matchmaking(num_candidates=1, gap_start=0.4, gap_end=0.2)
    reward = CompositeReward(difficulty_weight=1.0, preference_weight=0.0)
    reputation = ReputationWeighting("elo_odds", scale=200.0)
    module = StackelbergPool(
        lm=_lm(tiny_lm_dir), matchmaking=match, leader_reward=reward, reputation=reputation, **SMALL
    )
    assert module.matchmaking.target_gap(0.5) == pytest.approx(0.3)
    assert module.reputation.weights([1200.0, 1000.0]) == pytest.approx([10 / 11, 1 / 11])  # 10^(200/200) : 1
    assert StackelbergPool(lm=_lm(tiny_lm_dir), **SMALL).reputation.rule == "raw"  # the default: the paper's rule
    assert module.leader_reward(4.0, 6.0, 0.0) == pytest.approx(5.0 / 9.0)  # (10 - 5) / 9: difficulty alone
    assert module.hparams["matchmaking"]["num_candidates"] == 1 and module.hparams["sampling"]["max_new_tokens"] == 6
    groups = ("matchmaking", "leader_reward", "sampling", "judging", "reputation", "followers")
    assert all(isinstance(module.hparams[k], dict) for k in groups)
    # a checkpoint's hparams (plain dicts) rebuild the same groups
    again = StackelbergPool(**{k: module.hparams[k] for k in ("lm", *groups)})
    assert all(getattr(again, k) == getattr(module, k) for k in groups)


def test_the_pool_rates_its_own_players(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), elo={"k_factor": 16.0}, **SMALL)
    assert module.elo.players == module.player_names and module.elo.k_factor == 16.0
    trainer = _fit(module, short_pool, tmp_path=tmp_path)
    assert not any(isinstance(c, EloRating) for c in trainer.callbacks)  # no callback: the module applies them
    assert sum(module.elo.games_played(p) for p in module.player_names) == 2 * SMALL["duels_per_iteration"]
    assert module.elo.pending == 0
    assert all(trainer.callback_metrics[f"elo/{p}"] == module.elo.rating(p) for p in module.player_names)
    assert module.history["ratings"][-1] == [module.elo.rating(p) for p in module.player_names]
    for bad in ({"players": ["a", "b", "c"]}, {"figure_path": "elo.png"}):
        with pytest.raises(ValueError, match="elo: unknown setting"):
            StackelbergPool(lm=_lm(tiny_lm_dir), elo=bad)
    assert StackelbergPool(lm=_lm(tiny_lm_dir), num_players=1).elo is None  # a pool of one has no reputations


def test_an_elo_callback_given_to_the_trainer_is_warned_about(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(
        lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **{**SMALL, "duels_per_iteration": 1}
    )
    user = EloRating(module.player_names)
    with pytest.warns(UserWarning, match="rates its own players"):
        _fit(module, short_pool, tmp_path=tmp_path, callbacks=[user])
    assert [sum(e.games_played(p) for p in module.player_names) for e in (user, module.elo)] == [0, 2]


def test_judges_that_never_parse_count_as_five_and_nothing_trains(tiny_lm_dir, tmp_path, short_pool):
    # A random tiny model never writes a score: every judgement is 5.0, counted, every duel ties, so there is no DPO
    # pair and no follower moves; the leader still updates (a tie is a valid duel outcome).
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("generate"), **SMALL)
    before = _adapters(module)
    with pytest.warns(UserWarning, match="none of judge"):
        trainer = _fit(module, short_pool, tmp_path=tmp_path)
    c = module.counters
    assert c["judgements"] == c["parse_failures"] > 0
    assert c["iterations_without_pairs"] == 1
    assert trainer.callback_metrics["judge/parse_failure_rate"] == 1.0
    # every score ties, so peer judging ranks a right answer above a wrong one at chance, where there is such a pair
    assert "judge/reference_pairs" in trainer.callback_metrics and "duel/reference_accuracy" in trainer.callback_metrics
    assert trainer.callback_metrics.get("judge/reference_agreement", torch.tensor(0.5)) == 0.5
    assert all(torch.equal(before[n], p) for n, p in _adapters(module).items())
    assert trainer.global_step == 0
    assert len(module.history["weights"]) == 2  # before and after the iteration
    assert (tmp_path / "pool_history.json").exists() and (tmp_path / "instruction_weights.png").exists()
    check_provenance(json.loads((tmp_path / "pool_history.json").read_text()), {"model.lm.name_or_path": tiny_lm_dir})


def test_empty_responses_score_the_minimum_and_dpo_trains(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained", '{"score": '), **SMALL)
    real_respond_all = module.respond_all

    def respond_all(instructions, n):
        out = real_respond_all(instructions, n)
        if "m1" in instructions:
            prompts = [module.chat("m1", x) for x in instructions["m1"] for _ in range(n)]
            out["m1"] = encode_texts(module.bank("m1"), prompts, [""] * len(prompts))
        return out

    module.respond_all = respond_all
    adapters, frozen = _adapters(module), _frozen(module)
    trainer = _fit(module, short_pool, tmp_path=tmp_path)
    elo = module.elo
    assert module.counters["empty_responses"] == elo.games_played("m1") > 0  # one response per m1 duel (DPO)
    assert elo.rating("m1") < 1000.0  # it lost every duel it played
    assert module.counters["parse_failures"] == 0
    assert trainer.global_step > 0
    after = _adapters(module)
    moved = {n.split(".")[-2] for n in after if not torch.equal(after[n], adapters[n])}
    assert moved == {"m0", "m1", "m2"}  # dpo_pairs="all": every follower learns from every non-tied pair
    assert all(trainer.callback_metrics[f"follower/margin_after/{p}"] > 0 for p in ("m0", "m1", "m2"))
    assert all(torch.equal(frozen[n], p) for n, p in _frozen(module).items())  # the shared base never moves


def test_checkpoint_restores_the_game(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **SMALL)
    trainer = _fit(module, short_pool, tmp_path=tmp_path)
    path = tmp_path / "pool.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert not any("base_layer" in k for k in ckpt["state_dict"])  # the frozen base is not stored
    assert not any("EloRating" in k for k in ckpt["callbacks"])  # the ratings are the game's, not a callback's
    fresh = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **SMALL)
    fresh.on_load_checkpoint(ckpt)
    fresh.load_state_dict(ckpt["state_dict"], strict=False)
    assert torch.equal(fresh.leader_probabilities(), module.leader_probabilities())
    assert fresh.history == module.history and fresh.counters == module.counters
    assert torch.equal(fresh.generator.get_state(), module.generator.get_state())
    assert fresh.iteration == module.iteration == 1
    assert fresh.elo.state_dict() == module.elo.state_dict() and sum(ckpt["game_state"]["elo"]["games"]) > 0
    assert {"epoch_means.leader_reward.mean_value", "epoch_means.follower_loss.weight"} <= set(ckpt["state_dict"])
    assert all(torch.equal(_adapters(fresh)[n], p) for n, p in _adapters(module).items())
    del ckpt["state_dict"][next(iter(ckpt["state_dict"]))]
    with pytest.raises(KeyError, match="lacks trainable"):
        fresh.on_load_checkpoint(ckpt)


def test_grpo_updates_the_combatants(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(
        lm=_lm(tiny_lm_dir),
        judging=_judging("constrained"),
        **{
            **SMALL,
            "duels_per_iteration": 2,
            "followers": FollowerTraining("grpo", lr=1e-2, batch_size=4, policy_gradient=PolicyGradient(group_size=2)),
        },
    )
    before = _adapters(module)
    trainer = _fit(module, short_pool, tmp_path=tmp_path)
    assert trainer.global_step > 0
    after = _adapters(module)
    moved = {n.split(".")[-2] for n in after if not torch.equal(after[n], before[n])}
    keys = [k for k in trainer.callback_metrics if k.startswith("follower/grpo_loss/")]
    assert moved and {k.rsplit("/", 1)[1] for k in keys} == moved  # exactly the models that played were trained


def test_grpo_followers_take_updates_per_batch_steps_on_each_batch(tiny_lm_dir, tmp_path, short_pool, monkeypatch):
    """``followers.policy_gradient.updates_per_batch`` μ: each batch of a follower's rollouts gives μ optimizer steps
    on the same rows (the sampling policy's log-probabilities kept, so the later steps' ratios differ from 1)."""
    from alignment_games.modules.games.pool_followers import FollowerUpdates

    steps, step = [], FollowerUpdates._step
    monkeypatch.setattr(FollowerUpdates, "_step", lambda *a: steps.append((mu, a[2], a[5])) or step(*a))  # player, n
    for mu in (1, 3):
        pg = PolicyGradient(group_size=2, updates_per_batch=mu, clip=0.01)
        followers = FollowerTraining("grpo", lr=5e-2, batch_size=4, policy_gradient=pg)
        module = StackelbergPool(
            lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **{**SMALL, "followers": followers}
        )
        _fit(module, short_pool, tmp_path=tmp_path)
    once = [(p, n) for m, p, n in steps if m == 1]
    assert once and [(p, n) for m, p, n in steps if m == 3] == [x for x in once for _ in range(3)]


def test_grpo_followers_with_a_token_budget_train_as_without(tiny_lm_dir, tmp_path, short_pool, monkeypatch):
    """``followers.policy_gradient.max_tokens_per_micro_batch``: each batch of a follower's rollouts runs in
    micro-batches of at most the budget's padded tokens (here the longest row's, so several a batch), and each
    follower's first step has the unchunked run's gradients (the chunks' summed losses make the batch's; later steps
    start from weights AdamW moved by float-rounding-sized differences)."""
    import alignment_games.modules.games.pool_followers as pf

    chunks, real = [], pf.micro_batches
    monkeypatch.setattr(pf, "micro_batches", lambda *a, **k: chunks.append((a, k, real(*a, **k))) or chunks[-1][2])
    firsts = []
    for budget in (0, None):
        if budget is None:  # the longest row of the first run (the second samples the same rows)
            budget = max(s + max(c, 1) for (spans, counts, *_), _, _ in chunks for s, c in zip(spans, counts))
            chunks.clear()
        L.seed_everything(0)
        pg = PolicyGradient(group_size=2, clip=0.2, max_tokens_per_micro_batch=budget)
        followers = FollowerTraining("grpo", lr=5e-2, batch_size=4, policy_gradient=pg)
        module = StackelbergPool(
            lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **{**SMALL, "followers": followers}
        )
        first, step = {}, module.optimizer_step

        def recorded(opt, params=None, _first=first, _step=step):
            _first.setdefault(id(opt), [p.grad.clone() for p in params])
            return _step(opt, params)

        module.optimizer_step = recorded
        _fit(module, short_pool, tmp_path=tmp_path)
        firsts.append(list(first.values()))
    batches = [out for *_, out in chunks if out]
    assert batches and all(len(out) > 1 for out in batches)  # every batch cut, none refused
    for (spans, counts, max_tokens, *_), _, out in chunks:
        assert max_tokens == budget
        assert all((b - a) * (max(spans[a:b]) + max(max(counts[a:b]), 1)) <= budget for a, b in out)
    assert len(firsts[0]) == len(firsts[1]) > 0
    for whole, cut in zip(*firsts):
        assert any(g.abs().sum() > 0 for g in whole)
        for g_whole, g_cut in zip(whole, cut, strict=True):
            torch.testing.assert_close(g_cut, g_whole, rtol=0, atol=1e-6)


def test_followers_policy_gradient_from_checkpoint_hparams():
    """A checkpoint's hparams hold the nested group as a dict: it comes back as the group; an unknown field is named."""
    followers = FollowerTraining("grpo", policy_gradient=PolicyGradient(group_size=3, kl_coef=0.5))
    assert FollowerTraining(**dataclasses.asdict(followers)) == followers
    with pytest.raises(ValueError, match=r"followers.policy_gradient: unknown field\(s\) \['grpo_beta'\]"):
        FollowerTraining(policy_gradient={"grpo_beta": 0.1})


def test_self_rewarding_baseline_with_uniform_leader_and_validation(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(
        lm=_lm(tiny_lm_dir), num_players=1, leader="uniform", judging=_judging("constrained"), **SMALL
    )
    trainer = _fit(module, short_pool, limit_val_batches=1, tmp_path=tmp_path)
    assert module.history["selection"] == []
    k = len(module.history["weights"][0])
    assert module.history["weights"][-1] == pytest.approx([1 / k] * k)
    assert set(trainer.callback_metrics) >= {"val/acc/m0", "val/acc_macro"}


def test_pool_split_and_final_answer():
    rows = [{"prompt": f"q{i}", "reference": str(i)} for i in range(10)] + [{"prompt": "q0", "reference": "0"}]
    train, val = split_pool(rows, 0.2, seed=0)
    assert len(train) == 8 and len(val) == 2 and not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    with pytest.raises(ValueError, match="at least two"):
        split_pool(rows[:2], 0.5, seed=0)
    assert final_answer(r"so \boxed{12} and 13") == "12"
    assert final_answer("The total is 1,250 apples.") == "1,250"
    assert final_answer("no number") is None


def test_figures_from_a_history(tmp_path):
    history = {
        "weights": [[0.25] * 4, [0.4, 0.2, 0.2, 0.2]],
        "ratings": [[1000.0] * 3, [1010.0, 990.0, 1000.0]],
        "selection": [[1 / 3] * 3],
        "rewards": [0.5],
    }
    figs = make_pool_figures(history, ["m0", "m1", "m2"])
    assert set(figs) == {"instruction_weights", "reputations", "opponent_selection"}
    csv = CSVLogger(tmp_path, name="csv")
    trainer = SimpleNamespace(is_global_zero=True, loggers=[csv])
    record, *paths = write_pool_artifacts(str(tmp_path), {"players": ["m0", "m1", "m2"], **history}, figs, trainer, 3)
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths) and len(paths) == 3
    logged = sorted(p.relative_to(tmp_path / "csv" / "version_0").as_posix() for p in (tmp_path / "csv").rglob("*.png"))
    assert logged == sorted(f"media/pool/{name}/step_3.png" for name in figs)  # each figure to the trainer's logger
    assert json.loads(open(record).read())["weights"] == history["weights"]


def test_separate_models_each_get_a_bank(tiny_lm_dir):
    # each member a path or ModelConfig fields over `lm`: m1 overrides the LoRA rank
    module = StackelbergPool(lm=_lm(tiny_lm_dir), models=[tiny_lm_dir, {"lora_r": 2}, str(tiny_lm_dir)], **SMALL)
    assert len(module.banks) == 3 and module.player_names == ["m0", "m1", "m2"]
    ranks = [{p.shape[0] for n, p in module.bank(m).model.named_parameters() if "lora_A" in n} for m in ("m0", "m1")]
    assert ranks == [{4}, {2}] and module.model_names == [str(tiny_lm_dir)] * 3
    params = [{id(p) for p in module.bank(n).player_parameters(n)} for n in module.player_names]
    assert all(params) and not (params[0] & params[1] or params[1] & params[2])
    out = module.respond("m2", ["1+2=?"], 2)
    assert len(out.texts) == 2
    scores = module.judge("m0", ["1+2=?", "1+2=?"], ["3", ""])
    assert [s for s, _ in scores] == [5.0, 5.0]  # a random model never writes a score: counted as 5.0


def test_resume_continues_like_an_uninterrupted_run(tiny_lm_dir, tmp_path, short_pool):
    kw = dict(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **SMALL)

    def trainer(epochs, module, root):
        # no EloRating callback: the pool rates its players and checkpoints the ratings
        return make_trainer(root, [], max_epochs=epochs, limit_val_batches=0)

    L.seed_everything(0)
    full = StackelbergPool(**kw)
    t_full = trainer(2, full, tmp_path / "full")
    t_full.fit(full, datamodule=_data(short_pool))

    L.seed_everything(0)
    first = StackelbergPool(**kw)
    t_first = trainer(1, first, tmp_path / "first")
    t_first.fit(first, datamodule=_data(short_pool))
    t_first.save_checkpoint(tmp_path / "one.ckpt")

    L.seed_everything(123)  # whatever the seed, the checkpoint's RNG state takes over
    resumed = StackelbergPool(**kw)
    t_resumed = trainer(2, resumed, tmp_path / "resumed")
    t_resumed.fit(resumed, datamodule=_data(short_pool), ckpt_path=tmp_path / "one.ckpt", weights_only=False)

    assert torch.equal(resumed.leader_probabilities(), full.leader_probabilities())
    assert resumed.history["weights"] == full.history["weights"]
    assert not any(isinstance(c, EloRating) for c in t_first.callbacks)
    assert torch.load(tmp_path / "one.ckpt", weights_only=True)["game_state"]["elo"] == first.elo.state_dict()
    assert resumed.elo.state_dict() == full.elo.state_dict()  # ratings, duel counts, volatility windows, history
    assert resumed.elo.ratings != first.elo.ratings  # and it rated on after the resume
    a, b = _adapters(resumed), _adapters(full)
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in b)


BASE_SCORE = [5.0, 6.0, 4.0, 7.0]  # each author's response quality
JUDGE_BIAS = [0.0, 2.0, -3.0, 1.0]  # each judge's leniency: the judges disagree, so their weights matter
RATINGS = [1000.0, 1300.0, 800.0, 1000.0]


def _scripted_pool(module):
    """Every model answers ``reply of <name>`` and judge ``j`` scores author ``a``'s reply ``BASE[a] + BIAS[j]``."""

    def respond(player, instructions, n):
        prompts = [module.chat(player, x, module.hparams.system_prompt) for x in instructions for _ in range(n)]
        return encode_texts(module.bank(player), prompts, [f"reply of {player}"] * len(prompts))

    def judge(name, instructions, responses):
        j = module.player_names.index(name)
        return [(BASE_SCORE[int(r.rsplit("m", 1)[1])] + JUDGE_BIAS[j], True) for r in responses]

    module.respond_all = lambda asked, n: {p: respond(p, xs, n) for p, xs in asked.items()}
    module.judge_all = lambda asked: {p: judge(p, xs, ys) for p, (xs, ys, _) in asked.items()}


def _paper_reward(score_a, score_b):
    """The composite reward at progress 0 by the paper's terms (§2.1, App. C): 0.3 difficulty + 0.7 preference."""
    difficulty = (10.0 - (score_a + score_b) / 2.0) / 9.0 if max(score_a, score_b) >= 3.0 else 0.0
    preference = math.exp(-((abs(score_a - score_b) / 9.0 - 0.6) ** 2) / (2.0 * 0.15**2))
    return 0.3 * difficulty + 0.7 * preference


@pytest.mark.parametrize("rule", ["raw", "elo_odds"])
def test_the_leader_learns_from_the_composite_reward_of_reputation_weighted_scores(
    rule, tiny_lm_dir, tmp_path, short_pool, monkeypatch
):
    """Phases 4-6 end to end: EXP3's update receives, for each chosen instruction, the composite reward of the two
    sides' reputation-weighted peer scores (weights by hand: the ratings, or 10^((R - mean) / 400) normalised)."""
    from alignment_games.modules.algorithms.exp3 import Exp3

    module = StackelbergPool(
        lm=_lm(tiny_lm_dir), num_players=4, reputation=ReputationWeighting(rule), **{**SMALL, "duels_per_iteration": 4}
    )
    _scripted_pool(module)
    module.elo.load_state_dict({**module.elo.state_dict(), "ratings": RATINGS})
    updates, drawn = [], {}
    original_update, original_match, original_choose = Exp3.update, module._match, module._choose_instructions

    def update(bandit, indices, rewards):
        updates.append((list(indices), list(rewards)))
        original_update(bandit, indices, rewards)

    monkeypatch.setattr(Exp3, "update", update)
    module._match = lambda *a: drawn.setdefault("duels", original_match(*a))
    module._choose_instructions = lambda *a: drawn.setdefault("chosen", original_choose(*a))
    _fit(module, short_pool, tmp_path=tmp_path)

    mean = sum(RATINGS) / len(RATINGS)
    weight = {"raw": lambda r: r, "elo_odds": lambda r: 10.0 ** ((r - mean) / 400.0)}[rule]
    expected, plain = [], []
    for a, b in drawn["duels"][0]:
        judges = [j for j in range(4) if j not in (a, b)]
        w = [weight(RATINGS[j]) for j in judges]
        sides = [sum(wj * (BASE_SCORE[x] + JUDGE_BIAS[j]) for wj, j in zip(w, judges)) / sum(w) for x in (a, b)]
        expected.append(_paper_reward(*sides))
        plain.append(_paper_reward(*[sum(BASE_SCORE[x] + JUDGE_BIAS[j] for j in judges) / 2 for x in (a, b)]))
    ((indices, rewards),) = updates  # one iteration, one update
    assert indices == drawn["chosen"]
    assert rewards == pytest.approx(expected, abs=1e-9)
    # the weights made a difference here (far more than the tolerance above), so plain means would fail the test;
    # raw ratings barely move them, Elo odds do
    gap = max(abs(x - y) for x, y in zip(expected, plain))
    assert gap > {"raw": 1e-3, "elo_odds": 0.02}[rule]


def test_the_dpo_reference_is_the_previous_iterations_model(tiny_lm_dir, tmp_path, short_pool):
    """§2.4: "DPO uses the previous iteration's checkpoint as its reference policy". The reference log-probabilities
    of iteration 2 are those of the adapters as iteration 1 left them, not the base's nor the initial adapters'."""
    module = StackelbergPool(lm=_lm(tiny_lm_dir), num_players=4, **{**SMALL, "duels_per_iteration": 4})
    _scripted_pool(module)
    snapshots = [_adapters(module)]  # the adapters before iteration 1, then after each iteration
    references = []
    original_rows = module.follow._dpo_rows

    def dpo_rows(p, pairs, questions, texts):
        both, ref = original_rows(p, pairs, questions, texts)
        references.append((module.iteration, p, both, ref.clone()))
        return both, ref

    class AfterEachIteration(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append(_adapters(pl_module))

    module.follow._dpo_rows = dpo_rows
    _fit(module, short_pool, epochs=2, tmp_path=tmp_path, callbacks=[AfterEachIteration()])
    assert len(snapshots) == 3 and sorted({it for it, *_ in references}) == [1, 2]
    final = _adapters(module)

    def logprobs_with(adapters, p, both):
        with torch.no_grad():
            for name, param in module.banks.named_parameters():
                if name in adapters:
                    param.copy_(adapters[name])
            return module.bank(p).logprobs(p, both, 1.0).view(-1, 2)

    for iteration, p, both, ref in references:
        torch.testing.assert_close(ref, logprobs_with(snapshots[iteration - 1], p, both), atol=1e-5, rtol=0)
        if iteration == 2:
            # neither the initial adapters nor the frozen base: iteration 1 moved this follower
            assert (ref - logprobs_with(snapshots[0], p, both)).abs().max() > 1e-3
            with torch.no_grad():
                base = module.bank(p).logprobs(None, both, 1.0).view(-1, 2)
            assert (ref - base).abs().max() > 1e-3
    logprobs_with(final, "m0", references[0][2])  # leave the trained adapters in place


def test_paired_dpo_rows_give_the_log_probabilities_of_separate_rollouts(tiny_lm_dir):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), **SMALL)
    bank, prompts = module.bank("m1"), [module.chat("m1", "1+2=?"), module.chat("m1", "10+20=?")]
    chosen, rejected = ["3", "three"], ["4", ""]
    both = encode_texts(bank, [x for x in prompts for _ in (0, 1)], ["3", "4", "three", ""], group_size=2)
    with torch.no_grad():
        paired = bank.logprobs("m1", both, 1.0).view(-1, 2)
        alone = [bank.logprobs("m1", encode_texts(bank, prompts, t), 1.0) for t in (chosen, rejected)]
    assert both.group_size == 2
    assert torch.allclose(paired[:, 0], alone[0], atol=1e-5) and torch.allclose(paired[:, 1], alone[1], atol=1e-5)
    with pytest.raises(ValueError, match="groups of 2 sharing one prompt"):
        encode_texts(bank, prompts, chosen, group_size=2)


def test_iterations_per_epoch_must_be_a_positive_integer():
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="iterations_per_epoch"):
            InstructionPoolDataModule(iterations_per_epoch=bad)


def test_nonfinite_follower_losses_are_skipped_and_stop_with_the_last_good_checkpoint(
    tiny_lm_dir, tmp_path, short_pool
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO

    L.seed_everything(0)
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), max_consecutive_nonfinite=2, **SMALL)
    module.follow._dpo_rows_loss = NaNAfter(module.follow._dpo_rows_loss, after=4)  # iteration 0: three good steps
    ckpt = ModelCheckpoint(tmp_path, save_last=True, every_n_train_steps=3)
    trainer = make_trainer(
        tmp_path, [ckpt], max_epochs=1, limit_val_batches=0, enable_checkpointing=True, plugins=[AtomicCheckpointIO()]
    )
    with pytest.warns(UserWarning, match="NaN or inf; the update is skipped"):
        with pytest.raises(RuntimeError, match="2 consecutive steps had non-finite losses of follower m1"):
            trainer.fit(module, datamodule=_data(short_pool, iterations_per_epoch=3))
    assert module.nonfinite_skipped == module.consecutive_nonfinite == 2  # m0 and m1 of iteration 1
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == trainer.global_step == 3 and ckpt["game_state"]["iteration"] == 1
    assert ckpt["game_state"]["nonfinite"] == {"nonfinite_skipped": 0, "consecutive_nonfinite": 0}
    for name, value in _adapters(module).items():  # the skipped steps changed nothing after the last good one
        assert torch.equal(ckpt["state_dict"][f"banks.{name}"], value), name


def test_a_nonfinite_peer_score_skips_the_whole_iteration(tiny_lm_dir, tmp_path, short_pool):
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), max_consecutive_nonfinite=2, **SMALL)
    module.judge_all = lambda asked: {p: [(float("nan"), True)] * len(xs) for p, (xs, _, _) in asked.items()}
    adapters, elo = _adapters(module), module.elo
    trainer = make_trainer(tmp_path, [], max_epochs=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match="peer scores"):
        with pytest.raises(RuntimeError, match="2 consecutive steps had non-finite peer scores"):
            trainer.fit(module, datamodule=_data(short_pool, iterations_per_epoch=2))
    assert module.iteration == module.nonfinite_skipped == 2 and trainer.global_step == 0
    assert all(elo.games_played(p) == 0 for p in module.player_names)  # no reputation update
    assert module.leader_bandit.rounds == 0  # no leader update
    assert all(torch.equal(adapters[n], p) for n, p in _adapters(module).items())


def test_several_processes_other_than_ddp_are_refused_by_name(tiny_lm_dir):
    from lightning.pytorch.strategies import FSDPStrategy

    module = StackelbergPool(lm=_lm(tiny_lm_dir), **SMALL)
    module._trainer = SimpleNamespace(world_size=2, strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="trainer.strategy.*DDP only.*got FSDPStrategy on 2 processes"):
        module.setup("fit")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_follower_batch_is_split_into_contiguous_shares_that_tile_it(world):
    n, batch = 11, 4
    owned = [shared_rows(SimpleNamespace(global_rank=r, world_size=world), n, batch) for r in range(world)]
    assert all(sum(o[i] for o in owned) == 1 for i in range(n))  # every row computed by exactly one rank
    for o in owned:
        local = local_batches(o, batch)
        assert [size for size, _ in local] == [4, 4, 3]
        assert [b - a for _, (a, b) in local] == [sum(o[lo : lo + batch]) for lo in range(0, n, batch)]
        assert local[-1][1][1] == sum(o) and all(x[1][1] == y[1][0] for x, y in zip(local, local[1:]))


def test_an_unset_schedule_spans_the_trainers_iterations(tiny_lm_dir, tmp_path, short_pool):
    small = {k: v for k, v in SMALL.items() if k != "num_iterations"}
    module = StackelbergPool(lm=_lm(tiny_lm_dir), judging=_judging("constrained"), **small)
    assert module.hparams.num_iterations is None and module.num_iterations is None
    _fit(module, short_pool, epochs=2, tmp_path=tmp_path)
    assert module.num_iterations == 2 and module.iteration == 2  # trainer.max_epochs x one iteration per epoch
    assert module.hparams.num_iterations is None  # the checkpoint records "the trainer's", not a number
