import pytest
import torch
from helpers.callback_helpers import GameModule, SeriesModule, ddp_results, docs_block, make_trainer, run_docs_example

from alignment_games.callbacks import TwoTimescaleWarmup, warmup_learning_rates

ETA_INIT, ETA_L, ETA_F, T = 1e-3, 8e-3, 2e-2, 10


def app_d1(t: int) -> tuple[float, float]:
    """The schedule as App. D.1 writes it, independently of the library."""
    progress = min(t / T, 1.0)
    leader = ETA_INIT + progress * (ETA_L - ETA_INIT)
    follower = leader * (1.0 + progress * (ETA_F / ETA_L - 1.0))
    return leader, follower


def test_schedule_function_hand_values():
    kwargs = {"initial_lr": ETA_INIT, "leader_lr": ETA_L, "follower_lr": ETA_F, "warmup_steps": T}
    assert warmup_learning_rates(0, **kwargs) == pytest.approx((1e-3, 1e-3, 1.0), rel=1e-12)
    assert warmup_learning_rates(5, **kwargs) == pytest.approx((4.5e-3, 7.875e-3, 1.75), rel=1e-12)
    assert warmup_learning_rates(10, **kwargs) == pytest.approx((8e-3, 2e-2, 2.5), rel=1e-12)
    assert warmup_learning_rates(10_000, **kwargs) == pytest.approx((8e-3, 2e-2, 2.5), rel=1e-12)
    # The paper's Table 2: 1e-6 -> 8e-6 over 50 steps, ratio 1 -> 2.5.
    leader, follower, ratio = warmup_learning_rates(25, 1e-6, 8e-6, 2e-5, 50)
    assert (leader, ratio) == pytest.approx((4.5e-6, 1.75), rel=1e-12)
    assert follower == pytest.approx(leader * ratio, rel=1e-15)
    # No warm-up: the targets from the first step.
    assert warmup_learning_rates(0, 1e-6, 8e-6, 2e-5, 0) == pytest.approx((8e-6, 2e-5, 2.5), rel=1e-12)
    with pytest.raises(ValueError, match="step"):
        warmup_learning_rates(-1, **kwargs)


def test_rates_follow_app_d1_per_training_batch_under_manual_optimization(tmp_path):
    module = GameModule()  # 12 batches per epoch, two optimizers, the leader's with two parameter groups
    warmup = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, T, tau_leader=5e-4, tau_follower=5e-4)
    trainer = make_trainer(tmp_path, [warmup], max_epochs=2, limit_val_batches=0)
    trainer.fit(module)

    # Steps are training batches: global_step counts both optimizers' steps, twice as many.
    assert warmup.batches_seen == len(module.lr_history) == 24
    assert trainer.global_step == 48
    for t in (0, T // 2, T, T + 10):
        leader_groups, follower_groups = module.lr_history[t]
        expected_leader, expected_follower = app_d1(t)
        assert leader_groups == pytest.approx([expected_leader] * 2, rel=1e-12)
        assert follower_groups == pytest.approx([expected_follower], rel=1e-12)
    assert module.lr_history[0] == ([1e-3, 1e-3], [1e-3])  # the module's own rates (0.123, 0.456) are gone
    assert module.lr_history[T // 2][0][0] == pytest.approx(4.5e-3, rel=1e-12)
    assert module.lr_history[T // 2][1][0] == pytest.approx(7.875e-3, rel=1e-12)
    for t, (leader_groups, follower_groups) in enumerate(module.lr_history):
        assert (leader_groups[0], follower_groups[0]) == pytest.approx(app_d1(t), rel=1e-12)
    # The last batch's rates are logged under the callback's namespace.
    metrics = trainer.callback_metrics
    assert float(metrics["warmup/leader_lr"]) == pytest.approx(ETA_L, rel=1e-6)
    assert float(metrics["warmup/follower_lr"]) == pytest.approx(ETA_F, rel=1e-6)
    assert float(metrics["warmup/ratio"]) == pytest.approx(2.5, rel=1e-6)


def test_logged_rates_during_warmup(tmp_path):
    module = GameModule()
    warmup = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, warmup_steps=40)
    trainer = make_trainer(tmp_path, [warmup], max_epochs=1, limit_val_batches=0)  # 12 batches: still warming up
    trainer.fit(module)
    # The 12th batch ran at t = 11, progress 11 / 40 = 0.275 (App. D.1 by hand): leader 1e-3 + 0.275 * 7e-3,
    # ratio 1 + 0.275 * (2.5 - 1), follower their product.
    metrics = trainer.callback_metrics
    assert float(metrics["warmup/leader_lr"]) == pytest.approx(2.925e-3, rel=1e-6)
    assert float(metrics["warmup/follower_lr"]) == pytest.approx(4.1315625e-3, rel=1e-6)
    assert float(metrics["warmup/ratio"]) == pytest.approx(1.4125, rel=1e-6)
    # the next batch, t = 12, progress 0.3: 1e-3 + 2.1e-3, ratio 1.45, follower 3.1e-3 * 1.45
    assert warmup.rates() == pytest.approx((3.1e-3, 4.495e-3, 1.45), rel=1e-12)


def test_swapped_optimizer_indices(tmp_path):
    module = GameModule()
    warmup = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, T, leader_optimizer=1, follower_optimizer=0)
    make_trainer(tmp_path, [warmup], max_epochs=1, limit_val_batches=0).fit(module)
    first_group_of_0, only_group_of_1 = module.lr_history[T][0][0], module.lr_history[T][1][0]
    assert (only_group_of_1, first_group_of_0) == pytest.approx((ETA_L, ETA_F), rel=1e-12)


def test_refuses_broken_timescale_order_with_clear_message():
    # Follower slower in effective step: 8e-6 * 5e-3 = 4e-8 >= 2e-5 * 1e-3 = 2e-8.
    with pytest.raises(ValueError, match=r"eta_L \* tau_L < eta_F \* tau_F") as info:
        TwoTimescaleWarmup(8e-6, 2e-5, 1e-6, 50, tau_leader=5e-3, tau_follower=1e-3)
    assert "4e-08" in str(info.value) and "2e-08" in str(info.value) and "fast player" in str(info.value)
    with pytest.raises(ValueError, match="two-timescale order"):  # equality breaks the strict order too
        TwoTimescaleWarmup(1e-5, 2e-5, 1e-6, 50, tau_leader=2.0, tau_follower=1.0)
    TwoTimescaleWarmup(8e-6, 2e-5, 1e-6, 50, tau_leader=5e-4, tau_follower=5e-4)  # the paper's setting is fine


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"leader_lr": 0.0}, "leader_lr"),
        ({"follower_lr": -1.0}, "follower_lr"),
        ({"initial_lr": -1e-6}, "initial_lr"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"follower_optimizer": 0}, "different"),
        ({"leader_optimizer": -1}, "non-negative"),
        ({"tau_leader": 1.0}, "both"),
        ({"tau_leader": 0.0, "tau_follower": 1.0}, "KL weights"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    arguments = {"leader_lr": 8e-6, "follower_lr": 2e-5, "initial_lr": 1e-6, "warmup_steps": 50, **kwargs}
    with pytest.raises(ValueError, match=match):
        TwoTimescaleWarmup(**arguments)


def test_warns_when_follower_not_faster_without_taus():
    with pytest.warns(UserWarning, match="fast player"):
        TwoTimescaleWarmup(2e-5, 8e-6, 1e-6, 50)


def test_missing_optimizer_fails_at_fit_start(tmp_path):
    warmup = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, T)
    with pytest.raises(ValueError, match=r"follower_optimizer=1.*1 optimizer"):
        make_trainer(tmp_path, [warmup], max_epochs=1).fit(SeriesModule([(1, 2)]))


class ScheduledGame(GameModule):
    def configure_optimizers(self):
        leader, follower = super().configure_optimizers()
        return [leader, follower], [torch.optim.lr_scheduler.StepLR(leader, step_size=1)]


def test_warns_about_a_scheduler_on_an_owned_optimizer(tmp_path):
    warmup = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, T)
    trainer = make_trainer(tmp_path, [warmup], max_steps=2, limit_val_batches=0)
    with pytest.warns(UserWarning, match="scheduler .* will be overridden"):
        trainer.fit(ScheduledGame())


def test_state_key_lets_two_instances_coexist():
    a = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, T, leader_optimizer=0, follower_optimizer=1)
    b = TwoTimescaleWarmup(ETA_L, ETA_F, ETA_INIT, T, leader_optimizer=2, follower_optimizer=3, name="warmup2")
    assert a.state_key != b.state_key
    a.batches_seen = 7
    b.load_state_dict(a.state_dict())
    assert b.batches_seen == 7


@pytest.mark.distributed
def test_ddp_ranks_set_the_same_rates():
    _, (rank0, rank1) = ddp_results()
    assert rank0["lr_history"] == rank1["lr_history"]
    assert len(rank0["lr_history"]) == 18  # 3 epochs of 6 batches per rank
    for t, (leader_groups, follower_groups) in enumerate(rank0["lr_history"]):
        assert leader_groups == pytest.approx([app_d1(t)[0]] * 2, rel=1e-12)
        assert follower_groups == pytest.approx([app_d1(t)[1]], rel=1e-12)


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = run_docs_example("warmup = TwoTimescaleWarmup(")
    warmup, trainer = example["warmup"], example["trainer"]
    assert warmup.batches_seen == 16 and trainer.global_step == 32
    # t = 16 of 50, progress 0.32: leader 1e-6 + 0.32 * 7e-6, ratio 1 + 0.32 * 1.5, follower their product
    assert warmup.rates() == pytest.approx((3.24e-6, 4.7952e-6, 1.48), rel=1e-12)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(3.1e-6, rel=1e-12)  # the last batch ran at t = 15: 1e-6 + 0.3 * 7e-6


def test_readme_cli_config_instantiates():
    import importlib

    import yaml

    config = yaml.safe_load(docs_block("class_path: alignment_games.callbacks.TwoTimescaleWarmup", language="yaml"))
    (entry,) = config["trainer"]["callbacks"]
    module_name, class_name = entry["class_path"].rsplit(".", 1)
    warmup = getattr(importlib.import_module(module_name), class_name)(**entry["init_args"])
    assert isinstance(warmup, TwoTimescaleWarmup) and warmup.rates(50) == pytest.approx((8e-6, 2e-5, 2.5))


def test_math_docstring_examples():
    import doctest

    from alignment_games.callbacks.functional import beta, elo, mcc, warmup

    results = [doctest.testmod(m) for m in (beta, elo, mcc, warmup)]
    assert sum(r.attempted for r in results) >= 12 and all(r.failed == 0 for r in results)


class TauGame(GameModule):
    """:class:`GameModule` (leader 0.123 in both groups, follower 0.456) with the KL weights in its hparams."""

    def __init__(self, tau_leader: float, tau_follower: float) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_targets_and_taus_default_to_the_modules(tmp_path):
    module = TauGame(tau_leader=0.05, tau_follower=0.05)
    warmup = TwoTimescaleWarmup(initial_lr=0.01, warmup_steps=4)  # targets and taus stated once, in the module
    make_trainer(tmp_path, [warmup], max_steps=12, limit_val_batches=0).fit(module)
    assert warmup.targets == (0.123, 0.456)
    assert (warmup.leader_lr, warmup.follower_lr) == (None, None)  # as given: a second fit reads its own module
    # hand values of App. D.1 with eta_init 0.01, eta_L 0.123, eta_F 0.456, T 4: at t = 2, p = 1/2
    leader = 0.01 + 0.5 * (0.123 - 0.01)
    assert module.lr_history[0] == ([0.01, 0.01], [0.01])
    assert module.lr_history[2][0] == pytest.approx([leader] * 2, rel=1e-12)
    assert module.lr_history[2][1] == pytest.approx([leader * (1 + 0.5 * (0.456 / 0.123 - 1))], rel=1e-12)
    assert module.lr_history[5] == ([0.123, 0.123], [0.456])


def test_taus_from_the_module_check_the_timescale_order_at_fit_start(tmp_path):
    # 0.123 * 1.0 is not below 0.456 * 0.1: the follower would be the slow player
    warmup = TwoTimescaleWarmup(initial_lr=0.01, warmup_steps=4)
    with pytest.raises(ValueError, match="two-timescale order"):
        make_trainer(tmp_path, [warmup], max_steps=2, limit_val_batches=0).fit(TauGame(1.0, 0.1))


class MixedRates(GameModule):
    def configure_optimizers(self):
        leader, follower = super().configure_optimizers()
        leader.param_groups[1]["lr"] = 0.5
        return [leader, follower]


def test_a_target_from_groups_of_different_rates_is_refused_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"leader's optimizer .* give `leader_lr`"):
        make_trainer(tmp_path, [TwoTimescaleWarmup()], max_steps=2, limit_val_batches=0).fit(MixedRates())
    warmup = TwoTimescaleWarmup(leader_lr=0.2, initial_lr=0.01)  # given: the groups' rates do not matter
    make_trainer(tmp_path, [warmup], max_steps=2, limit_val_batches=0).fit(MixedRates())
    assert warmup.targets == (0.2, 0.456)


def test_rates_before_fit_need_given_targets():
    with pytest.raises(RuntimeError, match="fit start"):
        TwoTimescaleWarmup(initial_lr=0.01).rates()
    assert TwoTimescaleWarmup(0.1, 0.2, 0.01, 0).rates() == (0.1, 0.2, 2.0)
