"""Row checks of texts read by the datamodules (datamodules/validation.py) and their use by the preference data."""

import pytest

from datamodules.preference import validate_rows
from datamodules.validation import require_text

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


@pytest.mark.parametrize("field", ["prompt", "response_a", "response_b"])
def test_preference_rows_refuse_an_empty_prompt_or_response(field):
    with pytest.raises(ValueError, match=rf"pairs.jsonl: row 1: field '{field}' is empty"):
        validate_rows([GOOD, {**GOOD, field: "   "}], "pairs.jsonl")
    assert validate_rows([GOOD], "pairs.jsonl")[0]["prompt"] == GOOD["prompt"]


@pytest.mark.parametrize("family", ["prompts", "debate", "pool", "pool_test"])
def test_every_prompt_reader_refuses_a_whitespace_prompt_by_row(tmp_path, family):
    """The prompt files of Deep SMIDA/GRPO (prompts), debate and the pool (its train and test sources)."""
    import json

    from datamodules.debate import DebateDataModule
    from datamodules.pool import InstructionPoolDataModule
    from datamodules.prompts import PromptDataModule, PromptSource

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n" + json.dumps({"prompt": " \t "}) + "\n")
    source = PromptSource(path=str(path))
    dm = {
        "prompts": lambda: PromptDataModule(source=source),
        "debate": lambda: DebateDataModule(source=source),
        "pool": lambda: InstructionPoolDataModule(source=source),
        "pool_test": lambda: InstructionPoolDataModule(test_source=source),
    }[family]()
    with pytest.raises(ValueError, match=r"q.jsonl': row 1: field 'prompt' is missing or empty"):
        dm.setup("fit")
