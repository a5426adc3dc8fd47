"""Nothing lost on a preemption: RNG states in every checkpoint, a checkpoint on SIGTERM, atomic checkpoint files."""

import contextlib
import os
import random
import re
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from alignment_games.callbacks.functional.digests import (
    read_sidecar,
    sha256_file,
    sidecar_of,
    verify_sidecar,
    write_sidecar,
)
from alignment_games.callbacks.functional.files import fsync_dir, os_error_behind, pid_alive, write_error
from alignment_games.callbacks.hooks import EvaluationBatchCallback


def collect_rng_state() -> dict[str, Any]:
    """The ``python``, ``numpy``, ``torch`` and (once initialised) ``cuda`` generator states (``weights_only``)."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "keys": list(keys), "gauss": gauss},
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators of this process to a state from :func:`collect_rng_state`.

    Raises:
        KeyError: if ``state`` lacks the ``python``, ``numpy`` or ``torch`` entry.
    """
    py = state["python"]
    random.setstate((py["version"], tuple(py["keys"]), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            rank_zero_warn("The checkpoint holds CUDA generator states for another set of devices; not restored.")


def rank_and_world() -> tuple[int, int]:
    """The process's rank and the world size under ``torch.distributed``; ``(0, 1)`` without a process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class RNGStateCallback(Callback):
    """Save every rank's generator states in each checkpoint and restore them when a run resumes.

    Rank ``r`` restores entry ``r``; a resume on a different number of ranks restores the ranks in both and warns.
    """

    @property
    @override
    def state_key(self) -> str:
        return "RNGStateCallback"

    @override
    def state_dict(self) -> dict[str, Any]:
        ranks: list[Any] = [collect_rng_state()] * rank_and_world()[1]
        if len(ranks) > 1:
            torch.distributed.all_gather_object(ranks, ranks[0])
        return {"ranks": ranks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks", [])
        rank, world = rank_and_world()
        if len(ranks) != world:
            rank_zero_warn(
                f"RNGStateCallback: the checkpoint holds generator states of {len(ranks)} rank(s), this run has "
                f"{world}; ranks beyond the saved ones keep their seeded states."
            )
        if rank < len(ranks):
            restore_rng_state(ranks[rank])


class CheckpointOnSigterm(EvaluationBatchCallback):
    """Write ``last.ckpt`` (:meth:`target_path`) when ``fit`` stops on SIGTERM, so a preempted run resumes from there.

    Nothing is written before the first step, during validation, at an epoch's last batch, on other exceptions, with
    ``fast_dev_run`` or outside ``fit``. Under DDP the handler only notes the signal (Lightning's broadcasts inside it
    and hangs); the ranks agree by one all-reduce at each batch end and stop together.
    """

    def __init__(self) -> None:
        super().__init__()
        self._signalled = False  # set by the handler (the signal came to this process), read where the ranks agree
        self._trainer: pl.Trainer | None = None  # set while this callback's handler replaces Lightning's (DDP)
        self._start_step: int | None = None  # the global step training started from in this run

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._signalled = True  # under DDP only noted: the ranks agree on it at the next point all reach (`_agree`)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:  # a signal noted at the end of fit still stops the test that follows it
            self._signalled, self._start_step = False, None
        if trainer.world_size == 1 or stage not in (TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING):
            return
        # Lightning registers its SIGTERM handler right after setup, as its notifier (the broadcast) followed by the
        # process's own handler; with this instance attribute the notifier it registers is ours (until teardown)
        connector = trainer._signal_connector
        if not callable(getattr(connector, "_sigterm_notifier_fn", None)):
            raise RuntimeError(
                f"CheckpointOnSigterm: Lightning {pl.__version__}'s signal connector has no _sigterm_notifier_fn, "
                "so its SIGTERM handler (a broadcast inside the handler, which hangs DDP) cannot be replaced"
            )
        connector._sigterm_notifier_fn = self._on_sigterm
        self._trainer = trainer

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._trainer is not None:
            vars(trainer._signal_connector).pop("_sigterm_notifier_fn", None)  # Lightning's own again
            self._trainer = None

    def _agree(self, trainer: pl.Trainer) -> None:
        """One all-reduce, where every rank is: any rank signalled sets Lightning's flag on all of them."""
        if self._trainer is not None and trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            trainer._signal_connector.received_sigterm = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step
        self._agree(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._agree(trainer)

    @override
    def on_evaluation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        self._agree(trainer)

    on_test_batch_end = EvaluationBatchCallback.on_validation_batch_end  # the same agreement point in a test loop

    @staticmethod
    def _model_checkpoint(trainer: pl.Trainer) -> ModelCheckpoint | None:
        return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)

    @staticmethod
    def target_path(trainer: pl.Trainer) -> str:
        """Where the SIGTERM checkpoint goes: the ``last`` file of the trainer's ``ModelCheckpoint`` folder."""
        ckpt = CheckpointOnSigterm._model_checkpoint(trainer)
        if ckpt is not None and ckpt.dirpath is not None:
            return os.path.join(ckpt.dirpath, ckpt.CHECKPOINT_NAME_LAST + ckpt.FILE_EXTENSION)
        # the logger's run folder, never the working directory (``trainer.log_dir`` is a collective under DDP)
        logger_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        return os.path.join(logger_dir or trainer.default_root_dir, "checkpoints", "last.ckpt")

    def _save(self, trainer: pl.Trainer) -> None:
        path, ckpt = self.target_path(trainer), self._model_checkpoint(trainer)
        if ckpt is not None and ckpt.save_last:
            # the callback's own `last`, so after the resume it is overwritten instead of getting a `last-v1.ckpt`
            ckpt.last_model_path = path
        trainer.save_checkpoint(path, weights_only=False)  # the full state a resume needs, asked for by name
        rank_zero_info(f"SIGTERM: checkpoint of step {trainer.global_step} written to {path}")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING or trainer.fast_dev_run:
            return
        if self._start_step is None or trainer.global_step == self._start_step:
            # the sanity check, or training stopped before its first step: a checkpoint would hold what was loaded
            rank_zero_warn(
                f"SIGTERM before the first training step: nothing was trained, no checkpoint written (the run "
                f"stands at step {trainer.global_step}, as it started)"
            )
        elif trainer.validating:
            rank_zero_warn(
                "SIGTERM during validation: no checkpoint written (a validation cannot be resumed half-way); "
                "resume from the last periodic checkpoint."
            )
        elif trainer.fit_loop.epoch_loop.done:  # after the end-of-epoch work: not a state Lightning resumes exactly
            rank_zero_warn("SIGTERM at the end of an epoch: no checkpoint written; resume from the last periodic one.")
        else:
            self._save(trainer)


_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _remove_stale_temps(path: str) -> None:
    """Remove temporaries of ``path`` left by processes that died while writing it (a kill during a save)."""
    folder, name = os.path.split(path)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(folder or "."):
            if (m := _TMP.match(entry)) and m.group("name") == name and not pid_alive(int(m.group("pid"))):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, entry))


def _replace_with_sidecar(tmp: str, path: str) -> None:
    """Rename ``tmp`` over ``path`` and leave ``path``'s sidecar holding ``tmp``'s sha256."""
    _remove_stale_temps(sidecar_of(path))
    digest = sha256_file(tmp)
    try:
        previous = read_sidecar(path) if os.path.isfile(path) else None
    except ValueError:  # a torn sidecar of the file being replaced: nothing of it to keep
        previous = None
    if previous:
        write_sidecar(path, [digest, previous[0]])  # a kill before the next rename leaves the old file accepted
    os.replace(tmp, path)
    write_sidecar(path, [digest])


def atomic_torch_save(obj: Any, path: str | os.PathLike, sidecar: bool = False) -> None:
    """``torch.save(obj, path)`` via a ``.<name>.tmp-<pid>`` file renamed over ``path``: old content or all the new.

    With ``sidecar`` the file's sha256 is written beside it (:mod:`~alignment_games.callbacks.functional.digests`);
    between the two renames the sidecar accepts the old file and the new, so a kill there leaves a checkpoint that
    verifies.

    Raises:
        OSError: naming ``path`` when it cannot be written, with the failed write's errno; ``path`` is left as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
        _remove_stale_temps(path)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if sidecar:
            _replace_with_sidecar(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        cause = os_error_behind(err) if isinstance(err, (OSError, RuntimeError)) else None  # torch.save wraps it
        if cause is not None:
            raise write_error(cause, path) from err
        raise
    fsync_dir(folder)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic, durable local writes (:func:`atomic_torch_save`).

    Lightning's default moves a temporary across file systems, a copy a kill can cut short; remote paths keep it.
    Each local file gets its sha256 in ``<file>.sha256``, checked when it is loaded (one without a sidecar loads with
    a warning). Loading is ``weights_only=True`` only; asking for ``weights_only=False`` raises.
    """

    @override
    def load_checkpoint(self, path: Any, *args: Any, weights_only: bool | None = None, **kwargs: Any) -> Any:
        if weights_only is False:
            raise ValueError(
                f"weights_only: {type(self).__name__} reads checkpoints with weights_only=True only (no pickled code); "
                f"refused for {path}"
            )
        if _local(path) and os.path.isfile(_local(path)):
            verify_sidecar(_local(path))
        return super().load_checkpoint(path, *args, weights_only=True, **kwargs)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        if _local(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(sidecar_of(_local(path)))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if _local(path):
            atomic_torch_save(checkpoint, _local(path), sidecar=True)
        else:
            super().save_checkpoint(checkpoint, path)


def _local(path: Any) -> str:
    """``path`` as a local path (``file://`` dropped); ``""`` for a remote one."""
    text = str(path)
    return "" if "://" in text and not text.startswith("file://") else text.removeprefix("file://")
