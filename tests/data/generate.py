"""Write the small data files of this folder (generated arithmetic, not hub data): ``python tests/data/generate.py``.

Each file is one of the own-data recipes of ``docs/data.md`` in a few dozen rows; the problems come from
:func:`alignment_games.modules.algorithms.arithmetic.generate_problems` with seeds of their own, so they overlap no
default data.
"""

import json
import os
import random

from alignment_games.modules.algorithms.arithmetic import generate_problems, make_response

HERE = os.path.dirname(os.path.abspath(__file__))


def _write(name, rows):
    with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _user(text):
    return [{"role": "user", "content": text}]


def _assistant(text):
    return [{"role": "assistant", "content": text}]


def main():
    rng = random.Random(0)
    pairs = []
    for p in generate_problems(40, seed=19_000_001):
        wrong = rng.choice(["wrong_step", "wrong_final", "truncated"])
        pairs.append((p, make_response(p, "correct", rng), make_response(p, wrong, rng)))
    # docs/data.md's main own-data recipe: a chosen/rejected file with its own column names
    _write(
        "pairs_question_chosen_rejected.jsonl",
        [{"question": p.question, "chosen": c, "rejected": r, "answer": p.answer} for p, c, r in pairs],
    )
    # TRL's preference format, standard, conversational and conversational with an implicit prompt
    _write("trl_preference_standard.jsonl", [{"prompt": p.question, "chosen": c, "rejected": r} for p, c, r in pairs])
    _write(
        "trl_preference_conversational.jsonl",
        [{"prompt": _user(p.question), "chosen": _assistant(c), "rejected": _assistant(r)} for p, c, r in pairs],
    )
    _write(
        "trl_preference_implicit.jsonl",
        [
            {"chosen": _user(p.question) + _assistant(c), "rejected": _user(p.question) + _assistant(r)}
            for p, c, r in pairs
        ],
    )
    sft = [(p, make_response(p, "correct", rng)) for p in generate_problems(32, seed=19_000_002)]
    # SFT: TRL's prompt-completion format (standard and conversational) and its messages format
    _write("sft_prompt_completion.jsonl", [{"prompt": p.question, "completion": y} for p, y in sft])
    _write(
        "sft_prompt_completion_conversational.jsonl",
        [{"prompt": _user(p.question), "completion": _assistant(y)} for p, y in sft],
    )
    system = [{"role": "system", "content": "You solve word problems step by step."}]
    _write("sft_messages.jsonl", [{"messages": system + _user(p.question) + _assistant(y)} for p, y in sft])
    # prompts with reference answers in GSM8K's style (worked solution, the answer after ####) for GRPO and debate
    problems = generate_problems(32, seed=19_000_003)
    _write(
        "problems_gsm8k_style.jsonl",
        [{"question": p.question, "answer": f"{make_response(p, 'correct', rng)}\n#### {p.answer}"} for p in problems],
    )
    # pool instructions with a category (the number of steps) and a reference answer each
    instructions = generate_problems(24, seed=19_000_004)
    _write(
        "instructions_with_categories.jsonl",
        [{"instruction": p.question, "category": f"{len(p.ops)}_steps", "answer": p.answer} for p in instructions],
    )


if __name__ == "__main__":
    main()
