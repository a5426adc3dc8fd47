"""The base of the language-model games (GRPO, debate, deep-SMIDA, SLHF, NLHF, the pool), as torchgeo's BaseTask is."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import zip_longest
from typing import Any, ClassVar, TypeVar

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from alignment_games.callbacks.fault_tolerance import RNGStateCallback
from alignment_games.modules.checkpoints.export import Player, export_at_fit_end
from alignment_games.modules.checkpoints.trust import CheckpointLoading, check_checkpoint_matches, stamp_family
from alignment_games.modules.distributed.sharding import (
    check_manual_backward_strategy,
    grad_norm_after_step,
    gradient_sync,
    shard_for_strategy,
)
from alignment_games.modules.evaluation.tensorboard import GameBoard
from alignment_games.modules.lm.base_identity import check_base_identity
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.training.artifacts import atomic_write_text
from alignment_games.modules.training.faults import AutomaticStepGuard, NonFiniteGuard, refuse_nonfinite_checkpoint
from alignment_games.modules.training.optimizers import OptimizerCallable, build_optimizer, check_optimizer

G = TypeVar("G")

#: where a checkpoint records each policy bank's frozen base (alignment_games.modules.lm.base_identity)
BASE_IDENTITY_KEY = "base_identity"


def argument_group(cls: type[G], value: G | dict[str, Any], name: str) -> G:
    """``value`` itself, or the dataclass ``cls`` built from a dict of its fields (as a checkpoint's hparams hold it).

    Raises:
        ValueError: naming an unknown field of the group ``name``.
    """
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name}: expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(value) - known):
        raise ValueError(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**value)


class InjectedOptimizer(L.LightningModule):
    """A LightningModule with a family's ``optimizer`` option, checked on construction (:func:`check_optimizer`)."""

    def __init__(self, optimizer: OptimizerCallable | None = None) -> None:
        super().__init__()
        self.optimizer_callable = check_optimizer(optimizer)

    def make_optimizer(self, params: Any, lr: float, **adamw: Any) -> torch.optim.Optimizer:
        """The family's ``optimizer`` over ``params`` at ``lr`` (no weight decay by default)."""
        return build_optimizer(self.optimizer_callable, params, lr, **{"weight_decay": 0.0, **adamw})


class AutomaticFamily(CheckpointLoading, AutomaticStepGuard, InjectedOptimizer):
    """The base of the automatically optimised families (the preference ensemble, SFT), owning their shared arguments.

    A family takes them as ``**training`` and passes them on: they stay its config options, with this help.

    Args:
        max_consecutive_nonfinite: Non-finite batches skipped in a row that stop training.
        optimizer: The optimizer (:mod:`alignment_games.modules.training.optimizers`); ``None``: AdamW.
    """

    def __init__(self, max_consecutive_nonfinite: int = 10, optimizer: OptimizerCallable | None = None) -> None:
        super().__init__(optimizer)
        self.init_nonfinite_guard(max_consecutive_nonfinite)


class LanguageModelGame(CheckpointLoading, NonFiniteGuard, InjectedOptimizer):
    """Manual optimisation over :class:`PolicyBank` s, with the shared strategy, checkpoint and artifact code.

    A subclass sets :attr:`family`, builds its banks after ``super().__init__(...)``, keeps its state in
    :meth:`game_state`, kept non-trainable entries in :attr:`kept_state_prefixes`, TensorBoard extras in :attr:`board`.
    A family may take these arguments as ``**game`` and pass them on: they stay its config options, with this help.

    Args:
        grad_clip: Gradient norm clip per optimizer (``None``: none).
        max_consecutive_nonfinite: Stop after this many skipped steps in a row.
        log_samples: Samples per validation shown as text in TensorBoard (0: none).
        optimizer: Each player's optimizer (:mod:`alignment_games.modules.training.optimizers`); ``None``: AdamW.
    """

    family: ClassVar[str] = "language-model game"
    #: where the game's own state lives in a checkpoint
    state_key: ClassVar[str] = "game_state"
    #: non-trainable state-dict entries kept in checkpoints, by prefix
    kept_state_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        grad_clip: float | None = 1.0,
        max_consecutive_nonfinite: int = 10,
        log_samples: int = 4,
        optimizer: OptimizerCallable | None = None,
    ) -> None:
        super().__init__(optimizer)
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be positive or null, got {grad_clip}")
        self.automatic_optimization = False
        # frozen bases, judges and utilities are reloaded from their paths; on_load_checkpoint checks the rest
        self.strict_loading = False
        self.init_nonfinite_guard(max_consecutive_nonfinite)
        self.grad_clip = grad_clip
        self.phase_times: dict[str, float] = {}
        self.board = GameBoard(log_samples)
        self._base_hparams = dict(
            grad_clip=grad_clip, max_consecutive_nonfinite=max_consecutive_nonfinite, log_samples=log_samples
        )

    def save_arguments(self, lm: Any, ignore: Sequence[str] = (), **groups: type) -> None:
        """The caller's ``__init__`` arguments as plain hparams (weights-only loading); each group also an attribute."""
        frame = inspect.currentframe().f_back
        for name, cls in groups.items():
            value = frame.f_locals[name]
            setattr(self, name, None if value is None else argument_group(cls, value, name))
        self.save_hyperparameters(ignore=["lm", *groups, *ignore, "optimizer"], frame=frame)
        code = frame.f_code
        declared = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        self.hparams.update({k: v for k, v in self._base_hparams.items() if k not in declared})
        plain = {"lm": lm, **{name: getattr(self, name) for name in groups}}
        self.hparams.update({k: v and dataclasses.asdict(v) for k, v in plain.items()})

    def policy_banks(self) -> dict[str, PolicyBank]:
        """The game's policy banks by attribute name (sharded, fitted to the strategy, trimmed in checkpoints)."""
        return {name: m for name, m in self.named_children() if isinstance(m, PolicyBank)}

    def game_state(self) -> dict[str, Any]:
        """Plain values and tensors the game keeps across a resume (beyond the trainable weights)."""
        return {}

    def load_game_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`game_state` returned."""

    @override
    def configure_model(self) -> None:
        """Under FSDP2 shard each bank over the data-parallel mesh, one unit per decoder block; elsewhere nothing."""
        for bank in self.policy_banks().values():
            shard_for_strategy(self, bank, self.family)

    @override
    def setup(self, stage: str) -> None:
        if stage == "fit":
            check_manual_backward_strategy(self.trainer.strategy, self.family, self.grad_clip, self.num_optimizers())
        for bank in self.policy_banks().values():  # sharded strategies gather once per generate call
            bank.use_strategy(self.trainer.strategy)

    def num_optimizers(self) -> int:
        """How many optimizers ``configure_optimizers`` returns (DeepSpeed takes exactly one)."""
        return 1

    @override
    def configure_callbacks(self) -> list[L.Callback]:
        """Every checkpoint's generator states have one owner: :class:`~alignment_games.callbacks.RNGStateCallback`."""
        return [RNGStateCallback()]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Each step times its own phases (:meth:`log_phase_times`)."""
        self.phase_times = {}

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Write the step's buffered TensorBoard histograms when the step logs (see :attr:`board`)."""
        self.board.write_values_if_due(self)

    @override
    def on_validation_end(self) -> None:
        """Write the samples kept for TensorBoard (rank zero, TensorBoard logger only; see :attr:`board`)."""
        self.board.write_samples(self)

    def update(
        self,
        loss: Tensor | Callable[[], dict[str, Tensor] | None],
        optimizers: Any,
        parameters: Sequence[list[nn.Parameter] | None] = (),
        timed: bool = True,
    ) -> tuple[dict[str, Tensor], list[Tensor]] | None:
        """Every game's step: zero-grad, backward (``loss``, or a callable using :meth:`accumulate`), clipped steps.

        Returns the stats and each optimizer's norm before clipping over its ``parameters``; ``None``: not finite.
        """
        opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        for opt in opts:
            opt.zero_grad()
        with self._timed("backward") if timed else nullcontext():
            stats = loss() if callable(loss) else self.accumulate([(0, 1)], lambda *_: (loss, {}))
        if stats is None:
            for opt in opts:
                opt.zero_grad()
            return None
        with self._timed("optimizer") if timed else nullcontext():
            return stats, [self.optimizer_step(opt, params) for opt, params in zip_longest(opts, parameters)]

    def accumulate(
        self,
        chunks: Sequence[tuple[int, int]],
        loss_of: Callable[[int, int], tuple[Tensor, dict[str, Tensor]]],
        total_rows: int | None = None,
        reduce: Callable[[float], float] | None = None,
        what: str = "losses",
    ) -> dict[str, Tensor] | None:
        """Forward and backward of row ranges ``chunks``; the summed loss and stats, or ``None`` (non-finite ``what``).

        ``loss_of(start, stop)`` gives its rows' loss and detached stats, weighted by their share of ``total_rows``.
        Gradients sync on the last chunk only; with ``reduce`` never: ``reduce(loss)`` sums gradients and loss instead.
        """
        num_rows, banks = chunks[-1][1] if chunks else 0, list(self.policy_banks().values())
        total: dict[str, Any] = {}
        for start, stop in chunks:
            with gradient_sync(self._trainer, self, banks, enabled=reduce is None and stop >= num_rows):
                loss, stats = loss_of(start, stop)
                if reduce is None and not self.check_finite(loss.detach(), what):  # same decision on every rank
                    return None
                weight = (stop - start) / total_rows if total_rows else 1.0
                self.manual_backward(loss * weight)
            loss = loss.detach() if reduce is None else float(loss.detach())  # summed as the caller reduces it
            for key, value in {"loss": loss, **stats}.items():
                total[key] = total.get(key, 0.0) + weight * value
        if reduce is not None:
            total["loss"] = reduce(total.get("loss", 0.0))
            if not self.check_finite(torch.tensor(total["loss"]), what):
                return None
        return total

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to :attr:`phase_times` ``[phase]`` (CUDA synchronised around it)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda device: None
        sync(self.device)
        start = time.perf_counter()
        yield
        sync(self.device)
        self.phase_times[phase] = self.phase_times.get(phase, 0.0) + time.perf_counter() - start

    def log_phase_times(self, batch_size: int, step_total: bool = False, **extra: float) -> None:
        """Log the step's timed phases as ``time/<phase>`` (seconds), their sum as ``time/step`` and ``extra``."""
        if step_total:
            self.phase_times["step"] = sum(self.phase_times.values())
        self.phase_times.update(extra)
        self.log_dict({f"time/{k}": float(v) for k, v in self.phase_times.items()}, batch_size=batch_size)

    def optimizer_step(self, optimizer: Any, parameters: list[nn.Parameter] | None = None) -> Tensor:
        """Clip by :attr:`grad_clip` and step; the 2-norm before clipping (NaN, nothing stepped, for a NaN or inf)."""
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        params = parameters if parameters is not None else stepped
        # every parameter the step would move, not only ``parameters`` (the norm's): a NaN anywhere must not land
        if not self.check_gradients(stepped):
            optimizer.zero_grad(set_to_none=True)
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None and scaler.is_enabled():
                # fp16 "16-mixed": its GradScaler never sees this overflow (its step is not called), so lower its
                # scale here as its own step would have; else the next steps overflow again
                scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            return torch.full((), float("nan"))
        norm = self.grad_norm(params)
        if self.grad_clip is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.grad_clip, gradient_clip_algorithm="norm")
        optimizer.step()
        self.record_update()
        return grad_norm_after_step(self.trainer.strategy, norm)

    @staticmethod
    def grad_norm(parameters: Sequence[nn.Parameter]) -> Tensor:
        """Total 2-norm of the gradients present (0 without any), as the clip measures it."""
        grads = [p.grad for p in parameters if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def trainable_state_names(self) -> set[str]:
        """State-dict names of every trainable tensor of the banks."""
        return {
            f"{attr}.{name}"
            for attr, bank in self.policy_banks().items()
            for name, p in bank.named_parameters()
            if p.requires_grad
        }

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the trainable tensors, game state, family and each bank's base; refuse NaN or inf (``RuntimeError``)."""
        keep = self.trainable_state_names()
        if (state_dict := checkpoint.get("state_dict")) is not None:  # DeepSpeed keeps weights in its own files
            for name in list(state_dict):
                if name not in keep and not name.startswith(self.kept_state_prefixes):
                    del state_dict[name]
        checkpoint[self.state_key] = {"nonfinite": self.nonfinite_state(), **self.game_state()}
        checkpoint[BASE_IDENTITY_KEY] = {name: dict(bank.base_identity) for name, bank in self.policy_banks().items()}
        stamp_family(self, checkpoint)
        refuse_nonfinite_checkpoint(checkpoint, self.family)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another family, that does not fit, or of another base; restore the game state."""
        check_checkpoint_matches(self, checkpoint, self.trainable_state_names())
        banks = self.policy_banks()
        for name, stored in (checkpoint.get(BASE_IDENTITY_KEY) or {}).items():
            if name in banks:
                check_base_identity(stored, banks[name].base_identity, f"{self.family} ({name})")
        state = dict(checkpoint.get(self.state_key) or {})
        self.load_nonfinite_state(state.pop("nonfinite", None))
        self.load_game_state(state)

    def item_ids(self, batch: dict[str, Any], count: int) -> Tensor:
        """The dataset indices of an evaluation batch's ``count`` items (``batch["index"]``): each counted once.

        Raises:
            KeyError: the batch has no ``"index"``.
            ValueError: it holds another number of ids than items.
        """
        if "index" not in batch:
            raise KeyError(
                f"{type(self).__name__}: evaluation batches need each item's dataset index under 'index' (as"
                " alignment_games.datamodules.prompts.collate_prompts gives), to count every item once across processes"
            )
        ids = torch.as_tensor(batch["index"]).reshape(-1).long().to(self.device)
        if ids.numel() != count:
            raise ValueError(f"{type(self).__name__}: {ids.numel()} ids under 'index' for {count} items")
        return ids

    def artifact_dir(self) -> str:
        """The run's log folder, from the first logger (``trainer.log_dir`` is a broadcast rank 0 alone cannot call)."""
        logger = self.trainer.loggers[0] if self.trainer.loggers else None
        folder = None if logger is None else getattr(logger, "log_dir", None) or logger.save_dir
        return folder or self.trainer.default_root_dir

    @rank_zero_only
    def write_artifact(self, name: str, content: str | dict[str, Any] | list[Any]) -> str | None:
        """Write text, or JSON (a dict gets ``provenance``), atomically to ``<log dir>/<name>`` (rank 0, no dev run)."""
        if self.trainer.fast_dev_run:
            return None
        if isinstance(content, dict):
            from alignment_games.modules.evaluation.audit import run_provenance

            content = {**content, "provenance": run_provenance(self.trainer, self)}
        path = os.path.join(self.artifact_dir(), name)
        atomic_write_text(path, content if isinstance(content, str) else json.dumps(content, indent=2))
        return path

    def export_players(self) -> list[Player]:
        """Every bank's players: LoRA adapters over the bank's base, or (``players: separate``) full copies."""
        return [
            Player(n, b.lm, b.model if b.mode == "lora" else b.models[n], n if b.mode == "lora" else None, b.tokenizer)
            for b in self.policy_banks().values()
            for n in b.player_names
        ]

    @override
    def on_fit_end(self) -> None:
        """Export players to ``<log dir>/export/`` (:mod:`alignment_games.modules.checkpoints.export`; all ranks)."""
        export_at_fit_end(self, self.artifact_dir() if self.trainer.is_global_zero else None, self.family)
