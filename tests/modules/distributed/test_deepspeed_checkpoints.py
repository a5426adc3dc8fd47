"""SafeDeepSpeedStrategy's checkpoints: a save killed at any moment leaves the previous one whole and resumable
exactly; a file naming code is refused without running it; what cannot load safely is refused by path and reason.

The DeepSpeed runs are child processes (one CPU rank, ``helpers/cpu_deepspeed.py``; ZeRO-2, Adam) of a tiny linear
model on 4 samples in batches of 2, saving ``last.ckpt`` every 2 steps (each save ends an epoch, so a resume
continues from the same data position). They are ``slow`` (~15 CPU-s each, mostly importing DeepSpeed); the checks
of the refusals run without DeepSpeed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from alignment_games.modules.checkpoints.trust import read_checkpoint_or_explain
from alignment_games.modules.distributed.deepspeed_checkpoints import (
    SafeDeepSpeedStrategy,
    _WeightsOnlyEngine,
    check_deepspeed_checkpoint,
    read_deepspeed_client_state,
    safe_deepspeed_strategy,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, lightning as L
    from torch import nn
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy
    import alignment_games.modules.training.artifacts as artifacts
    from alignment_games.modules.distributed.deepspeed_checkpoints import SafeDeepSpeedStrategy
    from helpers.cpu_deepspeed import CPUDeepSpeedStrategy

    root, steps, kill_at, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] or None
    if os.environ.get("IN_PLACE"):  # Lightning's own save, for showing what the atomic one prevents
        SafeDeepSpeedStrategy.save_checkpoint = DeepSpeedStrategy.save_checkpoint

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)

    saves = {"written": 0, "optim": 0}
    def hook(moment):
        saves["written"] += moment == "written"
        if saves["written"] == 2 and moment == kill_at:
            os._exit(17)
    artifacts.SWAP_HOOK = hook
    real_save = torch.save
    def dying_save(obj, f, *a, **k):  # DeepSpeed writes the model states, then the optimizer's
        if str(f).endswith("optim_states.pt"):
            saves["optim"] += 1
            if saves["optim"] == 2 and kill_at == "inside":
                os._exit(17)
        return real_save(obj, f, *a, **k)
    torch.save = dying_save

    L.seed_everything(0)
    config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": 1}
    every = ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=2, save_top_k=0, save_last=True)
    trainer = L.Trainer(strategy=CPUDeepSpeedStrategy(config=config), accelerator="cpu", devices=1, max_steps=steps,
                        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[every])
    model = Tiny()
    trainer.fit(model, ckpt_path=ckpt)
    with open(os.path.join(root, "final.json"), "w") as f:
        json.dump({"global_step": trainer.global_step, "weights": [p.detach().flatten().tolist()
                   for p in model.parameters()]}, f)
    """
)


def _child(
    root, steps: int, kill_at: str = "none", ckpt: str = "", in_place: bool = False
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("IN_PLACE", None)
    if in_place:
        env["IN_PLACE"] = "1"
    args = [sys.executable, "-c", CHILD, str(root), str(steps), kill_at, ckpt]
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _final(root) -> dict:
    with open(os.path.join(root, "final.json")) as f:
        return json.load(f)


def _states(checkpoint) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A ZeRO-2 checkpoint's step and weights (model-states file), and the optimizer's fp32 master copy of them."""
    read = _WeightsOnlyEngine(None).load
    model = read(str(checkpoint / "checkpoint" / "mp_rank_00_model_states.pt"), map_location="cpu")
    optim = read(str(checkpoint / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"), map_location="cpu")
    weights = torch.cat([t.flatten() for t in model["module"].values()])
    master = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach()[: weights.numel()]
    return model["global_step"], weights, master


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: 4 steps, ``last.ckpt`` saved at steps 2 and 4."""
    root = tmp_path_factory.mktemp("whole")
    proc = _child(root, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["inside", "written", "old_aside"])
def test_a_save_killed_at_any_moment_leaves_the_previous_checkpoint_whole_and_resumes_exactly(whole, tmp_path, kill_at):
    """Killed in the second save (while DeepSpeed writes its files, after all is written, between the renames): the
    step-2 checkpoint is whole, the leftovers go, and resuming from it ends on the uninterrupted run's weights."""
    proc = _child(tmp_path, 4, kill_at)
    assert proc.returncode == 17, proc.stderr[-3000:]
    last = tmp_path / "ck" / "last.ckpt"
    # killed between the renames, the old folder is aside until a reader (the strategy's load) puts it back
    whole_one = tmp_path / "ck" / ".last.ckpt.previous" if kill_at == "old_aside" else last
    assert read_checkpoint_or_explain(str(whole_one))["global_step"] == 2
    step, weights, master = _states(whole_one)
    assert step == 2 and torch.equal(weights, master)  # the model and optimizer files of one and the same save
    resumed = _child(tmp_path, 4, ckpt=str(last))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "ck")) == ["last.ckpt"]  # leftovers of the killed save removed
    a, b = _final(whole), _final(tmp_path)
    assert a["global_step"] == b["global_step"] == 4
    assert a["weights"] == b["weights"]


@pytest.mark.slow
def test_lightnings_in_place_save_tears_where_the_safe_one_does_not(tmp_path):
    """The control: with Lightning's own save, the same kill leaves ``last.ckpt`` torn, step-4 model states (and loop
    state) over the step-2 optimizer states, a state no run was ever in."""
    proc = _child(tmp_path, 4, "inside", in_place=True)
    assert proc.returncode == 17, proc.stderr[-3000:]
    step, weights, master = _states(tmp_path / "ck" / "last.ckpt")
    assert step == 4 and not torch.equal(weights, master)


class _Payload:
    """Unpickled, it creates the file named: proof that loading ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _poison(checkpoint, marker) -> str:
    folder = checkpoint / "checkpoint"
    (name,) = [n for n in os.listdir(folder) if n.endswith("optim_states.pt")]
    path = folder / name
    state = torch.load(path, weights_only=False)  # our own file, written by the fixture's run
    state["extra"] = _Payload(str(marker))
    torch.save(state, path)
    return str(path)


@pytest.mark.slow
def test_a_checkpoint_file_naming_code_is_refused_without_running_it(whole, tmp_path):
    ckpt = tmp_path / "last.ckpt"
    shutil.copytree(whole / "ck" / "last.ckpt", ckpt)
    marker = tmp_path / "ran"
    poisoned = _poison(ckpt, marker)
    proc = _child(tmp_path, 6, ckpt=str(ckpt))
    assert proc.returncode != 0
    assert f"{poisoned}' refused" in proc.stderr and "io.open" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()
    torch.load(poisoned, weights_only=False)  # the payload is live: an unsafe load does run it
    assert marker.exists()


# ---------------------------------------------------------------------- refusals, read without DeepSpeed's engine
def _fake_checkpoint(path, tag="checkpoint", files=("mp_rank_00_model_states.pt",), state=None) -> str:
    os.makedirs(path / tag, exist_ok=True)
    (path / "latest").write_text(tag)
    for name in files:
        torch.save(state if state is not None else {"global_step": 3, "module": {}}, path / tag / name)
    return str(path)


def test_the_lightning_state_of_a_deepspeed_folder_reads_weights_only(tmp_path):
    path = _fake_checkpoint(tmp_path / "last.ckpt", state={"global_step": 3, "module": {"w": torch.ones(2)}})
    assert read_deepspeed_client_state(path) == {"global_step": 3}
    assert read_checkpoint_or_explain(path)["global_step"] == 3  # what --ckpt_path last checks before resuming
    marker = tmp_path / "ran"
    _fake_checkpoint(tmp_path / "evil.ckpt", state={"global_step": 3, "x": _Payload(str(marker))})
    with pytest.raises(
        pickle.UnpicklingError, match=r"evil\.ckpt/checkpoint/mp_rank_00_model_states\.pt' refused.*io\.open"
    ):
        read_checkpoint_or_explain(str(tmp_path / "evil.ckpt"))
    assert not marker.exists()


def test_a_latest_file_leading_outside_the_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    _fake_checkpoint(outside)
    path = _fake_checkpoint(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt" / "latest").write_text("../elsewhere/checkpoint")
    with pytest.raises(ValueError, match=r"last\.ckpt.*'latest' file names '\.\./elsewhere/checkpoint'"):
        check_deepspeed_checkpoint(path)


def test_universal_moe_and_zero3_outside_fit_are_refused_naming_path_and_reason(tmp_path):
    universal = _fake_checkpoint(tmp_path / "u.ckpt")
    (tmp_path / "u.ckpt" / "latest_universal").write_text("checkpoint")
    with pytest.raises(ValueError, match=r"u\.ckpt' is a universal checkpoint"):
        check_deepspeed_checkpoint(universal)
    moe = _fake_checkpoint(
        tmp_path / "m.ckpt", files=("mp_rank_00_model_states.pt", "expert_0_mp_rank_00_model_states.pt")
    )
    with pytest.raises(ValueError, match=r"m\.ckpt' holds MoE expert"):
        check_deepspeed_checkpoint(moe)
    plain = _fake_checkpoint(tmp_path / "z3.ckpt")
    assert check_deepspeed_checkpoint(plain, stage_3=True, fitting=True) == "checkpoint"
    with pytest.raises(ValueError, match=r"z3\.ckpt' is ZeRO-3: DeepSpeed cannot load it outside `fit`"):
        check_deepspeed_checkpoint(plain, stage_3=True, fitting=False)
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        check_deepspeed_checkpoint(tmp_path)


def test_train_py_runs_deepspeed_names_safely_and_refuses_lightnings_own_strategy():
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    for name, stage in (("deepspeed_stage_2", 2), ("deepspeed_stage_3", 3), ("deepspeed", 2)):
        strategy = safe_deepspeed_strategy(name)
        assert type(strategy) is SafeDeepSpeedStrategy and strategy.config["zero_optimization"]["stage"] == stage
    assert safe_deepspeed_strategy("ddp") == "ddp" and safe_deepspeed_strategy(None) is None
    with pytest.raises(ValueError, match=r"trainer\.strategy: lightning\.pytorch\.strategies\.deepspeed\.Deep"):
        safe_deepspeed_strategy(DeepSpeedStrategy(stage=2))
    with pytest.raises(ValueError, match="weights_only"):
        SafeDeepSpeedStrategy(stage=2).load_checkpoint("x", weights_only=False)


def test_train_py_builds_the_safe_strategy_and_refuses_lightnings_by_name(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from alignment_games import train

    monkeypatch.chdir(tmp_path)
    base = ["--config", os.path.join(ROOT, "configs", "smida_tabular.yaml"), "--trainer.logger=false"]
    cli = train.main([*base, "--trainer.strategy=deepspeed_stage_3", "--trainer.accelerator=cpu"], run=False)
    assert type(cli.trainer.strategy) is SafeDeepSpeedStrategy and cli.trainer.strategy.zero_stage_3
    lightnings = json.dumps({"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy", "init_args": {"stage": 2}})
    with pytest.raises(ValueError, match=r"trainer\.strategy: lightning\.pytorch\.strategies\.deepspeed\.DeepSpeedStr"):
        train.main([*base, f"--trainer.strategy={lightnings}", "--trainer.accelerator=cpu"], run=False)
