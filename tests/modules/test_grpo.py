"""GRPO with a tiny LM policy: what learns, what is batched, how rewards are scored, what is skipped."""

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.decode_spy import spy_decodes

from alignment_games.modules.algorithms.rl_losses import PairwiseLoss, PolicyGradient
from alignment_games.modules.grpo import GRPO
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import build_tiny_reward_model
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.reward_models import RewardModels, answer_rewards


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    return [
        build_tiny_reward_model(root / "rm0", seed=1),
        build_tiny_reward_model(root / "rm1", config={"hidden_size": 32, "num_attention_heads": 2}, seed=2),
    ]


def _model(tiny_lm_dir, pg=None, **kw):
    args = dict(
        lm=ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8),
        policy_gradient=PolicyGradient(**{"group_size": 2, "kl_coef": 0.1, **(pg or {})}),
        sampling=Sampling(temperature=1.0, max_new_tokens=6),
        lr=5e-2,
        chat_template=False,
    )
    args.update(kw)
    return GRPO(**args)


def _trainer(tmp_path, steps=2, callbacks=(), **kw):
    return make_trainer(tmp_path, list(callbacks), max_steps=steps, max_epochs=None, limit_val_batches=0, **kw)


def _dm():
    from alignment_games.datamodules.prompts import PromptDataModule

    return PromptDataModule(num_prompts=24, batch_size=2)


def test_the_adapter_learns_and_the_base_does_not_move(tiny_lm_dir, reward_dirs, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir, reward_models=reward_dirs, reward_weights=[1.0, 0.5, 1.0])
    calls = spy_decodes(model.players)  # rows of each batched decode
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logged = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    _trainer(tmp_path, steps=3, callbacks=[Collect()]).fit(model, _dm())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".policy." in n and "lora_" in n for n in changed)  # base and reward models frozen
    assert calls == [4, 4, 4]  # one generate call per step: B * G rows
    for key in ("time/generate", "time/score", "time/ref_logprobs", "time/backward", "time/optimizer"):
        assert logged[-1][key] > 0
    assert logged[-1]["train/kl"] > 0  # the adapter has moved away from the reference by step 3
    assert "train/reward_rm1" in logged[-1] and "train/reward_answer" in logged[-1]


def test_reward_models_in_one_batch_equal_one_by_one(reward_dirs):
    rms = RewardModels(reward_dirs)
    texts = ["1+1= \\boxed{2}", "a much longer text with more words in it", "x"]
    batched = rms(texts)
    assert batched.shape == (3, 2)
    one_by_one = torch.cat([rms([t]) for t in texts])
    assert torch.allclose(batched, one_by_one, atol=1e-5)
    assert torch.allclose(RewardModels(reward_dirs, batch_size=2)(texts), batched, atol=1e-5)
    assert not torch.allclose(batched[:, 0], batched[:, 1])  # two different models
    assert rms.fingerprints[0] == rms.fingerprints[1]  # same byte tokenizer: tokenised once per call


def test_reward_models_score_a_groups_shared_prefix_once_with_the_same_scores(reward_dirs):
    prompts = ["What is 2 + 3? Think.", "Tom has 4 apples and buys 7 more. How many now?", "1+1?"]
    replies = [["5", "It is 5.", "", "2 + 3 = 6, so six"], ["11 apples", "eleven", "4 + 7 = 11", "11"], ["2"] * 4]
    texts = [p + r for p, rs in zip(prompts, replies) for r in rs]  # "" makes a row that IS its prompt
    rms = RewardModels(reward_dirs)
    plain = rms(texts)
    calls = []
    for m in rms.models:
        m.register_forward_hook(lambda mod, args, kw, out: calls.append(kw["input_ids"].shape), with_kwargs=True)
    shared = rms(texts, group_size=4)
    assert torch.allclose(shared, plain, atol=1e-5)
    # each model ran its backbone over the 3 prefixes once and its head over the rows' own tokens only
    assert all(shape[0] == 12 and shape[1] < max(len(t) for t in texts) for shape in calls)
    assert torch.allclose(RewardModels(reward_dirs, batch_size=5)(texts, group_size=4), plain, atol=1e-5)
    # rows that share nothing (a group of different prompts) are scored as they are
    mixed = [texts[0], texts[4], texts[8], texts[1]]
    assert torch.allclose(rms(mixed, group_size=4), rms(mixed), atol=1e-6)


def test_answer_rewards_by_hand():
    got = answer_rewards(["so \\boxed{12}", "\\boxed{1,000}", "no box 12", "\\boxed{3"], ["12", "1000", "12", "3"])
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="row 1: field 'reference' is missing"):
        answer_rewards(["a", "b"], ["1", None])


def test_a_nonfinite_reward_is_skipped_and_counted(tiny_lm_dir, reward_dirs, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir, reward_models=reward_dirs[:1], answer_reward=False, max_consecutive_nonfinite=5)
    calls = {"n": 0}
    real = model.rewards

    def sometimes_nan(inputs, completions, references, **kw):
        calls["n"] += 1
        r = real(inputs, completions, references, **kw)
        if calls["n"] == 2:  # the second step's rewards hold one NaN
            r[1, 0] = float("nan")
        return r

    model.rewards = sometimes_nan
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = []

    class Snap(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            steps.append(trainer.global_step)

    with pytest.warns(UserWarning, match="1 of 4 rewards are NaN or inf; the update is skipped"):
        _trainer(tmp_path, steps=2, callbacks=[Snap()]).fit(model, _dm())
    assert model.nonfinite_skipped == 1 and model.consecutive_nonfinite == 0
    assert steps == [1, 1, 2]  # the second batch made no optimizer step
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_consecutive_nonfinite_rewards_stop_training(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir, max_consecutive_nonfinite=2)
    model.rewards = lambda inputs, completions, references, **kw: torch.full((len(completions), 1), float("inf"))
    with pytest.warns(UserWarning, match="update is skipped"):
        with pytest.raises(RuntimeError, match="2 consecutive steps had non-finite rewards"):
            _trainer(tmp_path, steps=10).fit(model, _dm())


def test_several_updates_per_rollout_clip_and_micro_batches(tiny_lm_dir, reward_dirs, tmp_path):
    L.seed_everything(0)
    model = _model(
        tiny_lm_dir,
        reward_models=reward_dirs[:1],
        answer_reward=False,
        pg={"updates_per_batch": 3, "clip": 0.01, "micro_batch": 1, "logprob_micro_batch": 3},
    )
    trainer = _trainer(tmp_path, steps=6)
    trainer.fit(model, _dm())
    assert trainer.global_step == 6  # three optimizer steps per batch
    assert model.phase_times["old_logprobs"] > 0
    assert trainer.callback_metrics["train/clip_fraction"] > 0  # the later updates leave the trust region


def test_checkpoint_holds_the_adapter_and_counters_only(tiny_lm_dir, reward_dirs, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir, reward_models=reward_dirs[:1])
    trainer = _trainer(tmp_path, steps=1)
    trainer.fit(model, _dm())
    model.nonfinite_skipped = 7
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    assert ckpt["state_dict"] and all(".policy." in k for k in ckpt["state_dict"])
    fresh = _model(tiny_lm_dir, reward_models=reward_dirs[:1])
    fresh.on_load_checkpoint(ckpt)
    fresh.load_state_dict(ckpt["state_dict"], strict=False)
    assert fresh.nonfinite_skipped == 7
    for n, p in model.players.named_parameters():
        assert torch.equal(p, dict(fresh.players.named_parameters())[n])
    with pytest.raises(KeyError, match="lacks trainable tensors"):
        fresh.on_load_checkpoint({"state_dict": {}})


def test_bad_settings_are_refused(tiny_lm_dir, tmp_path):
    with pytest.raises(ValueError, match="no reward"):
        _model(tiny_lm_dir, answer_reward=False)
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1 rewards"):
        _model(tiny_lm_dir, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="policy_gradient.group_size must be at least 2, got 1"):
        _model(tiny_lm_dir, policy_gradient={"group_size": 1})  # as a checkpoint's hparams hold the group
    with pytest.raises(ValueError, match=r"policy_gradient: unknown field\(s\) \['beta'\]"):
        _model(tiny_lm_dir, policy_gradient={"beta": 0.1})
    for field, bad, message in [
        ("lr", -1e-3, "lr must be positive"),  # a negative rate would be gradient ascent
        ("lr", float("nan"), "lr must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            _model(tiny_lm_dir, **{field: bad})
    with pytest.raises(ValueError, match="min_new_tokens"):
        _model(tiny_lm_dir, sampling=Sampling(max_new_tokens=6, min_new_tokens=10))
    with pytest.raises(OSError, match=r"reward_models\[0\]"):
        _model(tiny_lm_dir, reward_models=[str(tmp_path / "missing")])


def test_min_new_tokens_fixes_the_reply_length(tiny_lm_dir):
    model = _model(tiny_lm_dir, sampling=Sampling(max_new_tokens=6, min_new_tokens=6))
    torch.manual_seed(0)
    roll = model.players.generate("policy", ["1+1="], 3, model.sampling)
    assert roll.completion_mask.sum(1).tolist() == [6, 6, 6]


def test_merged_adapter_generation_matches_and_leaves_the_base_untouched(tiny_lm_dir):
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), players=["policy"])
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(0.1 * torch.randn_like(p))
    base = {n: (p, p.detach().clone()) for n, p in bank.named_parameters() if "base_layer" in n}
    prompts = ["3+4=", "twelve minus five is "]
    merged = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=8), greedy=True)
    bank.merge_for_generation = False
    unmerged = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=8), greedy=True)
    assert merged.texts == unmerged.texts
    assert torch.equal(merged.sequences, unmerged.sequences)
    after = dict(bank.named_parameters())
    assert all(after[n] is obj and torch.equal(obj, copy) for n, (obj, copy) in base.items())  # same tensors, bits
    reference = bank.generate(None, prompts, 1, Sampling(max_new_tokens=8), greedy=True)
    assert not torch.equal(reference.sequences, merged.sequences)  # the adapter was really applied


def test_shared_prompt_logprobs_and_gradients_equal_the_full_forward(tiny_lm_dir):
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), players=["policy"])
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(0.1 * torch.randn_like(p))
    roll = bank.generate("policy", ["3+4=", "a longer prompt: twelve minus five is "], 3, Sampling(0.6, 1.0, 7))
    assert roll.group_size == 3

    def run(share, micro):
        bank.share_prompts = share
        bank.zero_grad(set_to_none=True)
        lp = bank.token_logprobs("policy", roll, temperature=0.8, micro_batch=micro)
        (lp * torch.linspace(-1, 1, lp.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in bank.named_parameters() if p.grad is not None}
        return lp.detach(), grads

    full, full_grads = run(False, 0)
    for micro in (0, 2):  # 2 rows is rounded up to one whole group of 3
        shared, shared_grads = run(True, micro)
        assert torch.allclose(shared, full, atol=1e-5)
        assert full_grads.keys() == shared_grads.keys() and full_grads
        for n, gr in full_grads.items():
            assert torch.allclose(shared_grads[n], gr, atol=1e-5), n
    with torch.no_grad():
        bank.share_prompts = True
        ref_shared = bank.token_logprobs(None, roll, temperature=0.8)
        bank.share_prompts = False
        assert torch.allclose(ref_shared, bank.token_logprobs(None, roll, temperature=0.8), atol=1e-5)


def test_groups_are_ordered_by_their_longest_completion():
    from alignment_games.modules.grpo import _groups_by_length

    lengths = [3, 5, 1, 2, 4, 4]  # groups of 2: longest 5, 2, 4
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    assert _groups_by_length(mask, 2).tolist() == [2, 3, 4, 5, 0, 1]


def test_length_ordered_micro_batches_give_the_whole_batchs_update(tiny_lm_dir, reward_dirs, tmp_path, monkeypatch):
    """One step in chunks of one group, in a changed group order (rewards, advantages and reference log-probabilities
    follow their rows) and each run to its own longest reply, moves the adapter as the whole batch in one forward
    does."""
    import alignment_games.modules.grpo as grpo

    orders = []

    def reversed_groups(mask, g):  # a real reordering whatever lengths the tiny policy samples
        order = torch.arange(mask.shape[0]).view(-1, g).flip(0).reshape(-1)
        orders.append(order.tolist())
        return order

    monkeypatch.setattr(grpo, "_groups_by_length", reversed_groups)
    before, after = [], []
    for micro in (0, 2):
        L.seed_everything(3)
        model = _model(
            tiny_lm_dir,
            reward_models=reward_dirs[:1],
            answer_reward=False,
            pg={"micro_batch": micro},
            sampling=Sampling(temperature=1.0, max_new_tokens=12),
        )
        before.append({n: p.detach().clone() for n, p in model.players.named_parameters() if p.requires_grad})
        _trainer(tmp_path, steps=1).fit(model, _dm())
        after.append({n: p.detach().clone() for n, p in model.players.named_parameters() if p.requires_grad})
    assert after[0].keys() == after[1].keys() and after[0]
    for name, p in after[0].items():
        torch.testing.assert_close(before[1][name], before[0][name], rtol=0, atol=0)
        torch.testing.assert_close(after[1][name], p, rtol=1e-5, atol=1e-6)
    assert sum(not torch.equal(after[0][n], before[0][n]) for n in after[0]) >= len(after[0]) // 2
    assert orders == [[2, 3, 0, 1]]  # the chunked run reordered its 2 groups of 2; the whole batch kept its order


def test_uniform_groups_are_left_out_of_the_backward_with_the_same_update(tiny_lm_dir, tmp_path, monkeypatch):
    """Groups whose rewards are all equal have advantage 0: leaving them out of the forward and backward (β = 0)
    moves the adapter exactly as running them does, over a mixed step and then an all-uniform step (AdamW's momentum
    alone). The mean keeps counting their rows; ``train/informative_groups`` logs the share that counted."""
    steps = iter([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]] * 2)  # step 1: group 0 uniform; step 2: both uniform

    def rewards(self, inputs, completions, references, group_size=1):
        return torch.tensor(next(steps)).unsqueeze(1)

    monkeypatch.setattr(GRPO, "rewards", rewards)
    rows_run, before, after, informative = [], [], [], []
    for skip in (False, True):
        L.seed_everything(5)
        model = _model(tiny_lm_dir, {"kl_coef": 0.0}, answer_reward=True, skip_uniform_groups=skip, lr=1e-2)
        run = model.players.token_logprobs
        rows_run.append([])

        def spy(name, rollout, *a, _run=run, _rows=rows_run[-1], **k):
            if torch.is_grad_enabled():
                _rows.append(rollout.sequences.shape[0])
            return _run(name, rollout, *a, **k)

        monkeypatch.setattr(model.players, "token_logprobs", spy)
        before.append({n: p.detach().clone() for n, p in model.players.named_parameters() if p.requires_grad})
        _trainer(tmp_path, steps=2).fit(model, _dm())
        after.append({n: p.detach().clone() for n, p in model.players.named_parameters() if p.requires_grad})
        informative.append(float(model.trainer.callback_metrics["train/informative_groups"]))
    assert rows_run == [[4, 4], [2, 2]]  # all four rows twice; group 1 only, then one (uniform) group kept to step on
    assert informative == [0.0, 0.0]  # the last step's share
    for name, p in after[0].items():
        torch.testing.assert_close(before[1][name], before[0][name], rtol=0, atol=0)
        torch.testing.assert_close(after[1][name], p, rtol=1e-5, atol=1e-6)
    assert sum(not torch.equal(after[0][n], before[0][n]) for n in after[0]) >= len(after[0]) // 2


@pytest.mark.parametrize(
    "settings",
    [{"kl_coef": 0.1}, {"kl_coef": 0.0, "clip": None, "baseline": False, "scale_advantages": False}],
    ids=["kl", "rft"],
)
def test_uniform_groups_are_run_when_they_have_a_gradient(settings, tiny_lm_dir, tmp_path, monkeypatch):
    """The KL term pulls every row; in Online RFT (no baseline, KL or clip) an all-correct group has advantage 1."""
    monkeypatch.setattr(GRPO, "rewards", lambda self, *a, **k: torch.tensor([[1.0], [1.0], [0.0], [1.0]]))
    model = _model(tiny_lm_dir, settings, answer_reward=True)
    rows, run = [], model.players.token_logprobs

    def spy(name, rollout, *a, **k):
        if torch.is_grad_enabled():
            rows.append(rollout.sequences.shape[0])
        return run(name, rollout, *a, **k)

    monkeypatch.setattr(model.players, "token_logprobs", spy)
    _trainer(tmp_path, steps=1).fit(model, _dm())
    assert rows == [4]
    assert float(model.trainer.callback_metrics["train/informative_groups"]) == 0.5


def test_the_arguments_passed_on_to_the_base_are_kept_in_the_hparams_with_their_defaults(tiny_lm_dir):
    model = _model(tiny_lm_dir, log_samples=2)
    assert (model.hparams.grad_clip, model.hparams.max_consecutive_nonfinite, model.hparams.log_samples) == (1.0, 10, 2)
    assert model.board.num_samples == 2 and "optimizer" not in model.hparams


# ------------------------------------------------------------------------------------- online pairwise (pairwise=)
def _online_ipo(tiny_lm_dir, monkeypatch, rewards, tau=0.1, lr=1e-3):
    """GRPO with ``pairwise`` IPO on fixed rewards; its rollouts are kept in the returned list, one per step."""
    monkeypatch.setattr(GRPO, "rewards", lambda self, *a, **k: torch.tensor(rewards).unsqueeze(1))
    model = _model(tiny_lm_dir, {"kl_coef": 0.0}, pairwise=PairwiseLoss("ipo", beta=tau), lr=lr, grad_clip=None)
    rollouts, generate = [], model.players.generate
    monkeypatch.setattr(model.players, "generate", lambda *a, **k: rollouts.append(generate(*a, **k)) or rollouts[-1])
    return model, rollouts


def test_online_ipo_moves_its_pairs_margin_as_the_first_adam_step_predicts(tiny_lm_dir, tmp_path, monkeypatch):
    """Two prompts, two replies each, the first reply rewarded: pairs (0, 1) and (2, 3). The policy starts at the
    reference, so each pair's IPO margin h (chosen minus rejected per-token log-ratio) is 0 and the first loss is
    (1/(2τ))² = 25 exactly. Adam's first step moves every parameter by lr·sign(g) with g = −(1/τ)·∇h̄ (h̄ the pairs'
    mean margin), so to first order h̄ rises by lr·‖∇h̄‖₁ and the mean loss falls to 25 − (2/(2τ))·lr·‖∇h̄‖₁."""
    L.seed_everything(0)
    tau, lr = 0.1, 1e-3
    model, rollouts = _online_ipo(tiny_lm_dir, monkeypatch, [1.0, 0.0, 1.0, 0.0], tau, lr)
    trainable = [p for p in model.players.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trainable]
    _trainer(tmp_path, steps=1).fit(model, _dm())
    assert float(model.trainer.callback_metrics["train/loss"]) == pytest.approx(1 / (2 * tau) ** 2, rel=1e-6)
    pairs = rollouts[0].rows(slice(0, 4), 2)
    lengths = pairs.completion_mask.sum(dim=1).float()

    def margins() -> torch.Tensor:
        ratio = (model.players.logprobs("policy", pairs, 1.0) - model.players.logprobs(None, pairs, 1.0)) / lengths
        return ratio[0::2] - ratio[1::2]

    trained = [p.detach().clone() for p in trainable]
    with torch.no_grad():
        for p, s in zip(trainable, start):
            p.copy_(s)
    grads = torch.autograd.grad(margins().mean(), trainable, allow_unused=True)
    l1 = sum(float(g.abs().sum()) for g in grads if g is not None)
    with torch.no_grad():
        for p, t in zip(trainable, trained):
            p.copy_(t)
        after = margins()
    predicted_mean_margin = lr * l1
    assert after.mean().item() == pytest.approx(predicted_mean_margin, rel=0.01)  # measured: 0.07% off
    loss_after = ((after - 1 / (2 * tau)) ** 2).mean().item()
    assert 25.0 - loss_after == pytest.approx(2 * (1 / (2 * tau)) * predicted_mean_margin, rel=0.01)
    assert (after > 0).all()  # each chosen reply's log-prob rose relative to its rejected one's


def test_online_pairwise_steps_on_tied_groups_without_moving(tiny_lm_dir, tmp_path, monkeypatch):
    """No group has a better reply: one tied pair runs at weight 0, the optimizer steps and nothing moves."""
    L.seed_everything(0)
    model, _ = _online_ipo(tiny_lm_dir, monkeypatch, [1.0, 1.0, 0.0, 0.0])
    before = {n: p.detach().clone() for n, p in model.players.named_parameters() if p.requires_grad}
    _trainer(tmp_path, steps=1).fit(model, _dm())
    assert model.trainer.global_step == 1
    for name, p in model.players.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), name
    assert float(model.trainer.callback_metrics["train/informative_groups"]) == 0.0


def test_online_pairwise_settings_are_refused_by_name(tiny_lm_dir):
    with pytest.raises(ValueError, match="policy_gradient.kl_coef must be 0 with pairwise"):
        _model(tiny_lm_dir, pairwise=PairwiseLoss("ipo"))  # _model's kl_coef is 0.1
    with pytest.raises(ValueError, match="pairwise.loss_type must be one of"):
        _model(tiny_lm_dir, {"kl_coef": 0.0}, pairwise={"loss_type": "kto"})
