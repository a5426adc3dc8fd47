"""Elo reputations of the players of a multi-model game, updated after each duel."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from alignment_games.callbacks.functional.elo import (
    _check_score,
    decayed_k_factor,
    effective_k_factor,
    elo_expected_score,
    sample_std,
    weighted_score,
)
from alignment_games.callbacks.media import log_figure, log_scalar_layout

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class EloRating(Callback):
    r"""Elo reputations of named players, updated with an adapted Elo rule after every reported duel (§2.3, App. C).

    The rule is :func:`~alignment_games.callbacks.functional.elo_update` with each player's
    :func:`~alignment_games.callbacks.functional.effective_k_factor` (README, "Elo reputations"). :meth:`report` buffers
    a duel (pass Python numbers: a tensor would sync the device); duels are applied at batch and epoch ends and before a
    checkpoint, in rank order across ranks. Give it to the ``Trainer``, not ``configure_callbacks`` (it hangs under
    DDP). Logs ``{name}/<player>`` and ``{name}_volatility/<player>``.

    Args:
        players: the players' names (unique, at least two).
        initial_rating: everyone's rating before any duel.
        k_factor: :math:`K_0`, the K factor of a player with no duel behind it.
        k_decay: :math:`d`, duels after which the decayed K has halved; ``None`` keeps K at ``k_factor``.
        volatility_window: number of recent rating changes whose standard deviation is the volatility (>= 2).
        scale: logistic scale of the expected score (400: a 400-point gap means 10:1 odds).
        apply_every_n_batches: under DDP, gather and apply the buffered duels every n training batches.
        figure_path: if given, rank 0 writes the trajectory figure there at the end of fit, and to the loggers.
        name: namespace of the logged keys and part of :attr:`state_key`.

    Raises:
        ValueError: on fewer than two players, duplicate names or an out-of-range argument; from :meth:`report`,
            on an unknown player, a player duelling itself or a score outside [0, 1].
    """

    def __init__(
        self,
        players: Sequence[str],
        initial_rating: float = 1000.0,
        k_factor: float = 32.0,
        k_decay: float | None = 50.0,
        volatility_window: int = 10,
        scale: float = 400.0,
        apply_every_n_batches: int = 1,
        figure_path: str | os.PathLike | None = None,
        name: str = "elo",
    ) -> None:
        super().__init__()
        players = [str(p) for p in players]
        for ok, message in (
            (len(players) >= 2, f"EloRating needs at least two players, got {players}."),
            (len(set(players)) == len(players), f"Player names must be unique, got {players}."),
            (math.isfinite(initial_rating), f"`initial_rating` must be finite, got {initial_rating}."),
            (k_factor > 0, f"`k_factor` must be > 0, got {k_factor}."),
            (k_decay is None or k_decay > 0, f"`k_decay` must be > 0 or None, got {k_decay}."),
            (volatility_window >= 2, f"`volatility_window` must be >= 2 (a sample std), got {volatility_window}."),
            (scale > 0, f"`scale` must be > 0, got {scale}."),
            (apply_every_n_batches >= 1, f"`apply_every_n_batches` must be >= 1, got {apply_every_n_batches}."),
        ):
            if not ok:
                raise ValueError(message)
        if figure_path is not None and importlib.util.find_spec("matplotlib") is None:  # not after a whole fit
            raise ImportError(
                "EloRating(figure_path=...) draws with matplotlib, which is not installed: pip install matplotlib "
                '(or the games extra, which has it: pip install "alignment-games[games]")'
            )
        self.players, self.initial_rating, self.k_factor = players, float(initial_rating), float(k_factor)
        self.k_decay = None if k_decay is None else float(k_decay)
        self.volatility_window, self.scale = int(volatility_window), float(scale)
        self.apply_every_n_batches, self.figure_path, self.name = int(apply_every_n_batches), figure_path, name
        self._index = {p: i for i, p in enumerate(players)}
        self._ratings, self._games = [self.initial_rating] * len(players), [0] * len(players)
        self._recent: list[deque[float]] = [deque(maxlen=self.volatility_window) for _ in players]
        self._history: list[list[float]] = [list(self._ratings)]
        self._pending: list[tuple[int, int, float]] = []
        self._batches = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    @classmethod
    def find(cls, trainer: pl.Trainer, name: str | None = None) -> EloRating:
        """The trainer's ``EloRating`` callback (the one called ``name`` when there are several).

        Raises:
            LookupError: if there is none, or several and ``name`` does not pick one.
        """
        found = [cb for cb in trainer.callbacks if isinstance(cb, cls) and (name is None or cb.name == name)]
        if len(found) != 1:
            raise LookupError(
                f"Expected one {cls.__name__} callback{f' named {name!r}' if name else ''} on the trainer,"
                f" found {len(found)}."
            )
        return found[0]

    def _idx(self, player: str) -> int:
        try:
            return self._index[player]
        except KeyError:
            raise ValueError(f"Unknown player {player!r}; the players are {self.players}.") from None

    def report(
        self, player_a: str, player_b: str, score_a: float | Sequence[float], weights: Sequence[float] | None = None
    ) -> None:
        """Report the result of one duel, applied at the next flush.

        Args:
            player_a: name of player a.
            player_b: name of player b (not a).
            score_a: a's score in [0, 1], or one score in [0, 1] per judge.
            weights: with per-judge scores, one non-negative weight per judge (e.g. :meth:`judge_weights`).

        Raises:
            ValueError: on an unknown player, ``player_a == player_b``, a score outside [0, 1] or bad weights.
        """
        ia, ib = self._idx(player_a), self._idx(player_b)
        if ia == ib:
            raise ValueError(f"A player cannot duel itself ({player_a!r}).")
        if isinstance(score_a, (int, float)) or (isinstance(score_a, torch.Tensor) and score_a.numel() == 1):
            if weights is not None:
                raise ValueError("`weights` only apply to a sequence of per-judge scores.")
            score = _check_score(float(score_a))
        else:
            score = weighted_score(list(score_a), weights)
        self._pending.append((ia, ib, score))

    @property
    def ratings(self) -> dict[str, float]:
        """Current rating of every player (a copy)."""
        return dict(zip(self.players, self._ratings))

    def rating(self, player: str) -> float:
        """Current rating of ``player``."""
        return self._ratings[self._idx(player)]

    def games_played(self, player: str) -> int:
        """Number of duels of ``player`` applied so far."""
        return self._games[self._idx(player)]

    def volatility(self, player: str) -> float:
        """Sample standard deviation of the last ``volatility_window`` rating changes of ``player``."""
        return sample_std(self._recent[self._idx(player)])

    def current_k_factor(self, player: str) -> float:
        """K factor that ``player``'s next duel will use."""
        return self._k(self._idx(player))

    def _k(self, i: int) -> float:
        return effective_k_factor(self.k_factor, self._games[i], self.k_decay, sample_std(self._recent[i]))

    def decayed_k_factor(self, player: str) -> float:
        """K factor of ``player`` without the volatility boost."""
        return decayed_k_factor(self.k_factor, self.games_played(player), self.k_decay)

    def expected_score(self, player_a: str, player_b: str) -> float:
        """Expected score of ``player_a`` against ``player_b`` under the current ratings."""
        return elo_expected_score(self.rating(player_a), self.rating(player_b), self.scale)

    def judge_weights(self, judges: Sequence[str]) -> list[float]:
        """Current ratings of ``judges`` (floored at 0), for a reputation-weighted mean of their scores."""
        return [max(0.0, self.rating(j)) for j in judges]

    @property
    def history(self) -> list[dict[str, float]]:
        """Ratings after each applied duel, the initial ratings first."""
        return [dict(zip(self.players, row)) for row in self._history]

    @property
    def pending(self) -> int:
        """Number of this rank's reported duels not applied yet."""
        return len(self._pending)

    def _apply_one(self, ia: int, ib: int, score: float) -> None:
        surprise = score - elo_expected_score(self._ratings[ia], self._ratings[ib], self.scale)
        for i, delta in ((ia, self._k(ia) * surprise), (ib, -self._k(ib) * surprise)):
            self._ratings[i] += delta
            self._recent[i].append(delta)
            self._games[i] += 1
        self._history.append(list(self._ratings))

    def _gather(self, trainer: pl.Trainer | None) -> list[tuple[int, int, float]]:
        local, self._pending = self._pending, []
        if trainer is None or trainer.world_size == 1:
            return local
        strategy, device = trainer.strategy, trainer.strategy.root_device
        counts = strategy.all_gather(torch.tensor([len(local)], device=device)).reshape(-1).tolist()
        longest = max(counts)
        if longest == 0:
            return []
        # One row per duel: player indices and score, padded to the longest list; float64 holds both exactly.
        rows = torch.zeros(longest, 3, dtype=torch.float64)
        if local:
            rows[: len(local)] = torch.tensor(local, dtype=torch.float64)
        gathered = strategy.all_gather(rows.to(device)).reshape(len(counts), longest, 3).cpu().tolist()
        return [(int(a), int(b), s) for rank, n in enumerate(counts) for a, b, s in gathered[rank][:n]]

    def apply_pending(self, trainer: pl.Trainer | None = None) -> int:
        """Apply the buffered duels now (of every rank under DDP: call it on all ranks); returns how many."""
        duels = self._gather(trainer)
        for duel in duels:
            self._apply_one(*duel)
        return len(duels)

    def tensorboard_layout(self) -> dict[str, dict[str, list[Any]]]:
        """TensorBoard custom-scalars layout: all ratings in one chart, all volatilities in another."""

        def tags(prefix: str) -> list[str]:
            return [f"^{re.escape(f'{prefix}/{p}')}$" for p in self.players]

        return {
            f"{self.name} (Elo)": {
                "ratings": ["Multiline", tags(self.name)],
                "volatility": ["Multiline", tags(f"{self.name}_volatility")],
            }
        }

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # TensorBoard reads the first layout of a run: written once, here
        log_scalar_layout(trainer, self.tensorboard_layout())

    def _log(self, pl_module: pl.LightningModule) -> None:
        options = {"on_step": True, "on_epoch": False, "batch_size": 1}
        for player, rating, recent in zip(self.players, self._ratings, self._recent):
            pl_module.log(f"{self.name}/{player}", rating, **options)
            pl_module.log(f"{self.name}_volatility/{player}", sample_std(recent), **options)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if trainer.world_size == 1 or self._batches % self.apply_every_n_batches == 0:
            self.apply_pending(trainer)
        self._log(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.apply_pending(trainer)

    on_validation_epoch_end = on_train_epoch_end

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs on every rank after `state_dict()` was taken: the file must lose no rank's buffered duels.
        if trainer.world_size > 1 or self._pending:
            if self.apply_pending(trainer) and self.state_key in checkpoint.get("callbacks", {}):
                checkpoint["callbacks"][self.state_key] = self.state_dict()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.apply_pending(trainer)
        if self.figure_path is not None and trainer.is_global_zero:
            log_figure(trainer, f"{self.name}/trajectories", self.plot(self.figure_path))
            rank_zero_info(f"EloRating: wrote the rating trajectories to {os.fspath(self.figure_path)}.")

    def plot(self, path: str | os.PathLike | None = None) -> Figure:
        """Figure of every player's rating against the number of applied duels; saved to ``path`` if given."""
        from matplotlib.figure import Figure  # lazy: only figures need matplotlib

        figure = Figure(figsize=(7.0, 4.0), layout="constrained")
        axes = figure.add_subplot(xlabel="duels applied", ylabel="Elo rating", title="Reputation trajectories")
        for player, ratings in zip(self.players, zip(*self._history)):
            axes.plot(range(len(self._history)), ratings, label=player)
        axes.legend(loc="best", fontsize="small")
        if path is not None:
            figure.savefig(path)
        return figure

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "players": list(self.players),
            "ratings": list(self._ratings),
            "games": list(self._games),
            "recent": [list(d) for d in self._recent],
            "history": [list(row) for row in self._history],
            "pending": [list(p) for p in self._pending],
            "batches": self._batches,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if list(state_dict["players"]) != self.players:
            raise ValueError(
                f"The checkpoint's EloRating was for players {state_dict['players']}, this one is for {self.players}."
            )
        self._ratings = [float(r) for r in state_dict["ratings"]]
        self._games = [int(g) for g in state_dict["games"]]
        self._recent = [deque((float(x) for x in d), maxlen=self.volatility_window) for d in state_dict["recent"]]
        self._history = [[float(r) for r in row] for row in state_dict["history"]]
        self._pending = [(int(a), int(b), float(s)) for a, b, s in state_dict["pending"]]
        self._batches = int(state_dict["batches"])
