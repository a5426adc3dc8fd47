"""``python -m alignment_games.commands.judge_score``: measure a debate judge on answers of known truth before a game.

Each step reads the debate config the game runs (its problems, Alice's prompts and sampling, its judge)::

    python -m alignment_games.commands.judge_score answers --config configs/debate_smollm2.yaml --split val \\
        --samples 2 --out judge/heldout.jsonl
    python -m alignment_games.commands.judge_score sft --config configs/debate_smollm2.yaml \\
        --answers judge/train.jsonl --out judge/sft.jsonl
    python -m alignment_games.commands.judge_score score --config configs/debate_smollm2.yaml \\
        --answers judge/heldout.jsonl --votes 8 --out judge/report.json

``answers``: Alice's sampled answers (the base, or ``--adapter``) to a split's problems, graded by the answer checker.
``sft``: each answer's judge prompt and the verdict the checker gives, as prompt-completion rows for the SFT family
(a verifier trained on programmatic labels), in the system message the judge's chat template renders.
``score``: the judge's votes on every answer, :func:`~alignment_games.modules.evaluation.judge_score.judge_report`,
the per-answer rows and the sha256 of every input.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
import yaml

from alignment_games.modules.algorithms.debate import PROMPTS, Transcript, fill_fields, split_reply
from alignment_games.modules.evaluation.audit import provenance
from alignment_games.modules.evaluation.judge_score import judge_report
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.lm.text import render_chat
from alignment_games.modules.training.artifacts import atomic_write_text

VERDICTS = {True: "Verdict: Alice", False: "Verdict: Bob"}


def _merged(base: Any, over: Any) -> Any:
    """``over`` laid on ``base`` as later ``--config`` files are: mappings merged key by key, other values replaced."""
    if not isinstance(base, dict) or not isinstance(over, dict):
        return over
    return {**base, **{k: _merged(base.get(k), v) for k, v in over.items()}}


def _config(paths: Sequence[str]) -> tuple[dict, dict, dict]:
    """The debate config's model init_args, its judge block and its data block (later files laid over earlier)."""
    config: dict = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            layer = yaml.safe_load(f) or {}
        if not isinstance(layer, dict):
            raise ValueError(f"--config: {path} is not a mapping of settings (a YAML {type(layer).__name__})")
        config = _merged(config, layer)
    model = (config.get("model") or {}).get("init_args") or {}
    if "judge" not in model or "data" not in config:
        raise ValueError(f"--config: {paths} has no model.init_args.judge or no data block (a debate config has both)")
    return model, model["judge"], config["data"]


def _build(block: dict, kind: type, key: str) -> Any:
    """A ``class_path``/``init_args`` block built as LightningCLI builds it (types checked, nested values cast)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=kind)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    return getattr(instantiate(parser.parse_object({key: block})), key)


def build_judge(block: dict, model: str | None = None, votes: int | None = None, decode: str | None = None) -> Any:
    """The config's judge, with ``model``, ``num_votes`` and ``decode`` replaced where given."""
    from alignment_games.modules.scorers.judges import DebateJudge

    block = {**block, "init_args": dict(block.get("init_args") or {})}
    given = {"model": model, "num_votes": votes, "decode": decode}
    block["init_args"].update({k: v for k, v in given.items() if v is not None})
    return _build(block, DebateJudge, "judge")


def split_problems(data: dict, split: str) -> list[dict[str, str]]:
    """The ``{"prompt", "reference"}`` problems of the data module's ``split``, as the game draws them."""
    from alignment_games.datamodules.debate import DebateDataModule

    dm = _build(data, DebateDataModule, "data")
    dm.setup("fit")
    return list(dm.splits[split])


def write_answers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Alice's answers to the split's problems: ``--samples`` at each of ``--temperature`` (0: one greedy), graded."""
    from alignment_games.commands.generate import generate, load_policy

    model, _, data = _config(args.config)
    problems = split_problems(data, args.split)[: args.num_problems]
    template = PROMPTS.get(model.get("alice_prompt", "alice"), model.get("alice_prompt", "alice"))
    bank = load_policy(args.model or model["lm"]["name_or_path"], args.adapter)
    max_new = (model.get("sampling") or {}).get("max_new_tokens", 64)
    torch.manual_seed(args.seed)
    prompts = [fill_fields(template, problem=p["prompt"]) for p in problems]
    rows = []
    for temperature in args.temperature:
        sampling = Sampling(temperature=temperature or 1.0, max_new_tokens=max_new)
        for k in range(1 if temperature == 0 else args.samples):
            for start in range(0, len(prompts), args.batch_size):
                chunk = prompts[start : start + args.batch_size]
                texts = generate(bank, chunk, model.get("system_prompt"), sampling, greedy=temperature == 0)
                for i, text in enumerate(texts, start):
                    row = {"problem": i, "temperature": temperature, "sample": k, **problems[i], "answer": text}
                    rows.append(row | {"truth": bool(_transcript(row, model).correct)})
    _write_lines(args.out, rows)
    return rows


def read_answers(path: str) -> list[dict[str, Any]]:
    """The rows ``answers`` wrote, each checked for the fields the other steps read (rows counted from 1).

    Raises:
        ValueError: naming the file and row of a malformed one.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"--answers: {path}: row {i}: not JSON ({err})") from None
            types = {"problem": int, "prompt": str, "reference": str, "answer": str, "truth": bool}
            bad = [k for k, t in types.items() if not isinstance(row.get(k) if isinstance(row, dict) else None, t)]
            if bad:
                raise ValueError(
                    f"--answers: {path}: row {i}: field {bad[0]!r} missing or not {types[bad[0]].__name__}"
                )
            rows.append(row)
    if not rows:
        raise ValueError(f"--answers: {path}: no rows")
    return rows


def _transcript(row: dict[str, Any], model: dict) -> Transcript:
    reply = split_reply(row["answer"], model.get("think_open", "<think>"), model.get("think_close", "</think>"), False)
    return Transcript(row["prompt"], row["reference"], "rlaif_a", [reply])


def _write_lines(path: str, rows: Sequence[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def reasoning_fields(row: dict[str, Any], t: Transcript) -> dict[str, Any]:
    """``--reasoning``'s fields: the row's, Alice's ``final`` answer as the checker reads it, the problem's ``n1``, ...

    ``final`` is ``none`` when Alice boxed nothing; ``n1``, ``n2``, ... are the problem's numbers in order; ``check``
    is ``equal`` when the checker accepts her answer, otherwise ``not equal``.
    """
    numbers = re.findall(r"\d+(?:\.\d+)?", row["prompt"])
    check = "equal" if row["truth"] else "not equal"
    return {**row, "final": t.final_answer or "none", "check": check, **{f"n{k}": n for k, n in enumerate(numbers, 1)}}


def write_sft(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prompt-completion rows: the judge's request for each answer, the checker's verdict as the completion.

    With ``--reasoning`` (a chain-of-thought judge) the completion is the judge's thinking, that text with the
    :func:`reasoning_fields` filled in, then the verdict: a verifier that writes the check it makes.

    Raises:
        ValueError: when ``--system`` and the user turn do not render to the judge's own prompt (the verifier would
            learn on text the judge never reads), or the completion does not start with the judge's prefill.
    """
    model, block, _ = _config(args.config)
    judge = build_judge(block, model=args.judge_model, votes=1)
    rows, answers = [], list(enumerate(read_answers(args.answers), 1))
    if args.balance:  # each verdict's rows repeated in turn up to the larger class's count
        right, wrong = [a for a in answers if a[1]["truth"]], [a for a in answers if not a[1]["truth"]]
        n = max(len(right), len(wrong))
        answers = [a for group in (right, wrong) if group for a in itertools.islice(itertools.cycle(group), n)]
    for i, row in answers:
        t = _transcript(row, model)
        messages = [{"role": "system", "content": args.system}, {"role": "user", "content": judge.user_message(t)}]
        if render_chat(judge.tokenizer, messages, True) + judge.prefill != judge.render(t):
            raise ValueError(
                f"--system: {args.system!r} with row {i}'s request does not render to the judge's prompt: pass the "
                "system message the judge's chat template puts in"
            )
        completion = VERDICTS[row["truth"]]
        if args.reasoning is not None:
            fields = reasoning_fields(row, t)
            try:
                thought = args.reasoning.format(**fields)
            except (KeyError, IndexError) as err:
                raise ValueError(f"--reasoning: row {i} has no field {err}; it has {sorted(fields)}") from None
            completion = f"{judge.think_open}{thought}{judge.think_close}\n{completion}"
        if not completion.startswith(judge.prefill):
            raise ValueError(
                f"row {i}: the completion {completion!r} does not start with the judge's prefill {judge.prefill!r} "
                "(a thinking judge needs --reasoning)"
            )
        rows.append({"prompt": messages, "completion": completion})
    _write_lines(args.out, rows)
    return rows


def score(args: argparse.Namespace) -> dict[str, Any]:
    """The judge's votes on every answer and their report, with the sha256 of everything read."""
    model, block, _ = _config(args.config)
    judge = build_judge(block, model=args.judge_model, votes=args.votes, decode=args.decode)
    rows = read_answers(args.answers)
    start, votes = time.perf_counter(), []
    for i in range(0, len(rows), args.batch_size):
        votes.append(judge([_transcript(r, model) for r in rows[i : i + args.batch_size]]).votes)
    votes = torch.cat(votes)
    report = judge_report(votes, [r["truth"] for r in rows], [r["problem"] for r in rows], seed=args.seed)
    report["judge"] = {"model": getattr(judge, "model_name", None), "decode": args.decode, "seconds": None}
    report["judge"]["seconds"] = round(time.perf_counter() - start, 1)
    report["provenance"] = provenance(
        {
            **{f"config{k or ''}": path for k, path in enumerate(args.config)},
            "answers": args.answers,
            "judge_model": report["judge"]["model"],
        }
    )
    report["answers"] = [
        {
            "problem": r["problem"],
            "prompt_sha256": hashlib.sha256(r["prompt"].encode()).hexdigest(),
            "truth": r["truth"],
            "votes": [None if v != v else v for v in v_row.tolist()],
        }
        for r, v_row in zip(rows, votes)
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> Any:
    """Command line: ``answers``, ``sft`` or ``score`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    a = steps.add_parser("answers", help="Alice's graded answers to a split's problems")
    a.add_argument("--split", choices=("train", "val"), default="val")
    a.add_argument("--num-problems", type=int, default=None, help="the split's first N (default: all)")
    a.add_argument("--samples", type=int, default=1, help="answers per problem at each sampled temperature")
    a.add_argument("--temperature", type=float, nargs="+", default=[0.7], help="one or more; 0: the greedy answer")
    a.add_argument("--model", help="the base (default: the config's lm.name_or_path)")
    a.add_argument("--adapter", help="an exported LoRA adapter folder as Alice")
    s = steps.add_parser("sft", help="SFT rows: the judge's prompt and the checker's verdict")
    s.add_argument("--system", default="You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    s.add_argument("--balance", action="store_true", help="repeat the rarer verdict's rows to match the other's count")
    s.add_argument("--reasoning", help="the judge's thinking before its verdict, e.g. '{n1} + {n2} = {reference}.'")
    c = steps.add_parser("score", help="the judge's MCC, AUROC, accept rate, ties and unparsed, with intervals")
    c.add_argument("--votes", type=int, help="votes per answer (default: the config's num_votes)")
    c.add_argument("--decode", choices=("auto", "vllm"), help="the judge's engine (default: the config's)")
    for p in (a, s, c):
        p.add_argument("--config", required=True, action="append", help="the game's config; repeat to lay one over")
        p.add_argument("--out", required=True)
        p.add_argument("--seed", type=int, default=0, help="sampling seed (answers) or bootstrap seed (score)")
        p.add_argument("--batch-size", type=int, default=16)
    for p in (s, c):
        p.add_argument("--answers", required=True, help="a file the answers step wrote")
        p.add_argument("--judge-model", help="the judge's model in place of the config's (e.g. a merged verifier)")
    args = parser.parse_args(argv)
    counts = [getattr(args, k, None) for k in ("batch_size", "samples", "votes", "num_problems")]
    if min(n for n in counts if n is not None) < 1:
        parser.error("--batch-size, --samples, --votes and --num-problems must be at least 1")
    if min(getattr(args, "temperature", [0])) < 0:
        parser.error("--temperature must be 0 (greedy) or above")
    try:
        return {"answers": write_answers, "sft": write_sft, "score": score}[args.step](args)
    except (OSError, ValueError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
