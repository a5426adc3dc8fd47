"""The debate judge's phase before and after prefilling each transcript once for all its votes, in one run.

:class:`~modules.scorers.judges.HFJudge` votes ``--votes`` times per transcript in one ``generate`` call. Before, that
call sampled ``num_return_sequences`` rows that each prefilled the transcript; now each transcript is prefilled once
and its cache copied to its votes (``share_prompt``). Both ways are timed on the same judge, transcripts and seed,
alternating, and their texts compared (they must be the same votes). Models are random-initialised from a config
with the suite's byte tokenizer (nothing is downloaded): a small decoder (``tiny``) and a Qwen2.5-0.5B-shaped one
(``q05b``: vocabulary 151,936, hidden 896, 14/2 heads, intermediate 4,864; ``--layers`` blocks, 24 is the real depth).

    python benchmarks/judge_prefill.py                          # both shapes, 8 votes, 4 transcripts of ~1,400 tokens
    python benchmarks/judge_prefill.py --shapes tiny --prompt_words 40 --repeats 1    # a smoke run

Prints the host (CPU model, cores, torch threads), one line per shape with the median seconds of the judge phase
before and after and their ratio, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # benchmarks/ is the script's folder


def transcripts(count: int, words: int) -> list:
    """``count`` debate transcripts whose answer and critique hold about ``words`` words each (distinct per row)."""
    from alignment_games.modules.algorithms.debate import Transcript, split_reply

    out = []
    for i in range(count):
        answer = " ".join(f"step {k}: {i + k} + {k} = {i + 2 * k}." for k in range(words // 6)) + f" \\boxed{{{i}}}"
        critique = " ".join(f"check {k} of row {i} holds." for k in range(words // 5))
        out.append(Transcript(f"Problem {i}: add.", str(i), "debate_ab", [split_reply(answer), split_reply(critique)]))
    return out


def run(shape: str, args) -> dict:
    import torch

    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.scorers.judges import HFJudge

    path, config = _common.build_shape(shape, args.layers, "ag_bench_judge")
    sampling = Sampling(max_new_tokens=args.judge_tokens, min_new_tokens=args.judge_tokens)  # fixed work per vote
    judge = HFJudge(path, chain_of_thought=False, num_votes=args.votes, sampling=sampling, max_prompt_tokens=4096)
    batch = transcripts(args.transcripts, args.prompt_words)
    tokens = [len(judge.tokenizer(judge.prompt(t))["input_ids"]) for t in batch]
    times: dict[bool, list[float]] = {False: [], True: []}
    texts: dict[bool, list] = {}
    for _ in range(args.repeats):
        for share in (False, True):
            judge.share_prompt = share
            judge.load_state_dict({"generator": torch.Generator().manual_seed(0).get_state()})
            start = time.perf_counter()
            out = judge.vote(batch)
            times[share].append(time.perf_counter() - start)
            texts[share] = out.texts
    before, after = statistics.median(times[False]), statistics.median(times[True])
    return {
        "shape": shape,
        "layers": config.get("num_hidden_layers"),
        "transcripts": len(batch),
        "prompt_tokens": int(statistics.mean(tokens)),
        "votes": args.votes,
        "judge_tokens": args.judge_tokens,
        "before_s": round(before, 3),
        "after_s": round(after, 3),
        "speedup": round(before / after, 2),
        "same_texts": texts[False] == texts[True],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,q05b", help="comma-separated: tiny, q05b")
    parser.add_argument("--votes", type=int, default=8)
    parser.add_argument("--transcripts", type=int, default=4)
    parser.add_argument("--prompt_words", type=int, default=140, help="words per judged ply (~1,400 prompt tokens)")
    parser.add_argument("--judge_tokens", type=int, default=16, help="tokens per verdict (a no-reasoning judge)")
    _common.add_shape_options(parser, repeats=2)
    _common.run_shapes(parser.parse_args(), run, show)


def show(r: dict) -> None:
    print(
        f"{r['shape']}: {r['transcripts']} transcripts x {r['prompt_tokens']} prompt tokens, {r['votes']} votes x "
        f"{r['judge_tokens']} tokens: before {r['before_s']} s, after {r['after_s']} s, "
        f"speedup {r['speedup']}x, same texts {r['same_texts']}"
    )


if __name__ == "__main__":
    main()
