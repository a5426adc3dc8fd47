"""``python -m alignment_games.commands.generate``: a trained policy's replies, decoded by the suite's own decoder.

    python -m alignment_games.commands.generate --model builtin:smollm2-135m-instruct \\
        --adapter runs/grpo_smollm2/version_0/export/policy --prompt "Ann has 3 pens. Then, Ann buys 4 more. ..."

The adapter folder is data: the base is ``--model`` (which its ``export.json`` must record, when it records one), the
tensors come from ``adapter_model.safetensors`` only, and no code runs.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import torch

from alignment_games.modules.lm.base_identity import check_base_identity
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling

PLAYER = "adapter"


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--adapter: {path}: not readable JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"--adapter: {path}: not a JSON object")
    return value


def load_policy(model: str, adapter: str | None) -> PolicyBank:
    """``model`` with the LoRA adapter of the folder ``adapter`` as the player ``"adapter"`` (or none).

    Raises:
        FileNotFoundError: naming an adapter folder without ``adapter_config.json`` or ``adapter_model.safetensors``.
        ValueError: naming the file when its base is not ``model``, or its tensors do not fit the adapter's config.
    """
    if adapter is None:
        return PolicyBank(ModelConfig(model), players=())
    files = [os.path.join(adapter, n) for n in ("adapter_config.json", "adapter_model.safetensors")]
    if missing := [path for path in files if not os.path.isfile(path)]:
        raise FileNotFoundError(f"--adapter: {missing[0]} does not exist (an exported adapter folder holds it)")
    config = _read_json(files[0])
    lora = {"lora_r": config.get("r"), "lora_alpha": config.get("lora_alpha")}
    if not all(isinstance(v, int) and v > 0 for v in lora.values()):
        raise ValueError(f"--adapter: {files[0]}: r and lora_alpha must be positive integers, got {lora}")
    lora["lora_extra"] = {k: True for k in ("use_rslora", "use_dora") if config.get(k) is True}  # they scale the update
    bank = PolicyBank(ModelConfig(model, **lora, lora_target_modules=config.get("target_modules")), [PLAYER])
    record = os.path.join(adapter, "export.json")
    if os.path.isfile(record) and isinstance(base := _read_json(record).get("base_identity"), dict):
        check_base_identity(base, bank.base_identity, f"--adapter {adapter}")
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    loaded = set_peft_model_state_dict(bank.model, load_file(files[1]), adapter_name=PLAYER)
    if loaded.unexpected_keys:
        raise ValueError(f"--adapter: {files[1]} holds tensors its config does not make: {loaded.unexpected_keys[:3]}")
    bank.requires_grad_(False)
    return bank


def generate(
    bank: PolicyBank, prompts: Sequence[str], system: str | None, sampling: Sampling, greedy: bool
) -> list[str]:
    """One reply per prompt (one user turn after ``system`` in the tokenizer's chat template)."""
    player = PLAYER if PLAYER in bank.player_names else None
    return bank.generate(player, [bank.chat(system, p) for p in prompts], 1, sampling, greedy=greedy).texts


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Command line: print each prompt's reply (greedy unless ``--temperature`` is above 0)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the base: a folder, a hub name or builtin:<alias>")
    parser.add_argument("--adapter", help="an exported LoRA adapter folder (export/<player>/ of a run)")
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeat for several)")
    parser.add_argument("--system", default="You are a helpful assistant.", help="the system message ('' for none)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0:
        parser.error("--max-new-tokens must be >= 1 and --temperature >= 0")
    try:
        bank = load_policy(args.model, args.adapter)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    torch.manual_seed(args.seed)
    sampling = Sampling(temperature=args.temperature or 1.0, max_new_tokens=args.max_new_tokens)
    replies = generate(bank, args.prompt, args.system or None, sampling, greedy=args.temperature == 0)
    for prompt, reply in zip(args.prompt, replies):
        print(f">>> {prompt}\n{reply}")
    return replies


if __name__ == "__main__":
    main()
