"""The leader–follower game that deep-SMIDA and SLHF play, each with its own losses.

A step: D leader samples per prompt, M follower samples per leader sample (the leader's reply in the follower's system
message, App. E.4), their ``utility``, log-probabilities, one backward of the family's losses and clipped steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.text import fill_template
from alignment_games.modules.scorers.utility import Utility


def check_leader_follower(samples_per_prompt: int, follower_samples: int, minimum: int, template: str) -> None:
    """Refuse (``ValueError``) fewer than ``minimum`` samples D or M, or a follower template without its slot."""
    if min(samples_per_prompt, follower_samples) < minimum:
        why = " for the leave-one-out baselines" if minimum == 2 else ""
        raise ValueError(
            f"samples_per_prompt (D) and follower_samples (M) must be at least {minimum}{why}, "
            f"got D={samples_per_prompt}, M={follower_samples}"
        )
    if "{leader_response}" not in template:
        raise ValueError("follower_system_template must contain {leader_response}")


def play_state(game: Any) -> dict[str, Any]:
    """The game state a sampling game keeps: its count of empty generations and its oracle's generator and counters."""
    # the oracle's generator and counters: a resumed validation draws and counts the same
    oracle = {} if game.oracle is None else {"oracle": game.oracle.state_dict()}
    return {"empty_generations": game.empty_generations} | oracle


def load_play_state(game: Any, state: dict[str, Any]) -> None:
    """Restore what :func:`play_state` returned."""
    game.empty_generations = int(state.get("empty_generations", 0))
    if game.oracle is not None and "oracle" in state:
        game.oracle.load_state_dict(state["oracle"])


class TwoOptimizers:
    """A leader–follower game's optimizers (mixin, before ``LanguageModelGame``): one per player."""

    players: PolicyBank  # with a "leader" and a "follower"; hparams hold leader_lr and follower_lr
    make_optimizer: Callable[..., torch.optim.Optimizer]

    def num_optimizers(self) -> int:
        """Two: the leader's and the follower's."""
        return 2

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per player at ``leader_lr`` / ``follower_lr``."""
        lrs = (("leader", self.hparams.leader_lr), ("follower", self.hparams.follower_lr))
        return [self.make_optimizer(self.players.player_parameters(p), lr) for p, lr in lrs]


class LeaderFollower:
    """The rollout, scoring, log-probabilities and updates of a game's ``leader`` and ``follower``.

    Args:
        game: The game that plays; this sets its ``players``, ``utility``, ``oracle`` and ``empty_generations``.
        lm: The policy both players start from; its frozen weights are the references.
        utility: The game's score of (x, y, y′), frozen here.
        oracle: The game's optional oracle.
    """

    def __init__(self, game: Any, lm: ModelConfig, utility: Utility, oracle: Any) -> None:
        game.players = PolicyBank(lm, players=("leader", "follower"))
        game.utility, game.oracle, game.empty_generations = utility.requires_grad_(False), oracle, 0
        self.game = game

    def leader_prompts(self, prompts: list[str]) -> list[str]:
        """Chat-formatted leader inputs."""
        return [self.game.players.chat(self.game.hparams.system_prompt, x) for x in prompts]

    def follower_prompts(self, prompts: list[str], leader_texts: list[str]) -> list[str]:
        """Chat-formatted follower inputs with the leader's reply in the system message (App. E.4)."""
        system = [fill_template(self.game.hparams.follower_system_template, leader_response=y) for y in leader_texts]
        return [self.game.players.chat(s, x) for s, x in zip(system, prompts)]

    def rollout(
        self, prompts: list[str], d: int, m: int, leader="leader", follower="follower"
    ) -> tuple[Rollout, Rollout]:
        """Leader samples ``[B·D]`` then follower samples ``[B·D·M]``, one generate call per player."""
        players, s = self.game.players, self.game.sampling
        lead = players.generate(leader, self.leader_prompts(prompts), d, s)
        xs = [x for x in prompts for _ in range(d)]
        return lead, players.generate(follower, self.follower_prompts(xs, lead.texts), m, s)

    @staticmethod
    def triplets(prompts: list[str], lead: Rollout, foll: Rollout, d: int, m: int) -> tuple[list[str], ...]:
        """Flattened (x, y, y′) lists in ``[B, D, M]`` order."""
        return [x for x in prompts for _ in range(d * m)], [y for y in lead.texts for _ in range(m)], foll.texts

    def train_step(self, batch: dict[str, Any], losses: Callable[..., dict[str, Tensor]], follower_only: bool) -> None:
        """One step; ``follower_only``: the leader neither learns nor steps. ``losses(u, lp_l, ref, lp_f, ref)``."""
        game, players = self.game, self.game.players
        prompts = list(batch["prompt"])
        hp, temp = game.hparams, game.sampling.temperature
        b, d, m, mb = len(prompts), hp.samples_per_prompt, hp.follower_samples, hp.logprob_micro_batch
        with game._timed("generate"):
            lead, foll = self.rollout(prompts, d, m)
        empty_l, empty_f = lead.num_empty, foll.num_empty
        game.empty_generations += empty_l + empty_f
        with game._timed("score"):
            u = game.utility(*self.triplets(prompts, lead, foll, d, m)).to(game.device).view(b, d, m)
        game.log_dict({"train/empty_leader": float(empty_l), "train/empty_follower": float(empty_f)}, batch_size=b)
        if not game.check_finite(u, "utilities"):  # same decision on every rank: nobody steps
            return
        with game._timed("logprob"):
            lp_l = players.logprobs("leader", lead, temp, mb).view(b, d)
            lp_f = players.logprobs("follower", foll, temp, mb).view(b, d, m)
            with torch.no_grad():
                lp_l_ref = players.logprobs(None, lead, temp, mb).view(b, d)
                lp_f_ref = players.logprobs(None, foll, temp, mb).view(b, d, m)
        out = losses(u, lp_l, lp_l_ref, lp_f, lp_f_ref)
        game.board.add_values(game, {"follower/utility_hist": u, "leader/cost_hist": out["a_bar"]})
        loss = out["follower_loss"] + (0.0 if follower_only else out["leader_loss"])
        opts, params = game.optimizers(), [players.player_parameters(p) for p in ("leader", "follower")]
        if follower_only:  # the leader never steps; its norm is still logged
            opts[0].zero_grad()
        # one backward: the players' parameters are disjoint; non-finite (e.g. an infinite log-probability): no step
        if (step := game.update(loss, opts[follower_only:], params[follower_only:])) is None:
            return
        norms = [game.grad_norm(params[0])] * follower_only + step[1]  # before clipping
        game.log_phase_times(b, generated_tokens=float(lead.completion_mask.sum() + foll.completion_mask.sum()))
        stats = {"train/loss": (out["leader_loss"] + out["follower_loss"]).detach()}
        stats |= {"follower/utility": out["utility_mean"], "leader/cost": out["a_bar"].mean()}
        for name, rollout, norm in (("leader", lead, norms[0]), ("follower", foll, norms[1])):
            stats |= {f"{name}/kl": out[f"{name}_kl"], f"{name}/grad_norm": norm}
            stats[f"{name}/response_tokens"] = rollout.completion_mask.sum(1).float().mean()
        game.log_dict(stats, prog_bar=False, batch_size=b)
