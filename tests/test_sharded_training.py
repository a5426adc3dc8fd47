"""Sharded training on two CPU processes (gloo): GRPO and debate self-play under Lightning's DeepSpeed strategy at
ZeRO-2/3 (helpers/cpu_deepspeed.py); GRPO, debate self-play, deep-SMIDA, SFT and the preference ensemble under FSDP2
(alignment_games.modules.distributed.strategies.FSDP2Strategy); how the sharded strategies are recognised and which
families refuse Lightning's FSDP. The overlays themselves and the DDP runs: ``test_overlays.py``."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import ROOT
from test_overlays import OVERLAYS, TINY_SFT


# ------------------------------------------------------------------ DeepSpeed ZeRO-2/3 on CPU (gloo), 2 processes
def _deepspeed_run(tmp_path, stage: int, config: str, extra: list[str], **kwargs) -> list[dict]:
    """Run a family's config under Lightning's DeepSpeed strategy on 2 CPU processes (``helpers/cpu_deepspeed.py``);
    every parameter is partitioned at ZeRO-3 (no persistence threshold). The probes of both ranks."""
    strategy = {
        "class_path": "helpers.cpu_deepspeed.CPUDeepSpeedStrategy",
        "init_args": {
            "config": {
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "zero_allow_untested_optimizer": True,
                "train_micro_batch_size_per_gpu": 1,
            }
        },
    }
    return _two_process_run(tmp_path, strategy, config, extra, **kwargs)


def _two_process_run(
    tmp_path,
    strategy: dict | str,
    config: str,
    extra: list[str],
    bank_attr: str | None = "players",
    probe: str = "probe",
    steps: int = 2,
    subcommand: str = "fit",
    expect_error: str | None = None,
) -> list[dict]:
    """Run a family's config for ``steps`` steps under ``strategy`` on 2 CPU processes, with a
    ``cpu_deepspeed.ShardProbe`` on the bank at ``bank_attr``; the probes of both ranks. With ``expect_error`` the run
    must fail with that text in its output (and nothing is read back)."""
    overlay = tmp_path / f"{probe}_strategy.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"strategy": strategy, "accelerator": "cpu", "devices": 2}}))
    probe = tmp_path / probe
    args = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        subcommand,
        "--config",
        os.path.join(ROOT, "configs", config),
        "--config",
        str(overlay),
        "--trainer.limit_val_batches=0",
        *extra,
    ]
    if subcommand == "fit":
        args.append(f"--trainer.max_steps={steps}")
    if bank_attr is not None:
        args += [
            "--trainer.callbacks+=helpers.cpu_deepspeed.ShardProbe",
            f"--trainer.callbacks.out_dir={probe}",
            f"--trainer.callbacks.bank_attr={bank_attr}",
        ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if expect_error is not None:
        assert proc.returncode != 0 and expect_error in proc.stderr, proc.stderr[-3000:]
        return []
    assert proc.returncode == 0, proc.stderr[-3000:]

    return [] if bank_attr is None else [json.load(open(probe / f"rank{r}.json")) for r in range(2)]


def _check_exported(root, adapters: dict, player: str = "policy") -> None:
    """The adapter the end of ``fit`` exported (gathered whole, written by rank 0) is the trained one, value for value.

    ``adapters``: a probe's gathered adapters, by the bank's parameter names (``model.<...>.lora_A.<player>.weight``).
    """
    from safetensors.torch import load_file

    (path,) = root.rglob(f"export/{player}/adapter_model.safetensors")
    saved = load_file(path)
    want = {n.removeprefix("model.").replace(f".{player}.", "."): v for n, v in adapters.items()}
    assert saved.keys() == want.keys()
    for name, tensor in saved.items():
        assert tensor.float().flatten().tolist() == want[name], name


def _grpo_args(tiny_lm_dir, reward) -> list[str]:
    return [
        f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
        "--model.init_args.sampling.max_new_tokens=6",
        "--model.init_args.policy_gradient.group_size=2",
        f"--model.init_args.reward_models=[{reward}]",
        "--model.init_args.answer_reward=false",
        "--model.init_args.policy_gradient.micro_batch=2",  # 2 micro-batches per step: no no_sync under ZeRO
        "--model.init_args.lr=0.01",
        "--data.init_args.num_prompts=40",
        "--data.init_args.batch_size=2",
    ]


@pytest.mark.distributed
def test_grpo_trains_under_deepspeed_zero2_and_zero3_alike(tiny_lm_dir, tmp_path):
    """GRPO (generation inside training_step, 2 micro-batches per step) on 2 CPU processes under ZeRO-2 and ZeRO-3.

    ZeRO-3 partitions every parameter; generation must see them whole at every decoded token (gathered once, not
    re-partitioned by DeepSpeed's hooks between tokens), and the run must end where ZeRO-2's (whole parameters) ends.
    """
    from alignment_games.modules.lm.models import build_tiny_reward_model

    reward = build_tiny_reward_model(tmp_path / "rm", seed=3)
    runs = {}
    for stage in (2, 3):
        (tmp_path / f"z{stage}").mkdir()
        runs[stage] = _deepspeed_run(tmp_path / f"z{stage}", stage, "grpo_tiny.yaml", _grpo_args(tiny_lm_dir, reward))
    for stage, ranks in runs.items():
        for rec in ranks:
            assert rec["global_step"] == 2
            assert len(rec["generate_whole"]) == 2  # one generate call per step
            assert rec["generate_calls"] >= 2 * 6  # a model call per decoded token (6 new tokens), twice
            assert rec["generate_whole"] == [rec["total"]] * 2  # whole at every one of them
            assert rec["engine_gradient_clipping"] == 1.0  # grpo_tiny's grad_clip, applied by DeepSpeed's step
            if stage == 3:  # partitioned: inside the steps, outside generate, a rank held almost none of the policy
                assert all(held < rec["total"] // 4 for held in rec["held_in_steps"])
            else:  # ZeRO-2 keeps parameters whole
                assert rec["held_in_steps"] == [rec["total"]] * 2
        a, b = (rec["adapters"] for rec in ranks)
        assert a == b  # one model: both ranks hold the same adapters
        assert any(any(v != 0.0 for v in vals) for name, vals in a.items() if "lora_B" in name)  # moved off zero
        _check_exported(tmp_path / f"z{stage}", a)  # the end of fit gathered the partitions before writing
    z2, z3 = runs[2][0]["adapters"], runs[3][0]["adapters"]
    assert z2.keys() == z3.keys()
    for name in z2:  # the same samples, losses and updates with sharded parameters (up to reduction order)
        diff = (torch.tensor(z2[name]) - torch.tensor(z3[name])).abs().max()
        assert diff < 1e-4, name  # other samples would move weights by about lr (1e-2) per step


@pytest.mark.distributed
def test_grpo_under_deepspeed_zero3_composes_with_the_bf16_and_gradient_checkpointing_overlays(tiny_lm_dir, tmp_path):
    from alignment_games.modules.lm.models import build_tiny_reward_model

    reward = build_tiny_reward_model(tmp_path / "rm", seed=3)
    overlays = [f"--config={os.path.join(OVERLAYS, n)}" for n in ("bf16.yaml", "grad_ckpt.yaml")]
    for rec in _deepspeed_run(tmp_path, 3, "grpo_tiny.yaml", [*_grpo_args(tiny_lm_dir, reward), *overlays]):
        assert rec["global_step"] == 2
        assert rec["generate_dtype"] == "torch.bfloat16"  # DeepSpeed's bf16 engine: generation in bf16 too
        assert rec["generate_whole"] == [rec["total"]] * 2
        assert all(held < rec["total"] // 4 for held in rec["held_in_steps"])
        assert any(any(v != 0.0 for v in vals) for name, vals in rec["adapters"].items() if "lora_B" in name)


@pytest.mark.distributed
def test_grpo_resumes_exactly_under_deepspeed_zero3(tiny_lm_dir, tmp_path):
    """A mid-epoch ZeRO-3 checkpoint (each rank's parameter and optimizer shards in DeepSpeed's folder, the rest of
    the game in Lightning's client state) continues to the adapters of the uninterrupted run, bit for bit."""
    from alignment_games.modules.lm.models import build_tiny_reward_model

    reward = build_tiny_reward_model(tmp_path / "rm", seed=3)
    every_step = ["--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1"]
    args = _grpo_args(tiny_lm_dir, reward)
    whole = _deepspeed_run(tmp_path, 3, "grpo_tiny.yaml", [*args, *every_step], steps=3)
    ckpt = next((tmp_path / "runs").rglob("epoch=0-step=1.ckpt"))
    assert (ckpt / "checkpoint").is_dir()  # DeepSpeed's sharded checkpoint folder
    resumed = _deepspeed_run(tmp_path, 3, "grpo_tiny.yaml", [*args, f"--ckpt_path={ckpt}"], probe="resumed", steps=3)
    for a, b in zip(whole, resumed, strict=True):
        assert b["global_step"] == 3 and len(b["generate_whole"]) == 2  # it went on from step 1: two more steps
        assert a["adapters"] == b["adapters"]


def _tiny_debate_args(tiny_lm_dir) -> list[str]:
    """Debate-AB on the tiny policy: short plies, 8 batches of 2 problems."""
    return [
        f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
        "--model.init_args.sampling.max_new_tokens=6",
        "--model.init_args.reply_max_new_tokens=4",
        "--model.init_args.lm.max_prompt_tokens=48",
        "--data.init_args.num_prompts=16",
        "--data.init_args.batch_size=2",
    ]


@pytest.mark.distributed
def test_debate_trains_under_deepspeed_zero3_on_two_processes(tiny_lm_dir, tmp_path):
    extra = [
        *_tiny_debate_args(tiny_lm_dir),
        "--trainer.limit_val_batches=1",  # one evaluation at step 2: MCC trackers and the peak checkpoint
        "--trainer.val_check_interval=2",
    ]
    ranks = _deepspeed_run(tmp_path, 3, "debate_ab.yaml", extra, bank_attr="bank")
    peak = [p for p in (tmp_path / "runs").rglob("*.ckpt") if "peak" in p.name]
    assert peak and (peak[0] / "checkpoint").is_dir()  # the peak, saved as DeepSpeed's sharded folder
    for rec in ranks:
        assert rec["global_step"] == 2
        # every ply of training and of the evaluation ran on the whole policy throughout
        assert len(rec["generate_whole"]) > 2 and set(rec["generate_whole"]) == {rec["total"]}
        assert rec["grad_norm"] > 0  # the engine's global norm (a p.grad norm would read 0 under ZeRO)
        assert all(held < rec["total"] // 4 for held in rec["held_in_steps"])
    a, b = (rec["adapters"] for rec in ranks)
    assert a == b
    assert any(any(v != 0.0 for v in vals) for name, vals in a.items() if "lora_B" in name)


# ------------------------------------------------------------------ FSDP2 (fully_shard) on CPU (gloo), 2 processes
FSDP2 = {"class_path": "alignment_games.modules.distributed.strategies.FSDP2Strategy"}


def _check_fsdp2_sharding(rec: dict, generate_calls: int) -> None:
    """Half of the bank on each rank inside the steps; whole at every model call of every generate."""
    assert all(held * 2 == rec["total"] for held in rec["held_in_steps"])  # every tensor split over the 2 ranks
    assert len(rec["generate_whole"]) == generate_calls and set(rec["generate_whole"]) == {rec["total"]}


@pytest.mark.distributed
def test_grpo_under_fsdp2_ends_where_ddp_does_and_resumes_exactly(tiny_lm_dir, tmp_path):
    """GRPO (2 micro-batches per step: the first skips the reduce-scatter) under FSDP2 on 2 processes: the policy is
    sharded in the steps and whole at every decoded token, 3 steps end where DDP's end, a mid-run sharded checkpoint
    (without the frozen base) continues bit for bit, and one lacking a trainable tensor is refused by name."""
    from alignment_games.modules.lm.models import build_tiny_reward_model

    reward = build_tiny_reward_model(tmp_path / "rm", seed=3)
    args = _grpo_args(tiny_lm_dir, reward)
    every_step = ["--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1"]
    (tmp_path / "ddp").mkdir()
    ddp = _two_process_run(tmp_path / "ddp", "ddp", "grpo_tiny.yaml", args, steps=3)
    whole = _two_process_run(tmp_path, FSDP2, "grpo_tiny.yaml", [*args, *every_step], steps=3)
    for rec in whole:
        assert rec["global_step"] == 3
        _check_fsdp2_sharding(rec, generate_calls=3)
        assert rec["generate_calls"] >= 3 * 6  # a model call per decoded token
    assert whole[0]["adapters"] == whole[1]["adapters"]  # one model: the ranks' gathered adapters agree
    _check_exported(tmp_path / "runs", whole[0]["adapters"])  # the end of fit gathered the shards before writing
    for name, want in ddp[0]["adapters"].items():  # same samples and losses; sums reduced in another order
        diff = (torch.tensor(whole[0]["adapters"][name]) - torch.tensor(want)).abs().max()
        assert diff < 1e-4, name  # other samples would move weights by about lr (1e-2) per step
    assert any(any(v != 0.0 for v in vals) for name, vals in ddp[0]["adapters"].items() if "lora_B" in name)

    ckpt = next((tmp_path / "runs").rglob("epoch=0-step=1.ckpt"))
    # DCP's index, the files' sha256, one file per rank, the rest
    shards = [".metadata", "SHA256SUMS", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == shards
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    weights = {k for k in saved if k.startswith("state_dict.")}
    assert weights and all("lora_" in k for k in weights)  # the adapters only: the frozen base is the start file
    assert any(k.startswith("optimizer_0.state.") for k in saved)  # AdamW's moments, sharded alike
    resumed = _two_process_run(
        tmp_path, FSDP2, "grpo_tiny.yaml", [*args, f"--ckpt_path={ckpt}"], probe="resumed", steps=3
    )
    for a, b in zip(whole, resumed, strict=True):
        assert b["global_step"] == 3 and len(b["generate_whole"]) == 2  # it went on from step 1: two more steps
        assert a["adapters"] == b["adapters"]
    other = [*args, "--model.init_args.lm.lora_target_modules=[q_proj,v_proj,o_proj]", f"--ckpt_path={ckpt}"]
    _two_process_run(
        tmp_path, FSDP2, "grpo_tiny.yaml", other, probe="other", steps=3, expect_error="lacks trainable tensors"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["debate", "deep_smida"])
def test_debate_and_deep_smida_train_under_fsdp2_on_two_processes(family, tiny_lm_dir, tmp_path):
    """Every ply of debate self-play (training and an evaluation, with FSDP2's bf16 mixed precision) and every
    generation of deep-SMIDA's two players (with the bf16 autocast and gradient-checkpointing overlays) run on the
    whole policy while the steps hold half of it; both ranks end with the same adapters, which moved."""
    if family == "debate":
        config, bank, gens = "debate_ab.yaml", "bank", 6  # 2 steps x 2 plies + the evaluation's 2 plies
        extra = [*_tiny_debate_args(tiny_lm_dir), "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2"]
    else:
        # 2 batches (2 optimizer steps each) x 2 players, + the evaluation's trained and reference pairs (4)
        config, bank, gens = "deep_smida.yaml", "players", 8
        extra = [
            f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
            "--model.init_args.sampling.max_new_tokens=4",
            "--model.init_args.lm.max_prompt_tokens=48",
            "--model.init_args.follower_samples=2",
            f"--model.init_args.utility.init_args.backbone={tiny_lm_dir}",
            "--model.init_args.utility.init_args.backbone_task=causal_lm",
            "--model.init_args.utility.init_args.num_members=2",
            "--model.init_args.utility.init_args.allow_untrained=true",
            "--data.init_args.num_prompts=40",  # a validation split of 4 or more: 2 prompts per rank
            "--data.init_args.batch_size=2",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            *(f"--config={os.path.join(OVERLAYS, n)}" for n in ("bf16.yaml", "grad_ckpt.yaml")),  # they compose
        ]
    steps = 2 if family == "debate" else 4
    # debate: FSDP2's own mixed precision (shards in fp32, gathered and run in bf16, gradients reduced in fp32)
    bf16 = {**FSDP2, "init_args": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}
    strategy = bf16 if family == "debate" else FSDP2
    ranks = _two_process_run(tmp_path, strategy, config, extra, bank_attr=bank, steps=steps)
    for rec in ranks:
        assert rec["global_step"] == steps
        _check_fsdp2_sharding(rec, generate_calls=gens)
        assert rec["generate_dtype"] == ("torch.bfloat16" if family == "debate" else "torch.float32")
    if family == "debate":
        assert all(rec["grad_norm"] > 0 for rec in ranks)  # the clip's global norm over the sharded gradients
        assert [p for p in (tmp_path / "runs").rglob("peak.ckpt") if (p / "meta.pt").is_file()]  # sharded peak
    else:
        evals = [json.load(open(p)) for p in (tmp_path / "runs").rglob("game_eval.json")]
        assert len(evals) == 1 and evals[0]["n_prompts"] == 4  # 2 prompts per rank, gathered from both
    a, b = (rec["adapters"] for rec in ranks)
    assert a == b
    assert any(any(v != 0.0 for v in vals) for name, vals in a.items() if "lora_B" in name)


def test_sharded_strategies_are_recognised_through_subclasses():
    from helpers.cpu_deepspeed import CPUDeepSpeedStrategy
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    from alignment_games.modules.distributed.sharding import sharded_strategy_kind
    from alignment_games.modules.distributed.strategies import FSDP2Strategy
    from alignment_games.modules.lm.decoders import GenerateDecoder
    from alignment_games.modules.lm.policy_bank import PolicyBank

    class MyFSDP(FSDPStrategy):  # a user's own subclass (e.g. other launch or checks) is still FSDP
        pass

    assert sharded_strategy_kind(DeepSpeedStrategy()) == "DeepSpeedStrategy"
    assert sharded_strategy_kind(CPUDeepSpeedStrategy()) == "DeepSpeedStrategy"
    assert sharded_strategy_kind(MyFSDP()) == "FSDPStrategy"
    assert sharded_strategy_kind(FSDP2Strategy()) == "ModelParallelStrategy"
    assert sharded_strategy_kind(DDPStrategy()) is None and sharded_strategy_kind(object()) is None
    # the bank keeps adapters unmerged under a subclass too (merging would swap sharded parameters)
    bank = PolicyBank.__new__(PolicyBank)
    torch.nn.Module.__init__(bank)
    bank.decoder = GenerateDecoder(eos=None, pad=0)  # an own decoder: the vLLM engine is refused under sharding
    strategies = (MyFSDP(), CPUDeepSpeedStrategy(stage=3), FSDP2Strategy(), DDPStrategy())
    for strategy, merge in zip(strategies, (False, False, False, True), strict=True):
        bank.use_strategy(strategy)
        assert bank.merge_for_generation is merge, type(strategy).__name__


@pytest.mark.distributed
def test_sft_saves_the_whole_model_under_deepspeed_zero3_and_fsdp2(tmp_path):
    """SFT's model for the next job, written by rank 0 at the end of fit: under ZeRO-3 every rank gathers the
    partitioned weights first, and under FSDP2 every rank assembles the full state dict, so the saved model equals
    the one ZeRO-2 (whole weights) trains to."""
    from transformers import AutoModelForCausalLM

    extra = TINY_SFT
    saved = {}
    for run in ("z2", "z3", "fsdp2"):
        (tmp_path / run).mkdir()
        if run == "fsdp2":
            _two_process_run(tmp_path / run, FSDP2, "sft_tiny.yaml", extra, bank_attr=None)
        else:
            _deepspeed_run(tmp_path / run, int(run[1]), "sft_tiny.yaml", extra, bank_attr=None)
        saved[run] = AutoModelForCausalLM.from_pretrained(tmp_path / run / "tiny_out").state_dict()
    init = AutoModelForCausalLM.from_pretrained(tmp_path / "z3" / "tiny_out" / "_init").state_dict()
    assert saved["z3"].keys() == saved["z2"].keys() == saved["fsdp2"].keys() == init.keys()
    for run in ("z3", "fsdp2"):
        for name, w in saved[run].items():
            assert w.shape == init[name].shape and w.numel() > 0, name  # whole tensors, not a rank's partition
            assert torch.allclose(w, saved["z2"][name], atol=1e-4), (run, name)
        assert any(not torch.equal(w, init[name]) for name, w in saved[run].items())  # it trained


@pytest.mark.distributed
def test_preference_ensemble_under_deepspeed_zero3_is_tested_from_a_converted_checkpoint(tmp_path):
    """ZeRO-3 trains the ensemble; test_after_fit is skipped with a warning (DeepSpeed cannot load a ZeRO-3
    checkpoint for testing), and the converted checkpoint tests on one device to ZeRO-2's own test report."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    extra = [
        "--data.init_args.num_prompts=40",
        "--data.init_args.batch_size=8",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
    ]
    reports = {}
    for stage in (2, 3):
        work = tmp_path / f"z{stage}"
        work.mkdir()
        _deepspeed_run(work, stage, "preference_ensemble.yaml", extra, bank_attr=None, steps=3)
        found = list((work / "runs").rglob("report.json"))
        if stage == 2:  # tested after fit with the best checkpoint
            reports[2] = json.load(open(found[0]))
            continue
        assert not found  # skipped under ZeRO-3
        converted = tmp_path / "converted.ckpt"
        convert_zero_checkpoint_to_fp32_state_dict(str(next((work / "runs").rglob("last.ckpt"))), str(converted))
        args = [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "test",
            "--config",
            os.path.join(ROOT, "configs", "preference_ensemble.yaml"),
            *extra[:2],
            "--trainer.accelerator=cpu",
            f"--ckpt_path={converted}",
        ]
        env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[3] = json.load(open(next((work / "runs").rglob("report.json"))))
    for key in ("ensemble_accuracy", "overall_error_rate", "top10_error_rate"):
        assert reports[3][key] == pytest.approx(reports[2][key], abs=1e-6), key
    assert reports[3]["member_accuracy"] == pytest.approx(reports[2]["member_accuracy"], abs=1e-6)


@pytest.mark.distributed
def test_preference_ensemble_under_fsdp2_matches_ddp_and_tests_after_fit(tmp_path):
    """The preference ensemble under FSDP2 on 2 processes: the backbone sharded, the heads averaged across ranks.

    Frozen sharing with the feature cache: the test set's last batch is padded by the sampler with sequences already
    cached on one rank, which then had nothing to compute while the other ran the sharded backbone, and the run hung in
    test_after_fit (``alignment_games.modules.distributed.collectives.lockstep``). With one-file checkpoints (what
    ``load_frozen`` reads, for the game modules) the heads and the report equal DDP's. LoRA members: each rank holds
    rows of only some members per batch; every member's forward and backward still runs on every rank, and the sharded
    checkpoint is tested."""
    from alignment_games.modules.preference import PreferenceEnsemble

    extra = [
        "--data.init_args.num_prompts=40",
        "--data.init_args.batch_size=8",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
    ]
    one_file = {**FSDP2, "init_args": {"save_distributed_checkpoint": False}}
    reports, best = {}, {}
    for run, strategy, more in (
        ("ddp", "ddp", []),
        ("fsdp2", one_file, []),
        ("lora", FSDP2, ["--model.init_args.sharing=lora", "--model.init_args.num_members=3"]),
    ):
        work = tmp_path / run
        work.mkdir()
        _two_process_run(work, strategy, "preference_ensemble.yaml", [*extra, *more], bank_attr=None, steps=3)
        reports[run] = json.load(open(next((work / "runs").rglob("report.json"))))  # tested after fit
        best[run] = next(p for p in (work / "runs").rglob("*.ckpt") if p.name != "last.ckpt")
    assert best["fsdp2"].is_file() and (best["lora"] / "meta.pt").is_file()  # one file; per-rank shards
    for key in ("ensemble_accuracy", "overall_error_rate", "top10_error_rate"):
        assert reports["fsdp2"][key] == pytest.approx(reports["ddp"][key], abs=1e-6), key
    assert reports["fsdp2"]["member_accuracy"] == pytest.approx(reports["ddp"]["member_accuracy"], abs=1e-6)
    models = {run: PreferenceEnsemble.load_frozen(str(best[run])) for run in ("ddp", "fsdp2")}
    heads = {run: m.head.state_dict() for run, m in models.items()}
    init = PreferenceEnsemble(**models["ddp"].hparams).head.state_dict()  # the same seeds: the untrained heads
    for name, want in heads["ddp"].items():
        torch.testing.assert_close(heads["fsdp2"][name], want, rtol=0, atol=1e-5, msg=name)
        assert not torch.allclose(want, init[name], atol=1e-4), name  # 3 steps moved them
    assert len(reports["lora"]["member_accuracy"]) == 3


@pytest.mark.parametrize("family", ["grpo", "debate", "deep_smida"])
def test_manual_backward_families_refuse_lightning_fsdp_by_name(family, tiny_lm_dir):
    """Lightning runs training_step inside the root FSDP unit's forward; a backward there breaks FSDP's state machine
    (see alignment_games.modules.distributed.sharding.check_manual_backward_strategy), so these families refuse FSDP
    before any work."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from alignment_games.modules.lm.sampling import Sampling

    if family == "grpo":
        from alignment_games.modules.grpo import GRPO
        from alignment_games.modules.lm.model_config import ModelConfig

        module = GRPO(lm=ModelConfig(tiny_lm_dir, lora_r=4), sampling=Sampling(max_new_tokens=4))
    elif family == "debate":
        from alignment_games.modules.debate import DebateSelfPlay
        from alignment_games.modules.lm.model_config import ModelConfig

        module = DebateSelfPlay(lm=ModelConfig(tiny_lm_dir, lora_r=4), sampling=Sampling(max_new_tokens=4))
    else:
        from alignment_games.modules.deep_smida import DeepSMIDA
        from alignment_games.modules.lm.model_config import ModelConfig
        from alignment_games.modules.scorers.utility import Utility

        class Zero(Utility):
            def forward(self, prompts, leader, follower):
                return torch.zeros(len(follower))

        module = DeepSMIDA(lm=ModelConfig(tiny_lm_dir, lora_r=4), utility=Zero(), sampling=Sampling(max_new_tokens=4))
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match=r"trainer.strategy: .* inside training_step .* \(got FSDPStrategy\)"):
        module.setup("fit")
    module.setup("validate")  # evaluation alone runs no backward: allowed


def test_deepspeed_takes_the_families_gradient_clip():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    from alignment_games.modules.distributed.sharding import check_manual_backward_strategy

    strategy = DeepSpeedStrategy(stage=3)
    check_manual_backward_strategy(strategy, "GRPO", 0.5)
    assert strategy.config["gradient_clipping"] == 0.5
    unclipped = DeepSpeedStrategy(stage=2)
    check_manual_backward_strategy(unclipped, "GRPO", None)
    assert "gradient_clipping" not in unclipped.config  # Lightning then sets its own default (0: none)
    check_manual_backward_strategy(DDPStrategy(), "GRPO", 0.5)  # nothing to do elsewhere


@pytest.mark.distributed
def test_debate_validates_under_deepspeed_zero3_with_the_whole_policy(tiny_lm_dir, tmp_path):
    """`validate` alone builds DeepSpeed's inference engine (no optimizer, its offload state held elsewhere): every ply
    must still generate on the whole policy, not fetch each layer per token through DeepSpeed's hooks."""
    extra = [
        *_tiny_debate_args(tiny_lm_dir),
        "--trainer.limit_val_batches=1",
    ]
    for rec in _deepspeed_run(tmp_path, 3, "debate_ab.yaml", extra, bank_attr="bank", subcommand="validate"):
        assert rec["generate_calls"] >= 6  # a model call per decoded token of each ply
        assert rec["generate_whole"] and set(rec["generate_whole"]) == {rec["total"]}
