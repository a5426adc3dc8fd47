"""SafeDeepSpeedStrategy: Lightning's DeepSpeed strategy with atomic saves and weights-only loads.

Only DeepSpeed's own classes (:data:`ALLOWED_GLOBALS`) may be unpickled; what cannot be read that way is refused.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from alignment_games.modules.training.artifacts import recover_folder_on_rank_zero, saved_beside


def _allowed_globals() -> list[Any]:
    """What DeepSpeed pickles beyond tensors: the loss scaler, the ZeRO stage, (ZeRO-1/2) fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


ALLOWED_GLOBALS: list[Any] = []  #: filled on first use (importing DeepSpeed is slow); see :func:`_allowed_globals`


class _WeightsOnlyEngine:
    """A DeepSpeed checkpoint engine that loads with ``torch.load(weights_only=True)``; the rest is the inner one's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        if not ALLOWED_GLOBALS:
            ALLOWED_GLOBALS.extend(_allowed_globals())
        try:
            with torch.serialization.safe_globals(ALLOWED_GLOBALS):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:  # torch's message names the global; this one names the file too
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            named = found.group(1) if found else str(err)
            raise pickle.UnpicklingError(
                f"DeepSpeed checkpoint file {os.fspath(path)!r} refused: it names {named}, which is neither a tensor "
                "nor one of DeepSpeed's own checkpoint classes (a checkpoint is loaded weights-only, never as code)"
            ) from err

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _tag(path: str) -> str:
    """The checkpoint folder ``latest`` names inside ``path``; a name that leads elsewhere is refused."""
    with open(os.path.join(path, "latest")) as f:
        tag = f.read().strip()
    inside = os.path.join(path, tag)
    if not tag or os.sep in tag or (os.altsep and os.altsep in tag) or tag in (".", "..") or not os.path.isdir(inside):
        raise ValueError(
            f"DeepSpeed checkpoint {path!r}: its 'latest' file names {tag!r}, which is not a folder inside the "
            "checkpoint (refused: a checkpoint is read only from its own folder)"
        )
    return tag


def check_deepspeed_checkpoint(path: str | os.PathLike, stage_3: bool = False, fitting: bool = True) -> str:
    """Refuse a DeepSpeed checkpoint folder that cannot be loaded whole and pickle-free; returns its tag.

    Raises:
        FileNotFoundError: naming the path when it is not a DeepSpeed checkpoint folder.
        ValueError: naming the path and the reason for a universal or MoE checkpoint, a ZeRO-3 load outside ``fit``
            (deepspeedai/DeepSpeed#7272) or a ``latest`` that leads outside the folder.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "latest_universal")):
        raise ValueError(
            f"DeepSpeed checkpoint {path!r} is a universal checkpoint: refused (its files are loaded by DeepSpeed "
            "with weights_only=False, outside the safe reader); resume from the checkpoint the run wrote"
        )
    if not os.path.isfile(os.path.join(path, "latest")):
        raise FileNotFoundError(f"{path!r} is not a DeepSpeed checkpoint folder (no 'latest' file in it)")
    tag = _tag(path)
    if any(n.startswith(("expert_", "layer_")) for n in os.listdir(os.path.join(path, tag))):
        raise ValueError(
            f"DeepSpeed checkpoint {path!r} holds MoE expert or pipeline layer files: refused (the suite's models "
            "have neither, and DeepSpeed reads those files outside the safe reader)"
        )
    if stage_3 and not fitting:
        raise ValueError(
            f"DeepSpeed checkpoint {path!r} is ZeRO-3: DeepSpeed cannot load it outside `fit` "
            "(deepspeedai/DeepSpeed#7272); convert it with lightning.pytorch.utilities.deepspeed."
            "convert_zero_checkpoint_to_fp32_state_dict and test the converted file without ZeRO-3"
        )
    return tag


def read_deepspeed_client_state(path: str | os.PathLike) -> dict[str, Any]:
    """The Lightning state of a DeepSpeed checkpoint folder (rank 0's model-states file, weights-only, no tensors)."""
    path = os.fspath(path)
    tag = check_deepspeed_checkpoint(path)
    folder = os.path.join(path, tag)
    states = sorted(n for n in os.listdir(folder) if n.endswith("_model_states.pt"))
    if not (names := [n for n in states if n.startswith("mp_rank_")] or states):
        raise FileNotFoundError(f"DeepSpeed checkpoint {path!r} has no model-states file in {tag}/")
    state = _WeightsOnlyEngine(None).load(os.path.join(folder, names[0]), map_location="cpu")
    return {k: v for k, v in state.items() if k != "module"}


class SafeDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` whose checkpoints are written atomically and read weights-only (module docstring)."""

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its DeepSpeed files into a folder beside ``filepath``; rank 0 then swaps it in."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        with saved_beside(self, filepath, "deepspeed") as tmp:
            super().save_checkpoint(checkpoint, tmp)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a DeepSpeed checkpoint folder (or, with ``load_full_weights``, one file) weights-only.

        Raises:
            ValueError: for ``weights_only=False``, and for a checkpoint :func:`check_deepspeed_checkpoint` refuses.
        """
        if weights_only is False:
            raise ValueError(
                f"weights_only: {type(self).__name__} reads checkpoints with weights_only=True only "
                "(no pickled code from a checkpoint folder)"
            )
        path = self.broadcast(str(checkpoint_path))
        recover_folder_on_rank_zero(self, path, "deepspeed_load_recovered")
        if self.load_full_weights and self.zero_stage_3 and os.path.isfile(path):
            return super().load_checkpoint(path, weights_only=True)  # one file, through the checkpoint IO
        module = self.lightning_module
        fitting = module is None or module.trainer.state.fn == TrainerFn.FITTING
        check_deepspeed_checkpoint(path, stage_3=self.zero_stage_3, fitting=fitting)
        engine = self.deepspeed_engine
        if getattr(engine, "has_moe_layers", False) or engine.load_universal_checkpoint():
            raise ValueError(
                f"DeepSpeed checkpoint {path!r}: refused, the engine is configured for "
                f"{'MoE layers' if engine.has_moe_layers else 'universal checkpoints'}, whose files DeepSpeed reads "
                "outside the safe reader"
            )
        inner = engine.checkpoint_engine
        engine.checkpoint_engine = _WeightsOnlyEngine(inner)  # DeepSpeed's files read with weights_only=True
        try:
            return super().load_checkpoint(path, weights_only=True)
        finally:
            engine.checkpoint_engine = inner


def safe_deepspeed_strategy(strategy: Any) -> Any:
    """The strategy ``train.py`` runs: a ``deepspeed*`` name becomes :class:`SafeDeepSpeedStrategy`, others stay.

    Raises:
        ValueError: naming ``trainer.strategy`` for Lightning's own ``DeepSpeedStrategy`` (or a non-safe subclass).
    """
    if isinstance(strategy, str) and strategy.startswith("deepspeed") and strategy in StrategyRegistry:
        return SafeDeepSpeedStrategy(**StrategyRegistry[strategy]["init_params"])
    if isinstance(strategy, DeepSpeedStrategy) and not isinstance(strategy, SafeDeepSpeedStrategy):
        raise ValueError(
            f"trainer.strategy: {type(strategy).__module__}.{type(strategy).__qualname__} is refused: Lightning's "
            "DeepSpeedStrategy writes checkpoints in place (a kill tears them) and loads them with weights_only=False. "
            "Use alignment_games.modules.distributed.deepspeed_checkpoints.SafeDeepSpeedStrategy (same arguments) or a "
            "name such as deepspeed_stage_2"
        )
    return strategy
