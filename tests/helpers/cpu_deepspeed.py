"""The suite's DeepSpeed strategy (``SafeDeepSpeedStrategy``) on CPU processes (gloo), for the tests only.

Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA in three places, none of which touches what the
tests check: ``setup_environment`` (an isinstance check), ``setup_distributed`` (device indices must equal the local
ranks) and ``root_device`` (its index is DeepSpeed's device rank, ``None`` for the CPU device; ``cpu:<local rank>``
is the same device with the index DeepSpeed needs, for training and for the inference engine of validate/test).
:class:`CPUDeepSpeedStrategy` replaces just those with their CPU meaning; DeepSpeed's CPU accelerator then runs over
gloo. Everything else is the real thing: the ZeRO config, parameter partitioning (stage 3), the engine's forward,
backward and step under Lightning's manual optimization, and the families' own code (gathering for generation).

:class:`ShardProbe` (used for the FSDP2 runs too, where a rank holds the local shards of ``DTensor`` parameters)
writes, per rank, what the tests read back: the parameters each rank held inside the training steps
(0 elements for a partitioned ZeRO-3 parameter), per ``generate`` call the least it held at any model call inside it
(the whole bank when the weights stayed gathered for every decoded token), and the adapters' final values (gathered).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from alignment_games.modules.distributed.deepspeed_checkpoints import SafeDeepSpeedStrategy


class CPUDeepSpeedStrategy(SafeDeepSpeedStrategy):
    """``SafeDeepSpeedStrategy`` (atomic, weights-only saves) with its CUDA-only checks given their CPU meaning."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)


class ShardProbe(L.Callback):
    """Record sharding inside the training steps and generation, then the gathered adapters, to ``out_dir``."""

    def __init__(self, out_dir: str, bank_attr: str = "players") -> None:
        self.out_dir, self.bank_attr = out_dir, bank_attr
        self.record: dict[str, Any] = {"held_in_steps": [], "total": 0, "generate_whole": []}

    def setup(self, trainer, pl_module, stage) -> None:
        bank = getattr(pl_module, self.bank_attr)
        self.record["total"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in bank.parameters())  # global sizes
        generate = bank.generate

        def probed(*args, **kwargs):
            # what the rank holds of the bank at every model call inside generate (each decoded token's included)
            held = []

            def look(m, a):
                held.append(_held(bank))
                self.record["generate_dtype"] = str(m.weight.dtype)

            # the input embedding runs in every model call, through generate's own loop or ours
            handle = bank.model.get_input_embeddings().register_forward_pre_hook(look)
            try:
                return generate(*args, **kwargs)
            finally:
                handle.remove()
                self.record["generate_whole"].append(min(held) if held else -1)
                self.record["generate_calls"] = self.record.get("generate_calls", 0) + len(held)

        bank.generate = probed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        bank = getattr(pl_module, self.bank_attr)
        self.record["held_in_steps"].append(_held(bank))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self.on_fit_end(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        bank = getattr(pl_module, self.bank_attr)
        params = {n: p for n, p in bank.named_parameters() if "lora_" in n}
        with _gathered(list(params.values())) as whole:
            self.record["adapters"] = {n: p.detach().float().flatten().tolist() for n, p in zip(params, whole)}
        self.record["global_step"] = trainer.global_step
        norm = trainer.callback_metrics.get("train/grad_norm")
        self.record["grad_norm"] = None if norm is None else float(norm)
        engine = trainer.strategy.model
        if hasattr(engine, "gradient_clipping"):  # the clip DeepSpeed applies in its step
            self.record["engine_gradient_clipping"] = float(engine.gradient_clipping())
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.record, f)


def _held(bank: torch.nn.Module) -> int:
    """Elements of ``bank``'s parameters this rank holds: 0 for a partitioned ZeRO-3 parameter, the local shard of an
    FSDP2 ``DTensor`` (an unsharded FSDP2 unit's parameters are plain whole tensors)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in bank.parameters())


@contextmanager
def _gathered(params: list[torch.nn.Parameter]):
    if any(hasattr(p, "full_tensor") for p in params):  # FSDP2 DTensor shards: each gathered to its whole value
        yield [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    elif any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            yield params
    else:
        yield params
