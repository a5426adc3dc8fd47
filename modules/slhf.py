"""SLHF baseline (Pásztor et al., 2026): a Leader and a refining Follower LM optimise one frozen preference model P0."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from alignment_games.modules.algorithms.baselines import slhf_surrogate_losses
from alignment_games.modules.algorithms.checks import require_at_least, require_positive
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.evaluation.win_rate import WinRateValidation
from alignment_games.modules.games import leader_follower as lf
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.prompts import FOLLOWER_SYSTEM, QWEN_SYSTEM
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.preference import EnsembleUtility
from alignment_games.modules.scorers.oracle import PreferenceOracle
from alignment_games.modules.scorers.utility import Utility


class SLHF(WinRateValidation, lf.TwoOptimizers, LanguageModelGame):
    """Leader and Follower trained by SLHF's StackelbergGDA against one frozen preference model P0.

    Args:
        lm: The policy both players start from; its frozen weights are the references (``players: lora | separate``).
        preference: P0(first ≻ second | x), as :class:`~alignment_games.modules.nlhf.NashMDPG` takes it.
        tau_leader: τ_L.
        tau_follower: τ_F.
        leader_lr: η_L (the optimizer's rate unless a warm-up callback sets it).
        follower_lr: η_F (faster than η_L: the Follower's timescale, App. C.2).
        samples_per_prompt: D, leader samples per prompt (≥ 1; 1: Table 3's budget).
        follower_samples: M, follower samples per leader sample (≥ 1; 1: Table 3's budget).
        sampling: How both players sample.
        system_prompt: Leader's system message.
        follower_system_template: Follower's system message; ``{leader_response}`` is replaced.
        eval_pairs: Leader–reference answer pairs per held-out prompt.
        oracle: Optional oracle for the held-out preference rate against the reference.
        logprob_micro_batch: Sequences per log-probability forward (0: all at once).
        **game: :class:`~alignment_games.modules.base.LanguageModelGame`'s arguments (``grad_clip``, ...).
    """

    family = "SLHF (StackelbergGDA)"
    eval_player = "leader"

    def __init__(
        self,
        lm: ModelConfig,
        preference: Utility | None = None,
        tau_leader: float = 0.05,
        tau_follower: float = 0.05,
        leader_lr: float = 4e-4,
        follower_lr: float = 1e-3,
        samples_per_prompt: int = 1,
        follower_samples: int = 1,
        sampling: Sampling = Sampling(temperature=0.6, max_new_tokens=512),
        system_prompt: str = QWEN_SYSTEM,
        follower_system_template: str = FOLLOWER_SYSTEM,
        eval_pairs: int = 2,
        oracle: PreferenceOracle | None = None,
        logprob_micro_batch: int = 0,
        **game: Any,
    ) -> None:
        utility = preference if preference is not None else EnsembleUtility(checkpoint=None, kind="preference")
        super().__init__(**game)
        lm = ModelConfig.coerce(lm)
        # a player with one sample takes the constant baseline ½ (slhf_surrogate_losses)
        lf.check_leader_follower(samples_per_prompt, follower_samples, 1, follower_system_template)
        require_positive(tau_leader=tau_leader, tau_follower=tau_follower, leader_lr=leader_lr, follower_lr=follower_lr)
        require_at_least(eval_pairs=(eval_pairs, 1), logprob_micro_batch=(logprob_micro_batch, 0))
        self.save_arguments(lm, ["preference", "oracle"], sampling=Sampling)
        self.play = lf.LeaderFollower(self, lm, utility, oracle)
        self.last_eval: dict[str, Any] | None = None

    @property
    def preference(self) -> Utility:
        """P0, held as the game's ``utility`` (scored once per triplet, leader's response first)."""
        return self.utility

    game_state, load_game_state = lf.play_state, lf.load_play_state

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.play.train_step(batch, self.surrogate_losses, follower_only=False)

    def surrogate_losses(
        self, u: Tensor, lp_l: Tensor, lp_l_ref: Tensor, lp_f: Tensor, lp_f_ref: Tensor
    ) -> dict[str, Tensor]:
        """Both players' losses from P0's leader-first preferences ``[B, D, M]`` and the log-probabilities."""
        hp = self.hparams
        out = slhf_surrogate_losses(u, lp_l, lp_l_ref, lp_f, lp_f_ref, hp.tau_leader, hp.tau_follower)
        self.log("leader/win_rate", out["leader_win_rate"], batch_size=u.shape[0])  # P0(y ≻ y′)
        return out

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        raise NotImplementedError(
            "SLHF writes no annotation candidates (that is deep-SMIDA's predict); compare trained policies with "
            "python -m alignment_games.commands.round_robin"
        )
