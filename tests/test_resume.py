"""Kill a run (SIGTERM, SIGKILL, mid-epoch, at an epoch boundary, during a checkpoint write), resume it with
``fit --ckpt_path last``, and require the numbers an uninterrupted run logs. Families: ``resume_families.FAMILIES``."""

import os
import signal

import pytest
import torch
from helpers.nan_after import NaNAfter
from helpers.recipes import RECIPES, tiny_lm
from helpers.resume_families import FAMILIES, resume_points
from helpers.resume_harness import ForkServer, Runner, _KillWhenPickled, compare

from alignment_games.callbacks.fault_tolerance import atomic_torch_save
from alignment_games.modules.lm.model_config import ModelConfig


@pytest.fixture(scope="module")
def runner(tiny_lm_dir):
    server = None if os.environ.get("RESUME_HARNESS_SPAWN") else ForkServer()
    yield Runner(server, tiny_lm_dir)
    if server is not None:
        server.close()


@pytest.fixture(scope="module")
def reference(runner, tmp_path_factory):
    """The uninterrupted run of a family, shared by every test of that family."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = runner.fit(FAMILIES[name], tmp_path_factory.mktemp(f"reference_{name}"), tag="reference")
            assert done[name].returncode == 0, done[name].log[-4000:]
        return done[name]

    return get


def _checkpoint(run, family):
    ckpt = torch.load(run.log_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt, ckpt["global_step"] // family.steps_per_batch


@pytest.mark.e2e  # 14-24 s a family on 2 cores: run by `python -m pytest -m e2e` (.ci/run, after the default set)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_killed_and_resumed_chain_logs_what_the_uninterrupted_run_logs(name, runner, reference, tmp_path):
    family = FAMILIES[name]
    ref = reference(name)
    total = max(step for _, step in ref.metrics)
    points = resume_points(family)
    for i, kill in enumerate(family.kills):
        run = runner.fit(family, tmp_path, kill=kill, resume=i > 0, tag=f"stage{i}")
        expected_rc = 143 if kill.signal == "SIGTERM" else -signal.SIGKILL
        assert run.returncode == expected_rc, f"stage {i} ({kill}): rc {run.returncode}\n{run.log[-4000:]}"
        # what this run logged before it died is the reference's too (it started at the previous resume point)
        assert compare(ref.metrics, run.metrics, family.rel_tol) == [], f"stage {i} ({kill})"
        if i > 0:
            assert min(step for _, step in run.metrics) == points[i - 1], f"stage {i} did not resume where expected"
        ckpt, batches = _checkpoint(run, family)
        assert batches == points[i], f"after {kill}: last.ckpt at batch {batches}, expected {points[i]}"
        assert "RNGStateCallback" in ckpt["callbacks"]
    final = runner.fit(family, tmp_path, resume=True, tag="final")
    assert final.returncode == 0, final.log[-4000:]
    assert min(step for _, step in final.metrics) == points[-1]
    assert max(step for _, step in final.metrics) == total
    assert compare(ref.metrics, final.metrics, family.rel_tol) == []
    keys = {key for key, _ in final.metrics}
    assert keys, "the resumed run logged nothing"


@pytest.mark.parametrize("mode", ["pickle", "replace"])
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(mode, runner, reference, tmp_path):
    family = FAMILIES["smida_tabular"]
    ref = reference(family.name)
    killed = runner.fit(family, tmp_path, kill={"signal": "SIGKILL", "during_save_at": 10, "save_mode": mode})
    assert killed.returncode == -signal.SIGKILL, killed.log[-3000:]
    folder = killed.log_dir / "checkpoints"
    temps = list(folder.glob(".last.ckpt.tmp-*"))
    assert len(temps) == 1  # the write that was cut short
    if mode == "replace":
        torch.load(temps[0], weights_only=True)  # complete, only not yet renamed
    ckpt, batches = _checkpoint(killed, family)
    assert batches == 5  # the previous save, whole
    resumed = runner.fit(family, tmp_path, resume=True)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert min(step for _, step in resumed.metrics) == 5
    assert compare(ref.metrics, resumed.metrics) == []
    assert not list(folder.glob(".last.ckpt.tmp-*"))  # the dead writer's temporary was cleaned up


def _write_and_die(writer, path):
    pid = os.fork()
    if pid == 0:  # the child is killed inside torch.save
        writer({"step": 2, "killer": _KillWhenPickled(), "w": torch.ones(1000)}, path)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_atomic_save_survives_a_kill_that_corrupts_a_plain_save(tmp_path):
    def plain(obj, path):
        torch.save(obj, path)

    for writer, survives in ((plain, False), (atomic_torch_save, True)):
        path = tmp_path / f"{writer.__name__}.ckpt"
        torch.save({"step": 1, "w": torch.zeros(1000)}, path)
        assert _write_and_die(writer, path) == -signal.SIGKILL
        if survives:
            assert torch.load(path, weights_only=True)["step"] == 1
        else:
            with pytest.raises(Exception):  # noqa: B017 - whatever torch raises on a truncated file
                torch.load(path, weights_only=True)


# ------------------------------------------------------------------------------------------------ faults
def _fit_until_stopped(module, datamodule, tmp_path, limit, **trainer_kw):
    from helpers.callback_helpers import make_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO

    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=trainer_kw.pop("every"))
    plugins = [AtomicCheckpointIO()]
    trainer = make_trainer(
        tmp_path, [ckpt], max_steps=50, max_epochs=None, enable_checkpointing=True, plugins=plugins, **trainer_kw
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    with pytest.warns(UserWarning, match="NaN or inf; the update is skipped"):
        with pytest.raises(RuntimeError, match=f"{limit} consecutive steps had non-finite"):
            trainer.fit(module, datamodule)
    return trainer, before, torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)


def _assert_stopped_with_the_last_good_checkpoint(module, before, ckpt):
    assert module.nonfinite_skipped == module.consecutive_nonfinite == module.max_consecutive_nonfinite
    params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    assert any(not torch.equal(params[n], before[n]) for n in params)  # the good steps did train
    saved = {n: v for n, v in ckpt["state_dict"].items() if n in params}
    assert saved.keys() == params.keys()
    for name, value in saved.items():  # last.ckpt holds the weights of the last good step (skips change nothing)
        assert torch.equal(value, params[name]), name


def _recipe_model(family, lm, tmp_path, **kw):
    import lightning as L

    L.seed_everything(0)
    return RECIPES[family].make(lm, tmp_path, **kw)


def test_preference_ensemble_skips_nonfinite_losses_and_stops_with_the_last_good_checkpoint(tiny_lm_dir, tmp_path):
    model, data = _recipe_model("PreferenceEnsemble", ModelConfig(tiny_lm_dir), tmp_path, max_consecutive_nonfinite=3)
    model._own_member_logits = NaNAfter(model._own_member_logits, after=3)  # steps 1-2 good, then NaN
    _, before, ckpt = _fit_until_stopped(model, data["datamodule"], tmp_path, 3, every=2, limit_val_batches=0)
    _assert_stopped_with_the_last_good_checkpoint(model, before, ckpt)


def test_sft_skips_nonfinite_losses_and_stops_with_the_last_good_checkpoint(tiny_lm_dir, tmp_path):
    model, data = _recipe_model("CausalLMSFT", ModelConfig(tiny_lm_dir), tmp_path, max_consecutive_nonfinite=2)
    model._loss = NaNAfter(model._loss, after=3)
    _, before, ckpt = _fit_until_stopped(model, data["datamodule"], tmp_path, 2, every=1, limit_val_batches=0)
    _assert_stopped_with_the_last_good_checkpoint(model, before, ckpt)


def test_deep_smida_stops_on_nonfinite_utilities_with_the_last_good_checkpoint(tiny_lm_dir, tmp_path):
    from alignment_games.modules.lm.sampling import Sampling

    lm = tiny_lm(tiny_lm_dir, max_prompt_tokens=48)
    sampling = Sampling(temperature=0.6, max_new_tokens=4)
    model, data = _recipe_model("DeepSMIDA", lm, tmp_path, sampling=sampling, max_consecutive_nonfinite=2)
    model.utility.forward = NaNAfter(model.utility.forward, after=3)
    trainer, before, ckpt = _fit_until_stopped(model, data["datamodule"], tmp_path, 2, every=4, limit_val_batches=0)
    _assert_stopped_with_the_last_good_checkpoint(model, before, ckpt)
    # manual optimization: skipped batches step no optimizer, so the checkpoint of the last good step is the last
    assert trainer.global_step == ckpt["global_step"] == 4
    assert ckpt["game_state"]["nonfinite"]["consecutive_nonfinite"] == 0


# ------------------------------------------------------------------------------------------------ the pieces, alone
def test_rng_state_round_trip_restores_every_generator():
    import random

    import numpy as np

    from alignment_games.callbacks.fault_tolerance import RNGStateCallback

    callback = RNGStateCallback()
    state = callback.state_dict()
    buf = __import__("io").BytesIO()
    torch.save(state, buf)  # what a checkpoint holds must load with weights_only=True
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    first = (random.random(), np.random.rand(), torch.rand(3).tolist(), np.random.randn())
    callback.load_state_dict(state)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist(), np.random.randn()) == first


def test_resumable_loader_continues_the_same_order_after_a_restore():
    from alignment_games.datamodules.resumable import ResumableDataLoader

    def loader():
        return ResumableDataLoader(list(range(10)), batch_size=3, shuffle=True, seed=7)

    reference = loader()
    epochs = [[b.tolist() for b in reference] for _ in range(3)]  # epochs 0, 1, 2 (next iteration = next epoch)
    assert epochs[0] != epochs[1] and sorted(sum(epochs[1], [])) == list(range(10))
    stopped = loader()
    it = iter(stopped)
    for _ in range(4):
        next(it)  # all of epoch 0 (4 batches)
    it = iter(stopped)
    next(it)  # one batch of epoch 1
    state = stopped.state_dict()
    assert state == {"epoch": 1, "batches": 1}
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # what Lightning does at the start of the resumed epoch
    assert [b.tolist() for b in resumed] == epochs[1][1:]
    assert [b.tolist() for b in resumed] == epochs[2]  # and the epoch after it, as uninterrupted


def test_the_run_seed_draws_the_data_order_and_an_explicit_order_seed_holds(monkeypatch):
    import lightning as L

    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.datamodules.resumable import RUN_SEED_STRIDE, ResumableDataLoader

    def order(run_seed):  # the first epoch's prompts of a datamodule with its default (fixed) data seed
        if run_seed is None:
            monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
        else:
            L.seed_everything(run_seed)
        dm = PromptDataModule(num_prompts=40, batch_size=4)
        dm.setup("fit")
        return [p for batch in dm.train_dataloader() for p in batch["prompt"]]

    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored after the test, whatever seed_everything sets
    seed0, seed1, seed2 = order(0), order(1), order(2)
    assert len({tuple(seed0), tuple(seed1), tuple(seed2)}) == 3  # three seeds, three orders
    assert sorted(seed0) == sorted(seed1) == sorted(seed2)  # of the same training prompts
    assert order(1) == seed1 and order(None) == seed0  # a seed gives its order again; unseeded is run seed 0
    items = list(range(20))
    L.seed_everything(3)
    explicit = [b.tolist() for b in ResumableDataLoader(items, batch_size=4, order_seed=5)]
    data_seed = [b.tolist() for b in ResumableDataLoader(items, batch_size=4, seed=5 - RUN_SEED_STRIDE * 3)]
    L.seed_everything(4)
    assert [b.tolist() for b in ResumableDataLoader(items, batch_size=4, order_seed=5)] == explicit == data_seed
    whole = [b.tolist() for b in ResumableDataLoader(items, batch_size=4)]
    L.seed_everything(4)  # a resumed process, seeded by its config again: the same order, continued
    resumed = ResumableDataLoader(items, batch_size=4)
    resumed.load_state_dict({"epoch": 0, "batches": 2})
    resumed.sampler.set_epoch(0)
    assert [b.tolist() for b in resumed] == whole[2:]


def test_persistent_epoch_metrics_reset_only_outside_a_mid_epoch_resume():
    """The finished epoch's sums in an end-of-epoch checkpoint must not leak into the next epoch; a mid-epoch
    checkpoint's sums must survive (the helper every module with persistent epoch means calls)."""
    from types import SimpleNamespace

    import torchmetrics

    from alignment_games.modules.training.faults import reset_stale_epoch_metrics

    def trainer(done, batches=5):
        progress = SimpleNamespace(current=SimpleNamespace(completed=done))
        return SimpleNamespace(
            num_training_batches=batches, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
        )

    for done, kept in ((0, False), (2, True), (4, True), (5, False)):
        metric = torchmetrics.MeanMetric()
        metric.update(torch.tensor([1.0, 3.0]))
        assert reset_stale_epoch_metrics(trainer(done), [metric]) is not kept
        assert float(metric.weight) == (2.0 if kept else 0.0), done


@pytest.mark.parametrize("forget", [False, True])
def test_a_row_holds_only_what_its_step_logged_once_earlier_step_values_are_forgotten(tmp_path, forget):
    """Lightning writes a step-only value of an earlier batch of the epoch again in later rows (the control,
    ``forget=False``); a run resumed mid-epoch starts without it, so its rows differed from an uninterrupted run's
    (pool GRPO: a follower sitting out repeated its loss). With the helper each row holds its own step's values."""
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from alignment_games.modules.training.faults import forget_earlier_step_values

    class Rows(Logger):
        name, version = "rows", 0
        rows: list = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, sorted(k for k in metrics if k != "epoch")))

        def log_hyperparams(self, *args, **kwargs):
            pass

    class Sometimes(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def on_train_batch_start(self, batch, batch_idx):
            if forget:
                forget_earlier_step_values(self.trainer)

        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.log("sits_out_later", 1.0)
            self.log("every_step", float(batch_idx))
            self.log("epoch_mean", float(batch_idx), on_step=False, on_epoch=True)
            return (self.w * batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(3, 1)), batch_size=1)

    logger = Rows()
    logger.rows = []
    trainer = L.Trainer(
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Sometimes())
    steps = [keys for _, keys in logger.rows if "every_step" in keys]  # the step rows (the epoch row aside)
    assert len(steps) == 3 and "sits_out_later" in steps[0]
    assert ("sits_out_later" in steps[1]) is not forget and ("sits_out_later" in steps[2]) is not forget
    assert logger.rows[-1][1] == ["epoch_mean"]  # the epoch's aggregate is untouched
