"""HFJudge prefills each transcript once for all its votes, with the same votes as prefilling it per vote; its dtype;
greedy votes; the settings its vLLM engine path refuses."""

from __future__ import annotations

import pytest
import torch

from alignment_games.modules.algorithms.debate import Transcript, split_reply
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import HFJudge


def transcripts() -> list[Transcript]:
    texts = [(r"2 + 2 = 4, so \boxed{4}.", "Correct."), ("It is 5.", "No: 2 + 2 is 4, not 5, the answer is wrong.")]
    return [
        Transcript("What is 2 + 2?", "4", "debate_ab", [split_reply(x, required=False) for x in pair]) for pair in texts
    ]


def judged(judge: HFJudge, share: bool) -> tuple[list[list[str]], torch.Tensor, list[tuple[int, int]]]:
    """The judge's texts and votes with ``share_prompt=share``, and the (rows, tokens) of every forward it ran."""
    judge.share_prompt = share
    judge.load_state_dict({"generator": torch.Generator().manual_seed(7).get_state()})
    shapes: list[tuple[int, int]] = []
    hook = judge.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        out = judge.vote(transcripts())
    finally:
        hook.remove()
    return out.texts, out.votes, shapes


@pytest.mark.parametrize("temperature", [1.0, 1e-4])  # sampled, and greedy in effect
def test_prefill_once_gives_the_votes_of_prefilling_per_vote(tiny_lm_dir, temperature):
    judge = HFJudge(tiny_lm_dir, chain_of_thought=False, num_votes=4, sampling=Sampling(temperature, 1.0, 12))
    texts, votes, shapes = judged(judge, share=True)
    before_texts, before_votes, before_shapes = judged(judge, share=False)
    assert texts == before_texts and torch.equal(torch.isnan(votes), torch.isnan(before_votes))
    assert torch.equal(votes.nan_to_num(-1), before_votes.nan_to_num(-1))
    if temperature < 1:
        assert all(len(set(row)) == 1 for row in texts)  # greedy: every vote the same text
    else:
        assert any(len(set(row)) > 1 for row in texts)  # sampled: the votes differ
    width = before_shapes[0][1]
    # before: the 2 prompts were prefilled 4 times each; now once each (all but the last token), then 8 rows step
    assert before_shapes[0] == (8, width) and all(s[1] == 1 for s in before_shapes[1:])
    assert shapes[0] == (2, width - 1) and shapes[1] == (8, 1) and all(s == (8, 1) for s in shapes[1:])


def test_judge_dtype_auto_is_float32_on_cpu_and_bfloat16_with_cuda(tiny_lm_dir, monkeypatch):
    assert next(HFJudge(tiny_lm_dir, num_votes=1).model.parameters()).dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert next(HFJudge(tiny_lm_dir, num_votes=1).model.parameters()).dtype == torch.bfloat16
    assert next(HFJudge(tiny_lm_dir, num_votes=1, dtype="float32").model.parameters()).dtype == torch.float32


def test_a_4bit_judge_loads_nf4_computing_in_its_dtype_and_stays_where_it_was_loaded(tiny_lm_dir):
    from bitsandbytes.nn import Linear4bit

    judge = HFJudge(tiny_lm_dir, num_votes=1, load_in_4bit=True)
    layers = [m for m in judge.model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 14 and all(m.compute_dtype == torch.float32 for m in layers)  # dtype auto on CPU: fp32
    assert judge.to("meta") is judge and judge.device == torch.device("cpu")  # not moved: a 4-bit model cannot be
    assert next(judge.model.parameters()).device == torch.device("cpu")


def test_a_4bit_judge_without_bitsandbytes_is_refused_naming_the_package(tiny_lm_dir, without_bitsandbytes):
    with pytest.raises(ImportError, match="load_in_4bit=True needs the optional package bitsandbytes"):
        HFJudge(tiny_lm_dir, num_votes=1, load_in_4bit=True)


def test_a_greedy_judge_votes_transformers_greedy_reply_every_time(tiny_lm_dir):
    judge = HFJudge(tiny_lm_dir, chain_of_thought=False, num_votes=3, greedy=True, sampling=Sampling(max_new_tokens=8))
    texts, _, _ = judged(judge, share=True)
    tok = judge.tokenizer
    enc = tok([judge.prompt(t) for t in transcripts()], add_special_tokens=False, return_tensors="pt", padding=True)
    out = judge.model.generate(**enc, do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
    want = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert texts == [[w] * 3 for w in want]  # (sampled, at temperature 1, the votes differ: the test above)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"decode": "generate"}, "judge decode: must be auto or vllm, got 'generate'"),
        ({"decode": "vllm", "timeout_s": 5.0}, "judge load_in_4bit and timeout_s: not with decode: vllm"),
        ({"decode": "vllm", "load_in_4bit": True}, "judge load_in_4bit and timeout_s: not with decode: vllm"),
    ],
)
def test_settings_the_engine_cannot_serve_are_refused_naming_the_field(tiny_lm_dir, fields, message):
    with pytest.raises(ValueError, match=message):
        HFJudge(tiny_lm_dir, num_votes=1, **fields)
