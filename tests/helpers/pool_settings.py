"""Settings the pool's test files share: a small game, short judgements, the tiny model with small adapters."""

from __future__ import annotations

from typing import Any

from alignment_games.modules.games.pool_followers import FollowerTraining
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.peer_judges import PeerJudging

SMALL = dict(
    duels_per_iteration=3,
    num_iterations=2,
    sampling=Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6),
    eval_max_new_tokens=6,
    followers=FollowerTraining(lr=1e-2, batch_size=4),
)


def judging(mode: str = "generate", prefill: str = "") -> PeerJudging:
    """Short judgements of ``"{prompt} {response}"``."""
    return PeerJudging(template="{prompt} {response}", mode=mode, prefill=prefill, max_new_tokens=6)


def lm(path: Any, **kw: Any) -> dict[str, Any]:
    """The tiny model at ``path`` with rank-4 adapters."""
    return {"name_or_path": str(path), "lora_r": 4, "lora_alpha": 8, **kw}
