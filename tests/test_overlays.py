"""Strategy overlays: they parse and compose with every family config; the families train in two CPU processes under
DDP; generation gathers FSDP-sharded parameters (raw FSDP on CPU with gloo: Lightning's FSDP strategy needs CUDA).
DeepSpeed and FSDP2 runs: ``test_sharded_training.py``."""

import glob
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import ROOT

from alignment_games import train

OVERLAYS = os.path.join(ROOT, "configs", "overlays")
GRPO = os.path.join(ROOT, "configs", "grpo_tiny.yaml")
SMIDA = os.path.join(ROOT, "configs", "deep_smida.yaml")
TINY_SFT = [  # SFT on a one-layer model it builds, written to tiny_out at the end of fit
    '--model.init_args.tiny_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
    '"num_attention_heads": 4, "num_key_value_heads": 2}',
    "--model.init_args.max_length=96",
    "--model.init_args.output_dir=tiny_out",
    "--data.init_args.num_prompts=16",
    "--data.init_args.batch_size=2",
]


def _resolved(capsys, *configs, extra=()):
    args = ["fit"]
    for c in configs:
        args += ["--config", c]
    with pytest.raises(SystemExit) as stop:
        train.main([*args, *extra, "--print_config"])
    assert stop.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def _fit_in_two_processes(cwd, config: str, *args: str) -> None:
    """``train.py fit`` of ``config`` under the DDP overlay in two CPU processes (gloo), in ``cwd``; it must pass."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "fit", "--config", config, "--config"]
    cmd += [os.path.join(OVERLAYS, "ddp.yaml"), *args, "--trainer.accelerator=cpu", "--trainer.devices=2"]
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("base", [GRPO, SMIDA], ids=os.path.basename)
def test_each_overlay_parses_on_the_generating_families(base, capsys):
    expect = {
        "ddp.yaml": lambda c: c["trainer"]["strategy"]["class_path"].endswith("DDPStrategy"),
        "fsdp.yaml": lambda c: c["trainer"]["strategy"]["init_args"]["sharding_strategy"] == "FULL_SHARD",
        "fsdp2.yaml": lambda c: c["trainer"]["strategy"]["class_path"].endswith("distributed.strategies.FSDP2Strategy"),
        "deepspeed_zero2.yaml": lambda c: c["trainer"]["strategy"] == "deepspeed_stage_2",
        "deepspeed_zero3.yaml": lambda c: c["trainer"]["strategy"] == "deepspeed_stage_3",
        "bf16.yaml": lambda c: c["trainer"]["precision"] == "bf16-mixed",
        "grad_ckpt.yaml": lambda c: c["model"]["init_args"]["lm"]["gradient_checkpointing"] is True,
    }
    assert sorted(expect) == sorted(os.path.basename(p) for p in glob.glob(os.path.join(OVERLAYS, "*.yaml")))
    for name, check in expect.items():
        cfg = _resolved(capsys, base, os.path.join(OVERLAYS, name))
        assert check(cfg), name
        assert cfg["model"]["class_path"] == yaml.safe_load(open(base))["model"]["class_path"]  # family kept


def test_overlays_compose_and_the_command_line_still_wins(capsys):
    cfg = _resolved(
        capsys,
        GRPO,
        *(os.path.join(OVERLAYS, n) for n in ("ddp.yaml", "bf16.yaml", "grad_ckpt.yaml")),
        extra=["--trainer.devices=2", "--model.init_args.policy_gradient.kl_coef=0.1"],
    )
    assert cfg["trainer"]["strategy"]["class_path"].endswith("DDPStrategy")
    assert cfg["trainer"]["precision"] == "bf16-mixed" and str(cfg["trainer"]["devices"]) == "2"
    lm = cfg["model"]["init_args"]["lm"]
    assert lm["gradient_checkpointing"] is True and cfg["model"]["init_args"]["policy_gradient"]["kl_coef"] == 0.1
    assert lm["lora_r"] == 8  # the family config's lm block survives the overlay's
    assert (
        cfg["model"]["init_args"]["policy_gradient"]["group_size"] == 4
    )  # the family's own settings survive the overlays


@pytest.mark.distributed
def test_grpo_trains_in_two_ddp_processes(tiny_lm_dir, tmp_path):
    from alignment_games.modules.lm.models import build_tiny_reward_model

    reward = build_tiny_reward_model(tmp_path / "rm", seed=3)  # varied rewards: the answer checker scores 0 here
    _fit_in_two_processes(
        tmp_path,
        GRPO,
        f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
        "--model.init_args.sampling.max_new_tokens=8",
        f"--model.init_args.reward_models=[{reward}]",
        "--model.init_args.answer_reward=false",
        "--data.init_args.num_prompts=40",
        "--data.init_args.batch_size=2",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=2",
    )
    ckpts = glob.glob(str(tmp_path / "runs" / "**" / "last.ckpt"), recursive=True)
    ckpt = torch.load(ckpts[0], weights_only=False)
    assert ckpt["global_step"] == 2
    assert ckpt["state_dict"] and all(".policy." in k for k in ckpt["state_dict"])  # adapter only, no frozen base
    assert any(v.abs().sum() > 0 for k, v in ckpt["state_dict"].items() if "lora_B" in k)  # it moved off zero


def _fsdp_worker(rank: int, world: int, policy_dir: str, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from alignment_games.modules.distributed.sharding import parameter_gathering
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.sampling import Sampling

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        bank = PolicyBank(ModelConfig(policy_dir, lora_r=4, lora_alpha=8), players=["policy"])
        with torch.no_grad():
            for p in bank.player_parameters("policy"):
                p.add_(0.1 * torch.randn_like(p))
        prompts = ["3+4=", "twelve minus five is "]
        whole = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=6), greedy=True).sequences
        wrapped = FSDP(bank, use_orig_params=True, device_id=torch.device("cpu"))

        class FSDPStrategy:  # what parameter_gathering reads of Lightning's strategy: its name and .model
            model = wrapped

        bank.merge_for_generation = False  # sharded parameters must not be swapped
        sharded = sum(p.numel() for p in bank.parameters())
        try:
            bank.generate("policy", prompts, 1, Sampling(max_new_tokens=6), greedy=True)
            ungathered = "ran"
        except Exception:
            ungathered = "failed"
        bank.gather_for_generation = parameter_gathering(FSDPStrategy(), bank)
        gathered = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=6), greedy=True).sequences
        queue.put((rank, sharded, ungathered, torch.equal(gathered, whole)))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_generation_gathers_fsdp_sharded_parameters(tiny_lm_dir):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_lm_dir).parameters())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_fsdp_worker, args=(r, 2, tiny_lm_dir, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = sorted(queue.get(timeout=5) for _ in procs)
    for _rank, sharded, ungathered, equal in results:
        assert sharded < total  # each rank holds only its shard outside a forward
        assert ungathered == "failed"  # sharded weights cannot decode
        assert equal  # gathered once around generate: the same tokens as the unsharded policy


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("config", "extra", "trained_key"),
    [
        (
            "debate_ab.yaml",
            [
                "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                "--model.init_args.sampling.max_new_tokens=6",
                "--model.init_args.reply_max_new_tokens=4",
                "--model.init_args.lm.max_prompt_tokens=48",
                "--data.init_args.num_prompts=16",
                "--data.init_args.batch_size=2",
                "--trainer.val_check_interval=2",
            ],
            "lora_B",
        ),
        (
            "sft_tiny.yaml",
            [
                *TINY_SFT,
                "--trainer.val_check_interval=2",
            ],
            "",
        ),
    ],
    ids=["debate", "sft"],
)
def test_family_trains_in_two_ddp_processes(config, extra, trained_key, tiny_lm_dir, tmp_path):
    """Two gloo processes run a couple of steps; rank 0's checkpoint holds the steps and weights that moved."""
    _fit_in_two_processes(
        tmp_path,
        os.path.join(ROOT, "configs", config),
        *[a.replace("{tiny_lm_dir}", str(tiny_lm_dir)) for a in extra],
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
    )
    ckpts = glob.glob(str(tmp_path / "runs" / "**" / "*.ckpt"), recursive=True)
    assert ckpts, "no checkpoint written"
    ckpt = torch.load(ckpts[0], weights_only=False)
    assert ckpt["global_step"] == 2  # both ranks stepped together (a rank out of step would hang the all-reduce)
    if trained_key:  # the adapter moved off its zero init
        assert any(v.float().abs().sum() > 0 for k, v in ckpt["state_dict"].items() if trained_key in k)
    else:  # rank 0 saved the fine-tuned model for the next job
        assert (tmp_path / "tiny_out" / "config.json").exists()


def _pool_ddp_args(algorithm: str, tiny_lm_dir, duels: int, iterations: int, extra=()) -> list[str]:
    g = 2 if algorithm == "grpo" else 1
    return [
        os.path.join(ROOT, "configs", f"pool_{algorithm}.yaml"),
        f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
        f"--model.init_args.duels_per_iteration={duels}",
        f"--model.init_args.num_iterations={iterations}",
        "--model.init_args.sampling.max_new_tokens=6",
        "--model.init_args.eval_max_new_tokens=4",
        "--model.init_args.followers.batch_size=3",  # several follower steps per iteration, 1-2 rows per rank
        "--model.init_args.followers.lr=0.01",
        *([f"--model.init_args.followers.policy_gradient.group_size={g}"] if algorithm == "grpo" else []),
        "--data.init_args.num_problems=20",
        "--data.init_args.num_test_problems=4",
        "--trainer.limit_val_batches=1",
        *extra,
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_pool_plays_one_game_across_two_ddp_processes(algorithm, tiny_lm_dir, tmp_path):
    """Two gloo ranks split each iteration's 5 duels (3 and 2) and still play one game: every duel judged and
    Elo-rated exactly once, the counters summed over the ranks, the adapters moved and identical on both ranks (the
    module checks that after every iteration and raises otherwise)."""
    duels, iterations = 5, 2
    g = 2 if algorithm == "grpo" else 1
    _fit_in_two_processes(
        tmp_path, *_pool_ddp_args(algorithm, tiny_lm_dir, duels, iterations, [f"--trainer.max_epochs={iterations}"])
    )
    ckpt = torch.load(glob.glob(str(tmp_path / "runs" / "**" / "last.ckpt"), recursive=True)[0], weights_only=False)
    game = ckpt["game_state"]
    assert game["iteration"] == iterations
    # 3 players: one judge per duel, two sides, g rollouts each; all ranks' judgements gathered (rank 0 alone: 3 duels)
    counters = game["counters"]
    assert counters["judgements"] + counters["empty_responses"] == iterations * duels * 2 * g
    assert sum(game["elo"]["games"]) == 2 * iterations * duels  # each duel rated once (twice would be 40)
    assert len(game["history"]["weights"]) == iterations + 1  # one leader update per iteration, on every rank
    assert any(v.abs().sum() > 0 for k, v in ckpt["state_dict"].items() if "lora_B" in k)  # the followers moved


@pytest.mark.distributed
def test_pool_under_ddp_resumes_exactly(tiny_lm_dir, tmp_path):
    """Two ranks stopped after iteration 1 and resumed from last.ckpt end where the uninterrupted run ends: same
    adapters, leader weights, Elo ratings and histories (each rank's generators restored, the game's shared)."""

    def final(folder, epochs, resume=False):
        extra = [f"--trainer.max_epochs={epochs}", "--model.init_args.num_iterations=2"]
        if resume:
            extra.append("--ckpt_path=last")
        _fit_in_two_processes(folder, *_pool_ddp_args("grpo", tiny_lm_dir, 5, 2, extra))
        path = glob.glob(str(folder / "runs" / "**" / "last.ckpt"), recursive=True)
        return torch.load(path[0], weights_only=False)

    for folder in ("whole", "split"):
        (tmp_path / folder).mkdir()
    whole = final(tmp_path / "whole", 2)
    first = final(tmp_path / "split", 1)
    assert first["game_state"]["iteration"] == 1
    resumed = final(tmp_path / "split", 2, resume=True)
    assert resumed["game_state"]["iteration"] == whole["game_state"]["iteration"] == 2
    assert set(resumed["state_dict"]) == set(whole["state_dict"])
    for k, v in whole["state_dict"].items():
        assert torch.equal(v, resumed["state_dict"][k]), k
    assert resumed["game_state"]["history"] == whole["game_state"]["history"]
    assert resumed["game_state"]["counters"] == whole["game_state"]["counters"]
    assert resumed["game_state"]["elo"]["ratings"] == whole["game_state"]["elo"]["ratings"]
    assert any(not torch.equal(v, first["state_dict"][k]) for k, v in whole["state_dict"].items())  # it trained on
