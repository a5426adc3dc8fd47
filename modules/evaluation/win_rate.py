"""Held-out validation of the preference baselines: the trained policy against the frozen reference."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from alignment_games.callbacks.items import gather_unique_items
from alignment_games.modules.evaluation.game_eval import prompt_bootstrap_mean
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.oracle import PreferenceOracle
from alignment_games.modules.scorers.utility import Utility


def win_rate_summary(rates: Tensor, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Mean of preference rates ``[P, R]`` with a 95% prompt-bootstrap interval; NaN (unlabelled) rows dropped.

    Raises:
        ValueError: when ``rates`` is not ``[P, R]``.
    """
    if rates.ndim != 2:
        raise ValueError(f"rates must be [prompts, pairs], got shape {tuple(rates.shape)}")
    v = rates.double()[~torch.isnan(rates.double()).any(dim=1)]
    if v.numel() == 0:
        return {"mean": math.nan, "mean_ci": [math.nan, math.nan], "n_prompts": 0}
    lo, hi = prompt_bootstrap_mean(v, n_boot, seed)
    return {"mean": float(v.mean()), "mean_ci": [lo, hi], "n_prompts": int(v.shape[0])}


class WinRateValidation:
    """Validation of a policy against the frozen reference on held-out prompts (mixin; the host's attributes below)."""

    #: the bank's player that is evaluated
    eval_player: str = "policy"
    players: PolicyBank  # and hparams.system_prompt, hparams.eval_pairs
    sampling: Sampling
    preference: Utility  # P0
    oracle: PreferenceOracle | None
    item_ids: Callable[[dict[str, Any], int], Tensor]
    write_artifact: Callable[[str, dict[str, Any]], str | None]

    def _win_rate_buffers(self) -> dict[str, list[Tensor]]:
        self._wr_eval: dict[str, list[Tensor]] = getattr(self, "_wr_eval", {})
        return self._wr_eval

    def eval_prompts(self, prompts: list[str]) -> list[str]:
        """Chat-formatted inputs of the evaluated player (the reference answers the same)."""
        return [self.players.chat(self.hparams.system_prompt, x) for x in prompts]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """``eval_pairs`` answers of the player and of the reference per prompt, scored by P0 and the oracle."""
        prompts, refs = list(batch["prompt"]), list(batch["reference"])
        index = self.item_ids(batch, len(prompts))  # refuses a batch without one id per prompt
        buf, r, chats = self._win_rate_buffers(), self.hparams.eval_pairs, self.eval_prompts(prompts)
        trained = self.players.generate(self.eval_player, chats, r, self.sampling)
        reference = self.players.generate(None, chats, r, self.sampling)
        xs = [x for x in prompts for _ in range(r)]
        p0 = self.preference(xs, trained.texts, reference.texts).double()
        buf.setdefault("index", []).append(index)
        buf.setdefault("p0", []).append(p0.view(len(prompts), r).to(self.device))
        if self.oracle is not None and all(x is not None for x in refs):
            label = self.oracle.label(xs, trained.texts, reference.texts, [x for x in refs for _ in range(r)])
            buf.setdefault("oracle", []).append(label.view(len(prompts), r).to(self.device))

    def on_validation_epoch_end(self) -> None:
        """Each prompt once across ranks; means with prompt-bootstrap intervals to ``baseline_eval.json``."""
        buf = self._win_rate_buffers()
        if not buf:
            return
        index = torch.cat(buf.pop("index"))
        _, unique = gather_unique_items(index, {k: torch.cat(v) for k, v in buf.items()})
        buf.clear()
        r = self.hparams.eval_pairs
        result: dict[str, Any] = {"step": int(self.global_step), "player": self.eval_player, "pairs_per_prompt": r}
        result |= {key: win_rate_summary(v.reshape(-1, r).cpu()) for key, v in unique.items()}
        self.last_eval = result
        flat = {f"val/{k}_win_rate": result[k]["mean"] for k in ("p0", "oracle") if k in result}
        self.log_dict({k: float(v) for k, v in flat.items() if math.isfinite(v)}, sync_dist=True)
        self.write_artifact("baseline_eval.json", result)
