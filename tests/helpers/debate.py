"""A small debate module on the tiny random Qwen2, shared by the debate module's tests."""

from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.debate import DebateSelfPlay
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import ProgrammaticJudge


def tiny_debate_module(tiny_lm_dir, protocol="debate_aba", players="lora", **kw):
    """:class:`DebateSelfPlay`: 8-token answers, 6-token replies, G = 2, a programmatic judge; ``kw`` overrides."""
    args = dict(
        lm=ModelConfig(tiny_lm_dir, players=players, lora_r=4, lora_alpha=8),
        protocol=protocol,
        policy_gradient=PolicyGradient(group_size=2),
        sampling=Sampling(temperature=0.6, max_new_tokens=8),
        reply_max_new_tokens=6,
        require_thinking=False,
        alice_prompt="{problem}",
        judge=ProgrammaticJudge(num_votes=8),
    )
    args.update(kw)
    return DebateSelfPlay(**args)
