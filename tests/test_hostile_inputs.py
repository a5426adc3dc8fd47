"""Hostile inputs: parsers, data rows, files and config values never crash other than with the documented errors.

Property-based (hypothesis) where the input space is open, plus source scans for the security rules: checkpoints and
tensors load with ``weights_only=True``, ``trust_remote_code`` is off by default, nothing is ``eval``'d, and
templates are filled without ``str.format`` on data.
"""

import ast
import glob
import inspect
import json
import math
import os
import re

import pytest
from helpers import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignment_games.datamodules.preference import read_preference_table, validate_rows
from alignment_games.datamodules.prompts import PromptDataModule, PromptSource
from alignment_games.modules.algorithms.answers import (
    answers_match,
    extract_final_answer,
    extract_gsm8k_answer,
    normalize_answer,
    parse_number,
)
from alignment_games.modules.lm.text import fill_template

SOURCES = [
    p
    for pattern in ("modules/*.py", "datamodules/*.py", "callbacks/*.py", "train.py")
    for p in glob.glob(os.path.join(ROOT, pattern))
]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=300) | st.sampled_from(
    ["", " ", "\\boxed{", "\\boxed{}", "####", "#### ", "{{}}", "\\frac{1}{0}", "1/0", "9" * 5000, "\x00", "\ud7ff"]
)


# ------------------------------------------------------------------------------------------------ answer extraction
@FAST
@given(text=TEXT | st.none())
def test_answer_extraction_never_crashes_and_returns_text_or_none(text):
    for fn in (extract_final_answer, extract_gsm8k_answer):
        out = fn(text)
        assert out is None or isinstance(out, str)
    if text is not None:
        assert isinstance(normalize_answer(text), str)
        value = parse_number(text)
        assert value is None or value.denominator != 0
    assert isinstance(answers_match(text, text), bool)


@FAST
@given(prefix=TEXT, answer=st.integers(-(10**12), 10**12))
def test_the_last_box_and_the_last_marker_win_whatever_comes_before(prefix, answer):
    assert extract_final_answer(f"{prefix} \\boxed{{{answer}}}") == str(answer)
    assert extract_gsm8k_answer(f"{prefix}\n#### {answer}") == str(answer)
    assert answers_match(str(answer), f"{answer}.0")


def test_a_huge_number_is_text_not_a_crash():
    big = "1" * 10_000  # beyond Python's int-from-string limit: parse_number must not raise
    assert parse_number(big) is None or parse_number(big) > 0
    assert answers_match(big, big)


# ------------------------------------------------------------------------------------------------ preference rows
FIELD_VALUE = st.none() | st.integers() | st.floats(allow_nan=True) | TEXT | st.lists(st.integers(), max_size=2)
ROW = st.dictionaries(
    st.sampled_from(["prompt", "response_a", "response_b", "label", "extra"]), FIELD_VALUE, max_size=5
)


@FAST
@given(rows=st.lists(ROW, max_size=5))
def test_validate_rows_accepts_good_rows_and_names_row_and_field_of_bad_ones(rows):
    try:
        out = validate_rows(rows, "hostile.jsonl")
    except ValueError as e:
        msg = str(e)
        assert msg.startswith("hostile.jsonl: row ")
        assert re.search(r"row \d+: field '(prompt|response_a|response_b|label)'", msg)
        return
    assert len(out) == len(rows)
    for row in out:
        assert 0.0 <= row["label"] <= 1.0
        assert all(isinstance(row[f], str) for f in ("prompt", "response_a", "response_b"))
        assert row["response_a"].strip() and row["response_b"].strip()


def _write(path, raw: bytes):
    path.write_bytes(raw)
    return str(path)


@pytest.mark.parametrize(
    ("raw", "suffix", "match"),
    [
        (
            b'{"prompt": "a\xff\xfeb", "response_a": "x", "response_b": "y", "label": 1}\n',
            ".jsonl",
            "row 1: text is not",
        ),
        (b'prompt,response_a,response_b,label\n"a\xffb",x,y,1\n', ".csv", "cannot be read as csv"),
        (b"", ".jsonl", "holds no rows"),
        (b'{"prompt": "a"\n', ".jsonl", "cannot be read as json"),
        (b'{"prompt": "a", "response_a": "x", "label": 1}\n', ".jsonl", "column 'response_b'.*columns present"),
        (
            b'{"prompt": "a", "response_a": "x", "response_b": "  ", "label": 1}\n',
            ".jsonl",
            "row 1: field 'response_b'",
        ),
        (b'{"prompt": "a", "response_a": "x", "response_b": "y", "label": "yes"}\n', ".jsonl", "row 1: field 'label'"),
        (b'{"prompt": "a", "response_a": "x", "response_b": "y", "label": 1.5}\n', ".jsonl", "outside"),
        (b'{"prompt": null, "response_a": "x", "response_b": "y", "label": 1}\n', ".jsonl", "row 1: field 'prompt'"),
    ],
)
def test_bad_preference_files_fail_with_the_file_row_and_field(tmp_path, raw, suffix, match):
    path = _write(tmp_path / f"data{suffix}", raw)
    with pytest.raises(ValueError, match=match):
        validate_rows(read_preference_table(path)[0], path)


GOOD_PAIR = b'{"prompt": "a", "response_a": "x", "response_b": "y", "label": 0.5}'


def _pair_label(label: bytes) -> bytes:
    return b'{"prompt": "b", "response_a": "x", "response_b": "y", "label": ' + label + b"}"


@pytest.mark.parametrize(
    ("raw", "suffix", "message"),
    [
        # a number written as text, or true/false, is not a label (it used to be read as 0.7 and 1.0)
        (
            GOOD_PAIR + b"\n" + _pair_label(b'"0.7"') + b"\n",
            ".jsonl",
            "row 2: field 'label' = '0.7' is not a number (got str)",
        ),
        (
            GOOD_PAIR + b"\n" + _pair_label(b"true") + b"\n",
            ".jsonl",
            "row 2: field 'label' = True is not a number (got bool)",
        ),
        (
            b"prompt,response_a,response_b,label\na,x,y,false\nb,x,y,true\n",  # a CSV column of true/false
            ".csv",
            "row 1: field 'label' = False is not a number (got bool)",
        ),
        # not finite: 1e309 breaks the JSON readers (their error named no row), a JSON array made it null, NaN, CSV inf
        (GOOD_PAIR + b"\n" + _pair_label(b"1e309") + b"\n", ".jsonl", "row 2: field 'label' = 1e309 is not finite"),
        (
            b"[" + GOOD_PAIR + b", " + _pair_label(b"-1e309") + b"]",
            ".json",
            "row 2: field 'label' = -1e309 is not finite",
        ),
        (GOOD_PAIR + b"\n" + _pair_label(b"NaN") + b"\n", ".jsonl", "row 2: field 'label' = nan is not finite"),
        (
            b"prompt,response_a,response_b,label\na,x,y,0.5\nb,x,y,1e309\n",
            ".csv",
            "row 2: field 'label' = inf is not finite",
        ),
    ],
)
def test_labels_must_be_finite_numbers_named_by_file_row_and_field(tmp_path, raw, suffix, message):
    path = _write(tmp_path / f"pairs{suffix}", raw)
    with pytest.raises(ValueError) as err:
        validate_rows(read_preference_table(path)[0], path)
    assert path in str(err.value) and message in str(err.value)


def test_huge_fields_load_whole(tmp_path):
    huge = "x" * 2_000_000
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"prompt": huge, "response_a": huge, "response_b": "y", "label": 0.5}) + "\n")
    rows = validate_rows(read_preference_table(str(path))[0], str(path))
    assert len(rows[0]["prompt"]) == 2_000_000


def _gsm8k_file(path):
    return PromptSource(path=path, prompt_column="question", reference_column="answer", reference_format="gsm8k")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"question": "a\xffb", "answer": "#### 3"}\n', "row 1: text is not valid UTF-8"),
        (b'{"question": "", "answer": "#### 3"}\n', "row 1: field 'question' is empty"),
        (b'{"question": null, "answer": "#### 3"}\n', "row 1: field 'question'"),
        (b'{"answer": "#### 3"}\n', "column 'question' is missing"),
        (b"", "holds no rows"),
    ],
)
def test_bad_prompt_files_fail_with_the_file_row_and_field(tmp_path, raw, match):
    path = _write(tmp_path / "prompts.jsonl", raw)
    with pytest.raises(ValueError, match=match):
        _gsm8k_file(path).load()


@pytest.mark.parametrize(
    ("suffix", "column", "message"),
    [
        (".jsonl", "answer", "row 2: field 'answer' = nan is not finite"),
        (".jsonl", "category", "row 2: field 'category' = nan is not finite"),
        (".parquet", "answer", "row 2: field 'answer' = nan is not finite"),
        (".parquet", "category", "row 2: field 'category' = nan is not finite"),
        (".csv", "answer", "row 2: field 'answer' = inf is not finite"),
        (".json", "answer", "row 2: field 'answer' = 1e309 is not finite"),
    ],
)
def test_a_nan_reference_or_category_is_refused_not_read_as_the_text_nan(tmp_path, suffix, column, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / f"prompts{suffix}")
    other = {"answer": "category", "category": "answer"}[column]
    if suffix == ".parquet":  # a real NaN float, as pandas writes a missing number (not a null)
        pq.write_table(pa.table({"q": ["q1", "q2"], column: [1.0, math.nan], other: ["x", "y"]}), path)
    elif suffix == ".csv":
        _write(tmp_path / f"prompts{suffix}", f"q,{column},{other}\nq1,1,x\nq2,1e309,y\n".encode())
    elif suffix == ".json":
        _write(
            tmp_path / f"prompts{suffix}", f'[{{"q": "q1", "{column}": 1}}, {{"q": "q2", "{column}": 1e309}}]'.encode()
        )
    else:
        lines = f'{{"q": "q1", "{column}": 1, "{other}": "x"}}\n{{"q": "q2", "{column}": NaN, "{other}": "y"}}\n'
        _write(tmp_path / f"prompts{suffix}", lines.encode())
    source = PromptSource(
        path=path, prompt_column="q", **{f"{'reference' if column == 'answer' else column}_column": column}
    )
    with pytest.raises(ValueError) as err:
        source.load()
    assert path in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    ("raw", "suffix", "row", "kind"),
    [
        (b'{"q": "q1"}\n{"q": 123}\n', ".jsonl", 2, "int"),
        (b'[{"q": "q1"}, {"q": 1.5}]', ".json", 2, "float"),
        (b"q\n7\n123\n", ".csv", 1, "int"),  # a CSV column of numbers (one with text in it is a text column)
    ],
)
def test_a_numeric_prompt_is_refused_as_not_text(tmp_path, raw, suffix, row, kind):
    path = _write(tmp_path / f"prompts{suffix}", raw)
    with pytest.raises(ValueError) as err:
        PromptSource(path=path, prompt_column="q").load()
    assert str(err.value) == f"{path!r}: row {row}: field 'q' must be text, got {kind}"


def test_prompt_references_that_do_not_parse_become_none_not_a_crash(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"question": "q1", "answer": "no marker"},
        {"question": "q2", "answer": 7},
        {"question": "q3", "answer": None},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = _gsm8k_file(str(path)).load()
    assert [r["reference"] for r in rows] == [None, None, None]


# ------------------------------------------------------------------------------------------------ config values
NUM = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True, allow_infinity=True)


@FAST
@given(val=NUM, test=NUM, batch=NUM)
def test_prompt_datamodule_settings_are_accepted_or_refused_with_a_value_error(val, test, batch):
    try:
        PromptDataModule(val_fraction=val, test_fraction=test, batch_size=batch)
    except (ValueError, TypeError) as e:
        assert str(e)


@FAST
@given(steps=NUM | st.text(max_size=3))
def test_step_datamodule_refuses_anything_but_a_positive_int(steps):
    from alignment_games.datamodules.steps import StepDataModule

    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        assert StepDataModule(steps).steps_per_epoch == steps
    else:
        with pytest.raises(ValueError, match="steps_per_epoch"):
            StepDataModule(steps)


@FAST
@given(limit=NUM)
def test_nonfinite_limit_must_be_a_positive_integer(limit):
    from alignment_games.modules.training.faults import NonFiniteGuard

    guard = NonFiniteGuard()
    integral = isinstance(limit, (int, float)) and not isinstance(limit, bool) and math.isfinite(limit)
    if integral and limit == int(limit) and limit >= 1:  # 10 or 10.0 (a YAML float) both mean ten
        guard.init_nonfinite_guard(limit)
        assert guard.max_consecutive_nonfinite == limit
    else:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            guard.init_nonfinite_guard(limit)


# ------------------------------------------------------------------------------------------------ security
def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_sources_load_weights_only_never_eval_and_keep_remote_code_off(path):
    tree = ast.parse(open(path).read())
    for call in _calls(tree):
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        kwargs = {k.arg: k.value for k in call.keywords}
        if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", None) == "torch":
            assert isinstance(kwargs.get("weights_only"), ast.Constant) and kwargs["weights_only"].value is True, (
                f"{path}:{call.lineno}: torch.load without weights_only=True"
            )
        if name in ("load_from_checkpoint", "test", "validate", "predict") and "weights_only" in kwargs:
            assert kwargs["weights_only"].value is True, f"{path}:{call.lineno}: weights_only=False"
        assert name not in ("eval", "exec", "compile") or isinstance(func, ast.Attribute), (
            f"{path}:{call.lineno}: {name}() on text"
        )
        if "trust_remote_code" in kwargs:
            value = kwargs["trust_remote_code"]
            assert not (isinstance(value, ast.Constant) and value.value is True), f"{path}:{call.lineno}"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
            defaults += node.args.kw_defaults
            for arg, default in zip(args, defaults):
                if arg.arg == "trust_remote_code":
                    assert isinstance(default, ast.Constant) and default.value is False, f"{path}:{node.lineno}"


def test_no_config_turns_remote_code_on():
    for config in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        assert not re.search(r"trust_remote_code:\s*true", open(config).read(), re.I), config


def test_the_cli_classes_default_remote_code_off():
    import dataclasses

    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.models import load_model, load_tokenizer

    default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}["trust_remote_code"]
    assert default is False and ModelConfig("a/b").trust_remote_code is False
    for fn in (load_model, load_tokenizer):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False


@FAST
@given(data=TEXT)
def test_templates_insert_data_verbatim_without_interpreting_it(data):
    template = "Another answer was: {leader_response}\nWrite a different, better answer. {0} {__class__}"
    out = fill_template(template, leader_response=data)
    assert out == template.replace("{leader_response}", data, 1)  # placeholders inside the data stay text
    assert fill_template("{prompt}|{leader_response}", prompt=data, leader_response="{prompt}") == f"{data}|{{prompt}}"


def test_call_with_timeout_returns_in_time_results_flags_late_ones_and_keeps_errors():
    import time

    from alignment_games.modules.training.faults import call_with_timeout

    assert call_with_timeout(sum, None, [1, 2]) == (3, False)
    assert call_with_timeout(lambda a, b=0: a * b, 5.0, 3, b=4) == (12, False)
    start = time.perf_counter()
    assert call_with_timeout(time.sleep, 0.05, 2.0) == (None, True)
    assert time.perf_counter() - start < 1.0  # the caller did not wait for the sleeper

    def broken():
        raise KeyError("judge bug")

    with pytest.raises(KeyError, match="judge bug"):  # a bug in time is raised, not hidden as a timeout
        call_with_timeout(broken, 5.0)
    for bad in (0, -2, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="timeout_s"):
            call_with_timeout(sum, bad, [1])


@pytest.fixture
def alarm():
    """A read that blocks (a FIFO with no writer) fails the test after 10 s instead of hanging it."""
    import signal

    def timed_out(signum, frame):
        raise TimeoutError("the reader blocked on the FIFO")

    old = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("reader", ["prompts", "preference pairs", "ifeval"])
def test_a_fifo_named_as_a_data_file_is_refused_at_once(tmp_path, alarm, reader):
    from alignment_games.modules.evaluation.ifeval import read_ifeval

    fifo = str(tmp_path / "rows.jsonl")
    os.mkfifo(fifo)  # no writer: opening it for reading would wait for one for ever
    read = {
        "prompts": lambda: _gsm8k_file(fifo).load(),
        "preference pairs": lambda: read_preference_table(fifo),
        "ifeval": lambda: read_ifeval(fifo),
    }[reader]
    field = "--data" if reader == "ifeval" else "data.path"
    with pytest.raises(ValueError, match=f"^{field}: {re.escape(repr(fifo))} is a FIFO, not a regular file"):
        read()


def test_a_folder_named_as_a_data_file_is_refused_naming_it(tmp_path):
    folder = tmp_path / "rows.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match=f"data.path: {re.escape(repr(str(folder)))} is a folder, not a regular file"):
        read_preference_table(str(folder))
