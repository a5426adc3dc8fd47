"""Deep-SMIDA (Algorithm 2): a Leader and a Follower LM play the zero-sum Stackelberg game on a utility u(x, y, y′)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

from alignment_games.callbacks.items import gather_unique_items
from alignment_games.callbacks.media import log_figure
from alignment_games.modules.algorithms.checks import require_at_least, require_in_range, require_positive
from alignment_games.modules.algorithms.smida_estimators import smida_surrogate_losses
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.evaluation.audit import digests_from_tensor, digests_tensor
from alignment_games.modules.evaluation.figures import make_game_figures
from alignment_games.modules.evaluation.game_eval import adversarial_report, adversarial_yield, compare_pairs
from alignment_games.modules.games import leader_follower as lf
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.prompts import FOLLOWER_SYSTEM, QWEN_SYSTEM
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.preference import EnsembleUtility
from alignment_games.modules.scorers.oracle import PreferenceOracle
from alignment_games.modules.scorers.utility import Utility

TAGS = ("trained", "reference")  # the pairs validation compares


class DeepSMIDA(lf.TwoOptimizers, LanguageModelGame):
    """Leader and Follower language models trained by deep-SMIDA against a frozen utility.

    Args:
        lm: The policy both players start from and their adapters (``players: lora | separate``); it is the reference.
        utility: The game's utility ``u(x, y, y′)``; ``None`` is refused (ask by name for an untrained ensemble).
        tau_leader: τ_L.
        tau_follower: τ_F.
        leader_lr: η_L (the optimizer's rate unless a warm-up callback sets it).
        follower_lr: η_F.
        samples_per_prompt: D, leader samples per prompt (≥ 2).
        follower_samples: M, follower samples per leader sample (≥ 2).
        sampling: How both players sample (temperature also of the log-probabilities; the paper's 0.6 and 1500).
        follower_only: Ablation of App. G.5: the leader stays at its reference.
        system_prompt: Leader's system message.
        follower_system_template: Follower's system message; ``{leader_response}`` is replaced.
        eval_pairs: Response pairs per held-out prompt (paper: 2).
        alphas: α levels of the online candidate yield.
        epsilons: ε margins of the adversarial yield (needs an oracle and references).
        oracle: Optional oracle for ε-adversarial yields on validation.
        logprob_micro_batch: Sequences per log-probability forward (0: all at once).
        candidate_alpha: α of the candidates that ``predict`` writes.
        candidate_threshold: Their variance threshold (``None``: the latest validation's reference ``1 − α`` quantile).
        **game: :class:`~alignment_games.modules.base.LanguageModelGame`'s arguments, per player (paper: grad_clip 1).
    """

    family = "deep-SMIDA"

    def __init__(
        self,
        lm: ModelConfig,
        utility: Utility | None = None,
        tau_leader: float = 5e-4,
        tau_follower: float = 5e-4,
        leader_lr: float = 8e-6,
        follower_lr: float = 2e-5,
        samples_per_prompt: int = 4,
        follower_samples: int = 4,
        sampling: Sampling = Sampling(temperature=0.6, max_new_tokens=1500),
        follower_only: bool = False,
        system_prompt: str = QWEN_SYSTEM,
        follower_system_template: str = FOLLOWER_SYSTEM,
        eval_pairs: int = 2,
        alphas: tuple[float, ...] = (0.1, 0.05, 0.01),
        epsilons: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3),
        oracle: PreferenceOracle | None = None,
        logprob_micro_batch: int = 0,
        candidate_alpha: float = 0.1,
        candidate_threshold: float | None = None,
        **game: Any,
    ) -> None:
        super().__init__(**game)
        lm = ModelConfig.coerce(lm)
        # Algorithm 2's leave-one-out baselines need two samples D and M
        lf.check_leader_follower(samples_per_prompt, follower_samples, 2, follower_system_template)
        require_positive(tau_leader=tau_leader, tau_follower=tau_follower, leader_lr=leader_lr, follower_lr=follower_lr)
        require_at_least(eval_pairs=(eval_pairs, 1), logprob_micro_batch=(logprob_micro_batch, 0))
        for i, a in enumerate([*alphas, candidate_alpha]):  # α levels are probabilities of a false candidate
            require_in_range(
                f"alphas[{i}]" if i < len(alphas) else "candidate_alpha", a, 0.0, 1.0, open_low=True, open_high=True
            )
        for i, eps in enumerate(epsilons):  # margins on a probability
            require_in_range(f"epsilons[{i}]", eps, 0.0, 1.0, open_high=True)
        self.save_arguments(lm, ["utility", "oracle"], sampling=Sampling)
        utility = utility if utility is not None else EnsembleUtility()  # refuses, before the players load
        self.play = lf.LeaderFollower(self, lm, utility, oracle)
        self._eval: dict[str, list[Tensor]] = {}
        self.last_eval: dict[str, Any] | None = None
        self.reference_thresholds: dict[str, float] = {}

    @override
    def game_state(self) -> dict[str, Any]:
        return {**lf.play_state(self), "reference_thresholds": dict(self.reference_thresholds)}

    @override
    def load_game_state(self, state: dict[str, Any]) -> None:
        lf.load_play_state(self, state)
        self.reference_thresholds = dict(state.get("reference_thresholds", {}))

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.play.train_step(batch, self.surrogate_losses, follower_only=self.hparams.follower_only)

    def surrogate_losses(
        self, u: Tensor, lp_l: Tensor, lp_l_ref: Tensor, lp_f: Tensor, lp_f_ref: Tensor
    ) -> dict[str, Tensor]:
        """Both players' losses (eqs. 22–25); logs the share of triplets above the reference thresholds (App. G.1)."""
        p = getattr(self.utility, "last_member_probs", None)
        if p is not None and self.reference_thresholds:
            var, thresholds = p.var(dim=-1, unbiased=False), self.reference_thresholds.items()
            shares = {f"train/candidate_share_{a}": float((var >= t).double().mean()) for a, t in thresholds}
            self.log_dict(shares, batch_size=u.shape[0])
        hp = self.hparams
        return smida_surrogate_losses(u, lp_l, lp_l_ref, lp_f, lp_f_ref, hp.tau_leader, hp.tau_follower)

    def _variances(self, prompts: list[str], ys: list[str], y2s: list[str]) -> tuple[Tensor, Tensor]:
        if isinstance(self.utility, EnsembleUtility):
            p = self.utility.member_probs(prompts, ys, y2s)
            return p.var(dim=-1, unbiased=False), p.mean(dim=-1)
        u = self.utility(prompts, ys, y2s)
        return u, torch.full_like(u, float("nan"))

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        prompts, refs = list(batch["prompt"]), list(batch["reference"])
        self._eval.setdefault("index", []).append(self.item_ids(batch, len(prompts)))
        self._eval.setdefault("prompt_sha256", []).append(digests_tensor(prompts).to(self.device))
        r = self.hparams.eval_pairs
        refs_r = [ref for ref in refs for _ in range(r)]

        def keep(key: str, values: Tensor) -> None:
            self._eval.setdefault(key, []).append(values.view(len(prompts), r).to(self.device))

        for tag, (lp, fp) in {"trained": ("leader", "follower"), "reference": (None, None)}.items():
            lead, foll = self.play.rollout(prompts, r, 1, leader=lp, follower=fp)
            xs, ys, y2s = self.play.triplets(prompts, lead, foll, r, 1)
            var, mean = self._variances(xs, ys, y2s)
            if tag == "trained" and self.board.wants_samples(self, "val/leader_follower"):
                rows = zip(xs, refs_r, ys, y2s, zip(var.tolist(), mean.tolist()))
                self.board.add_samples(self, "val/leader_follower", (_pair_row(*row) for row in rows))
            keep(f"{tag}_var", var)
            keep(f"{tag}_mean", mean)
            if self.oracle is not None and all(x is not None for x in refs):
                keep(f"{tag}_oracle", self.oracle.label(xs, ys, y2s, refs_r).float())
                for name, rows in self.oracle.last_rows.items():  # per row, so a repeated prompt counts once
                    keep(f"{tag}_{name}", rows)

    @override
    def on_validation_epoch_end(self) -> None:
        if not self._eval:
            return
        index = torch.cat(self._eval.pop("index"))
        items, unique = gather_unique_items(index, {k: torch.cat(v) for k, v in self._eval.items()})
        prompt_sha256 = digests_from_tensor(unique.pop("prompt_sha256").cpu())
        hp, self._eval = self.hparams, {}
        gathered = {k: v.reshape(-1, hp.eval_pairs).cpu() for k, v in unique.items()}
        result = compare_pairs(gathered["trained_var"], gathered["reference_var"], hp.alphas)
        if "trained_oracle" in gathered:  # over the labelled triplets: one without a valid verdict has no label
            result["adversarial_yield"] = {
                str(eps): {t: adversarial_yield(gathered[f"{t}_oracle"], gathered[f"{t}_mean"], eps) for t in TAGS}
                for eps in hp.epsilons
            }
            # the joint yield (Fig. 2b) and the candidates' precision (Fig. 5), both pairs on the reference thresholds
            thresholds = (result["thresholds"], hp.epsilons)
            result["oracle_errors"] = {
                tag: adversarial_report(*(gathered[f"{tag}_{k}"] for k in ("var", "oracle", "mean")), *thresholds)
                for tag in TAGS
            }
        if self.oracle is not None:  # this validation's verdicts left out (not probabilities, or too late), every rank
            result["oracle_num_queries"] = self.oracle.num_queries
            for name in ("invalid_verdicts", "timeouts", "unlabelled_rows"):  # each prompt once, both pairs
                parts = [gathered[k] for k in (f"trained_{name}", f"reference_{name}") if k in gathered]
                result[f"oracle_{name}"] = int(sum(int(p.sum()) for p in parts))
        self.last_eval = result
        self.reference_thresholds = dict(result["thresholds"])
        flat = {f"val/variance_{t}": result[t]["mean"] for t in TAGS} | {"val/variance_gain": result["mean_gain"]}
        flat["val/share_prompts_higher"] = result["share_prompts_higher"]
        for a, y in result["candidate_yield"].items():
            flat[f"val/candidate_yield_{a}"] = y["trained"]
            flat[f"val/candidate_yield_{a}_reference"] = y["reference"]
        for tag, suffix in (("trained", ""), ("reference", "_reference")):
            per_eps = result.get("oracle_errors", {}).get(tag, {}).get(str(hp.epsilons[0]))  # the smallest margin
            for a, (share, _, _) in (per_eps or {"joint": {}})["joint"].items():
                flat[f"val/joint_yield_{a}{suffix}"] = share
        self.log_dict({k: float(v) for k, v in flat.items() if math.isfinite(v)}, sync_dist=True)
        # per prompt (the sha256 of its text, and its data index): what a bootstrap over runs and prompts needs
        per_prompt = {"item": prompt_sha256, "index": items.tolist()}
        per_prompt |= {k: gathered[f"{k}_var"].tolist() for k in TAGS}
        self.write_artifact("game_eval.json", {"step": int(self.global_step), **result, "per_prompt": per_prompt})
        self._write_figures(gathered)

    @rank_zero_only
    def _write_figures(self, gathered: dict[str, Tensor]) -> None:
        """The §5.3 figures as PNG files beside ``game_eval.json`` and in the trainer's loggers."""
        if self.trainer.fast_dev_run:
            return
        os.makedirs(log_dir := self.artifact_dir(), exist_ok=True)
        figures = make_game_figures(gathered["trained_var"], gathered["reference_var"], self.hparams.alphas)
        for name, fig in figures.items():
            fig.savefig(os.path.join(log_dir, f"{name}.png"), dpi=110, bbox_inches="tight")
            log_figure(self._trainer, f"val/{name}", fig, self.global_step)

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        """α-online candidates of the trained pair, as rows of the preference datamodule's format (leader first)."""
        hp = self.hparams
        if (threshold := hp.candidate_threshold) is None:
            if (key := next((k for k in self.reference_thresholds if float(k) == hp.candidate_alpha), None)) is None:
                raise ValueError(
                    f"no reference threshold for alpha={hp.candidate_alpha}: validate first (the checkpoint keeps the "
                    f"thresholds) or set model.init_args.candidate_threshold"
                )
            threshold = self.reference_thresholds[key]
        prompts, refs, r = list(batch["prompt"]), list(batch["reference"]), hp.eval_pairs
        lead, foll = self.play.rollout(prompts, r, 1)
        xs, ys, y2s = self.play.triplets(prompts, lead, foll, r, 1)
        var, _ = self._variances(xs, ys, y2s)
        keys = ("prompt", "response_a", "response_b", "variance", "threshold", "alpha", "reference")
        rows = zip(xs, ys, y2s, var.tolist(), [ref for ref in refs for _ in range(r)])
        a = hp.candidate_alpha
        return [dict(zip(keys, (x, y, y2, v, threshold, a, ref))) for x, y, y2, v, ref in rows if v >= threshold]


def _pair_row(prompt: str, reference: str | None, leader: str, follower: str, stats: tuple[float, float]) -> dict:
    """One validation pair as a TensorBoard text row, with its variance and mean preference (or its utility)."""
    row = {"prompt": prompt, "reference": reference, "leader reply": leader, "follower reply": follower}
    if math.isnan(stats[1]):
        return {**row, "utility": stats[0]}
    return {**row, "ensemble variance": stats[0], "mean P(leader ≻ follower)": stats[1]}
