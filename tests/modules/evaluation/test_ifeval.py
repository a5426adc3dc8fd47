"""The IFEval command (App. G.5): reading and checking the jsonl, the four accuracies, the paired difference, and the
command end to end on two exported LoRA followers of a tiny decoder."""

import hashlib
import json
import math

import pytest
import torch
from helpers.provenance import check_provenance

from alignment_games.commands.ifeval import main
from alignment_games.modules.evaluation.ifeval import (
    METRICS,
    load_policy,
    paired_difference,
    read_ifeval,
    score_responses,
)
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.models import build_tiny_causal_lm
from alignment_games.modules.scorers.utility import Utility

NO_COMMA = "punctuation:no_comma"
QUOTED = "startend:quotation"
ROWS = [
    {"key": 1, "prompt": "p1", "instruction_id_list": [NO_COMMA, QUOTED], "kwargs": [{}, {}]},
    {"key": 2, "prompt": "p2", "instruction_id_list": [NO_COMMA], "kwargs": [{}]},
    {"key": 3, "prompt": "p3", "instruction_id_list": ["custom:unknown", NO_COMMA], "kwargs": [{"x": 1}, {}]},
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_four_accuracies_by_hand():
    responses = [
        'Sure, here:\n"a comma, inside"',  # commas in both lines: fails both ways; quotation: loose yes (line 1 cut)
        "plain text",  # no comma: follows
        "a, b",  # the unknown id is not scored; the comma fails
    ]
    out = score_responses(ROWS, responses)
    # supported instructions: p1 (2), p2 (1), p3 (1) = 4; strict followed: p2 = 1; loose: + p1's quotation = 2
    # prompt level over the fully supported prompts p1, p2: strict p2 only (1/2), loose p2 only (1/2)
    assert out["accuracy"] == {
        "prompt_loose": 0.5,
        "instruction_loose": 0.5,
        "prompt_strict": 0.5,
        "instruction_strict": 0.25,
    }
    assert list(out["accuracy"]) == list(METRICS)
    assert out["counts"] == {"prompts": 3, "prompts_scored": 2, "instructions_scored": 4}
    assert out["unsupported"] == {"instructions": 1, "prompts": 1, "ids": {"custom:unknown": 1}}
    assert out["results"][2] == {"key": 3, "response": "a, b", "strict": [None, False], "loose": [None, False]}
    assert out["results"][0]["strict"] == [False, False] and out["results"][0]["loose"] == [False, True]
    assert out["by_category"] == {
        "punctuation": {"strict": 1 / 3, "loose": 1 / 3, "instructions": 3},
        "startend": {"strict": 0.0, "loose": 1.0, "instructions": 1},
    }
    with pytest.raises(ValueError, match="3 rows but 2 responses"):
        score_responses(ROWS, responses[:2])


def test_nothing_supported_gives_nan_not_a_score():
    out = score_responses([ROWS[2] | {"instruction_id_list": ["custom:a", "custom:b"]}], ["x"])
    assert all(math.isnan(v) for v in out["accuracy"].values())
    assert out["unsupported"] == {"instructions": 2, "prompts": 1, "ids": {"custom:a": 1, "custom:b": 1}}


def test_paired_difference_by_hand():
    """Two prompts: p1 has 2 instructions (first follows both, second none), p2 one (first fails, second follows).
    Instruction level: (2 − 1)/3 overall; resamples {p1, p1} 4/4, {p2, p2} −2/2, {p1, p2} 1/3, so [−1, 1]. Prompt
    level: per-prompt differences 1 and −1, mean 0, resample means −1, 0, 1."""
    rows = [ROWS[0], ROWS[1]]
    first = score_responses(rows, ['"no comma here"', "a, b"])
    second = score_responses(rows, ["a, b", "fine"])
    out = paired_difference(first, second, n_boot=400)
    assert out["instruction_strict"]["first"] == pytest.approx(2 / 3)
    assert out["instruction_strict"]["second"] == pytest.approx(1 / 3)
    assert out["instruction_strict"]["difference"] == pytest.approx(1 / 3)
    assert out["instruction_strict"]["ci"] == pytest.approx([-1.0, 1.0])
    assert out["prompt_strict"]["difference"] == 0.0 and out["prompt_strict"]["ci"] == pytest.approx([-1.0, 1.0])
    same = paired_difference(first, first, n_boot=50)
    assert all(same[m]["difference"] == 0.0 and same[m]["ci"] == [0.0, 0.0] for m in METRICS)
    with pytest.raises(ValueError, match="different prompts"):
        paired_difference(first, score_responses([ROWS[1], ROWS[0]], ["a", "b"]))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"line 2: not valid JSON"),
        ('["a"]', r"line 2: a row must be a JSON object, got list"),
        ('{"prompt": "x", "instruction_id_list": [], "kwargs": []}', r"line 2: field 'key' is missing"),
        ('{"key": 1, "prompt": "x", "instruction_id_list": ["a"], "kwargs": [{}]}', r"\(key 1\): field 'key' repeats"),
        ('{"key": 9, "instruction_id_list": ["a"], "kwargs": [{}]}', r"line 2 \(key 9\): field 'prompt' is missing"),
        ('{"key": 9, "prompt": "x", "kwargs": [{}]}', r"\(key 9\): field 'instruction_id_list' is missing"),
        ('{"key": 9, "prompt": "x", "instruction_id_list": ["a"]}', r"\(key 9\): field 'kwargs' is missing"),
        ('{"key": 9, "prompt": " ", "instruction_id_list": ["a"], "kwargs": [{}]}', r"field 'prompt' must be"),
        ('{"key": 9, "prompt": "x", "instruction_id_list": [], "kwargs": []}', r"'instruction_id_list' must be a non"),
        (
            '{"key": 9, "prompt": "x", "instruction_id_list": ["a", "b"], "kwargs": [{}]}',
            r"'kwargs' must be a list of 2",
        ),
        (
            '{"key": 9, "prompt": "x", "instruction_id_list": ["a", "keywords:existence"], "kwargs": [{}, {}]}',
            r"\(key 9\): field 'kwargs\[1\]' \(keywords:existence\): kwargs.keywords is missing",
        ),
    ],
)
def test_bad_rows_are_refused_by_line_key_and_field(tmp_path, line, message):
    good = json.dumps({"key": 1, "prompt": "x", "instruction_id_list": ["custom:any"], "kwargs": [{}]})
    path = tmp_path / "data.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_ifeval(str(path))


def test_unknown_ids_are_read_and_an_empty_file_is_refused(tmp_path):
    rows = read_ifeval(_write(tmp_path / "data.jsonl", ROWS))
    assert rows == ROWS
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        read_ifeval(str(tmp_path / "empty.jsonl"))


class _Distinct(Utility):
    """u = distinct characters of the follower's reply: a real function of the text (never called here)."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([float(len(set(y))) for y in follower])


def _exported_follower(base_dir, out, seed, follower_only=False):
    """The follower of a DeepSMIDA game (or its follower-only ablation) as ``train.py export`` lays it out, with
    non-zero LoRA B (peft starts it at zero, where every adapter is the base): ``<out>/follower``."""
    from alignment_games.modules.checkpoints.export import export_module
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig

    game = DeepSMIDA(lm=ModelConfig(base_dir, lora_r=4), utility=_Distinct(), follower_only=follower_only)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in game.players.model.named_parameters():
            if ".follower." in name and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    assert export_module(game, out, players=["follower"]) == ["follower"]
    return str(out / "follower")


def test_load_policy_applies_the_exported_adapter(tiny_lm_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = _exported_follower(tiny_lm_dir, tmp_path / "export", seed=1)
    assert json.loads((tmp_path / "export" / "follower" / "export.json").read_text())["kind"] == "lora_adapter"
    ids = torch.tensor([[5, 6, 7, 8]])
    model, tokenizer = load_policy(folder)  # the base named by adapter_config.json
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), folder).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    with torch.no_grad():
        got, want, plain = model.eval()(ids).logits, reference(ids).logits, base(ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, plain, atol=1e-3)
    assert tokenizer.pad_token is not None
    full, _ = load_policy(tiny_lm_dir)  # a full model folder loads as it is
    with torch.no_grad():
        assert torch.equal(full.eval()(ids).logits, plain)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_policy(str(tmp_path / "nowhere"))


def test_command_scores_two_followers_and_their_difference(tiny_lm_dir, tmp_path, capsys):
    repeat = {"prompt_to_repeat": "Write a long poem about the sea and the sky, in twelve verses."}
    rows = [
        {
            "key": 10,
            "prompt": "Write a poem.",
            "instruction_id_list": ["combination:repeat_prompt", "keywords:letter_frequency"],
            "kwargs": [repeat, {"letter": "z", "let_frequency": 10, "let_relation": "less than"}],
        },
        {"key": 11, "prompt": "Say hi.", "instruction_id_list": [NO_COMMA, "custom:unknown"], "kwargs": [{}, {}]},
        {
            "key": 12,
            "prompt": "Count.",
            "instruction_id_list": ["keywords:letter_frequency"],
            "kwargs": [{"letter": "q", "let_frequency": 10, "let_relation": "less than"}],
        },
    ]
    data = _write(tmp_path / "ifeval.jsonl", rows)
    a = _exported_follower(tiny_lm_dir, tmp_path / "stackelberg", seed=1)
    b = _exported_follower(tiny_lm_dir, tmp_path / "follower_only", seed=2, follower_only=True)
    out = tmp_path / "ifeval.json"
    argv = ["--data", data, "--base", tiny_lm_dir, "--policy", f"stackelberg={a}", f"follower_only={b}"]
    argv += ["--max-new-tokens", "4"]
    report = main([*argv, "--n-boot", "200", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["settings"]["base_identity"] == base_identity(tiny_lm_dir)
    check_provenance(report, {"--data": data, "--base": tiny_lm_dir, "stackelberg": a, "follower_only": b})
    with pytest.raises(ValueError, match=f"--policy: '{b}' and '{b}/.' are the same path"):
        main(["--data", data, "--policy", f"x={b}", f"y={b}/."])
    other = build_tiny_causal_lm(tmp_path / "other", seed=1)  # the adapters' records name tiny_lm_dir
    with pytest.raises(ValueError, match=f"--policy '{a}'.*frozen base '{tiny_lm_dir}'.*given is '{other}'"):
        main(["--data", data, "--base", other, "--policy", f"x={a}"])
    assert set(json.loads(capsys.readouterr().out)) == {"stackelberg", "follower_only"}
    for name, folder in (("stackelberg", a), ("follower_only", b)):
        policy = dict(report["policies"][name])
        responses = [r["response"] for r in policy["results"]]
        assert all(len(r) <= 4 for r in responses)  # four byte tokens: at most four characters
        # the report is what the checkers say about the written responses
        assert {k: policy.pop(k) for k in ("folder", "path")} == {"folder": folder, "path": folder}
        weights = hashlib.sha256(open(f"{folder}/adapter_model.safetensors", "rb").read()).hexdigest()
        assert (policy.pop("sha256"), policy.pop("base_identity")) == (weights, base_identity(tiny_lm_dir))
        assert policy == score_responses(rows, responses)
        first = policy["results"][0]
        # four bytes never repeat a 60-character request; fewer than 10 z's holds whenever the reply is not blank
        assert first["strict"][0] is False and first["loose"][0] is False
        assert first["strict"][1] is bool(responses[0].strip())
        assert policy["unsupported"] == {"instructions": 1, "prompts": 1, "ids": {"custom:unknown": 1}}
    # each folder's own adapter answered: the same greedy replies as plain peft's unmerged model over the base
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignment_games.modules.evaluation.policy_accuracy import greedy_replies
    from alignment_games.modules.lm.prompts import QWEN_SYSTEM

    replies = {}
    for name, folder in (("stackelberg", a), ("follower_only", b)):
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), folder)
        prompts = [r["prompt"] for r in rows]
        replies[name] = greedy_replies(plain, AutoTokenizer.from_pretrained(folder), prompts, QWEN_SYSTEM, 4, 8)
        assert [r["response"] for r in report["policies"][name]["results"]] == replies[name]
    assert replies["stackelberg"] != replies["follower_only"]
    comparison = report["comparison"]
    assert (comparison["first"], comparison["second"]) == ("stackelberg", "follower_only")
    for metric in METRICS:
        acc_a = report["policies"]["stackelberg"]["accuracy"][metric]
        acc_b = report["policies"]["follower_only"]["accuracy"][metric]
        cell = comparison[metric]
        assert (cell["first"], cell["second"]) == (pytest.approx(acc_a), pytest.approx(acc_b))
        assert cell["difference"] == pytest.approx(acc_a - acc_b)
        assert -1.0 <= cell["ci"][0] <= cell["ci"][1] <= 1.0


def test_command_refuses_bad_arguments_before_generating(tiny_lm_dir, tmp_path):
    data = _write(tmp_path / "ifeval.jsonl", ROWS)
    with pytest.raises(SystemExit):
        main(["--data", data, "--policy", "no_equals_sign"])
    with pytest.raises(SystemExit):
        main(["--data", data, "--policy", f"a={tiny_lm_dir}", f"a={tiny_lm_dir}"])
    with pytest.raises(SystemExit):
        main(["--data", data, "--policy", f"a={tiny_lm_dir}", "--out", str(tmp_path / "missing" / "r.json")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": 1, "prompt": "x", "instruction_id_list": ["keywords:existence"], "kwargs": [{}]}\n')
    with pytest.raises(ValueError, match="line 1 .key 1.: field 'kwargs\\[0\\]'"):
        main(["--data", str(bad), "--policy", f"a={tiny_lm_dir}", "--out", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
