"""FSDP2Strategy: ``ModelParallelStrategy`` with every process data-parallel, loading partial checkpoints."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

#: the dtypes FSDP2 mixed precision may name (param_dtype, reduce_dtype)
MIXED_PRECISION_DTYPES = ("float32", "bfloat16", "float16")
METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint folder


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``data_parallel_size`` = world size, ``tensor_parallel_size`` = 1).

    Sharded checkpoints are swapped in whole, read without unpickling code
    (:mod:`alignment_games.modules.distributed.dcp_safe`), refusing a missing trainable tensor or NaN/inf. Use
    ``param_dtype`` with ``precision: 32-true``.

    Args:
        save_distributed_checkpoint: Each rank writes its shards to a folder (True), or rank 0 writes one file (False).
        process_group_backend: ``"nccl"`` on GPUs, ``"gloo"`` on CPUs by default.
        timeout: Of collective operations.
        param_dtype: Dtype the parameters are gathered and computed in (None: their own).
        reduce_dtype: Dtype gradients are reduced in (None: ``param_dtype``'s).

    Raises:
        ValueError: naming the argument, for a dtype name not in ``MIXED_PRECISION_DTYPES``.
    """

    def __init__(
        self,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtypes = {}
        for field, name in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if name is not None and name not in MIXED_PRECISION_DTYPES:
                raise ValueError(f"{field}: unknown dtype {name!r}; one of {sorted(MIXED_PRECISION_DTYPES)}")
            dtypes[field] = None if name is None else getattr(torch, name)
        self.mixed_precision_policy = MixedPrecisionPolicy(**dtypes) if any(dtypes.values()) else None

    @override
    def setup_environment(self) -> None:  # every process data-parallel
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint beside ``filepath`` (``meta.pt`` on rank 0), then swap it in; or one file."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

        from alignment_games.modules.training.artifacts import saved_beside

        with saved_beside(self, filepath, "fsdp2") as tmp:
            converted = {"state_dict": checkpoint.pop("state_dict")}
            converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            _distributed_checkpoint_save(converted, Path(tmp))
            if self.global_rank == 0:
                torch.save(checkpoint, Path(tmp) / METADATA_FILE)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint's tensors and optimizer states in place; return ``meta.pt`` (weights only)."""
        if weights_only is False:
            raise ValueError(
                f"weights_only: {type(self).__name__} reads sharded checkpoints with weights_only=True only "
                "(no pickled code from a checkpoint folder)"
            )
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as states

        from alignment_games.modules.distributed.dcp_safe import SafeFileSystemReader as Reader
        from alignment_games.modules.distributed.dcp_safe import WeightsOnlyLoadPlanner, read_dcp_metadata
        from alignment_games.modules.training.artifacts import recover_folder_on_rank_zero
        from alignment_games.modules.training.faults import nonfinite_entries

        path = Path(self.broadcast(str(checkpoint_path)))
        recover_folder_on_rank_zero(self, path, "fsdp2_load_recovered")
        if not (path.is_dir() and (path / METADATA_FILE).is_file()):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = read_dcp_metadata(path).state_dict_metadata
        model_state = states.get_model_state_dict(self.model)
        present = {k: v for k, v in model_state.items() if f"state_dict.{k}" in saved}
        missing = sorted(n for n, p in self.model.named_parameters() if p.requires_grad and n not in present)
        if missing:  # before anything is loaded: the model is left as it was
            raise KeyError(
                f"checkpoint {path} lacks trainable tensors: {missing[:5]}{' …' if len(missing) > 5 else ''}"
            )
        dcp.load({"state_dict": present}, storage_reader=Reader(path), planner=WeightsOnlyLoadPlanner())
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optim_states = []
        for idx, optimizer in enumerate(self.optimizers if fitting else ()):  # test/validate: weights only
            key = f"optimizer_{idx}"
            if not any(name.startswith(f"{key}.") for name in saved):
                raise KeyError(f"checkpoint {path} holds no state for optimizer {idx} ({key})")
            optim_state = {key: states.get_optimizer_state_dict(self.model, optimizer)}
            # a trainable tensor that never had a gradient (e.g. an unused pooler) has no AdamW state to load
            dcp.load(optim_state, storage_reader=Reader(path), planner=WeightsOnlyLoadPlanner(allow_partial_load=True))
            optim_states.append(optim_state[key])
        # a NaN or inf anywhere stops the restore on every rank before the states are set: nothing continues from it
        found = nonfinite_entries({"state_dict": present, "optimizer_states": optim_states})
        if not self.reduce_boolean_decision(not found, all=True):
            where = f"in {found[0]}" if found else "in another rank's shards"
            raise ValueError(
                f"checkpoint {str(path)!r} holds NaN or inf {where}: it is not a state to continue from; resume from "
                "an earlier checkpoint"
            )
        loose = states.StateDictOptions(strict=False)
        states.set_model_state_dict(self.model, present, options=loose)
        for optimizer, optim_state in zip(self.optimizers if fitting else (), optim_states, strict=True):
            states.set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state, options=loose)
        checkpoint = torch.load(path / METADATA_FILE, weights_only=True)
        checkpoint["state_dict"] = present  # loaded already; named for the module's on_load_checkpoint
        return checkpoint
