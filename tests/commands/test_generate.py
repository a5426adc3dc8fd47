"""``alignment_games.commands.generate``: an exported adapter's reply, decoded as the suite decodes its own players."""

import json

import pytest
import torch
from helpers.threads import one_torch_thread

from alignment_games.commands import generate
from alignment_games.modules.checkpoints.export import export_module
from alignment_games.modules.grpo import GRPO
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling

PROMPTS = ["What is 2 + 3?", "Name a colour."]


@pytest.fixture(scope="module")
def trained(tiny_lm_dir, tmp_path_factory):
    """A GRPO policy with a non-zero adapter (peft starts LoRA B at zero), exported as a fit exports it."""
    torch.manual_seed(0)  # peft draws LoRA A from the global generator: the same adapter whatever ran before
    with one_torch_thread():
        model = GRPO(lm=ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), sampling=Sampling(max_new_tokens=8))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.players.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
        out = tmp_path_factory.mktemp("export") / "out"
        export_module(model, out)
        yield model.players, str(out / "policy")


def test_generate_prints_the_adapters_own_greedy_reply(trained, tiny_lm_dir, capsys):
    bank, folder = trained
    with one_torch_thread():
        replies = generate.main(
            [
                "--model",
                tiny_lm_dir,
                "--adapter",
                folder,
                "--max-new-tokens",
                "8",
                "--prompt",
                PROMPTS[0],
                "--prompt",
                PROMPTS[1],
            ]
        )
        prompts = [bank.chat("You are a helpful assistant.", p) for p in PROMPTS]
        own = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=8), greedy=True).texts
        base = generate.main(
            ["--model", tiny_lm_dir, "--max-new-tokens", "8", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
        )
    assert replies == own and all(replies)
    assert replies != base  # the adapter changes the reply, so the equality above can fail
    assert capsys.readouterr().out.startswith(f">>> {PROMPTS[0]}\n{replies[0]}\n>>> {PROMPTS[1]}\n")


def test_an_adapter_of_another_base_or_without_safetensors_is_refused(trained, tiny_llama_dir, tmp_path, capsys):
    _, folder = trained
    with pytest.raises(SystemExit) as done:  # export.json records the tiny Qwen2 as its base
        generate.main(["--model", tiny_llama_dir, "--adapter", folder, "--prompt", "x"])
    assert done.value.code == 2 and f"--adapter {folder}" in capsys.readouterr().err
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (tmp_path / "adapter_model.bin").write_bytes(b"a pickle is never read")
    with pytest.raises(SystemExit):
        generate.main(["--model", tiny_llama_dir, "--adapter", str(tmp_path), "--prompt", "x"])
    assert "adapter_model.safetensors does not exist" in capsys.readouterr().err
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8}))
    with pytest.raises(SystemExit):
        generate.main(["--model", tiny_llama_dir, "--adapter", str(tmp_path), "--prompt", "x"])
    assert (
        "r and lora_alpha must be positive integers, got {'lora_r': None, 'lora_alpha': 8}" in capsys.readouterr().err
    )
