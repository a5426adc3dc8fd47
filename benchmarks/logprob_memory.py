"""Peak memory of one log-probability forward + backward: chunked over tokens against full-vocabulary logits.

A Qwen2.5-0.5B-shaped policy (vocabulary 151,936, hidden 896, 14/2 heads, intermediate 4,864; 2 layers by default,
as the vocabulary projection, not the depth, is what is measured) with a LoRA player, built from a config (no
download). The same rollout (random completion tokens over the whole vocabulary) goes through

* ``chunked``: :meth:`modules.lm.policy_bank.PolicyBank.token_logprobs` (logits a chunk of tokens at a time,
  recomputed in the backward);
* ``full``: the computation it replaced, written out here: the model's logits at every completion position over the
  whole vocabulary, ``float() / T``, gather minus ``logsumexp``.

Each is followed by the backward of the summed log-probabilities into the adapter. Peak memory is what tensors held
at most during that forward + backward, above what was held before it: ``torch.cuda.max_memory_allocated`` on a GPU,
the profiler's memory timeline (every allocation and release with its size) on CPU.

    python benchmarks/logprob_memory.py                 # 8 rows x 256 completion tokens, about a minute on 2 cores
    python benchmarks/logprob_memory.py --tiny          # the code path at a tiny size (the smoke test)

The last line is ``logprob_mem_ratio_vs_full=<chunked peak / full peak>``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable

import _common  # benchmarks/ is the script's folder
import torch
from _phase_memory import PhaseMemory

TINY = {"vocab_size": 4096, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Most bytes held at once by the tensors ``fn`` allocated, above what was held when it started."""
    meter = PhaseMemory(device)
    with meter.step():
        fn()
    return int(meter.steps[-1]["step"]["peak_bytes"])


def full_logits_token_logprobs(bank, player, roll, temperature: float) -> torch.Tensor:
    """``PolicyBank.token_logprobs`` as it was before chunking: ``[N, C, V]`` fp32 logits, one row per token."""
    seq, att, width = roll.sequences, roll.attention_mask, roll.prompt_width
    c = seq.shape[1] - width
    pos = (att.cumsum(dim=1) - 1).clamp_min(0)
    with bank.using(player) as model:
        logits = model(input_ids=seq, attention_mask=att, position_ids=pos, logits_to_keep=c + 1).logits[:, :-1]
        logits = logits.float() / temperature
        target = seq[:, width:]
        lp = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return lp * roll.completion_mask


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per row")
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--chunk_tokens", type=int, default=None, help="default: 128 MiB of fp32 logits per chunk")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model (vocabulary 4,096, hidden 16), 2 x 16 tokens, chunks of 4"
    )
    args = parser.parse_args(argv)

    from alignment_games.modules.lm.logprobs import chunk_tokens_for
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.models import build_tiny_causal_lm
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.rollout import Rollout

    shape = {**(TINY if args.tiny else _common.QWEN25_05B), "num_hidden_layers": args.layers}
    rows, tokens, width = (2, 16, 4) if args.tiny else (args.rows, args.tokens, args.prompt_tokens)
    vocab = shape["vocab_size"]
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_causal_lm(tmp, config=shape, seed=0)
        bank = PolicyBank(ModelConfig(path, lora_r=args.lora_r, lora_alpha=2 * args.lora_r), players=["player"])
    bank.to(device)
    with torch.no_grad():  # a trained-looking adapter: off its zero init
        for p in bank.player_parameters("player"):
            p.add_(0.01 * torch.randn_like(p))
    bank.logit_chunk_tokens = 4 if args.tiny and args.chunk_tokens is None else args.chunk_tokens
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, vocab, (rows, width + tokens), generator=gen)
    mask = torch.ones_like(seq)
    roll = Rollout(seq.to(device), mask.to(device), width, mask[:, width:].to(device), [""] * rows)

    def chunked() -> None:
        bank.token_logprobs("player", roll, temperature=0.7).sum().backward()

    def full() -> None:
        full_logits_token_logprobs(bank, "player", roll, 0.7).sum().backward()

    result = {
        "device": device.type,
        "shape": shape,
        "rows": rows,
        "completion_tokens": tokens,
        "chunk_tokens": bank.logit_chunk_tokens or chunk_tokens_for(vocab),
        "one_fp32_logits_bytes": rows * tokens * vocab * 4,
    }
    for name, fn in (("full", full), ("chunked", chunked)):
        start = time.perf_counter()
        result[f"{name}_peak_bytes"] = peak_bytes(fn, device)
        result[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
        bank.zero_grad(set_to_none=True)
    ratio = result["chunked_peak_bytes"] / result["full_peak_bytes"]
    print(json.dumps(result))
    for name in ("full", "chunked"):
        print(f"{name}: peak {result[f'{name}_peak_bytes'] / 2**30:.3f} GiB, {result[f'{name}_seconds']} s")
    print(f"logprob_mem_ratio_vs_full={ratio:.4f}")
    return result


if __name__ == "__main__":
    main()
