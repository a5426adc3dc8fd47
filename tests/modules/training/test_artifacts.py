"""recover_folder_on_rank_zero: rank 0 recovers a killed swap, every rank raises its refusal, then all meet."""

import os

import pytest

from alignment_games.modules.training.artifacts import recover_folder_on_rank_zero


class _Strategy:
    """The three members the helper uses; ``broadcast`` returns what rank 0 would have sent."""

    def __init__(self, rank: int, sent: object = None) -> None:
        self.global_rank, self.sent, self.barriers = rank, sent, []

    def broadcast(self, value: object) -> object:
        return value if self.global_rank == 0 else self.sent

    def barrier(self, name: str) -> None:
        self.barriers.append(name)


def test_rank_zero_puts_the_previous_folder_back_and_every_rank_meets_at_the_barrier(tmp_path):
    (tmp_path / ".last.ckpt.previous").mkdir()
    strategy = _Strategy(0)
    recover_folder_on_rank_zero(strategy, tmp_path / "last.ckpt", "load_recovered")
    assert (tmp_path / "last.ckpt").is_dir() and not (tmp_path / ".last.ckpt.previous").exists()
    assert strategy.barriers == ["load_recovered"]


def test_a_refused_previous_link_is_raised_on_every_rank_before_the_barrier(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / ".last.ckpt.previous"
    link.symlink_to(outside)
    zero = _Strategy(0)
    with pytest.raises(ValueError, match=r"\.last\.ckpt\.previous' is a symbolic link") as refused:
        recover_folder_on_rank_zero(zero, tmp_path / "run" / "last.ckpt", "load_recovered")
    other = _Strategy(1, sent=str(refused.value))
    with pytest.raises(ValueError) as also:
        recover_folder_on_rank_zero(other, tmp_path / "run" / "last.ckpt", "load_recovered")
    assert str(also.value) == str(refused.value)
    assert zero.barriers == other.barriers == []  # no rank waits for one that raised
    assert os.path.islink(link)  # left untouched
