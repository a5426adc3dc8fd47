import json

import pytest

from alignment_games.modules.algorithms.arithmetic import generate_problems, make_think_response
from alignment_games.modules.lm.models import build_byte_tokenizer, build_tiny_causal_lm, load_model, load_tokenizer
from alignment_games.modules.lm.task_tokenizer import SPECIAL_TOKENS, build_task_tokenizer, task_corpus


@pytest.fixture(scope="module")
def task_tok():
    return build_task_tokenizer()


def _chat(tok, problem):
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": problem}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_round_trips_and_is_shorter_than_bytes(task_tok):
    byte_tok = build_byte_tokenizer()
    task_len = byte_len = 0
    for p in generate_problems(50, seed=11, min_steps=1, max_steps=6):  # not the corpus's seed
        text = _chat(task_tok, p.question) + make_think_response(p)
        ids = task_tok(text, add_special_tokens=False)["input_ids"]
        assert task_tok.decode(ids) == text
        task_len, byte_len = task_len + len(ids), byte_len + len(byte_tok(text, add_special_tokens=False)["input_ids"])
    assert byte_len / task_len > 2.2  # measured 2.6
    odd = "Zoë's 1,234.5 €\n\n\t<think>x</think>"  # text the corpus never held still round-trips (byte-level)
    assert task_tok.decode(task_tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_digits_are_one_per_token_and_specials_keep_their_ids(task_tok):
    pieces = task_tok.convert_ids_to_tokens(task_tok("Ava has 12045 coins, then 77 = 7 * 11")["input_ids"])
    with_digits = [t for t in pieces if any(c.isdigit() for c in t)]
    assert with_digits == list("12045") + list("77") + ["7"] + list("11")
    assert task_tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3]
    assert (task_tok.eos_token_id, task_tok.pad_token_id) == (0, 3)
    # the task's frequent words are merged into single tokens
    assert len(task_tok("<think>", add_special_tokens=False)["input_ids"]) <= 3
    assert len(task_tok(" apples", add_special_tokens=False)["input_ids"]) == 1


def test_saved_folder_loads_with_its_own_pre_tokenizer(task_tok, tmp_path):
    # a folder with a Qwen2 config.json made AutoTokenizer load Qwen2Tokenizer, whose own split pattern replaced the
    # saved pre-tokenizer; load_tokenizer must give back the tokenizer that was saved
    folder = build_tiny_causal_lm(tmp_path / "m", config={"hidden_size": 32, "intermediate_size": 64}, tokenizer="task")
    loaded = load_tokenizer(folder)
    saved = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    assert json.loads(loaded.backend_tokenizer.to_str())["pre_tokenizer"] == saved["pre_tokenizer"]
    assert saved["pre_tokenizer"] == json.loads(task_tok.backend_tokenizer.to_str())["pre_tokenizer"]
    text = _chat(task_tok, "Ben has 305 marbles.\n\n") + "<think>305 - 7 = 298</think>\n\nThe answer is \\boxed{298}."
    assert loaded(text, add_special_tokens=False)["input_ids"] == task_tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    assert load_model(folder, task="causal_lm").config.vocab_size == len(loaded)


def test_byte_folder_keeps_its_byte_split(tiny_lm_dir):
    saved = json.loads(open(f"{tiny_lm_dir}/tokenizer.json").read())["pre_tokenizer"]
    assert json.loads(load_tokenizer(tiny_lm_dir).backend_tokenizer.to_str())["pre_tokenizer"] == saved


def test_tokenizer_choice_is_part_of_the_folder_stamp(tmp_path):
    shape = {"hidden_size": 32, "intermediate_size": 64}
    byte_dir = build_tiny_causal_lm(tmp_path / "m", config=shape)
    assert len(load_tokenizer(byte_dir)) == 260
    assert len(load_tokenizer(build_tiny_causal_lm(tmp_path / "m", config=shape, tokenizer="task"))) > 260  # rebuilt
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        build_tiny_causal_lm(tmp_path / "x", config=shape, tokenizer="bpe")


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="vocab_size must be at least 260"):
        build_task_tokenizer(["a b"], vocab_size=100)
    with pytest.raises(ValueError, match="num_problems must be at least 1"):
        task_corpus(num_problems=0)
