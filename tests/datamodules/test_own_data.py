"""Own data in every family: file labels kept unless relabelling is asked for by name, TRL's formats read as TRL
renders them, SFT files, prompts with references and categories; bad rows named."""

import json
import os

import pytest
import torch
from helpers import ROOT

from alignment_games.datamodules.preference import PreferenceDataModule, read_preference_table
from alignment_games.datamodules.prompts import PromptDataModule, PromptSource, collate_prompts, index_rows
from alignment_games.datamodules.sft import SFTFileDataModule
from alignment_games.modules.algorithms.pool import category_weights
from alignment_games.modules.lm.models import load_tokenizer
from alignment_games.modules.scorers.oracle import PreferenceOracle, ProgrammaticOracle

DATA = os.path.join(ROOT, "tests", "data")
PAIRS = os.path.join(DATA, "pairs_question_chosen_rejected.jsonl")
README_COLUMNS = {
    "prompt_column": "question",
    "response_a_column": "chosen",
    "response_b_column": "rejected",
    "label_column": None,
}


def _jsonl(name):
    with open(os.path.join(DATA, name)) as f:
        return [json.loads(line) for line in f]


def _write(tmp_path, rows, name="f.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _key(text):
    return len(text), text


class Shorter(PreferenceOracle):
    """A certain verdict for the shorter response (ties: the first in alphabetical order), whichever is shown first;
    counts its calls."""

    calls = 0

    def first_wins_probability(self, prompts, firsts, seconds, references):
        Shorter.calls += 1
        self.seen_references = references
        return torch.tensor([float(_key(f) < _key(s)) for f, s in zip(firsts, seconds)], dtype=torch.float64)


@pytest.fixture(scope="module")
def minilm():
    return load_tokenizer("builtin:minilm-l6")


@pytest.fixture(scope="module")
def qwen_tok(tiny_lm_dir):
    return load_tokenizer(tiny_lm_dir)


def _rows(tok, **kw):
    dm = PreferenceDataModule(num_members=2, tokenizer=None, **kw)
    dm._tokenizer = tok
    return dm, dm.read_rows()


# ------------------------------------------------------------------------------------------------ labels and oracle
def test_the_readme_recipe_keeps_the_files_labels_with_the_configs_oracle(minilm):
    """The main config's oracle does not touch file data: chosen/rejected pairs, half swapped, labels 1/0."""
    Shorter.calls = 0
    dm, rows = _rows(minilm, path=PAIRS, oracle=Shorter(), **README_COLUMNS)
    source = _jsonl("pairs_question_chosen_rejected.jsonl")
    assert Shorter.calls == 0 and dm.oracle_summary() is None and len(rows) == len(source) == 40
    for r, s in zip(rows, source):
        assert r["prompt"] == s["question"]
        assert (r["response_a"], r["response_b"]) == (
            (s["chosen"], s["rejected"])
            if r["label"] == 1.0
            else (
                s["rejected"],
                s["chosen"],
            )
        )
    assert 10 < sum(r["label"] for r in rows) < 30  # both orders occur


def test_relabelling_is_asked_for_by_name_and_uses_the_references(minilm):
    dm, rows = _rows(minilm, path=PAIRS, oracle=Shorter(), relabel=True, reference_column="answer", **README_COLUMNS)
    assert dm.labelled_by is dm.oracle and dm.oracle_summary()["oracle"] == "Shorter"
    # the oracle's labels, not the file's: the shorter response preferred, in whichever order the pair now stands
    assert [r["label"] for r in rows] == [float(_key(r["response_a"]) < _key(r["response_b"])) for r in rows]
    assert 0 < sum(r["label"] for r in rows) < len(rows)
    assert dm.oracle.seen_references == [str(s["answer"]) for s in _jsonl("pairs_question_chosen_rejected.jsonl")]


def test_relabelling_needs_no_label_column(tmp_path, minilm):
    rows = [{"prompt": f"q{i}", "response_a": "a" * (i % 3 + 1), "response_b": "bb", "answer": i} for i in range(6)]
    dm, out = _rows(minilm, path=_write(tmp_path, rows), oracle=Shorter(), relabel=True, reference_column="answer")
    assert [r["label"] for r in out] == [float(_key(r["response_a"]) < _key(r["response_b"])) for r in out]
    assert dm.oracle.seen_references == [str(i) for i in range(6)]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"reference_column": "answer"}, "data.reference_column='answer' is read only to relabel.*data.relabel: true"),
        ({"relabel": True, "oracle": ProgrammaticOracle()}, "needs the reference answers: set data.reference_column"),
        ({"relabel": True, "oracle": None, "reference_column": "answer"}, "data.relabel: true needs data.oracle"),
        ({"relabel": True, "oracle": Shorter(), "path": None}, "relabel needs data.path or data.name"),
        ({"format": "sharegpt"}, "data.format must be one of"),
    ],
)
def test_relabelling_options_that_cannot_apply_name_the_option(kw, match):
    args = {"path": PAIRS, "oracle": ProgrammaticOracle(), **README_COLUMNS, **kw}
    with pytest.raises(ValueError, match=match):
        PreferenceDataModule(**args)


def test_generated_data_are_still_labelled_by_the_oracle():
    dm = PreferenceDataModule(num_prompts=3, responses_per_prompt=2, oracle=Shorter())
    rows = dm.read_rows()
    assert [r["label"] for r in rows] == [float(_key(r["response_a"]) < _key(r["response_b"])) for r in rows]
    assert dm.oracle_summary()["oracle"] == "Shorter"


# ------------------------------------------------------------------------------------------------ TRL preference
def _trl_texts(tok, example):
    """TRL's own rendering of one preference example (implicit prompt extracted first)."""
    from trl.data_utils import extract_prompt, maybe_apply_chat_template

    if "prompt" not in example:
        example = extract_prompt(example)
    return maybe_apply_chat_template(example, tok)


@pytest.mark.parametrize(
    "name", ["trl_preference_standard.jsonl", "trl_preference_conversational.jsonl", "trl_preference_implicit.jsonl"]
)
def test_trl_preference_files_read_as_trl_renders_them(qwen_tok, name):
    pytest.importorskip("trl")
    _, cols, _ = read_preference_table(os.path.join(DATA, name), data_format="auto")
    assert cols["response_a"] == "chosen" and cols["label"] is None
    dm, rows = _rows(qwen_tok, path=os.path.join(DATA, name))  # no option: the format is recognised
    source = _jsonl(name)
    assert len(rows) == len(source)
    for r, s in zip(rows, source):
        want = _trl_texts(qwen_tok, s)
        chosen, rejected = (
            (r["response_a"], r["response_b"]) if r["label"] == 1.0 else (r["response_b"], r["response_a"])
        )
        assert (r["prompt"], chosen, rejected) == (want["prompt"], want["chosen"], want["rejected"])
    if name != "trl_preference_standard.jsonl":
        assert rows[0]["prompt"].startswith("<|im_start|>user\n") and rows[0]["response_a"].endswith("<|im_end|>\n")


def test_conversational_pairs_without_a_chat_template_get_the_plain_lines(minilm):
    _, rows = _rows(minilm, path=os.path.join(DATA, "trl_preference_implicit.jsonl"), seed=3)
    s = _jsonl("trl_preference_implicit.jsonl")[0]
    assert rows[0]["prompt"] == f"user: {s['chosen'][0]['content']}\nassistant: "
    assert {rows[0]["response_a"], rows[0]["response_b"]} == {
        s["chosen"][1]["content"] + "\n",
        s["rejected"][1]["content"] + "\n",
    }


def test_standard_implicit_prompt_and_mixed_rows(tmp_path, minilm):
    path = _write(tmp_path, [{"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}])
    rows = PreferenceDataModule(path=path, seed=0).read_rows()
    assert rows[0]["prompt"] == "Q: 2+2? A:" and {rows[0]["response_a"], rows[0]["response_b"]} == {" 4", " 5"}
    # a text prompt with message responses: the prompt becomes one user message
    path = _write(tmp_path, [{"prompt": "2+2?", "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}])
    _, rows = _rows(minilm, path=path)
    assert rows[0]["prompt"] == "user: 2+2?\nassistant: " and {rows[0]["response_a"], rows[0]["response_b"]} == {
        "4\n",
        "5\n",
    }


@pytest.mark.parametrize(
    ("row", "kw", "match"),
    [
        ({"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "b"}, {}, r"row 2, field 'response_a'"),
        ({"prompt": "p", "chosen": [], "rejected": "b"}, {}, r"row 2: field 'response_a' must be text or a list"),
        ({"chosen": "text", "rejected": [{"role": "assistant", "content": "b"}]}, {}, "row 2: an implicit prompt"),
        ({"prompt": "p", "chosen": "a", "rejected": " "}, {}, "row 2: field 'response_b' is empty"),
        ({"prompt": "p", "good": "a", "bad": "b"}, {"format": "trl"}, r"column 'chosen' \(for field 'response_a'\)"),
        ({"prompt": "p", "good": "a", "bad": "b"}, {}, r"column 'response_a' .* columns present: \['prompt', 'good'"),
    ],
)
def test_bad_preference_rows_name_the_row_and_field(tmp_path, minilm, row, kw, match):
    good = {k: v for k, v in row.items()}
    good.update({k: "ok" for k in ("prompt", "chosen", "rejected") if k in good})
    path = _write(tmp_path, [good, row])
    with pytest.raises(ValueError, match=match):
        _rows(minilm, path=path, **kw)


# ------------------------------------------------------------------------------------------------ SFT
@pytest.mark.parametrize(
    ("name", "system"),
    [
        ("sft_prompt_completion.jsonl", None),
        ("sft_prompt_completion_conversational.jsonl", None),
        ("sft_messages.jsonl", "You solve word problems step by step."),
    ],
)
def test_sft_files_in_trls_formats(name, system):
    dm = SFTFileDataModule(path=os.path.join(DATA, name), val_fraction=0.25, seed=1)
    dm.setup()
    assert (len(dm.val_pairs), len(dm.train_pairs)) == (8, 24)
    source = _jsonl(name)
    answers = {}
    for s in source:
        if "messages" in s:
            answers[s["messages"][1]["content"]] = s["messages"][2]["content"]
        else:
            prompt = s["prompt"] if isinstance(s["prompt"], str) else s["prompt"][0]["content"]
            completion = s["completion"] if isinstance(s["completion"], str) else s["completion"][0]["content"]
            answers[prompt] = completion
    for sys_msg, prompt, completion in dm.val_pairs + dm.train_pairs:
        assert sys_msg is None
        if isinstance(prompt, list):  # conversational: the messages as given, the system message kept
            assert [m["role"] for m in prompt] == (["system", "user"] if system else ["user"])
            assert system is None or prompt[0]["content"] == system
            prompt = prompt[-1]["content"]
        assert answers.pop(prompt) == completion
    assert not answers  # every row once


@pytest.mark.parametrize(
    ("rows", "kw", "match"),
    [
        (
            [{"prompt": "p", "completion": "c"}, {"prompt": "", "completion": "c"}],
            {},
            "row 2: field 'prompt' is empty",
        ),
        ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": None}], {}, "row 2: field 'completion'"),
        (
            [{"prompt": "p", "completion": [{"role": "user", "content": "c"}]}],
            {},
            r"row 1: field 'completion' must be one assistant message \(roles here: \['user'\]\)",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], {}, "row 1: field 'messages': the conversation needs"),
        ([{"text": "hi"}], {}, r"column 'prompt' \(for field 'prompt'\) is missing; columns present: \['text'\]"),
        ([{"text": "hi"}], {"format": "messages"}, "column 'messages'"),
        ([{"prompt": "p", "completion": "c"}], {}, "leave none for training"),
    ],
)
def test_bad_sft_rows_name_the_row_and_field(tmp_path, rows, kw, match):
    dm = SFTFileDataModule(path=_write(tmp_path, rows), **kw)
    with pytest.raises(ValueError, match=match):
        dm.setup()


def test_sft_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="data.path"):
        SFTFileDataModule()
    with pytest.raises(ValueError, match="data.format"):
        SFTFileDataModule(path="x.jsonl", format="alpaca")


def test_sft_encodes_a_conversation_with_its_template_and_without_one(tiny_lm_dir, tmp_path):
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.sft import CausalLMSFT

    sft = CausalLMSFT(lm=ModelConfig(tiny_lm_dir), system_prompt="Default.")
    tok = sft.tokenizer
    conv = [{"role": "system", "content": "Own."}, {"role": "user", "content": "2+2?"}]
    enc = sft.encode([conv, "3+3?"], ["4", "6"], [None, None])
    want_prompt = "<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    p_ids = tok(want_prompt, add_special_tokens=False)["input_ids"]
    r_ids = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert enc["input_ids"][0, : len(p_ids) + len(r_ids)].tolist() == p_ids + r_ids
    assert (
        enc["labels"][0, : len(p_ids)].eq(-100).all() and enc["labels"][0, len(p_ids) :][: len(r_ids)].tolist() == r_ids
    )
    text = tok.decode(enc["input_ids"][1][enc["attention_mask"][1].bool()])
    assert text.startswith("<|im_start|>system\nDefault.<|im_end|>")  # a text prompt gets the default system message
    tok.chat_template = None  # a base LM's tokenizer: the plain lines
    enc = sft.encode([conv], ["4"])
    n = len(tok("system: Own.\nuser: 2+2?\nassistant: ", add_special_tokens=False)["input_ids"])
    assert tok.decode(enc["input_ids"][0][:n]) == "system: Own.\nuser: 2+2?\nassistant: "
    assert enc["labels"][0, :n].eq(-100).all() and enc["labels"][0, n].item() != -100


# ------------------------------------------------------------------------------------------------ prompts
def test_prompts_with_references_and_categories():
    source = PromptSource(
        path=os.path.join(DATA, "instructions_with_categories.jsonl"),
        prompt_column="instruction",
        reference_column="answer",
        category_column="category",
    )
    rows, raw = source.load(), _jsonl("instructions_with_categories.jsonl")
    assert [(r["prompt"], r["reference"], r["category"]) for r in rows] == [
        (s["instruction"], str(s["answer"]), s["category"]) for s in raw
    ]
    batch = collate_prompts(index_rows(rows[:3]))
    assert batch["category"] == [s["category"] for s in raw[:3]] and batch["reference"][0] == str(raw[0]["answer"])
    assert "category" not in collate_prompts(index_rows([{"prompt": "p", "reference": None}]))
    gsm = PromptSource(
        path=os.path.join(DATA, "problems_gsm8k_style.jsonl"),
        prompt_column="question",
        reference_column="answer",
        reference_format="gsm8k",
    )
    dm = PromptDataModule(source=gsm, val_fraction=0.25)
    dm.setup()
    refs = {s["question"]: s["answer"].rsplit("#### ", 1)[1] for s in _jsonl("problems_gsm8k_style.jsonl")}
    assert len(dm.splits["train"]) == 24 and len(dm.splits["val"]) == 8
    assert all(refs[r["prompt"]] == r["reference"] for r in dm.splits["train"] + dm.splits["val"])


def test_conversational_prompts_and_bad_prompt_rows(tmp_path):
    user = {"role": "user", "content": "2+2?"}
    system = {"role": "system", "content": "Be brief."}
    path = _write(tmp_path, [{"prompt": [user]}, {"prompt": [system, user]}])
    assert [r["prompt"] for r in PromptSource(path=path).load()] == ["2+2?", "2+2?"]
    bad = [
        ([{"prompt": [user, {"role": "assistant", "content": "4"}]}], {}, r"row 1: field 'prompt': a conversational"),
        ([{"prompt": "p", "answer": [1, 2]}], {"reference_column": "answer"}, "row 1: field 'answer' must be"),
        (
            [{"prompt": "p", "kind": "a"}, {"prompt": "q", "kind": None}],
            {"category_column": "kind"},
            "row 2: field 'kind'",
        ),
        ([{"prompt": "p"}], {"category_column": "kind"}, "column 'kind' is missing"),
    ]
    for rows, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            PromptSource(path=_write(tmp_path, rows), **kw).load()


def test_category_weights_by_hand():
    assert category_weights([0.5, 0.25, 0.125, 0.125], ["a", "b", "a", None]) == {"a": 0.625, "b": 0.25, "none": 0.125}
    with pytest.raises(ValueError, match="3 probabilities for 2 categories"):
        category_weights([0.2, 0.3, 0.5], ["a", "b"])
