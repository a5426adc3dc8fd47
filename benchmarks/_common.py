"""What several benchmarks share: model shapes, a quiet one-device Lightning trainer that keeps each step's phase
times, worker processes that hand back one JSON line, and TRL's ``GRPOTrainer`` set up as this suite runs GRPO.

Only the standard library is imported here at the top (``gpu_bench.py``'s driver imports this module); torch,
Lightning and TRL are imported by the functions that use them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager

#: Qwen2.5-0.5B's widths (vocabulary 151,936, hidden 896, 14/2 heads, intermediate 4,864, tied embeddings); each
#: benchmark adds its depth and context length
QWEN25_05B = {
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
#: the small random decoder the step benchmarks train when no ``--policy`` is given
TINY_POLICY = {"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3}
#: the two shapes of the judge and pool decode benchmarks (``q05b``'s depth is their ``--layers``)
SHAPES = {
    "tiny": {**TINY_POLICY, "max_position_embeddings": 4096},
    "q05b": {**QWEN25_05B, "max_position_embeddings": 32768},
}


def tiny_policy() -> str:
    """:data:`TINY_POLICY` random-initialised with the suite's byte tokenizer, saved under the temp folder."""
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    return build_tiny_causal_lm(os.path.join(tempfile.gettempdir(), "ag_bench_tiny"), config=TINY_POLICY)


def build_shape(shape: str, layers: int, name: str) -> tuple[str, dict]:
    """The random model of ``SHAPES[shape]`` (``q05b`` with ``layers`` blocks), saved under the temp folder as
    ``<name>_<shape>_<layers>`` (reused if there): its folder and its config."""
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    config = dict(SHAPES[shape])
    if shape == "q05b":
        config["num_hidden_layers"] = layers
    path = build_tiny_causal_lm(os.path.join(tempfile.gettempdir(), f"{name}_{shape}_{layers}"), config)
    return path, config


def add_shape_options(parser, repeats: int) -> None:
    """``--layers`` (of the q05b shape), ``--repeats``, ``--threads``: the options each shape benchmark ends with."""
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks of the q05b shape (24: real depth)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def run_shapes(args, run: Callable[[str, object], dict], show: Callable[[dict], None]) -> None:
    """Set ``--threads`` (0: torch's default), print the host line, ``show`` each of ``--shapes``' ``run(shape,
    args)``, then print one JSON line of the host and the results."""
    import torch
    from _host import host, host_line  # a sibling: the shape benchmarks run as scripts

    if args.threads:
        torch.set_num_threads(args.threads)
    info = host()
    print(host_line(info))
    results = []
    for shape in args.shapes.split(","):
        results.append(run(shape, args))
        show(results[-1])
    print(json.dumps({"host": info, "results": results}))


def quiet_trainer(max_steps: int, root: str, callbacks: list, accelerator: str = "auto"):
    """A one-device Lightning trainer for ``max_steps`` training steps: no logger, checkpoints, progress bar, model
    summary or validation; what a family writes at the end of fit lands under ``root``, not in the working folder."""
    import lightning as L

    flags = ("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary")
    quiet = {**dict.fromkeys(flags, False), "limit_val_batches": 0, "num_sanity_val_steps": 0, "devices": 1}
    return L.Trainer(max_steps=max_steps, default_root_dir=root, callbacks=callbacks, accelerator=accelerator, **quiet)


def fit_phases(model, data, max_steps: int, root: str, accelerator: str = "auto", each=None) -> list[dict]:
    """Fit ``model`` on ``data`` (dataloader or datamodule) in a :func:`quiet_trainer`; a copy of the model's
    ``phase_times`` after each training step, passed as it grows to ``each`` when given."""
    import lightning as L

    steps: list[dict] = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            steps.append(dict(pl_module.phase_times))
            if each is not None:
                each(steps)

    quiet_trainer(max_steps, root, [Collect()], accelerator).fit(model, data)
    return steps


def step_parser(doc: str, role: str) -> argparse.ArgumentParser:
    """The step benchmarks' command line: ``--policy`` (default: :func:`tiny_policy`), ``--dtype``, ``--b`` (prompts
    per step), ``--tokens``, ``--steps``, ``--threads``, and the hidden ``--<role>`` that makes a process a worker."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(f"--{role}", default=None, help=argparse.SUPPRESS)
    return ap


def parse_or_work(parser: argparse.ArgumentParser, role: str, work: Callable[[argparse.Namespace], dict]):
    """Parse the command line. A worker (``--<role>`` given) prints ``work(args)`` as one JSON line and gets None;
    the driver gets its arguments."""
    args = parser.parse_args()
    if getattr(args, role) is None:
        return args
    print(json.dumps(work(args)))
    return None


def worker_argv(args, leave_out: tuple[str, ...] = ()) -> list[str]:
    """``args`` as options again (``--name=value``; a set flag as ``--name``), but for ``leave_out`` and unset ones."""
    argv = []
    for name, value in vars(args).items():
        if name in leave_out or value is None or value is False:
            continue
        argv.append(f"--{name}" if value is True else f"--{name}={value}")
    return argv


def worker_json(script: str, argv: list[str]) -> dict:
    """Run ``script`` with ``argv`` in a fresh offline Python process; the JSON of its last stdout line (raises
    ``CalledProcessError`` when it fails)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trl_grpo_trainer(paths: dict, prompts: list[str], args, batch: int, group: int, tokens: int, **settings):
    """TRL's ``GRPOTrainer`` on the same work as this suite's GRPO step: ``paths``' policy and reward models, the
    whole batch (``batch`` prompts x ``group``) in one micro-batch, one update per rollout, ``tokens`` new tokens on
    every row, the clipped loss at β ``args.beta`` (0.04 if absent), LoRA r ``args.lora_r`` (8), nothing logged or
    saved; ``settings`` add to or override these ``GRPOConfig`` fields."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    r = getattr(args, "lora_r", 8)
    fields = {
        "output_dir": os.path.join(args.workdir, "trl_out"),
        "use_cpu": args.device == "cpu",
        "seed": getattr(args, "seed", 0),
        "max_steps": 1,
        "per_device_train_batch_size": batch * group,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "num_generations": group,
        "max_completion_length": tokens,
        "generation_kwargs": {"min_new_tokens": tokens},
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "beta": getattr(args, "beta", 0.04),
        "epsilon": 0.2,
        "loss_type": "grpo",
        "learning_rate": getattr(args, "lr", 1e-5),
        "max_grad_norm": 1.0,
        "gradient_checkpointing": False,
        "shuffle_dataset": False,
        "dataloader_num_workers": 0,
        "logging_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "log_completions": False,
    }
    return GRPOTrainer(
        model=paths["policy"],
        reward_funcs=list(paths["rewards"]),
        args=GRPOConfig(**{**fields, **settings}),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        peft_config=LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM"),
    )


def trl_phases(trainer, phase: Callable[[str], AbstractContextManager], count: Callable[[float], None]):
    """Run TRL's generation, scoring and reference log-probabilities (its no-grad calls of the per-token
    log-probabilities) each inside ``phase(name)``, and ``count`` the completion tokens of every prepared batch.

    Returns the wrapper, ``wrap(name, fn)``, for the caller's further phases."""
    import torch

    def wrap(name: str, fn, only_no_grad: bool = False):
        def wrapper(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            with phase(name):
                return fn(*a, **k)

        return wrapper

    prepare = trainer._prepare_inputs

    def prepare_and_count(*a, **k):
        inputs = prepare(*a, **k)
        count(float(inputs["completion_mask"].sum()))
        return inputs

    trainer._generate = wrap("generate", trainer._generate)
    trainer._calculate_rewards = wrap("score", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = wrap(
        "ref_logprobs", trainer._get_per_token_logps_and_entropies, only_no_grad=True
    )
    trainer._prepare_inputs = prepare_and_count
    return wrap
