"""Row checks of texts read by the datamodules (datamodules/validation.py) and their use by the preference data."""

import pytest

from alignment_games.datamodules.preference import validate_rows
from alignment_games.datamodules.validation import require_number, require_text

GOOD = {"prompt": "What is 2 + 2?", "response_a": "4", "response_b": "5", "label": 1.0}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "f.jsonl: row 3: field 'prompt' is missing"),
        (7, "f.jsonl: row 3: field 'prompt' must be text, got int"),
        ("", "f.jsonl: row 3: field 'prompt' is empty"),
        (" \t\n\u3000", "f.jsonl: row 3: field 'prompt' is empty"),  # whitespace only, an ideographic space too
    ],
)
def test_require_text_names_file_row_and_field(value, message):
    with pytest.raises(ValueError) as err:
        require_text(value, "prompt", "f.jsonl", 3)
    assert str(err.value) == message


def test_require_text_returns_text_unchanged():
    assert require_text("  x ", "prompt", "f", 0) == "  x "


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "f.jsonl: row 3: field 'label' is missing"),
        ("0.7", "f.jsonl: row 3: field 'label' = '0.7' is not a number (got str)"),
        (True, "f.jsonl: row 3: field 'label' = True is not a number (got bool)"),
        ([0.5], "f.jsonl: row 3: field 'label' = [0.5] is not a number (got list)"),
        (float("inf"), "f.jsonl: row 3: field 'label' = inf is not finite"),
        (float("nan"), "f.jsonl: row 3: field 'label' = nan is not finite"),
        (-0.5, "f.jsonl: row 3: field 'label' = -0.5 is outside [0, 1]"),
        (10**400, "f.jsonl: row 3: field 'label' is an integer of 1329 bits, outside [0, 1]"),
    ],
)
def test_require_number_names_file_row_and_field(value, message):
    with pytest.raises(ValueError) as err:
        require_number(value, "label", "f.jsonl", 3, 0.0, 1.0)
    assert str(err.value) == message


def test_require_number_returns_a_float():
    assert [require_number(v, "label", "f", 0, 0.0, 1.0) for v in (0, 1, 0.25)] == [0.0, 1.0, 0.25]
    assert type(require_number(1, "label", "f", 0, 0.0, 1.0)) is float


@pytest.mark.parametrize("field", ["prompt", "response_a", "response_b"])
def test_preference_rows_refuse_an_empty_prompt_or_response(field):
    with pytest.raises(ValueError, match=rf"pairs.jsonl: row 2: field '{field}' is empty"):
        validate_rows([GOOD, {**GOOD, field: "   "}], "pairs.jsonl")
    assert validate_rows([GOOD], "pairs.jsonl")[0]["prompt"] == GOOD["prompt"]


@pytest.mark.parametrize("family", ["prompts", "debate", "pool", "pool_test"])
def test_every_prompt_reader_refuses_a_whitespace_prompt_by_row(tmp_path, family):
    """The prompt files of Deep SMIDA/GRPO (prompts), debate and the pool (its train and test sources)."""
    import json

    from alignment_games.datamodules.debate import DebateDataModule
    from alignment_games.datamodules.pool import InstructionPoolDataModule
    from alignment_games.datamodules.prompts import PromptDataModule, PromptSource

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n" + json.dumps({"prompt": " \t "}) + "\n")
    source = PromptSource(path=str(path))
    dm = {
        "prompts": lambda: PromptDataModule(source=source),
        "debate": lambda: DebateDataModule(source=source),
        "pool": lambda: InstructionPoolDataModule(source=source),
        "pool_test": lambda: InstructionPoolDataModule(test_source=source),
    }[family]()
    with pytest.raises(ValueError, match=r"q.jsonl': row 2: field 'prompt' is empty"):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": 123, "completion": "c"}, "row 2: field 'prompt' must be text, got int"),
        ({"prompt": "p", "completion": 4}, "row 2: field 'completion' must be text, got int"),
        ({"prompt": "p", "completion": " "}, "row 2: field 'completion' is empty"),
    ],
)
def test_sft_rows_refuse_a_number_as_not_text(tmp_path, row, message):
    import json

    from alignment_games.datamodules.sft import SFTFileDataModule

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as err:
        SFTFileDataModule(path=str(path)).setup()
    assert str(err.value) == f"{str(path)!r}: {message}"
