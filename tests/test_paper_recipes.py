"""The paper-scale recipes (``configs/paper/*.yaml``, each composed after its family's config) hold the papers' values:
Table 2 (deep-SMIDA) and Table 3 (NLHF, SLHF) of the Stackelberg preference-games paper, App. C of the multi-LLM pool
paper, each value read from the paper's text in ``../shared/papers`` (beside the repository; required under CI=true)."""

import math
import os
import re

import pytest
import torch
import yaml
from helpers import ROOT

from alignment_games import train
from alignment_games.modules.base import InjectedOptimizer

PAPERS = os.path.join(os.path.dirname(ROOT), "shared", "papers")
CONFIGS = os.path.join(ROOT, "configs")
SCI = re.compile(r"(\d+(?:\.\d+)?)×10−\d+\1× 10\^-(\d+)")  # "8×10−68× 10^-6": the text doubles each figure
POWER = re.compile(r"10−\d+10\^-(\d+)")  # "10−610^-6"
PLAIN = re.compile(r"([\d,.]+)(?=\s|$)")  # "6363", "2,0002,000", "0.60.6"
WORDS = {"three": 3, "four": 4, "eight": 8}


def _paper(name: str, folder: str = PAPERS) -> str:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path} is missing: under CI=true the papers are beside the clone and must be checked")
        pytest.skip(f"{path} is not here (outside CI the shared papers are optional)")
    with open(path, encoding="utf-8") as f:
        return " ".join(f.read().split())


def _between(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i : text.index(end, i)]


def _numbers(table: str, label: str) -> list[float]:
    """The figures after ``label`` in a table of the paper's text (one a column), each written twice by the text."""
    rest, out = table[table.index(label) + len(label) :], []
    while True:
        rest = rest.lstrip()
        if m := SCI.match(rest):
            out.append(float(m[1]) * 10.0 ** -int(m[2]))
        elif m := POWER.match(rest):
            out.append(10.0 ** -int(m[1]))
        elif (m := PLAIN.match(rest)) and len(m[1]) % 2 == 0 and m[1][: len(m[1]) // 2] == m[1][len(m[1]) // 2 :]:
            out.append(float(m[1][: len(m[1]) // 2].replace(",", "")))
        else:
            return out
        rest = rest[m.end() :]


def _resolved(capsys, base: str, overlay: str) -> dict:
    with pytest.raises(SystemExit) as stop:
        train.main(
            [
                "fit",
                "--config",
                os.path.join(CONFIGS, base),
                "--config",
                os.path.join(CONFIGS, overlay),
                "--print_config",
            ]
        )
    assert stop.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_a_missing_paper_fails_under_ci_and_skips_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="x.txt is missing: under CI=true"):
        _paper("x.txt", str(tmp_path))
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="x.txt is not here"):
        _paper("x.txt", str(tmp_path))
    (tmp_path / "x.txt").write_text("a\n  b", encoding="utf-8")
    assert _paper("x.txt", str(tmp_path)) == "a b"  # present: read, whitespace collapsed


def test_the_number_reader_reads_the_texts_notations():
    table = "a 8×10−68× 10^-6 b 10−610^-6 c 2,0002,000 2,0002,000 d 1.01.0 e 5050 Next"
    assert [_numbers(table, k) for k in "abcde"] == [[8e-6], [1e-6], [2000.0, 2000.0], [1.0], [50.0]]
    assert _numbers("x 123 y", "x") == []  # a figure not written twice is not read


def _train_prompts(data: dict) -> int:
    return data["num_prompts"] - round(data["num_prompts"] * data["val_fraction"])


@pytest.mark.parametrize("family", ["nlhf", "slhf"])
def test_the_baselines_paper_recipe_is_table_3(family, capsys):
    text = _paper("stackelberg-preference-games.txt")
    table = _between(text, "Table 3: Training and generation settings", "Table 4:")
    column = 0 if family == "nlhf" else 1
    paper = {k: _numbers(table, k)[column] for k in ("Training prompts", "Training epochs", "Optimizer steps")}
    paper |= {k: _numbers(table, k)[column] for k in ("Prompts per optimizer step", "Prompts in final step")}
    paper |= {k: _numbers(table, k)[column] for k in ("Responses per prompt", "Sampling temperature", "Top-p")}
    paper["tokens"] = _numbers(table, "Maximum generated tokens per response")[column]
    assert paper == {
        **{"Training prompts": 2000, "Training epochs": 1, "Optimizer steps": 63, "Prompts per optimizer step": 32},
        **{"Prompts in final step": 16, "Responses per prompt": 2, "Sampling temperature": 0.6, "Top-p": 1.0},
        "tokens": 512,
    }  # what the header of configs/paper/<family>.yaml states
    cfg = _resolved(capsys, f"{family}.yaml", f"paper/{family}.yaml")
    model, data, trainer = cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]
    n, b = _train_prompts(data), data["batch_size"]
    assert (n, trainer["max_epochs"], b) == (paper["Training prompts"], paper["Training epochs"], b)
    assert (math.ceil(n / b), n - (math.ceil(n / b) - 1) * b) == (
        paper["Optimizer steps"],
        paper["Prompts in final step"],
    )
    assert b == paper["Prompts per optimizer step"]
    optimizers = 1 if family == "nlhf" else 2  # SLHF steps the leader and the follower on each batch
    assert trainer["max_steps"] == optimizers * paper["Optimizer steps"]
    d = model["samples_per_prompt"]
    responses = 2 * d if family == "nlhf" else d * (1 + model["follower_samples"])
    assert responses == paper["Responses per prompt"]
    sampling = model["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["max_new_tokens"]) == (
        paper["Sampling temperature"],
        paper["Top-p"],
        paper["tokens"],
    )
    assert "Both methods fully fine-tune Qwen2.5-1.5B-Instruct" in table
    assert (model["lm"]["players"], model["lm"]["name_or_path"]) == ("separate", "Qwen/Qwen2.5-1.5B-Instruct")


def test_the_deep_smida_paper_recipe_is_table_2(capsys):
    text = _paper("stackelberg-preference-games.txt")
    table = _between(text, "Table 2: Hyperparameters for training the Leader and Follower", "During warm-up")
    labels = {
        "leader_lr": "Leader learning rate ηLη^L",
        "follower_lr": "Follower learning rate ηFη^F",
        "initial_lr": "Initial learning rate (both policies)",
        "warmup_steps": "Warm-up steps",
        "tau": "KL coefficients τL,τFτ^L,τ^F",
        "weight_decay": "Weight decay",
        "grad_clip": "Maximum gradient norm",
        "prompts": "Training prompts",
        "epochs": "Training epochs",
        "steps": "Optimizer steps",
        "B": "Prompts per step B",
        "D": "Leader responses per prompt D",
        "M": "Follower responses per Leader response M",
        "temperature": "Sampling temperature",
        "top_p": "Top-p",
        "tokens": "Maximum generated tokens per response",
    }
    paper = {k: _numbers(table, label) for k, label in labels.items()}
    assert all(len(v) == 1 for v in paper.values()), paper
    paper = {k: v[0] for k, v in paper.items()}
    assert paper == pytest.approx(
        {"leader_lr": 8e-6, "follower_lr": 2e-5, "initial_lr": 1e-6, "warmup_steps": 50, "tau": 5e-4}
        | {"weight_decay": 0, "grad_clip": 1.0, "prompts": 2000, "epochs": 1, "steps": 500, "B": 4, "D": 4, "M": 4}
        | {"temperature": 0.6, "top_p": 1.0, "tokens": 1500}
    )  # what the header of configs/paper/deep_smida.yaml states
    assert "Optimizer AdamW" in table and "Parameter precision bfloat16" in table
    cfg = _resolved(capsys, "deep_smida.yaml", "paper/deep_smida.yaml")
    model, data, trainer = cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]
    (warmup,) = [c["init_args"] for c in trainer["callbacks"] if c["class_path"].endswith("TwoTimescaleWarmup")]
    assert (model["leader_lr"], model["follower_lr"]) == (paper["leader_lr"], paper["follower_lr"])
    assert (warmup["initial_lr"], warmup["warmup_steps"]) == (paper["initial_lr"], paper["warmup_steps"])
    assert model["tau_leader"] == model["tau_follower"] == paper["tau"]
    assert model["optimizer"] is None  # the family's AdamW without weight decay:
    optimizer = InjectedOptimizer(None).make_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["weight_decay"] == paper["weight_decay"]
    assert model["grad_clip"] == paper["grad_clip"]
    assert (model["lm"]["dtype"], model["lm"]["players"]) == ("bfloat16", "separate")  # full bf16 fine-tuning
    assert (_train_prompts(data), trainer["max_epochs"]) == (paper["prompts"], paper["epochs"])
    assert trainer["max_steps"] == 2 * paper["steps"]  # the leader's and the follower's step on each batch
    assert paper["prompts"] / data["batch_size"] == paper["steps"] and data["batch_size"] == paper["B"]
    assert (model["samples_per_prompt"], model["follower_samples"]) == (paper["D"], paper["M"])
    sampling = model["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["max_new_tokens"]) == (
        paper["temperature"],
        paper["top_p"],
        paper["tokens"],
    )
    assert model["system_prompt"] in text.replace("[System]: ", "")
    assert "Another assistant previously answered the user’s request as follows:" in text
    follower = model["follower_system_template"].replace("'", "’").split("\n")
    assert all(part in text for part in follower if "{leader_response}" not in part)


def _app_c(text: str, pattern: str) -> tuple:
    m = re.search(pattern, text)
    assert m, f"App. C no longer says {pattern!r}"
    return tuple(WORDS[g] if g in WORDS else float(g) for g in m.groups())


@pytest.mark.parametrize("base", ["pool_dpo.yaml", "pool_grpo.yaml"])
def test_the_pool_paper_recipe_is_app_c(base, capsys):
    text = _between(_paper("multi-llm-stackelberg-alignment.txt"), "C IMPLEMENTATION DETAILS", "D MODEL POOL")
    cfg = _resolved(capsys, base, "paper/pool.yaml")
    model = cfg["model"]["init_args"]
    reward, match, followers = model["leader_reward"], model["matchmaking"], model["followers"]
    assert _app_c(text, r"runs for (\w+) iterations over (\d+) instructions") == (
        cfg["trainer"]["max_epochs"],
        model["duels_per_iteration"],
    )
    assert _app_c(text, r"γ=(\d\.\d+)") == (model["gamma"],)
    assert _app_c(text, r"reward (\d\.\d+) rdiff \+ (\d\.\d+) rpref") == (
        reward["difficulty_weight"],
        reward["preference_weight"],
    )
    assert _app_c(text, r"annealed from (\d\.\d+) to (\d\.\d+);") == (reward["gap_start"], reward["gap_end"])
    assert _app_c(text, r"threshold (\d\.\d+)") == (reward["min_score"],)
    assert _app_c(text, r"bandwidth (\d\.\d+)") == (reward["bandwidth"],)
    assert _app_c(text, r"random opponents for (\d+)% of duels") == (100 * match["uniform_share"],)
    assert _app_c(text, r"from (\w+) candidate opponents") == (match["num_candidates"],)
    assert "DPO and GRPO both use LoRA" in text and model["lm"]["players"] == "lora"
    assert 10.0 ** -_app_c(text, r"learning rate of 10\^-(\d+)")[0] == followers["lr"]
    dpo = _app_c(text, r"DPO uses β=(\d\.\d+) and effective batch size (\d+)")
    assert dpo == (followers["pairwise"]["beta"], followers["batch_size"])
    pg = followers["policy_gradient"]
    grpo = _app_c(text, r"GRPO uses (\w+) rollout generations per prompt, β=(\d\.\d+), and clip ratio (\d\.\d+)")
    assert grpo == (pg["group_size"], pg["kl_coef"], pg["clip"])
    sampling = model["sampling"]
    assert _app_c(text, r"temperature (\d\.\d+) and top-p (\d\.\d+)") == (sampling["temperature"], sampling["top_p"])
    assert "peer judges score greedily" in text and model["judging"]["mode"] == "generate"


def test_no_config_calls_the_pools_rate_a_full_fine_tuning_rate():
    """App. C: the pool's 1e-6 is a LoRA rate (DPO and GRPO both use LoRA), not a full 7B fine-tuning rate."""
    for name in sorted(os.listdir(CONFIGS)):
        if name.endswith(".yaml"):
            with open(os.path.join(CONFIGS, name), encoding="utf-8") as f:
                assert "full 7B" not in f.read(), name
