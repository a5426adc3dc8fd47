import math

import pytest
import torch
from helpers.callback_helpers import (
    DDP_CKPT_EVERY_STEPS,
    DDP_ELO_EVERY,
    DDP_EPOCHS,
    PLAYERS,
    GameModule,
    ddp_results,
    duel_of,
    make_trainer,
    run_docs_example,
)

from alignment_games.callbacks import (
    EloRating,
    decayed_k_factor,
    effective_k_factor,
    elo_expected_score,
    elo_update,
    sample_std,
    weighted_score,
)


def test_expected_score_hand_values():
    assert elo_expected_score(1000.0, 1000.0) == 0.5
    assert elo_expected_score(1400.0, 1000.0) == pytest.approx(10 / 11, rel=1e-15)  # 400 points: 10:1 odds
    assert elo_expected_score(1016.0, 1000.0) == pytest.approx(0.5230095872975623, rel=1e-14)
    assert elo_expected_score(1000.0, 1200.0) + elo_expected_score(1200.0, 1000.0) == pytest.approx(1.0)
    assert elo_expected_score(1100.0, 1000.0, scale=100.0) == pytest.approx(10 / 11, rel=1e-15)


def test_update_hand_values():
    assert elo_update(1000.0, 1000.0, 1.0, k_a=32.0) == (1016.0, 984.0)
    assert elo_update(1000.0, 1000.0, 0.5, k_a=32.0) == (1000.0, 1000.0)
    new_a, new_c = elo_update(1016.0, 1000.0, 0.5, k_a=21.333333333333332, k_b=32.0)
    assert new_a == pytest.approx(1015.5091288043187, abs=1e-9)
    assert new_c == pytest.approx(1000.736306793522, abs=1e-9)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        elo_update(1000.0, 1000.0, 1.5, k_a=32.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        elo_update(1000.0, 1000.0, float("nan"), k_a=32.0)
    with pytest.raises(ValueError, match="K factors"):
        elo_update(1000.0, 1000.0, 1.0, k_a=-1.0)


def test_k_decay_and_volatility_rules():
    # Harmonic decay: K halves after k_decay duels, thirds after twice as many; None disables it.
    assert decayed_k_factor(32.0, 0, 50.0) == 32.0
    assert decayed_k_factor(32.0, 50, 50.0) == 16.0
    assert decayed_k_factor(32.0, 100, 50.0) == pytest.approx(32.0 / 3)
    assert decayed_k_factor(32.0, 10_000, None) == 32.0
    # Sample standard deviation with ddof=1, 0 below two values.
    assert sample_std([]) == sample_std([5.0]) == 0.0
    assert sample_std([16.0, -0.7363067935219938]) == pytest.approx(11.834356025717886, rel=1e-14)
    # The boost: 1 + min(1, sigma / K0), on top of the decayed K.
    assert effective_k_factor(32.0, 0, 50.0, 0.0) == 32.0
    assert effective_k_factor(32.0, 0, 50.0, 8.0) == 40.0
    assert effective_k_factor(32.0, 50, 50.0, 16.0) == 24.0
    assert effective_k_factor(32.0, 50, 50.0, 1e6) == 32.0  # capped at a doubling
    with pytest.raises(ValueError, match="volatility"):
        effective_k_factor(32.0, 0, 50.0, -1.0)


def test_weighted_score():
    assert weighted_score([1.0, 0.0], [3.0, 1.0]) == 0.75
    assert weighted_score([1.0, 0.0, 0.5]) == 0.5
    for scores, weights, match in [
        ([], None, "At least one"),
        ([1.2], None, r"\[0, 1\]"),
        ([1.0, 0.0], [1.0], "weights"),
        ([1.0, 0.0], [1.0, -1.0], ">= 0"),
        ([1.0, 0.0], [0.0, 0.0], "zero"),
    ]:
        with pytest.raises(ValueError, match=match):
            weighted_score(scores, weights)


# The same five duels, the ratings worked out by hand from the documented rule (K0=32, d=2, window 3).
SEQUENCE = [("A", "B", 1.0), ("A", "C", 0.5), ("B", "C", 1.0), ("A", "B", 0.25), ("C", "A", 0.0)]
HAND = [
    # expected score of the first player, K of each player, ratings (A, B, C) after the duel
    (0.5, 32.0, 32.0, (1016.0, 984.0, 1000.0)),
    (0.5230095872975623, 21.333333333333332, 32.0, (1015.5091288043187, 984.0, 1000.736306793522)),
    (
        0.4759331307924147,
        21.333333333333332,
        21.333333333333332,
        (1015.5091288043187, 995.1800932097618, 989.5562135837602),
    ),
    (
        0.5292224926984492,
        21.830403425070088,
        25.609614110952506,
        (1009.4135891433579, 1002.3308734988674, 989.5562135837602),
    ),
    (
        0.4714540153496435,
        20.21308362482669,
        17.394414041151403,
        (1017.6142554877129, 1002.3308734988674, 980.0266741462375),
    ),
]


def test_known_sequence_of_duels_matches_hand_computation():
    elo = EloRating(["A", "B", "C"], k_factor=32.0, k_decay=2.0, volatility_window=3)
    for (a, b, score), (expected, k_a, k_b, ratings) in zip(SEQUENCE, HAND):
        assert elo.expected_score(a, b) == pytest.approx(expected, abs=1e-12)
        assert elo.current_k_factor(a) == pytest.approx(k_a, abs=1e-9)
        assert elo.current_k_factor(b) == pytest.approx(k_b, abs=1e-9)
        elo.report(a, b, score)
        assert elo.pending == 1  # reported duels wait for the next flush
        assert elo.apply_pending() == 1
        assert [elo.rating(p) for p in "ABC"] == pytest.approx(ratings, abs=1e-9)
    assert [elo.games_played(p) for p in "ABC"] == [4, 3, 3]
    assert elo.decayed_k_factor("A") == pytest.approx(32.0 / 3)
    # Volatility: sample std of A's last three changes.
    changes_a = [16.0, 1015.5091288043187 - 1016.0, 1009.4135891433579 - 1015.5091288043187]
    changes_a.append(HAND[4][3][0] - HAND[3][3][0])
    assert elo.volatility("A") == pytest.approx(sample_std(changes_a[-3:]), abs=1e-9)
    assert len(elo.history) == 6 and elo.history[0] == {"A": 1000.0, "B": 1000.0, "C": 1000.0}
    assert elo.history[-1] == elo.ratings


def test_plain_elo_without_decay_is_zero_sum():
    elo = EloRating(["x", "y"], k_factor=16.0, k_decay=None, volatility_window=2)
    elo.report("x", "y", 1.0)
    elo.apply_pending()
    assert elo.ratings == {"x": 1008.0, "y": 992.0}
    elo.report("y", "x", 1.0)
    elo.apply_pending()
    # Both now have sigma = |8 + d| / sqrt(2) for their two changes; equal K keeps the sum at 2000.
    assert sum(elo.ratings.values()) == pytest.approx(2000.0, abs=1e-9)


def test_judge_weights_give_a_reputation_weighted_score():
    elo = EloRating(["a", "b", "j1", "j2"])
    elo.report("j1", "j2", 1.0)
    elo.apply_pending()
    weights = elo.judge_weights(["j1", "j2"])
    assert weights == [1016.0, 984.0]
    elo.report("a", "b", [1.0, 0.0], weights=weights)
    elo.apply_pending()
    assert elo.rating("a") == pytest.approx(1000.0 + 32.0 * (1016.0 / 2000.0 - 0.5), abs=1e-9)


def test_report_rejects_bad_input():
    elo = EloRating(["a", "b"])
    with pytest.raises(ValueError, match="Unknown player 'z'"):
        elo.report("a", "z", 1.0)
    with pytest.raises(ValueError, match="Unknown player"):
        elo.rating("z")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        elo.report("a", "b", 1.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        elo.report("a", "b", -0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        elo.report("a", "b", [0.5, 2.0])
    with pytest.raises(ValueError, match="itself"):
        elo.report("a", "a", 1.0)
    with pytest.raises(ValueError, match="per-judge"):
        elo.report("a", "b", 1.0, weights=[1.0])
    assert elo.pending == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"players": ["a"]}, "at least two"),
        ({"players": ["a", "a"]}, "unique"),
        ({"k_factor": 0.0}, "k_factor"),
        ({"k_decay": 0.0}, "k_decay"),
        ({"volatility_window": 1}, "volatility_window"),
        ({"apply_every_n_batches": 0}, "apply_every_n_batches"),
        ({"initial_rating": math.inf}, "initial_rating"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EloRating(**{"players": ["a", "b"], **kwargs})


def test_state_round_trip_and_player_mismatch():
    elo = EloRating(["A", "B", "C"], k_decay=2.0, volatility_window=3)
    for a, b, score in SEQUENCE:
        elo.report(a, b, score)
    elo.apply_pending()
    elo.report("A", "B", 1.0)  # still pending: saved too
    copy = EloRating(["A", "B", "C"], k_decay=2.0, volatility_window=3)
    copy.load_state_dict(elo.state_dict())
    assert copy.state_dict() == elo.state_dict()
    assert copy.volatility("A") == elo.volatility("A") and copy.current_k_factor("C") == elo.current_k_factor("C")
    with pytest.raises(ValueError, match="players"):
        EloRating(["A", "B"]).load_state_dict(elo.state_dict())


def test_in_training_ratings_are_logged_exposed_and_plotted(tmp_path):
    elo = EloRating(PLAYERS, k_factor=32.0, k_decay=4.0, volatility_window=3, figure_path=tmp_path / "elo.png")
    trainer = make_trainer(tmp_path, [elo], max_epochs=2, limit_val_batches=0)
    trainer.fit(GameModule())
    # The module reported one duel per batch; each is applied at its batch end, in order.
    offline = EloRating(PLAYERS, k_factor=32.0, k_decay=4.0, volatility_window=3)
    for epoch in range(2):
        for batch_idx in range(12):
            offline.report(*duel_of(epoch, batch_idx, rank=0))
            offline.apply_pending()
    assert elo.ratings == offline.ratings
    assert sum(elo.games_played(p) for p in PLAYERS) == 2 * 24
    assert EloRating.find(trainer) is elo
    for player in PLAYERS:
        assert float(trainer.callback_metrics[f"elo/{player}"]) == pytest.approx(elo.rating(player), rel=1e-6)
        assert float(trainer.callback_metrics[f"elo_volatility/{player}"]) == pytest.approx(
            elo.volatility(player), rel=1e-5
        )
    assert (tmp_path / "elo.png").stat().st_size > 1000
    figure = elo.plot()
    assert len(figure.axes[0].lines) == len(PLAYERS)
    assert list(figure.axes[0].lines[0].get_ydata()) == [row["alice"] for row in elo.history]


def test_find_requires_exactly_one(tmp_path):
    trainer = make_trainer(tmp_path, [EloRating(["a", "b"]), EloRating(["c", "d"], name="other")])
    assert EloRating.find(trainer, name="other").players == ["c", "d"]
    with pytest.raises(LookupError, match="found 2"):
        EloRating.find(trainer)
    with pytest.raises(LookupError, match="found 0"):
        EloRating.find(make_trainer(tmp_path, []))


def _expected_ddp_elo(batches_per_epoch: int) -> EloRating:
    """Replay the DDP job's duels: flushed every DDP_ELO_EVERY batches, at checkpoints and at epoch ends."""
    offline = EloRating(PLAYERS, k_factor=32.0, k_decay=4.0, volatility_window=3)
    pending: dict[int, list] = {0: [], 1: []}
    t = 0
    for epoch in range(DDP_EPOCHS):
        for batch_idx in range(batches_per_epoch):
            t += 1
            for rank in (0, 1):
                pending[rank].append(duel_of(epoch, batch_idx, rank))
            checkpoint = (2 * t) % DDP_CKPT_EVERY_STEPS == 0
            if t % DDP_ELO_EVERY == 0 or checkpoint or batch_idx == batches_per_epoch - 1:
                for rank in (0, 1):  # rank 0's duels first, each rank's in the order reported
                    for duel in pending[rank]:
                        offline.report(*duel)
                    pending[rank] = []
                offline.apply_pending()
    return offline


@pytest.mark.distributed
def test_ddp_ranks_agree_and_apply_every_ranks_duels_in_rank_order():
    outdir, (rank0, rank1) = ddp_results()
    key = EloRating(PLAYERS).state_key
    assert rank0["states"][key] == rank1["states"][key]
    expected = _expected_ddp_elo(batches_per_epoch=6)
    state = rank0["states"][key]
    assert state["ratings"] == pytest.approx(list(expected.ratings.values()), abs=1e-9)
    assert state["games"] == [24, 24, 24]  # 18 batches x 2 ranks x 2 players / 3 players
    assert state["pending"] == []
    # A checkpoint written between two applications holds every rank's duels (flushed while saving).
    ckpt = torch.load(f"{outdir}/steps/epoch=0-step=4.ckpt", weights_only=False)
    saved = ckpt["callbacks"][key]
    assert saved["pending"] == [] and sum(saved["games"]) == 2 * 2 * 2
    assert saved["history"] == [row for row in state["history"][: len(saved["history"])]]


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = run_docs_example("elo = EloRating(")
    elo = example["elo"]
    assert sum(elo.games_played(p) for p in elo.players) == 2 * 64
    assert elo.rating("qwen") > elo.rating("gemma")  # the stronger player earns the higher reputation
    assert (tmp_path / "elo_trajectories.png").exists()


def test_a_figure_without_matplotlib_is_refused_at_construction_naming_the_install(monkeypatch, tmp_path):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, **k: None if n == "matplotlib" else find(n, *a, **k))
    with pytest.raises(ImportError, match=r'pip install matplotlib \(or .*pip install "alignment-games\[games\]"\)'):
        EloRating(PLAYERS, figure_path=tmp_path / "elo.png")
    assert EloRating(PLAYERS).figure_path is None  # without a figure nothing needs it
