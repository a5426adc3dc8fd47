"""TRL's dataset formats as text: against TRL's own ``extract_prompt`` / ``maybe_apply_chat_template``, hand values
for the plain fallback, and the errors of malformed messages."""

import pytest

from alignment_games.datamodules.formats import (
    as_messages,
    extract_implicit_prompt,
    render_prompt_completion,
    split_last_reply,
)
from alignment_games.modules.lm.models import load_tokenizer
from alignment_games.modules.lm.text import pad_sequences, plain_chat, render_chat

trl_data = pytest.importorskip("trl.data_utils")

USER = [{"role": "user", "content": "What color is the sky?"}]
BLUE = [{"role": "assistant", "content": "It is blue."}]
GREEN = [{"role": "assistant", "content": "It is green."}]


@pytest.fixture(scope="module")
def qwen_tok(tiny_lm_dir):
    return load_tokenizer(tiny_lm_dir)


@pytest.mark.parametrize(
    ("chosen", "rejected"),
    [
        (USER + BLUE, USER + GREEN),
        ("Human: sky? Assistant: It is blue.", "Human: sky? Assistant: It is green."),
        ("Q: 2+2? A: 4", "Q: 2+2? A: 5"),  # the space before the difference goes with the completions
        ("abc", "xyz"),  # nothing shared: an empty prompt
        (USER + [{"role": "user", "content": "and at night?"}] + BLUE, USER + GREEN),
    ],
)
def test_implicit_prompt_is_trls(chosen, rejected):
    want = trl_data.extract_prompt({"chosen": chosen, "rejected": rejected})
    assert extract_implicit_prompt(chosen, rejected) == (want["prompt"], want["chosen"], want["rejected"])


def test_implicit_prompt_by_hand():
    assert extract_implicit_prompt("Q: 2+2? A: 4", "Q: 2+2? A: 5") == ("Q: 2+2? A:", " 4", " 5")
    # one completion a prefix of the other: the whole shorter one is the prompt, its completion empty (refused later)
    assert extract_implicit_prompt("ab", "abc") == ("ab", "", "c")


def test_rendering_with_a_chat_template_is_trls(qwen_tok):
    prompt, chosen = render_prompt_completion(qwen_tok, USER, BLUE)
    want = trl_data.maybe_apply_chat_template({"prompt": USER, "chosen": BLUE, "rejected": GREEN}, qwen_tok)
    assert (prompt, chosen) == (want["prompt"], want["chosen"])
    assert prompt == "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    assert chosen == "It is blue.<|im_end|>\n"


def test_plain_fallback_without_a_chat_template():
    minilm = load_tokenizer("builtin:minilm-l6")
    assert not minilm.chat_template
    system = [{"role": "system", "content": "Be brief."}]
    assert render_chat(minilm, system + USER, add_generation_prompt=True) == (
        "system: Be brief.\nuser: What color is the sky?\nassistant: "
    )
    assert render_prompt_completion(minilm, USER, BLUE) == (
        "user: What color is the sky?\nassistant: ",
        "It is blue.\n",
    )
    assert plain_chat(USER + BLUE) == "user: What color is the sky?\nassistant: It is blue.\n"
    assert render_chat(None, USER) == "user: What color is the sky?\n"


def test_a_template_that_renders_the_prompt_differently_is_refused():
    class Odd:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return ("GEN:" if add_generation_prompt else "") + "|".join(m["content"] for m in messages)

    with pytest.raises(ValueError, match="pairs.jsonl: row 3: the chat template renders the prompt differently"):
        render_prompt_completion(Odd(), USER, BLUE, "pairs.jsonl: row 3")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([], "expected a non-empty list"),
        ("text", "expected a non-empty list"),
        ([{"role": "user", "content": "hi"}, "bye"], "message 1 is str"),
        ([{"role": "user"}], "message 0 has no text 'content'"),
        ([{"content": "hi"}], "message 0 has no text 'role'"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "message 0 has no text 'content'"),
    ],
)
def test_malformed_messages_name_the_place(value, match):
    with pytest.raises(ValueError, match=f"f.jsonl: row 7, field 'chosen': {match}"):
        as_messages(value, "f.jsonl: row 7, field 'chosen'")


def test_keys_datasets_filled_with_none_are_dropped():
    assert as_messages([{"role": "user", "content": "hi", "name": None}], "x") == [{"role": "user", "content": "hi"}]


def test_last_reply_split():
    system = [{"role": "system", "content": "s"}]
    follow = [{"role": "user", "content": "more?"}]
    assert split_last_reply(system + USER + BLUE + follow + GREEN, "x") == (system + USER + BLUE + follow, GREEN)
    assert split_last_reply(USER + BLUE + follow, "x") == (USER, BLUE)  # turns after the last reply are not trained
    for bad in (USER, BLUE + USER):
        with pytest.raises(ValueError, match="row 2: the conversation needs an assistant message after"):
            split_last_reply(bad, "row 2")


def test_pad_sequences_pads_on_either_side_with_the_mask_and_type_ids():
    out = pad_sequences([[5, 6, 7], [8], []], pad_id=0, type_ids=[[0, 1, 1], [0], []])
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert out["token_type_ids"].tolist() == [[0, 1, 1], [0, 0, 0], [0, 0, 0]]
    left = pad_sequences([[5, 6, 7], [8], []], pad_id=9, left=True)
    assert left["input_ids"].tolist() == [[5, 6, 7], [9, 9, 8], [9, 9, 9]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    both = pad_sequences([[5, 6], [8]], pad_id=0, type_ids=[[0, 1], [1]], left=True)
    assert both["token_type_ids"].tolist() == [[0, 1], [0, 1]]
