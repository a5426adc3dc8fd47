"""The multi-LLM pool's answer and judge phases decoded player by player against all players in one batch, in one run.

:class:`~modules.pool.StackelbergPool` holds its m players as LoRA adapters over one base. Before, each player
answered its duels with its own ``generate`` (its adapter merged), and each peer judge judged with its own; now
:meth:`~modules.lm.policy_bank.PolicyBank.generate_each` decodes every player's prompts in one batch, each row with
its own adapter. Both ways are timed on the same bank and prompts, alternating: the answer phase (``--duels`` duels,
two sides spread over m players, ``--rollouts`` sampled rollouts each, ``--answer_tokens`` tokens) and the judge phase
(every member outside a duel judges its first rollouts greedily, ``--judge_tokens`` tokens). Every row writes all its
tokens (``min_new_tokens``), so both ways do the same work; the greedy judge texts are compared (they must be the
same). Models are random-initialised from a config with the suite's byte tokenizer (nothing is downloaded): a small
decoder (``tiny``) and a Qwen2.5-0.5B-shaped one (``q05b``: vocabulary 151,936, hidden 896, 14/2 heads, intermediate
4,864; ``--layers`` blocks, 24 is the real depth).

    python benchmarks/pool_decode.py                                     # both shapes, m = 3
    python benchmarks/pool_decode.py --shapes tiny --duels 2 --repeats 1  # a smoke run
    python benchmarks/pool_decode.py --shapes tiny --threads 1 --clock cpu  # CPU seconds, on a shared host

Prints the host (CPU model, flags, cores, torch threads), one line per shape and phase with the median seconds before
and after and their ratio, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import _common  # benchmarks/ is the script's folder


def pool_bank(shape: str, args):
    """A bank of ``--players`` LoRA adapters over one random base, each adapter moved off its zero init differently."""
    import torch

    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    path, _ = _common.build_shape(shape, args.layers, "ag_bench_pool")
    players = [f"m{i}" for i in range(args.players)]
    bank = PolicyBank(ModelConfig(path, lora_r=8, lora_alpha=16, max_prompt_tokens=2048), players=players)
    with torch.no_grad():
        for i, p in enumerate(players):
            gen = torch.Generator().manual_seed(100 + i)
            for w in bank.player_parameters(p):
                w.add_(0.05 * torch.randn(w.shape, generator=gen))
    return bank, players


def phases(bank, players: list[str], args) -> tuple[list, list]:
    """The answer requests (each player's duel sides) and the judge requests (each judge's prompts), as in the pool."""
    from alignment_games.modules.algorithms.pool import duel_judges
    from alignment_games.modules.scorers.peer_judges import PeerJudging, judge_prompts

    m = len(players)
    questions = [f"Problem {d}: what is {d} + {2 * d} times {d % 7}? Explain each step." for d in range(args.duels)]
    duels = [(d % m, (d + 1 + (d // m) % (m - 1)) % m) for d in range(args.duels)]  # two distinct players each
    system = "You are a helpful assistant."
    answers = []
    for pi, p in enumerate(players):
        mine = [d for d, pair in enumerate(duels) for s in (0, 1) if pair[s] == pi]
        if mine:
            answers.append((p, [bank.chat(system, questions[d]) for d in mine]))
    reply = " ".join(f"step {k}: {k} + {k} = {2 * k}." for k in range(args.reply_words // 6))
    judging = PeerJudging(max_new_tokens=args.judge_tokens)
    judges = duel_judges(duels, m)
    asks = []
    for j, p in enumerate(players):
        items = [d for d in range(len(duels)) for _ in (0, 1) if j in judges[d]]
        if items:
            chat = lambda user, system_: bank.chat(system_, user)  # noqa: E731
            asks.append((p, judge_prompts(bank, chat, [questions[d] for d in items], [reply] * len(items), judging)))
    return answers, asks


def run(shape: str, args) -> dict:
    import torch

    from alignment_games.modules.lm.sampling import Sampling

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    bank, players = pool_bank(shape, args)
    answers, asks = phases(bank, players, args)
    answer = Sampling(0.7, max_new_tokens=args.answer_tokens, min_new_tokens=args.answer_tokens)
    judge = Sampling(max_new_tokens=args.judge_tokens, min_new_tokens=args.judge_tokens)  # greedy
    work = {"answer": (answers, args.rollouts, answer, False), "judge": (asks, 1, judge, True)}
    times = {(phase, way): [] for phase in work for way in ("before", "after")}
    texts = {}
    for requests, g, s, greedy in work.values():  # untimed: first-call costs off both ways
        bank.generate_each(requests, g, replace(s, max_new_tokens=2, min_new_tokens=2), greedy)
        bank.generate(*requests[0], g, replace(s, max_new_tokens=2, min_new_tokens=2), greedy)
    for _ in range(args.repeats):
        for phase, (requests, g, s, greedy) in work.items():
            for way in ("before", "after"):
                torch.manual_seed(0)
                start = clock()
                if way == "before":  # player by player, as the pool decoded before
                    outs = [bank.generate(p, x, g, s, greedy) for p, x in requests]
                else:
                    outs = bank.generate_each(requests, g, s, greedy)
                times[(phase, way)].append(clock() - start)
                texts[(phase, way)] = [o.texts for o in outs]
    layers = _common.SHAPES[shape].get("num_hidden_layers", args.layers)
    result = {"shape": shape, "layers": layers, "players": len(players)}
    result["clock"] = args.clock
    for phase, (requests, g, s, _) in work.items():
        before, after = statistics.median(times[(phase, "before")]), statistics.median(times[(phase, "after")])
        result[phase] = {
            "rows": sum(len(x) for _, x in requests) * g,
            "tokens": s.max_new_tokens,
            "before_s": round(before, 4),
            "after_s": round(after, 4),
            "speedup": round(before / after, 2),
        }
    result["judge"]["same_texts"] = texts[("judge", "before")] == texts[("judge", "after")]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,q05b", help="comma-separated: tiny, q05b")
    parser.add_argument("--players", type=int, default=3, help="m, the pool's players (adapters over one base)")
    parser.add_argument("--duels", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=4, help="G, sampled answers per duel side (GRPO's 4)")
    parser.add_argument("--answer_tokens", type=int, default=64)
    parser.add_argument("--judge_tokens", type=int, default=32, help="tokens per judgement (judging.max_new_tokens)")
    parser.add_argument("--reply_words", type=int, default=60, help="words of each judged reply")
    _common.add_shape_options(parser, repeats=3)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed seconds; cpu: this process's CPU seconds (with --threads 1 on a shared host, where "
        "elapsed time counts the waits for a core)",
    )
    _common.run_shapes(parser.parse_args(), run, show)


def show(r: dict) -> None:
    for phase in ("answer", "judge"):
        x = r[phase]
        same = f", same texts {x['same_texts']}" if "same_texts" in x else ""
        print(
            f"{r['shape']} {phase}: m={r['players']}, {x['rows']} rows x {x['tokens']} tokens: player by player "
            f"{x['before_s']} s, one batch {x['after_s']} s, speedup {x['speedup']}x{same}"
        )


if __name__ == "__main__":
    main()
