"""A small debate module on the tiny random Qwen2 and a scripted LM judge, shared by the debate module's tests."""

import torch

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


def script_judge(judge, decide):
    """Replace an ``HFJudge``'s ``generate`` by a reader that answers each prompt with ``decide(prompt text)``.

    One input row per transcript (``share_prompt`` off), so the reader sees each prompt once; returns the list the
    prompts it reads are appended to.
    """
    tok, seen = judge.tokenizer, []

    def scripted_generate(input_ids, attention_mask, num_return_sequences, **kw):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            text = tok.decode(ids[mask.bool()], skip_special_tokens=False)
            seen.append(text)
            rows += [ids.tolist() + tok(decide(text), add_special_tokens=False)["input_ids"]] * num_return_sequences
        width = max(map(len, rows))
        return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])

    judge.share_prompt = False
    judge.model.generate = scripted_generate
    return seen
