"""Peak memory of one GRPO update (forward + backward): all rows at once against a token budget per micro-batch.

The policy is vs_trl.py's random tiny Qwen2 (hidden 256, 4 layers, 4 heads, intermediate 768) with a LoRA player (r 8,
peft's default targets), built from a config (no download). One rollout of ``--rows`` rows in groups of ``--group``:
left-padded prompts of 16 to ``--prompt_tokens`` tokens (one per group), completions of 1/8 to all of ``--tokens``
tokens, drawn per row, random token ids. :meth:`modules.grpo.GRPO._policy_loss` (the module's update: micro-batches,
groups ordered by length, the chunks' padding dropped, a weighted backward per micro-batch) runs on it twice, in fp32:

* ``all_rows``: ``policy_gradient.max_tokens_per_micro_batch = 0``, every row in one forward and backward;
* ``budget``: ``max_tokens_per_micro_batch = --budget``.

Peak memory is the most bytes tensors held at once during the update above what was held before it
(``benchmarks/_phase_memory.py``: the profiler's allocation events on CPU, ``torch.cuda.max_memory_allocated`` on a
GPU); the profiler slows the update, so its seconds are not the unprofiled speed. The two updates' losses and LoRA
gradients are compared (the same update, so the difference is float rounding).

    python benchmarks/token_budget.py               # 16 rows x up to 1,024 completion tokens, budget 4,096
    python benchmarks/token_budget.py --tiny        # the code path at a tiny size (the smoke test)

The last line is ``token_budget_mem_ratio_vs_all_rows=<budget peak / all-rows peak>``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from _host import host, host_line  # benchmarks/ is the script's folder
from _phase_memory import PhaseMemory

POLICY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4}
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}


def rollout(rows: int, group: int, prompt_tokens: int, tokens: int, vocab: int, pad: int, seed: int = 0):
    """Random rows: a prompt span per group (16 … ``prompt_tokens``, left-padded), a completion length per row."""
    from alignment_games.modules.lm.rollout import Rollout

    gen = torch.Generator().manual_seed(seed)
    lo = min(16, prompt_tokens)
    spans = torch.randint(lo, prompt_tokens + 1, (rows // group,), generator=gen).repeat_interleave(group)
    lengths = torch.randint(max(1, tokens // 8), tokens + 1, (rows,), generator=gen)
    cols = torch.arange(prompt_tokens + tokens)
    prompt_mask = cols[None, :prompt_tokens] >= prompt_tokens - spans[:, None]
    completion_mask = cols[None, :tokens] < lengths[:, None]
    att = torch.cat([prompt_mask, completion_mask], dim=1).long()
    seq = torch.randint(0, vocab, (rows, prompt_tokens + tokens), generator=gen).masked_fill(att == 0, pad)
    return Rollout(seq, att, prompt_tokens, completion_mask.long(), [""] * rows, group_size=group)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=64, help="widest prompt")
    parser.add_argument("--tokens", type=int, default=1024, help="widest completion")
    parser.add_argument("--budget", type=int, default=4096, help="max_tokens_per_micro_batch")
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="hidden 16, 8 rows x up to 32 tokens, budget 96")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rows, args.group, args.prompt_tokens, args.tokens, args.budget = 8, 2, 8, 32, 96

    from alignment_games.modules.algorithms.rl_losses import PolicyGradient
    from alignment_games.modules.grpo import GRPO
    from alignment_games.modules.lm.micro_batches import row_lengths
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    device = torch.device(args.device)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_causal_lm(tmp, config=TINY if args.tiny else POLICY, seed=0)
        model = GRPO(
            lm=ModelConfig(path, lora_r=args.lora_r, lora_alpha=2 * args.lora_r),
            policy_gradient=PolicyGradient(group_size=args.group, kl_coef=0.0, clip=0.2),
            chat_template=False,
        )
    model.manual_backward = lambda loss: loss.backward()  # no trainer: the plain backward Lightning runs
    bank = model.players.to(device)
    with torch.no_grad():  # a trained-looking adapter: off its zero init
        for p in bank.player_parameters("policy"):
            p.add_(0.01 * torch.randn_like(p))
    roll = rollout(
        args.rows, args.group, args.prompt_tokens, args.tokens, bank.tokenizer.vocab_size, bank.tokenizer.pad_token_id
    )
    roll = type(roll)(*(x.to(device) if torch.is_tensor(x) else x for x in vars(roll).values()))
    advantages = torch.randn(args.rows, generator=torch.Generator().manual_seed(1))  # a nonzero on-policy loss
    spans, lengths = row_lengths(roll.attention_mask, roll.prompt_width, roll.completion_mask)
    result = {
        "device": device.type,
        "shape": TINY if args.tiny else POLICY,
        "rows": args.rows,
        "group": args.group,
        "real_tokens": int(roll.attention_mask.sum()),
        "padded_tokens_all_rows": args.rows * (max(spans) + max(lengths)),
        "budget": args.budget,
    }
    grads, forwards, run = {}, [], bank.token_logprobs

    def counted(player, part, *a, **k):
        """``token_logprobs``, recording each micro-batch's padded tokens (its rows × its width)."""
        s, c = row_lengths(part.attention_mask, part.prompt_width, part.completion_mask)
        forwards.append(len(s) * (max(s) + max(max(c), 1)))
        return run(player, part, *a, **k)

    bank.token_logprobs = counted
    for name, budget in (("all_rows", 0), ("budget", args.budget)):
        model.policy_gradient = PolicyGradient(group_size=args.group, kl_coef=0.0, max_tokens_per_micro_batch=budget)
        bank.zero_grad(set_to_none=True)
        forwards.clear()
        meter = PhaseMemory(device)
        start = time.perf_counter()
        with meter.step():
            out = model._policy_loss(roll, advantages.to(device), None, None)
        result[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
        result[f"{name}_peak_bytes"] = int(meter.steps[-1]["step"]["peak_bytes"])
        result[f"{name}_loss"] = float(out["loss"])
        result[f"{name}_micro_batch_tokens"] = list(forwards)
        grads[name] = {n: p.grad.clone() for n, p in bank.named_parameters() if p.grad is not None}
    result["max_grad_diff"] = max(float((grads["budget"][n] - g).abs().max()) for n, g in grads["all_rows"].items())
    result["max_grad"] = max(float(g.abs().max()) for g in grads["all_rows"].values())
    ratio = result["budget_peak_bytes"] / result["all_rows_peak_bytes"]
    print(json.dumps(result))
    print(host_line(host()))
    for name in ("all_rows", "budget"):
        peak, loss = result[f"{name}_peak_bytes"] / 2**20, result[f"{name}_loss"]
        print(
            f"{name}: peak {peak:.1f} MiB, {result[f'{name}_seconds']} s (profiler on), loss {loss:.7f}, "
            f"padded tokens of each micro-batch {result[f'{name}_micro_batch_tokens']}"
        )
    print(f"max |grad difference| {result['max_grad_diff']:.2e} (largest gradient {result['max_grad']:.2e})")
    print(f"token_budget_mem_ratio_vs_all_rows={ratio:.4f}")
    return result


if __name__ == "__main__":
    main()
