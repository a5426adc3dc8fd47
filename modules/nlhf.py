"""NLHF baseline (Nash-MD-PG, Munos et al., 2024): one LM policy against a mixture of itself and the reference."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from alignment_games.modules.algorithms.baselines import nash_md_pg_surrogate_loss
from alignment_games.modules.algorithms.checks import require_at_least, require_in_range, require_positive
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.evaluation.win_rate import WinRateValidation
from alignment_games.modules.games.leader_follower import load_play_state, play_state
from alignment_games.modules.lm.mixture import generate_mixture
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.prompts import QWEN_SYSTEM
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.preference import EnsembleUtility
from alignment_games.modules.scorers.oracle import PreferenceOracle
from alignment_games.modules.scorers.utility import Utility


class NashMDPG(WinRateValidation, LanguageModelGame):
    """An LM policy trained by Nash-MD-PG against a frozen preference model P0 (the paper's NLHF baseline).

    Args:
        lm: The policy (``players: lora``: one adapter, disabled as the reference μ; ``separate``: full copies).
        preference: P0(first ≻ second | x); the configs take ensemble member 0; ``None`` is refused (untrained).
        tau: τ, the weight of ``KL(π_θ ‖ μ)``.
        beta: β, the reference's weight in the opponent's geometric mixture (0: self-play, 1: the reference).
        lr: The policy's learning rate.
        samples_per_prompt: D, policy samples per prompt, each paired with one mixture sample (1: Table 3's budget).
        sampling: How the policy and the mixture sample (temperature also that of the log-probabilities).
        system_prompt: The policy's system message.
        eval_pairs: Policy–reference answer pairs per held-out prompt.
        oracle: Optional oracle for the held-out preference rate against the reference.
        logprob_micro_batch: Sequences per log-probability forward (0: all at once).
        **game: :class:`~alignment_games.modules.base.LanguageModelGame`'s arguments (``grad_clip``, ...).
    """

    family = "NLHF (Nash-MD-PG)"
    eval_player = "policy"

    def __init__(
        self,
        lm: ModelConfig,
        preference: Utility | None = None,
        tau: float = 0.05,
        beta: float = 0.125,
        lr: float = 4e-4,
        samples_per_prompt: int = 1,
        sampling: Sampling = Sampling(temperature=0.6, max_new_tokens=512),
        system_prompt: str = QWEN_SYSTEM,
        eval_pairs: int = 2,
        oracle: PreferenceOracle | None = None,
        logprob_micro_batch: int = 0,
        **game: Any,
    ) -> None:
        super().__init__(**game)
        lm = ModelConfig.coerce(lm)
        require_positive(tau=tau, lr=lr)
        require_in_range("beta (the reference's weight in the mixture)", beta, 0, 1)
        require_at_least(samples_per_prompt=(samples_per_prompt, 1), eval_pairs=(eval_pairs, 1))
        self.save_arguments(lm, ["preference", "oracle"], sampling=Sampling)
        self.players = PolicyBank(lm, players=("policy",))
        self.preference = preference if preference is not None else EnsembleUtility(checkpoint=None, kind="preference")
        self.preference.requires_grad_(False)
        self.oracle = oracle
        self.empty_generations = 0
        self.last_eval: dict[str, Any] | None = None

    game_state, load_game_state = play_state, load_play_state

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp, prompts = self.hparams, list(batch["prompt"])
        b, d, temp = len(prompts), hp.samples_per_prompt, self.sampling.temperature
        chats = self.eval_prompts(prompts)
        with self._timed("generate"):
            own = self.players.generate("policy", chats, d, self.sampling)
            opponent = generate_mixture(self.players, "policy", chats, d, hp.beta, self.sampling)
        self.empty_generations += own.num_empty + opponent.num_empty
        with self._timed("score"):
            xs = [x for x in prompts for _ in range(d)]
            pref = self.preference(xs, own.texts, opponent.texts).to(self.device).float()
        if not self.check_finite(pref, "preferences"):  # same decision on every rank: nobody steps
            return
        with self._timed("logprob"):
            lp = self.players.logprobs("policy", own, temp, hp.logprob_micro_batch)
            with torch.no_grad():
                lp_ref = self.players.logprobs(None, own, temp, hp.logprob_micro_batch)
        out = nash_md_pg_surrogate_loss(pref, lp, lp_ref, hp.tau)
        if (step := self.update(out["loss"], self.optimizers(), [self.players.player_parameters("policy")])) is None:
            return
        self.log_phase_times(b)
        stats = {"train/loss": out["loss"].detach(), "policy/win_rate": out["win_rate"], "policy/kl": out["kl"]}
        stats |= {"policy/grad_norm": step[1][0], "policy/response_tokens": own.completion_mask.sum(1).float().mean()}
        stats |= {"train/empty_policy": float(own.num_empty), "train/empty_opponent": float(opponent.num_empty)}
        self.log_dict(stats, batch_size=b)  # policy/win_rate: P0(y ≻ y′) against the mixture

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.players.player_parameters("policy"), self.hparams.lr)
