"""Debate self-play module on a tiny random Qwen2: forked play, gradients only on the forked ply, bad input, lr."""

import json
import math
import time

import lightning as L
import pytest
import torch
from helpers.debate import script_judge, tiny_debate_module
from helpers.provenance import check_provenance

from alignment_games.callbacks import MCCTracker, PeakCheckpoint
from alignment_games.datamodules.prompts import collate_prompts, index_rows
from alignment_games.modules.algorithms.debate import Transcript, split_reply
from alignment_games.modules.evaluation.audit import tensors_sha256
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import DebateJudge, HFJudge, JudgeVotes, ProgrammaticJudge

PROBLEMS = ["Ava has 2 apples. Then, Ava buys 3 more. How many apples does Ava have now?", "What is 4 + 4?", "1 + 1?"]


def _module(tiny_lm_dir, protocol="debate_aba", players="lora", **kw):
    return tiny_debate_module(tiny_lm_dir, protocol, players, **kw)


def test_forked_play_one_generate_call_per_ply(tiny_lm_dir):
    torch.manual_seed(0)
    m = _module(tiny_lm_dir)
    calls = []
    original = m.bank.generate

    def counting(player, prompts, num_samples, *a, **kw):
        calls.append(len(prompts))
        return original(player, prompts, num_samples, *a, **kw)

    m.bank.generate = counting
    roll = m.play(PROBLEMS, ["5", "8", None], group_size=2, fork_plies=[0, 1, 2])
    # ABA, G = 2, forks at plies 0, 1, 2: rows per ply [2+1+1, 2+2+1, 2+2+2]; Alice and Bob rows share a call
    assert calls == [4, 5, 6]
    ts = roll.transcripts
    assert len(ts) == 6 and all(len(t.replies) == 3 for t in ts)
    assert ts[2].replies[0] is ts[3].replies[0]  # problem 1 forks at the critique: one shared answer
    assert ts[4].replies[:2] == ts[5].replies[:2]  # problem 2 forks at the rebuttal: shared answer and critique
    assert sorted(roll.chunks) == [0, 1, 2] and [idx for _, idx in roll.chunks.values()] == [[0, 1], [2, 3], [4, 5]]
    # The forked ply's prompt holds the earlier plies' visible text: the rebuttal prompt quotes Bob's critique.
    chunk, _ = roll.chunks[2]
    prompt_text = m.bank.tokenizer.decode(chunk.sequences[0, : chunk.prompt_width], skip_special_tokens=True)
    assert ts[4].visible("critique") in prompt_text and ts[4].visible("answer") in prompt_text


def test_gradient_only_on_the_forked_ply(tiny_lm_dir):
    """Log-probability outputs at positions outside the forked ply's reply get exactly zero gradient."""
    torch.manual_seed(1)
    m = _module(tiny_lm_dir, protocol="debate_ab")
    roll = m.play(PROBLEMS[:2], ["5", "8"], group_size=2, fork_plies=[1, 1])  # both fork at Bob's critique
    assert list(roll.chunks) == [1]
    captured, forwards = [], []

    def keep_logits(module, inputs, output):
        if output.shape[-2] == 0:  # the model's own call: it hands its hidden states to the chunked log-softmax
            forwards.append(output.shape[0])
        else:  # one chunk of completion tokens, [tokens, V], in row-major order
            output.retain_grad()
            captured.append(output)

    handle = m.bank.model.get_output_embeddings().register_forward_hook(keep_logits)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _, _ = m.policy_loss(roll, adv)
    handle.remove()
    loss.backward()
    assert forwards == [4]  # one forward, on the forked rows only (the answer ply's rows are never scored)
    chunk, _ = roll.chunks[1]
    # only the forked reply's positions reach the vocabulary (earlier plies never do); row r, token t's logits
    grad = torch.cat([o.grad for o in captured]).abs().sum(-1).view(chunk.completion_mask.shape)
    reply = chunk.completion_mask.bool()
    assert (grad[~reply] == 0).all()  # padding after EOS (where a reply ended early): zero
    assert (grad[reply] > 0).all()  # every token of the forked reply: a gradient
    adapter = [p for p in m.bank.player_parameters("policy") if p.grad is not None]
    assert adapter and any(p.grad.abs().sum() > 0 for p in adapter)


def test_learning_rate_multiple_for_the_debates(tiny_lm_dir):
    assert _module(tiny_lm_dir, "rlaif_a", lr=1e-3).configure_optimizers().param_groups[0]["lr"] == 1e-3
    assert _module(tiny_lm_dir, "debate_ab", lr=1e-3).configure_optimizers().param_groups[0]["lr"] == 2.5e-4
    assert _module(tiny_lm_dir, "rlvr", lr=1e-3, multi_player_lr_scale=0.5).learning_rate == 1e-3


def test_bad_settings_are_refused(tiny_lm_dir):
    with pytest.raises(ValueError, match="protocol"):
        _module(tiny_lm_dir, "debate_abc")
    with pytest.raises(ValueError, match="policy_gradient.group_size must be at least 2, got 1"):
        _module(tiny_lm_dir, policy_gradient={"group_size": 1})
    with pytest.raises(ValueError, match="trainable_plies"):
        _module(tiny_lm_dir, "rlaif_a", trainable_plies=["critique"])
    with pytest.raises(ValueError, match="bob_prompt"):
        _module(tiny_lm_dir, bob_prompt="argue!")  # neither a prompt name nor a template with {solution}
    for field, bad, message in [
        ("lr", -1e-4, "lr must be positive"),
        ("multi_player_lr_scale", 0.0, "multi_player_lr_scale must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            _module(tiny_lm_dir, **{field: bad})


class Mumbler(DebateJudge):
    """A judge whose every output is unparseable."""

    def __call__(self, transcripts):
        return JudgeVotes(
            torch.full((len(transcripts), self.num_votes), float("nan")), [["hmm"] * 8] * len(transcripts)
        )


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows  # {"prompt", "reference", "index"} items

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _quiet_trainer(root, max_steps, limit_val_batches):
    """A trainer without logger, checkpoints or progress bar."""
    return L.Trainer(
        max_steps=max_steps,
        limit_val_batches=limit_val_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
    )


def _loader(rows):
    items = index_rows([{"prompt": problem, "reference": reference} for problem, reference in rows])
    return torch.utils.data.DataLoader(Rows(items), batch_size=len(rows), collate_fn=collate_prompts)


def test_eval_greedy_decodes_every_evaluation_ply_greedily_and_training_samples(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    m = _module(tiny_lm_dir, "debate_aba", eval_greedy=True)
    calls, original = [], m.bank.generate

    def recording(player, prompts, num_samples, sampling, greedy=False):
        calls.append((m.trainer.training, greedy))
        return original(player, prompts, num_samples, sampling, greedy=greedy)

    m.bank.generate = recording
    rows = [(PROBLEMS[0], "5"), (PROBLEMS[1], "8")]
    _quiet_trainer(tmp_path, max_steps=1, limit_val_batches=1).fit(m, _loader(rows), _loader(rows))
    # the sanity check, one step, one validation, three plies each: greedy exactly when not training
    assert calls == [(False, True)] * 3 + [(True, False)] * 3 + [(False, True)] * 3


def test_bad_input_is_counted_never_a_crash(tiny_lm_dir, tmp_path):
    """No reference, an unparseable judge and empty replies: one full step and a validation, all counted."""
    L.seed_everything(0)
    m = _module(tiny_lm_dir, "debate_ab", judge=Mumbler(num_votes=8))
    original = m.bank.generate

    def empty_answers(player, prompts, num_samples, sampling, *a, **kw):
        out = original(player, prompts, num_samples, sampling, *a, **kw)
        if sampling.max_new_tokens == 8:  # Alice's answer turn
            out.texts = ["" for _ in out.texts]
        return out

    m.bank.generate = empty_answers
    rows = [(PROBLEMS[0], None), (PROBLEMS[1], "8")]
    trainer = _quiet_trainer(tmp_path, max_steps=1, limit_val_batches=1)
    trainer.fit(m, train_dataloaders=_loader(rows), val_dataloaders=_loader(rows))
    c = m.counters
    assert c["batches_seen"] == 1 and c["no_reference"] == 2  # problem 0's two branches
    assert c["judge_unparseable"] == 4 * 8  # B * G transcripts, 8 votes each
    assert c["empty_replies"] >= 4  # every answer was emptied
    metrics = trainer.callback_metrics
    assert metrics["train/missing_answer"] == 1.0 and metrics["train/verdict_share"] == 0.5
    assert metrics["val/total"] == 1.0 and metrics["val/correct"] == 0.0  # only the referenced problem counts
    assert math.isfinite(float(metrics["train/reward"]))


class Confusion(ProgrammaticJudge):
    """A programmatic judge (its generator is checkpointed) with fixed votes per problem: 6/8 accept, 2/8 reject."""

    ACCEPT = {"1 + 2?": True, "1 + 3?": True, "1 + 4?": True, "2 + 2?": True, "2 + 3?": False, "2 + 4?": False}

    def __call__(self, transcripts):
        votes = [[1.0] * 6 + [0.0] * 2 if self.ACCEPT[t.problem] else [1.0] * 2 + [0.0] * 6 for t in transcripts]
        return JudgeVotes(torch.tensor(votes), [[] for _ in transcripts])


def test_rlvr_step_and_checkpoint_round_trip(tiny_lm_dir, tmp_path):
    """Two steps with scripted answers and verdicts: the evaluation's confusion counts are the hand-made truth."""
    from sklearn.metrics import matthews_corrcoef

    L.seed_everything(0)
    m = _module(tiny_lm_dir, "rlvr", judge=Confusion(num_votes=8, seed=5))
    # (problem, reference, Alice's answer): the first three right, the last three off by ten
    script = [("1 + 2?", "3", "3"), ("1 + 3?", "4", "4"), ("1 + 4?", "5", "5")]
    script += [("2 + 2?", "4", "14"), ("2 + 3?", "5", "15"), ("2 + 4?", "6", "16")]
    rows = [(problem, reference) for problem, reference, _ in script]
    original = m.bank.generate

    def scripted(player, prompts, num_samples, *a, **kw):
        out = original(player, prompts, num_samples, *a, **kw)
        out.texts = [f"\\boxed{{{next(ans for p, _, ans in script if p in prompt)}}}" for prompt in prompts]
        return out

    m.bank.generate = scripted
    trainer = _quiet_trainer(tmp_path, max_steps=2, limit_val_batches=1)
    before = [p.detach().clone() for p in m.bank.player_parameters("policy")]
    trainer.fit(m, train_dataloaders=_loader(rows), val_dataloaders=_loader(rows))
    records = [json.loads(line) for line in (tmp_path / "debate_evals.jsonl").read_text().splitlines()]
    assert [r["batches_seen"] for r in records] == [1, 2]  # one line per validation (one per 1-batch epoch)
    last = records[-1]
    assert last["trials"] == 6 and last["successes"] == 3 == trainer.callback_metrics["val/correct"]
    # four distinct counts, so any two cells swapped shows: right & accepted 3, wrong & accepted 1 (2 + 2),
    # wrong & rejected 2 (2 + 3, 2 + 4), right & rejected none
    counts = {k: last[k] for k in ("tp", "fp", "tn", "fn", "ties", "unparsed")}
    assert counts == {"tp": 3, "fp": 1, "tn": 2, "fn": 0, "ties": 0, "unparsed": 0}
    truth, accepted = [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]
    assert last["mcc"] == pytest.approx(matthews_corrcoef(truth, accepted))
    assert last["mcc"] == pytest.approx(6 / 72**0.5)  # (3 * 2 - 1 * 0) / sqrt(4 * 2 * 3 * 3)
    # each problem's result, in the dataset's order, and the adapter that produced them (it trained in between)
    rows = last["problems"]
    assert sorted(rows["item"]) == list(range(6))
    by_item = {k: [rows[k][rows["item"].index(i)] for i in range(6)] for k in ("correct", "accepts", "tie")}
    assert by_item == {"correct": truth, "accepts": accepted, "tie": [0] * 6}
    assert last["adapter_sha256"] == tensors_sha256(m.bank.player_parameters("policy"))
    assert records[0]["adapter_sha256"] == tensors_sha256(before)  # equal-reward groups: no update in between
    assert tensors_sha256([before[0] + 1e-3, *before[1:]]) != last["adapter_sha256"]
    path = tmp_path / "x.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    # the frozen base is not stored: the adapter and the running epoch averages are
    assert all(("lora" in k) == k.startswith("bank.") for k in ckpt["state_dict"])
    assert {k for k in ckpt["state_dict"] if not k.startswith("bank.")} == {
        f"{m}.{s}" for m in ("epoch_reward", "epoch_accuracy") for s in ("mean_value", "weight")
    }
    assert ckpt["game_state"]["counters"]["batches_seen"] == 2
    m2 = _module(tiny_lm_dir, "rlvr", judge=ProgrammaticJudge(num_votes=8, seed=99))
    m2.on_load_checkpoint(ckpt)
    assert m2.counters["batches_seen"] == 2
    assert torch.equal(m2.judge.generator.get_state(), m.judge.generator.get_state())
    after = list(m.bank.player_parameters("policy"))
    assert len(before) == len(after)
    bad = dict(ckpt, state_dict={})
    with pytest.raises(KeyError, match="trainable"):
        m2.on_load_checkpoint(bad)


def test_one_step_against_an_llm_judge(tiny_lm_dir, tmp_path):
    """The module trains against a frozen HF judge through the same interface (its votes: one call per step)."""
    L.seed_everything(0)
    judge = HFJudge(
        tiny_lm_dir, chain_of_thought=False, max_answer_words=50, num_votes=8, sampling=Sampling(max_new_tokens=4)
    )
    calls = []
    original = judge.model.generate
    judge.model.generate = lambda **kw: calls.append(kw["input_ids"].shape[0]) or original(**kw)
    m = _module(tiny_lm_dir, "debate_ab", judge=judge)
    trainer = _quiet_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(m, train_dataloaders=_loader([(PROBLEMS[0], "5"), (PROBLEMS[1], "8")]))
    assert calls == [32]  # B * G = 4 transcripts, 8 votes each: one generate call (each prompt prefilled once)
    assert m.counters["batches_seen"] == 1
    assert m.counters["judge_unparseable"] == int(trainer.callback_metrics["train/judge_unparseable"])


def test_llm_judge_reads_bob_and_his_critique_moves_its_vote(tiny_lm_dir):
    """The LM judge reads the whole debate, Bob included: his critique changes the judge's input and, with a scripted
    reader in place of ``generate`` (Bob when the input it is given holds his flagged mistake), the votes."""
    judge = HFJudge(tiny_lm_dir, chain_of_thought=False, num_votes=3, sampling=Sampling(max_new_tokens=4))
    answer = "2 + 3 = 6, so \\boxed{6}."
    critiques = {"quiet": "Looks fine to me.", "flagged": "The sum 2 + 3 is 5, not 6: an off-by-one slip."}
    seen = script_judge(judge, lambda text: "Verdict: Bob" if "off-by-one slip" in text else "Verdict: Alice")
    games = {
        k: Transcript(PROBLEMS[0], "5", "debate_ab", [split_reply(answer), split_reply(c)])
        for k, c in critiques.items()
    }
    out = judge.vote([games["quiet"], games["flagged"]])
    assert len(seen) == 2 and seen[0] != seen[1]
    for text, critique in zip(seen, critiques.values()):
        assert answer in text and critique in text and "Bob's critique:" in text
    assert out.votes.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert out.verdicts == ["alice", "bob"]


def test_llm_judge_prefill_starts_its_answer_and_is_read_with_it(tiny_lm_dir):
    """``prefill`` ends the judge's prompt, and a continuation that only names a side (`` Bob``) is read with it."""
    judge = HFJudge(
        tiny_lm_dir, chain_of_thought=False, prefill="Verdict:", num_votes=2, sampling=Sampling(max_new_tokens=2)
    )
    tok = judge.tokenizer
    game = Transcript(PROBLEMS[0], "5", "debate_ab", [split_reply("2 + 3 = 6, so \\boxed{6}."), split_reply("No.")])
    assert judge.prompt(game).endswith("<|im_start|>assistant\nVerdict:")

    def scripted_generate(input_ids, attention_mask, num_return_sequences, **kw):
        tail = tok(" Bob", add_special_tokens=False)["input_ids"]
        return torch.tensor([ids.tolist() + tail for ids in input_ids for _ in range(num_return_sequences)])

    judge.model.generate = scripted_generate
    out = judge.vote([game])
    assert out.votes.tolist() == [[0.0, 0.0]] and out.texts == [["Verdict: Bob", "Verdict: Bob"]]


def test_full_fine_tuning_option(tiny_lm_dir):
    m = _module(tiny_lm_dir, "debate_ab", players="separate")
    params = m.bank.player_parameters("policy")
    assert sum(p.numel() for p in params) == sum(p.numel() for p in m.bank.models["policy"].parameters())
    assert not any(p.requires_grad for p in m.bank.reference.parameters())  # the frozen reference copy
    roll = m.play(PROBLEMS[:1], ["5"], group_size=2, fork_plies=[0])
    loss, _, _ = m.policy_loss(roll, torch.tensor([1.0, -1.0]))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def _fit(tiny_lm_dir, root, max_steps, ckpt_path=None):
    L.seed_everything(0)
    m = _module(tiny_lm_dir, "debate_ab", judge=ProgrammaticJudge(num_votes=8, seed=1), lr=1e-2)
    trainer = _quiet_trainer(root, max_steps=max_steps, limit_val_batches=0)
    rows = [(PROBLEMS[0], "5"), (PROBLEMS[1], "8")]  # one batch per epoch: checkpoints fall on epoch boundaries
    trainer.fit(m, train_dataloaders=_loader(rows), ckpt_path=ckpt_path)
    return m, trainer


def test_resumed_run_matches_the_uninterrupted_one(tiny_lm_dir, tmp_path):
    """Sampling is seeded per batch and the judge's generator is checkpointed: a resume draws the same games."""
    full, _ = _fit(tiny_lm_dir, tmp_path / "full", 4)
    half, trainer = _fit(tiny_lm_dir, tmp_path / "half", 2)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed, _ = _fit(tiny_lm_dir, tmp_path / "resumed", 4, ckpt_path=str(tmp_path / "half.ckpt"))
    assert resumed.counters == full.counters
    for a, b in zip(full.bank.player_parameters("policy"), resumed.bank.player_parameters("policy")):
        assert torch.equal(a, b)
    moved = any(
        not torch.equal(a, b)
        for a, b in zip(full.bank.player_parameters("policy"), half.bank.player_parameters("policy"))
    )
    assert moved  # the last two steps did train


@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")
def test_nonfinite_rewards_and_losses_are_skipped_counted_and_stop_the_run(tiny_lm_dir, tmp_path):
    """Step 1 trains; step 2's rewards and step 3's loss are NaN: both skipped and counted, the second stops the run
    (2 in a row), and last.ckpt (step 1) holds the adapter as it is now."""
    import dataclasses

    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    m = _module(tiny_lm_dir, "debate_ab", judge=ProgrammaticJudge(num_votes=8, seed=1), max_consecutive_nonfinite=2)
    calls = {"rewards": 0, "loss": 0}
    rewards, policy_loss = m.rewards, m.policy_loss

    def nan_rewards(*a, **kw):
        calls["rewards"] += 1
        out = rewards(*a, **kw)
        bad = calls["rewards"] == 2
        return [[dataclasses.replace(x, reward=math.nan) if bad else x for x in row] for row in out]

    def nan_loss(*a, **kw):
        calls["loss"] += 1
        loss, stats, current = policy_loss(*a, **kw)
        return (loss * math.nan if calls["loss"] == 2 else loss), stats, current

    m.rewards, m.policy_loss = nan_rewards, nan_loss
    before = [p.detach().clone() for p in m.bank.player_parameters("policy")]
    trainer = L.Trainer(
        max_steps=50,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)],
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="NaN or inf; the update is skipped") as warned:
        with pytest.raises(RuntimeError, match="2 consecutive steps had non-finite losses"):
            trainer.fit(m, train_dataloaders=_loader([(PROBLEMS[0], "5"), (PROBLEMS[1], "8")]))
    assert sum("rewards are NaN" in str(w.message) for w in warned) == 1
    assert m.nonfinite_skipped == m.consecutive_nonfinite == 2 and m.counters["batches_seen"] == 3
    assert trainer.global_step == 1  # one optimizer step: the two skipped batches stepped nothing
    # step 2's logs (step 3 stopped the run before its own logs were collected): the count, and no stale loss
    assert trainer.callback_metrics["train/nonfinite_skipped"] == 1.0
    assert math.isnan(trainer.callback_metrics["train/loss"])
    assert float(m.epoch_reward.weight) == 0.0  # one batch per epoch: the skipped steps added nothing
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert float(ckpt["state_dict"]["epoch_reward.weight"]) == 4.0  # step 1's B * G rewards, mid-epoch
    assert ckpt["global_step"] == 1 and ckpt["game_state"]["nonfinite"] == {
        "nonfinite_skipped": 0,
        "consecutive_nonfinite": 0,
    }
    now = list(m.bank.player_parameters("policy"))
    assert any(not torch.equal(a, b) for a, b in zip(before, now))  # the good step trained
    trained = {f"bank.{n}": p.detach() for n, p in m.bank.named_parameters() if p.requires_grad}
    assert trained and all(torch.equal(ckpt["state_dict"][k], v) for k, v in trained.items())  # skips changed nothing


def _transcript():
    return Transcript("What is 5 + 7?", "12", "rlaif_a", [split_reply("5 + 7 = 12, so \\boxed{12}.", required=False)])


class Staller(DebateJudge):
    """A judge that hangs (an API that never answers) on every call after the first ``fast`` ones."""

    def __init__(self, fast=0, **kw):
        super().__init__(**kw)
        self.calls, self.fast = 0, fast

    def __call__(self, transcripts):
        self.calls += 1
        if self.calls > self.fast:
            time.sleep(3.0)
        return JudgeVotes(torch.ones((len(transcripts), self.num_votes)), [[] for _ in transcripts])


class Scribbler(DebateJudge):
    """A judge that returns garbage numbers as votes."""

    def __call__(self, transcripts):
        row = torch.tensor([1.0, 0.0, 2.0, -1.0, float("inf"), 0.5, float("nan"), 1.0])
        return JudgeVotes(row.repeat(len(transcripts), 1), [[] for _ in transcripts])


def test_judge_timeouts_and_garbage_votes_are_counted_defaults_never_a_crash(tiny_lm_dir, tmp_path):
    """A judge that hangs past timeout_s: the step finishes with a 0.5 share and counted timeouts."""
    L.seed_everything(0)
    m = _module(tiny_lm_dir, "rlaif_a", judge=Staller(num_votes=8, timeout_s=0.2))
    rows = [(PROBLEMS[0], "12"), (PROBLEMS[1], "8")]
    trainer = _quiet_trainer(tmp_path, max_steps=1, limit_val_batches=1)
    before = {n: p.detach().clone() for n, p in m.bank.named_parameters() if p.requires_grad}
    trainer.fit(m, train_dataloaders=_loader(rows), val_dataloaders=_loader(rows))
    metrics = trainer.callback_metrics
    assert m.counters["judge_timeouts"] == 4  # B * G transcripts of the one training step
    assert metrics["train/judge_timeouts"] == 4.0 and metrics["val/judge_timeouts"] == 2.0
    assert metrics["train/verdict_share"] == 0.5 and m.counters["judge_unparseable"] == 4 * 8
    # every branch got the same 0.5: no advantage, so no parameter moved
    assert all(torch.equal(before[n], p) for n, p in m.bank.named_parameters() if p.requires_grad)

    votes = Scribbler(num_votes=8).vote([_transcript()] * 3)
    assert votes.invalid == 3 * 4 and votes.unparseable == 3 * 5  # 2, -1, inf, 0.5 are garbage; plus the NaN
    assert votes.shares == [pytest.approx(2 / 3)] * 3  # 1, 0, 1 are the votes that count


def test_a_judge_in_time_is_not_changed_by_the_time_limit():
    ts = [_transcript()] * 5
    plain = ProgrammaticJudge(num_votes=8, seed=4).vote(ts)
    limited = ProgrammaticJudge(num_votes=8, seed=4, timeout_s=30.0).vote(ts)
    assert torch.equal(plain.votes, limited.votes) and limited.timed_out == 0 and limited.invalid == 0
    late = Staller(num_votes=8, timeout_s=0.05).vote(ts)
    assert late.timed_out == 5 and torch.isnan(late.votes).all() and late.shares == [0.5] * 5

    class Misshapen(DebateJudge):
        def __call__(self, transcripts):
            return JudgeVotes(torch.ones((len(transcripts), 3)), [])

    with pytest.raises(ValueError, match="Misshapen returned votes of shape"):
        Misshapen(num_votes=8).vote(ts)
    for bad in (0, -1.0, float("inf"), "10"):
        with pytest.raises(ValueError, match="timeout_s"):
            ProgrammaticJudge(timeout_s=bad)


def test_hf_judge_bounds_its_own_generation_time(tiny_lm_dir):
    judge = HFJudge(tiny_lm_dir, num_votes=4, sampling=Sampling(max_new_tokens=64), timeout_s=1e-4)
    seen = {}
    original = judge.model.generate

    def spy(**kw):
        seen.update(kw)
        return original(**kw)

    judge.model.generate = spy
    v = judge.vote([_transcript()] * 2)
    assert 0 <= seen["max_time"] <= 1e-4 and v.timed_out == 2  # what the prefill left of the limit
    assert all(len(t) < 64 for row in v.texts for t in row)  # stopped early, not after 64 tokens


class Scripted(DebateJudge):
    """A judge whose votes per problem are fixed: a 4/4 tie, all unparseable, 6 of 8 and 2 of 8 for Alice."""

    VOTES = {
        "2 + 3?": [1, 1, 1, 1, 0, 0, 0, 0],
        "4 + 4?": [float("nan")] * 8,
        "1 + 6?": [1, 1, 1, 1, 1, 1, 0, 0],
        "3 + 6?": [1, 1, 0, 0, 0, 0, 0, 0],
    }

    def __call__(self, transcripts):
        votes = torch.tensor([self.VOTES[t.problem] for t in transcripts], dtype=torch.float32)
        return JudgeVotes(votes, [[] for _ in transcripts])


def test_final_answers_ties_and_unparsed_verdicts_in_the_evaluation(tiny_lm_dir, tmp_path):
    """Ties and unparsed verdicts end to end: Alice's rebuttal corrects every answer, so by the paper's definition
    ("The final answer is the last \\boxed{...}") every problem is solved; the judge's 4/4 split and its unparseable
    votes are no verdict, so MCC scores two problems (one accepted, one rejected) and counts a tie and an unparsed.
    """
    L.seed_everything(0)
    m = _module(tiny_lm_dir, "debate_aba", judge=Scripted(num_votes=8))
    rows = [("2 + 3?", "5"), ("4 + 4?", "8"), ("1 + 6?", "7"), ("3 + 6?", "9")]
    answers = dict(rows)
    original = m.bank.generate

    def scripted(player, prompts, num_samples, *a, **kw):
        out = original(player, prompts, num_samples, *a, **kw)
        texts = []
        for prompt in prompts:
            problem = next(p for p in answers if p in prompt)
            if "Bob's critique" in prompt:  # Alice's rebuttal corrects her answer
                texts.append(f"I slipped, it is \\boxed{{{answers[problem]}}}.")
            elif "Alice's solution" in prompt:  # Bob
                texts.append("That is wrong.")
            else:  # Alice's answer turn: always off by ten
                texts.append(f"\\boxed{{{int(answers[problem]) + 10}}}")
        out.texts = texts
        return out

    m.bank.generate = scripted
    mcc = MCCTracker("judge", "truth", stage="val", id_key="judge_item")
    peak = PeakCheckpoint(success_key="correct", id_key="correct_item", window=1, dirpath=tmp_path / "peak")
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[mcc, peak],
    )
    trainer.fit(m, train_dataloaders=_loader(rows), val_dataloaders=_loader(rows))
    metrics = trainer.callback_metrics
    # the final answer (the rebuttal's box) is what accuracy reads: all four right
    assert (metrics["val/correct"], metrics["val/total"], metrics["val/accuracy"]) == (4.0, 4.0, 1.0)
    assert (metrics["val/judge_ties"], metrics["val/judge_unparsed"]) == (1.0, 1.0)
    (record,) = [json.loads(line) for line in (tmp_path / "debate_evals.jsonl").read_text().splitlines()]
    expected = {"tp": 1, "fp": 0, "tn": 0, "fn": 1, "ties": 1, "unparsed": 1, "successes": 4, "trials": 4}
    assert {k: record[k] for k in expected} == expected
    check_provenance(record, {"model.lm.name_or_path": tiny_lm_dir})  # the policy's base by each file's hash
    assert [mcc.last[k] for k in ("tp", "fp", "tn", "fn")] == [1.0, 0.0, 0.0, 1.0]
    assert (peak.evaluations[0]["successes"], peak.evaluations[0]["trials"]) == (4.0, 4.0)
    # training: 4 problems x 2 branches, the tie and the unparsed problem's branches counted
    assert (m.counters["judge_ties"], m.counters["judge_unparsed"]) == (2, 2)


@pytest.mark.distributed
def test_two_ddp_processes_count_each_validation_problem_once(tiny_lm_dir, tmp_path):
    """3 validation problems on 2 processes: the sampler pads them to 4, yet every count holds each problem once."""
    import glob
    import os
    import subprocess
    import sys

    from helpers import ROOT as root

    from alignment_games.datamodules.debate import DebateDataModule

    data = {"problems": "single_step", "num_prompts": 10, "val_fraction": 0.3, "batch_size": 2}
    dm = DebateDataModule(**data)
    dm.setup("fit")
    n_val = len(dm.splits["val"])
    assert n_val % 2 == 1  # does not divide by the number of processes
    args = [
        sys.executable,
        os.path.join(root, "train.py"),
        "fit",
        "--config",
        os.path.join(root, "configs", "debate_ab.yaml"),
        f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
        "--model.init_args.sampling.max_new_tokens=6",
        "--model.init_args.reply_max_new_tokens=4",
        "--model.init_args.lm.max_prompt_tokens=48",
        *[f"--data.init_args.{k}={v}" for k, v in data.items()],
        "--trainer.max_steps=1",
        "--trainer.val_check_interval=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
    ]
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "runs" / "**" / "debate_evals.jsonl"), recursive=True)
    (record,) = [json.loads(line) for line in open(path).read().splitlines()]
    assert record["trials"] == n_val  # 4 rows were played, one problem twice
    assert sum(record[k] for k in ("tp", "fp", "tn", "fn", "ties", "unparsed")) == n_val
    ckpt = torch.load(glob.glob(str(tmp_path / "runs" / "**" / "last.ckpt"), recursive=True)[0], weights_only=False)
    states = ckpt["callbacks"]
    (peak,) = [s for k, s in states.items() if k.startswith("PeakCheckpoint")]
    assert peak["evaluations"][0]["trials"] == n_val
    val_mcc = MCCTracker("judge", "truth", stage="val", trend_window=3, id_key="judge_item").state_key
    last = states[val_mcc]["history"][-1]
    assert [last[k] for k in ("tp", "fp", "tn", "fn")] == [record[k] for k in ("tp", "fp", "tn", "fn")]


def test_a_resumed_run_lists_each_evaluation_once(tiny_lm_dir, tmp_path, monkeypatch):
    """debate_evals.jsonl is rewritten from the evaluation history (restored from the checkpoint on a resume): the
    evaluation a killed run made after its checkpoint is replaced by the resumed run's, not appended twice."""
    m = _module(tiny_lm_dir, "rlvr")
    m.trainer = _quiet_trainer(tmp_path, max_steps=1, limit_val_batches=1)
    counts = iter([(3, 6), (4, 6), (5, 6)])

    def evaluation(stage):
        s, t = next(counts)
        cells = {"tp": s, "fp": 0, "tn": 0, "fn": t - s, "ties": 0, "unparsed": 0}
        found = {"successes": s, "trials": t, **cells, "reward_sum": 0.0, "n": 0}  # n = 0: reward NaN
        return found, {"item": list(range(t)), "correct": [1] * s + [0] * (t - s)}

    monkeypatch.setattr(m, "_end_evaluation", evaluation)
    m.counters["batches_seen"] = 1
    m.on_validation_epoch_end()
    checkpoint = m.game_state()  # the checkpoint holds the first evaluation
    m.counters["batches_seen"] = 2
    m.on_validation_epoch_end()  # the killed run evaluated once more, then died
    path = tmp_path / "debate_evals.jsonl"
    assert [json.loads(x)["successes"] for x in path.read_text().splitlines()] == [3, 4]
    m.load_game_state(checkpoint)  # the resume
    assert m.counters["batches_seen"] == 1
    m.counters["batches_seen"] = 2  # the resumed run trains the second batch again
    m.on_validation_epoch_end()  # the same evaluation again, by the resumed run
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["batches_seen"], r["successes"]) for r in records] == [(1, 3), (2, 5)]
    assert records[0]["reward"] is None  # NaN written as null, as before
    assert records[1]["problems"]["correct"] == [1] * 5 + [0]  # the resumed run's rows replaced the killed run's
