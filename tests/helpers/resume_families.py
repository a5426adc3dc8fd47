"""The families the resume tests run (``tests/test_resume.py``, ``tests/test_outside_kill.py``): one
:class:`~resume_harness.Family` each (its config, small overrides, batches per epoch, checkpoint cadence and chain of
kills), and :func:`resume_points`, where each resumed run of a chain must start."""

from __future__ import annotations

from .resume_harness import Family, Kill


def _chain(n: int) -> tuple[Kill, ...]:
    """SIGTERM mid-epoch 0, SIGKILL mid-epoch 1, SIGKILL at the start of epoch 2, SIGTERM at the end of epoch 2."""
    return (
        Kill("SIGTERM", after_batch=n // 2),
        Kill("SIGKILL", after_batch=n + n // 2),
        Kill("SIGKILL", epoch=2),
        Kill("SIGTERM", after_batch=3 * n),
    )


# LoRA families on the tiny LM: small adapters, prompts cut from the left (short sequences, fast steps)
_TINY_LORA = (
    "--model.init_args.lm.max_prompt_tokens=48",
    "--model.init_args.lm.lora_r=4",
    "--model.init_args.lm.lora_alpha=8",
)
# the preference model P0 of NLHF and SLHF: an untrained two-member ensemble on the tiny LM (as deep_smida's utility)
_TINY_PREFERENCE = (
    "--model.init_args.preference.init_args.backbone={tiny_lm_dir}",
    "--model.init_args.preference.init_args.backbone_task=causal_lm",
    "--model.init_args.preference.init_args.num_members=2",
    "--model.init_args.preference.init_args.allow_untrained=true",
)
# 14 steps (3.5 epochs of 4 batches) with one validation, at batch 9
_FOURTEEN_STEPS = ("--trainer.max_steps=14", "--trainer.val_check_interval=9", "--trainer.limit_val_batches=1")

# GRPO on the tiny LM with a reward model
_GRPO = (
    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
    # the tiny LM's folder loaded as a sequence classifier: its backbone with a score head initialised under the
    # run's seed, so the rewards vary and the adapter moves (the answer checker alone gives a random policy 0
    # everywhere)
    "--model.init_args.reward_models=[{tiny_lm_dir}]",
    "--model.init_args.answer_reward=false",
    "--model.init_args.policy_gradient.group_size=2",
    "--model.init_args.sampling.max_new_tokens=4",
    *_TINY_LORA,
    "--data.init_args.num_prompts=9",  # 8 train prompts (4 batches of 2), 1 validation
    *_FOURTEEN_STEPS,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="smida_tabular",
            config="smida_tabular.yaml",
            args=("--data.init_args.steps_per_epoch=6", "--trainer.max_steps=22"),
            batches_per_epoch=6,
            ckpt_every=5,
            kills=_chain(6),
        ),
        Family(
            name="preference_ensemble",
            config="preference_ensemble.yaml",
            args=(
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.backbone_task=causal_lm",
                "--model.init_args.num_members=2",
                "--model.init_args.report_bootstrap=0",
                "--data.init_args.num_prompts=24",
                "--data.init_args.responses_per_prompt=3",
                "--data.init_args.batch_size=8",
                "--data.init_args.max_length=96",
                "--trainer.max_steps=20",
                "--trainer.limit_val_batches=1",
                "--trainer.num_sanity_val_steps=0",
            ),
            batches_per_epoch=6,
            ckpt_every=5,
            kills=_chain(6),
            needs_tiny_lm=True,
        ),
        Family(
            name="deep_smida",
            config="deep_smida.yaml",
            args=(
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.sampling.max_new_tokens=4",
                "--model.init_args.lm.max_prompt_tokens=48",  # cut from the left: short sequences, fast steps
                "--model.init_args.follower_samples=2",
                "--model.init_args.utility.init_args.backbone={tiny_lm_dir}",
                "--model.init_args.utility.init_args.backbone_task=causal_lm",
                "--model.init_args.utility.init_args.num_members=2",
                "--model.init_args.utility.init_args.allow_untrained=true",
                "--data.init_args.num_prompts=9",
                "--data.init_args.batch_size=2",
                "--trainer.max_steps=20",  # 10 batches: two optimizer steps each
                "--trainer.val_check_interval=9",  # one validation in the reference run, one in the chain
                "--trainer.limit_val_batches=1",
            ),
            batches_per_epoch=4,
            ckpt_every=5,
            steps_per_batch=2,
            # the slowest family: SIGTERM mid-epoch, then SIGKILL at an epoch boundary (which resumes mid-epoch 1)
            kills=(Kill("SIGTERM", after_batch=2), Kill("SIGKILL", epoch=2)),
            rel_tol=1e-6,  # the gradient norms of a step after a resume can differ in the last float32 bit
            needs_tiny_lm=True,
        ),
        Family(
            name="nlhf",
            config="nlhf.yaml",
            args=(
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.sampling.max_new_tokens=4",
                *_TINY_LORA,
                *_TINY_PREFERENCE,
                "--data.init_args.num_prompts=9",  # 8 train prompts (4 batches of 2), 1 validation
                "--data.init_args.batch_size=2",
                "--trainer.max_steps=10",  # one optimizer: 10 batches
                # validations at batches 3, 6 and 9: the chain resumes at 5 between two of them, so the oracle's
                # generator must travel in the checkpoint
                "--trainer.val_check_interval=3",
                "--trainer.limit_val_batches=1",
            ),
            batches_per_epoch=4,
            ckpt_every=5,
            kills=(Kill("SIGTERM", after_batch=2), Kill("SIGKILL", epoch=2)),
            needs_tiny_lm=True,
        ),
        Family(
            name="slhf",
            config="slhf.yaml",
            args=(
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.sampling.max_new_tokens=4",
                *_TINY_LORA,
                "--model.init_args.follower_samples=2",
                *_TINY_PREFERENCE,
                "--data.init_args.num_prompts=9",
                "--data.init_args.batch_size=2",
                "--trainer.max_steps=20",  # 10 batches: two optimizer steps each
                "--trainer.val_check_interval=3",  # as nlhf: validations at batches 3, 6 and 9
                "--trainer.limit_val_batches=1",
            ),
            batches_per_epoch=4,
            ckpt_every=5,
            steps_per_batch=2,
            kills=(Kill("SIGTERM", after_batch=2), Kill("SIGKILL", epoch=2)),
            needs_tiny_lm=True,
        ),
        Family(
            name="sft_tiny",
            config="sft_tiny.yaml",
            args=(
                '--model.init_args.tiny_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
                '"num_attention_heads": 4, "num_key_value_heads": 2}',
                "--model.init_args.max_length=96",
                "--data.init_args.num_prompts=25",
                "--data.init_args.batch_size=4",
                "--trainer.max_steps=20",
                "--trainer.val_check_interval=4",
                "--trainer.limit_val_batches=1",
                "--trainer.num_sanity_val_steps=0",
            ),
            batches_per_epoch=6,
            ckpt_every=5,
            kills=_chain(6),
        ),
        Family(
            name="pool_dpo",
            config="pool_dpo.yaml",
            args=(
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.duels_per_iteration=2",
                "--model.init_args.num_iterations=13",
                "--model.init_args.sampling.max_new_tokens=4",
                "--model.init_args.eval_max_new_tokens=4",
                *_TINY_LORA,
                "--data.init_args.num_problems=20",
                "--data.init_args.num_test_problems=2",
                "--data.init_args.batch_size=2",
                "--data.init_args.iterations_per_epoch=4",  # one batch = one game iteration, four per epoch
                "--trainer.max_steps=39",  # 13 iterations: one DPO step per follower each (no iteration ties)
                "--trainer.limit_val_batches=1",
            ),
            batches_per_epoch=4,
            ckpt_every=5,  # batches 5 and 10: off the epoch ends (4, 8, 12), which are also the validations
            steps_per_batch=3,  # one AdamW step per follower (dpo_pairs=all, batch_size >= duels, no all-tied one)
            kills=_chain(4),
            needs_tiny_lm=True,
        ),
        Family(
            name="grpo",
            config="grpo_tiny.yaml",
            args=_GRPO,
            batches_per_epoch=4,
            ckpt_every=5,
            kills=_chain(4),
            needs_tiny_lm=True,
        ),
        Family(  # the same run over a 4-bit (NF4) base: the packed weights are reloaded, the adapter resumes
            name="grpo_4bit",
            config="grpo_tiny.yaml",
            args=(*_GRPO, "--model.init_args.lm.load_in_4bit=true"),
            batches_per_epoch=4,
            ckpt_every=5,
            kills=_chain(4),
            needs_tiny_lm=True,
        ),
        Family(
            name="debate_ab",
            config="debate_ab.yaml",  # two plies: the fork choice, Bob's turn and the judge's generator all resume
            args=(
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.policy_gradient.group_size=2",
                "--model.init_args.sampling.max_new_tokens=4",
                "--model.init_args.reply_max_new_tokens=4",
                *_TINY_LORA,
                "--data.init_args.num_prompts=16",  # 8 train problems (4 batches of 2), 8 validation
                "--data.init_args.batch_size=2",
                *_FOURTEEN_STEPS,  # one validation (batch 9): MCC, peak window, eval history
            ),
            batches_per_epoch=4,
            ckpt_every=5,
            kills=_chain(4),
            needs_tiny_lm=True,
        ),
    )
}


def resume_points(family: Family) -> list[int]:
    """Batches done at the checkpoint each resumed run must start from (one per kill, in chain order)."""
    points, done = [], 0
    for kill in family.kills:
        stop = kill.after_batch if kill.after_batch is not None else kill.epoch * family.batches_per_epoch
        epoch_end = kill.after_batch is not None and kill.after_batch % family.batches_per_epoch == 0
        # periodic saves happen at batch ends that are multiples of ckpt_every; a SIGKILL in on_train_batch_end
        # comes before that batch's save, a SIGTERM after it, an epoch-start kill after the previous batch's save
        included = kill.epoch is not None or kill.signal == "SIGTERM"
        last_periodic = (stop - (0 if included else 1)) // family.ckpt_every * family.ckpt_every
        # a SIGTERM saves where it stops, except at the end of an epoch (CheckpointOnSigterm)
        done = stop if kill.signal == "SIGTERM" and not epoch_end else max(done, last_periodic)
        points.append(done)
    return points
