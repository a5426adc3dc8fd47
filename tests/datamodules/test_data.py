import json
import math
import random
import warnings

import pytest
import torch

from alignment_games.datamodules.preference import PreferenceDataModule, read_preference_table, validate_rows
from alignment_games.modules.algorithms.answers import extract_final_answer
from alignment_games.modules.algorithms.arithmetic import CORRUPTIONS, generate_problems, make_response
from alignment_games.modules.lm.models import load_tokenizer
from alignment_games.modules.scorers.oracle import ProgrammaticOracle, solution_score


@pytest.fixture(scope="module")
def minilm_tok():
    return load_tokenizer("builtin:minilm-l6")


def test_generated_problems_have_checkable_answers():
    probs = generate_problems(200, seed=3)
    assert generate_problems(200, seed=3)[17].question == probs[17].question  # deterministic
    rng = random.Random(0)
    for p in probs:
        assert p.values()[-1] == p.answer and min([p.start] + p.values()) >= 0
        r = {k: make_response(p, k, rng) for k in CORRUPTIONS}
        assert extract_final_answer(r["correct"]) == str(p.answer)
        assert extract_final_answer(r["padded"]) == str(p.answer)
        assert len(r["padded"].split()) > len(r["correct"].split())
        assert extract_final_answer(r["wrong_final"]) != str(p.answer)
        assert extract_final_answer(r["wrong_step"]) != str(p.answer)
        assert extract_final_answer(r["truncated"]) is None
    with pytest.raises(ValueError, match="corruption kind"):
        make_response(probs[0], "nonsense", rng)


def test_oracle_prefers_correct_and_randomises_order():
    p = generate_problems(1, seed=0)[0]
    rng = random.Random(1)
    good, bad = make_response(p, "correct", rng), make_response(p, "wrong_final", rng)
    oracle = ProgrammaticOracle(beta=3.0, seed=0)
    ref = str(p.answer)
    pstar = oracle.true_preference(["q"], [good], [bad], [ref]).item()
    # s(good) - s(bad) = w_final = 2 (steps all valid in both) -> sigmoid(6)
    assert pstar == pytest.approx(torch.sigmoid(torch.tensor(6.0, dtype=torch.float64)).item())
    assert solution_score(good, ref) - solution_score(bad, ref) == pytest.approx(2.0)
    # antisymmetric truth; labels average num_queries Bernoulli verdicts
    assert oracle.true_preference(["q"], [bad], [good], [ref]).item() == pytest.approx(1 - pstar)
    many = ProgrammaticOracle(beta=0.5, num_queries=7, seed=0)
    labels = many.label(["q"] * 400, [good] * 400, [bad] * 400, [ref] * 400)
    assert set((labels * 7).round().tolist()) <= set(range(8))
    expected = torch.sigmoid(torch.tensor(1.0)).item()
    assert labels.mean().item() == pytest.approx(expected, abs=0.03)
    with pytest.raises(ValueError, match="equal lengths"):
        oracle.label(["q"], [good, good], [bad], [ref])


def _dm(tok, **kw):
    dm = PreferenceDataModule(num_prompts=60, num_members=3, batch_size=16, seed=5, **kw)
    dm._tokenizer = tok
    return dm


def test_partitions_are_disjoint_by_prompt_and_seeded(minilm_tok):
    dm = _dm(minilm_tok)
    dm.setup("fit")
    by_split = {}
    for split, items in dm.splits.items():
        for it in items:
            key = split if split != "train" else f"train_{it['member']}"
            by_split.setdefault(key, set()).add(it["prompt_id"])
    names = sorted(by_split)
    assert names == ["test", "train_0", "train_1", "train_2", "val"]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not (by_split[a] & by_split[b]), (a, b)
    assert sum(len(v) for v in by_split.values()) == 60
    dm2 = _dm(minilm_tok)
    dm2.setup("fit")
    assert [it["prompt_id"] for it in dm2.splits["val"]] == [it["prompt_id"] for it in dm.splits["val"]]
    assert len(dm.splits["train"]) + len(dm.splits["val"]) + len(dm.splits["test"]) == 60 * 10
    batch = next(iter(dm.train_dataloader()))
    assert (
        batch["idx_a"].max() < batch["input_ids"].shape[0]
        and batch["seq_keys"].unique().numel() == batch["input_ids"].shape[0]
    )


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "What is 2+2?", "response_a": "4", "response_b": "5", "label": 1}


def test_bad_rows_name_the_row_and_field(tmp_path):
    with pytest.raises(ValueError, match=r"row 2: field 'response_b' is empty"):
        validate_rows([GOOD, {**GOOD, "response_b": "   "}], "pairs.jsonl")
    with pytest.raises(ValueError, match=r"row 1: field 'label' = 1.5 is outside \[0, 1\]"):
        validate_rows([{**GOOD, "label": 1.5}])
    with pytest.raises(ValueError, match=r"row 1: field 'label' = 'yes' is not a number"):
        validate_rows([{**GOOD, "label": "yes"}])
    with pytest.raises(ValueError, match=r"row 3: field 'prompt' is missing"):
        validate_rows([GOOD, GOOD, {**GOOD, "prompt": None}])
    path = _write(tmp_path, [{"question": "q", "response_a": "a", "response_b": "b", "label": 1}])
    with pytest.raises(ValueError, match=r"column 'prompt' \(for field 'prompt'\) is missing; columns present"):
        read_preference_table(path)[0]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_preference_table(str(tmp_path / "nope.jsonl"))[0]


def test_file_data_with_column_mapping_and_chosen_rejected(tmp_path, minilm_tok):
    rows = [{"q": f"prompt {i}", "chosen": f"good answer {i}", "rejected": f"bad answer {i}"} for i in range(40)]
    path = _write(tmp_path, rows)
    dm = PreferenceDataModule(
        path=path,
        prompt_column="q",
        response_a_column="chosen",
        response_b_column="rejected",
        label_column=None,
        num_members=2,
        batch_size=8,
        val_fraction=0.2,
        heldout_fraction=0.2,
    )
    dm._tokenizer = minilm_tok
    dm.setup("fit")
    labels = [it["label"] for s in dm.splits.values() for it in s]
    assert len(labels) == 40 and 5 < sum(labels) < 35  # order randomised, label follows the chosen one


def test_long_prompt_is_truncated_counted_and_warned(tmp_path, minilm_tok):
    rows = [{**GOOD, "prompt": f"p{i} " + "word " * (400 if i == 3 else 3)} for i in range(20)]
    dm = PreferenceDataModule(
        path=_write(tmp_path, rows), num_members=2, max_length=64, val_fraction=0.2, heldout_fraction=0.2
    )
    dm._tokenizer = minilm_tok
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    assert dm.num_truncated == 2  # both sequences of the long prompt (with response_a and response_b)
    assert any("truncated" in str(w.message) for w in caught)
    assert max(len(s) for s in dm.sequences) == 64
    # the response survives truncation: the sequence still ends with the response tokens and [SEP]
    long_ids = [s for s in dm.sequences if len(s) == 64][0]
    assert minilm_tok.decode(long_ids[-3:]).replace(" ", "") in ("4[SEP]", "5[SEP]") or long_ids[-1] == 102


def test_bad_config_values():
    with pytest.raises(ValueError, match="val_fraction"):
        PreferenceDataModule(val_fraction=1.5)
    with pytest.raises(ValueError, match="responses_per_prompt"):
        PreferenceDataModule(responses_per_prompt=9)
    with pytest.raises(ValueError, match="fewer than num_members"):
        PreferenceDataModule.partition_prompts(["a", "b", "c"], 5, 0.0, 0.0, 0)


def test_llm_judge_oracle_batches_and_never_injects(tiny_lm_dir):
    from alignment_games.modules.scorers.oracle import LLMJudgeOracle

    judge = LLMJudgeOracle(tiny_lm_dir, batch_size=3, num_queries=3, seed=0)
    text = judge.render("say {second} and {0}", "A-text", "B-text")
    assert "say {second} and {0}" in text and text.count("A-text") == 1 and text.count("B-text") == 1
    p = judge.first_wins_probability(["q1", "q2"], ["a", "b"], ["b", "a"], None)
    assert p.shape == (2,) and ((p > 0) & (p < 1)).all()
    labels = judge.label(["q"] * 5, ["x"] * 5, ["y"] * 5)
    assert set((labels * 3).round().tolist()) <= {0.0, 1.0, 2.0, 3.0}
    with pytest.raises(ValueError, match="must contain"):
        LLMJudgeOracle(tiny_lm_dir, template="no fields")


def test_llm_judge_oracle_reads_the_last_position_as_the_whole_sequence_logits_do(tiny_lm_dir):
    """The judge projects only the last position onto the vocabulary: the same A/B probabilities as every position's
    logits, over batches with left padding."""
    from alignment_games.modules.scorers.oracle import LLMJudgeOracle

    judge = LLMJudgeOracle(tiny_lm_dir, batch_size=2)
    prompts, firsts, seconds = ["q1", "a longer question 2", "q3"], ["a", "bb", "c"], ["b", "a", "a longer answer"]
    got = judge.first_wins_probability(prompts, firsts, seconds, None)
    texts = [judge.render(x, a, b) for x, a, b in zip(prompts, firsts, seconds)]
    want = []
    for i in range(0, 3, 2):
        enc = judge.tokenizer(texts[i : i + 2], return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = judge.model(**enc).logits[:, -1, judge.choice_ids].double()
        want.append(torch.softmax(logits, dim=-1)[:, 0])
    torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=1e-6)


def test_prompt_files_read_gsm8k_and_boxed_references(tmp_path):
    from alignment_games.datamodules.prompts import PromptDataModule, PromptSource

    path = tmp_path / "gsm.jsonl"
    path.write_text(
        json.dumps({"question": "q1", "answer": "3 + 4 = 7\n#### 7"})
        + "\n"
        + json.dumps({"question": "q2", "answer": "so \\boxed{\\frac{1}{2}}"})
        + "\n"
    )
    gsm = PromptSource(path=str(path), prompt_column="question", reference_column="answer", reference_format="gsm8k")
    rows = gsm.load()
    assert rows[0] == {"prompt": "q1", "reference": "7"} and rows[1]["reference"] is None
    rows = PromptSource(path=str(path), prompt_column="question", reference_column="answer", reference_format="boxed")
    assert rows.load()[1]["reference"] == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="column 'problem' is missing"):
        PromptSource(path=str(path), prompt_column="problem").load()
    with pytest.raises(ValueError, match="reference_format"):
        PromptSource(path=str(path), prompt_column="question", reference_column="answer", reference_format="latex")
    dm = PromptDataModule(
        source=gsm,
        val_fraction=0.5,
        batch_size=1,
    )
    dm.setup()
    assert len(dm.splits["train"]) == 1 and len(dm.splits["val"]) == 1


def test_evaluation_batches_take_eval_batch_size_and_training_keeps_batch_size():
    from alignment_games.datamodules.prompts import PromptDataModule

    dm = PromptDataModule(num_prompts=40, val_fraction=0.5, test_fraction=0.25, batch_size=3, eval_batch_size=8)
    dm.setup()
    assert [len(b["prompt"]) for b in dm.val_dataloader()] == [8, 8, 4]  # 20 held-out prompts, in order
    assert [len(b["prompt"]) for b in dm.test_dataloader()] == [8, 2]
    assert sorted(len(b["prompt"]) for b in dm.train_dataloader()) == [1, 3, 3, 3]  # the other 10
    plain = PromptDataModule(num_prompts=40, val_fraction=0.5, batch_size=3)
    plain.setup()
    assert [len(b["prompt"]) for b in plain.val_dataloader()] == [3] * 6 + [2]
    with pytest.raises(ValueError, match="eval_batch_size"):
        PromptDataModule(eval_batch_size=0)


class Alternating:
    """Verdicts by hand: on even queries a is better, on odd queries b (certain verdicts, whatever the order);
    ``invalid[row]`` names the queries whose verdict for that row is garbage (NaN, inf, 1.7, -0.2 in turn)."""

    GARBAGE = (float("nan"), float("inf"), 1.7, -0.2)

    def __init__(self, invalid):
        self.invalid, self.calls = invalid, 0

    def __call__(self, prompts, firsts, seconds, references):
        q, self.calls = self.calls, self.calls + 1
        a_wins = q % 2 == 0
        out = [1.0 if (first == "a") == a_wins else 0.0 for first in firsts]
        for row, queries in self.invalid.items():
            if q in queries:
                out[row] = self.GARBAGE[(row + q) % 4]
        return torch.tensor(out, dtype=torch.float64)


def test_oracle_averages_the_valid_verdicts_and_leaves_the_invalid_out():
    """§5.3.2: "averaging the valid binary verdicts" of the queries. Four queries say a, b, a, b; per row, the
    queries with a garbage verdict: none (mean 1/2), {1} (a, a, b: 2/3), {0, 2} (b, b: 0), all (no label), {3}."""
    from alignment_games.modules.scorers.oracle import PreferenceOracle

    class Scripted(PreferenceOracle):
        def __init__(self, invalid, **kw):
            super().__init__(**kw)
            self.verdicts = Alternating(invalid)

        def first_wins_probability(self, prompts, firsts, seconds, references):
            return self.verdicts(prompts, firsts, seconds, references)

    oracle = Scripted({1: {1}, 2: {0, 2}, 3: {0, 1, 2, 3}, 4: {3}}, num_queries=4, seed=0)
    labels = oracle.label(["x"] * 5, ["a"] * 5, ["b"] * 5)
    assert labels[[0, 1, 2, 4]].tolist() == pytest.approx([0.5, 2 / 3, 0.0, 2 / 3], abs=1e-12)
    assert math.isnan(labels[3])  # no valid verdict: no estimate
    assert (oracle.invalid_verdicts, oracle.unlabelled_rows, oracle.timeouts) == (8, 1, 0)
    assert oracle.summary() == {
        "oracle": "Scripted",
        "protocol": "query_mean",
        "num_queries": 4,
        "invalid_verdicts": 8,
        "timeouts": 0,
        "unlabelled_rows": 1,
    }

    # sampled verdicts: a row's garbage leaves the other rows' draws, and so their labels, exactly as they were
    class Noisy(PreferenceOracle):
        def __init__(self, bad_rows, **kw):
            super().__init__(**kw)
            self.bad_rows = bad_rows

        def first_wins_probability(self, prompts, firsts, seconds, references):
            p = torch.tensor([0.7 if f == "a" else 0.3 for f in firsts], dtype=torch.float64)
            p[self.bad_rows] = float("nan")
            return p

    clean = Noisy([], num_queries=5, seed=3).label(["x"] * 40, ["a"] * 40, ["b"] * 40)
    dirty = Noisy([0, 7], num_queries=5, seed=3).label(["x"] * 40, ["a"] * 40, ["b"] * 40)
    keep = [i for i in range(40) if i not in (0, 7)]
    assert torch.equal(clean[keep], dirty[keep]) and dirty[[0, 7]].isnan().all()

    class Short(PreferenceOracle):
        def first_wins_probability(self, prompts, firsts, seconds, references):
            return torch.tensor([0.5])

    with pytest.raises(ValueError, match="1 verdicts for 3 rows"):
        Short().label(["x"] * 3, ["a"] * 3, ["b"] * 3)


def test_oracle_calls_past_the_time_limit_give_no_verdict():
    import time

    from alignment_games.modules.scorers.oracle import PreferenceOracle, ProgrammaticOracle

    class SlowSecondCall(PreferenceOracle):
        """a is always better; the second of three calls comes too late."""

        calls = 0

        def first_wins_probability(self, prompts, firsts, seconds, references):
            self.calls += 1
            if self.calls == 2:
                time.sleep(1.0)
            return torch.tensor([1.0 if f == "a" else 0.0 for f in firsts], dtype=torch.float64)

    oracle = SlowSecondCall(num_queries=3, seed=0, timeout_s=0.05)
    n = 200
    labels = oracle.label(["x"] * n, ["a"] * n, ["b"] * n)
    assert oracle.timeouts == n and oracle.invalid_verdicts == 0 and oracle.unlabelled_rows == 0
    assert labels.tolist() == [1.0] * n  # the two verdicts in time, both for a; a coin flip would pull some to 2/3
    late = SlowSecondCall(num_queries=1, seed=0, timeout_s=0.05)
    late.calls = 1  # its only call is the slow one
    assert late.label(["x"] * 3, ["a"] * 3, ["b"] * 3).isnan().all() and late.unlabelled_rows == 3
    args = (["q"] * 50, [r"1 + 1 = 2. \boxed{2}"] * 50, [r"1 + 1 = 3. \boxed{3}"] * 50, ["2"] * 50)
    in_time = ProgrammaticOracle(seed=1, timeout_s=30.0)
    assert torch.equal(in_time.label(*args), ProgrammaticOracle(seed=1).label(*args)) and in_time.timeouts == 0
    with pytest.raises(ValueError, match="timeout_s"):
        ProgrammaticOracle(timeout_s=-1)


def test_programmatic_labels_follow_the_oracles_preference_with_either_order_shown():
    """The programmatic oracle's labels against values derived by hand: P* = σ(β Δs) of hand-scored solutions, and
    a label of n queries a Binomial(n, P*) / n draw whichever response is shown first; the datamodule keeps them."""
    from scipy.stats import binom

    # s = 2·[final right] + (share of true equations) (same length: no length term; every answer boxed)
    right, wrong, steps_only = r"2 + 3 = 5. \boxed{5}", r"2 + 3 = 6. \boxed{6}", r"2 + 3 = 5. \boxed{6}"
    pairs = [(right, wrong), (wrong, right), (steps_only, wrong), (right, right)]  # Δs = 3, −3, 1, 0
    beta, n = 0.5, 1000
    p_star = [1 / (1 + math.exp(-beta * d)) for d in (3, -3, 1, 0)]
    oracle = ProgrammaticOracle(beta=beta, num_queries=n, seed=3)
    args = (["2 + 3?"] * 4, [a for a, _ in pairs], [b for _, b in pairs], ["5"] * 4)
    assert oracle.true_preference(*args).tolist() == pytest.approx(p_star, abs=1e-12)
    labels = oracle.label(*args)
    for row, (label, p) in enumerate(zip(labels.tolist(), p_star)):
        low, high = binom.interval(1 - 1e-6, n, p)  # a label outside is a 1-in-a-million draw
        assert low / n <= label <= high / n, f"row {row}: {label} for P* = {p}"
    # the datamodule's rows carry the oracle's labels: k/3 for 3 queries, and their sum near Σ P* of its own rows
    rows = PreferenceDataModule(
        num_prompts=4, responses_per_prompt=3, seed=1, oracle=ProgrammaticOracle(beta=2.0, num_queries=3, seed=7)
    ).generate_rows()
    assert len(rows) == 12 and {round(3 * r["label"], 9) for r in rows} <= {0.0, 1.0, 2.0, 3.0}
    dm = PreferenceDataModule(num_prompts=30, seed=0, oracle=ProgrammaticOracle(beta=10.0, num_queries=1, seed=0))
    rows = dm.generate_rows()
    cols = [[r[k] for r in rows] for k in ("prompt", "response_a", "response_b", "reference")]
    p = ProgrammaticOracle(beta=10.0).true_preference(*cols)
    labels = torch.tensor([r["label"] for r in rows], dtype=torch.float64)
    assert len(rows) == 300 and set(labels.tolist()) <= {0.0, 1.0}
    assert abs(float(labels.sum() - p.sum())) <= 5 * math.sqrt(float((p * (1 - p)).sum()))
    assert dm.oracle_summary() == {
        "oracle": "ProgrammaticOracle",
        "protocol": "binary",
        "num_queries": 1,
        "invalid_verdicts": 0,
        "timeouts": 0,
        "unlabelled_rows": 0,
        "pairs_dropped": 0,
    }
    # one query a pair gives the paper's binary labels; 11 give their mean, the deviation, named as such
    eleven = PreferenceDataModule(num_prompts=30, seed=0, oracle=ProgrammaticOracle(beta=10.0, num_queries=11, seed=0))
    assert set(labels.tolist()) == {0.0, 1.0} and len({r["label"] for r in eleven.generate_rows()}) > 2
    assert (eleven.oracle_summary()["protocol"], eleven.oracle_summary()["num_queries"]) == ("query_mean", 11)


def test_pairs_without_a_valid_verdict_are_dropped_and_counted():
    from alignment_games.modules.scorers.oracle import PreferenceOracle

    class Silent(PreferenceOracle):
        """No verdict for the first pair of every call."""

        def first_wins_probability(self, prompts, firsts, seconds, references):
            p = torch.full((len(prompts),), 0.9, dtype=torch.float64)
            p[0] = float("nan")
            return p

    dm = PreferenceDataModule(num_prompts=5, responses_per_prompt=3, seed=0, oracle=Silent(num_queries=2))
    with pytest.warns(UserWarning, match="1 of 15 pairs got no valid oracle verdict in 2 queries"):
        rows = dm.generate_rows()
    assert len(rows) == 14 and all(0.0 <= r["label"] <= 1.0 for r in rows)
    assert dm.oracle_summary()["pairs_dropped"] == 1 and dm.oracle_summary()["unlabelled_rows"] == 1
    assert PreferenceDataModule(path="unused.jsonl").oracle_summary() is None  # labels from the data: no oracle


def test_a_hub_prompt_source_passes_its_subset_and_revision_to_load_dataset(monkeypatch):
    import datasets

    from alignment_games.datamodules.prompts import PromptSource

    calls = []

    def fake_load_dataset(name, config_name=None, split=None, revision=None):
        calls.append((name, config_name, split, revision))
        return datasets.Dataset.from_list([{"question": "2 + 2?", "answer": "4\n#### 4"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = PromptSource(
        name="openai/gsm8k",
        config_name="main",
        revision="e53f048",
        split="test",
        prompt_column="question",
        reference_column="answer",
        reference_format="gsm8k",
    )
    assert source.load() == [{"prompt": "2 + 2?", "reference": "4"}]
    assert calls == [("openai/gsm8k", "main", "test", "e53f048")]
    with pytest.raises(ValueError, match=r"openai/gsm8k/main\[test\]: column 'problem' is missing"):
        PromptSource(name="openai/gsm8k", config_name="main", split="test", prompt_column="problem").load()
