"""Nothing lost on a preemption: RNG states in every checkpoint, a checkpoint on SIGTERM, atomic checkpoint files.

Three pieces, each usable on its own with any ``LightningModule`` (``train.py`` wires all three by default):

* :class:`RNGStateCallback` saves the Python, NumPy, torch (CPU and CUDA) generator states of every rank in each
  checkpoint and restores them on resume, so sampling, dropout and shuffling continue as if never stopped.
* :class:`CheckpointOnSigterm` writes ``last.ckpt`` when Lightning stops on SIGTERM (preemption, ``scancel``,
  ``kill``). Lightning turns SIGTERM into a clean stop after the running batch but saves nothing by itself.
* :class:`AtomicCheckpointIO` writes each checkpoint to a temporary file in the target folder, ``fsync`` s it and
  renames it over the target, so a kill during a save leaves the previous checkpoint whole.

The plain functions behind them (:func:`collect_rng_state`, :func:`restore_rng_state`, :func:`atomic_torch_save`)
have no Lightning in them.
"""

from __future__ import annotations

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

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointOnSigterm",
    "RNGStateCallback",
    "atomic_torch_save",
    "collect_rng_state",
    "restore_rng_state",
]


# ----------------------------------------------------------------------------------------------------------------
# RNG states
# ----------------------------------------------------------------------------------------------------------------


def collect_rng_state() -> dict[str, Any]:
    """The generator states of this process, as tensors and plain Python values (loadable with ``weights_only``).

    Keys: ``python`` (:func:`random.getstate`), ``numpy`` (the legacy global ``MT19937`` state), ``torch`` (CPU) and,
    once CUDA is initialised, ``cuda`` (one state per visible device).
    """
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


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class RNGStateCallback(Callback):
    """Save every rank's generator states in each checkpoint and restore them when a run resumes.

    With the generators restored, a resumed run draws the same samples (generation, dropout, shuffling with the
    global generator, random corruptions) as the run that was stopped, so on deterministic CPU settings it logs the
    same numbers. The states are taken when the checkpoint is written and set again as soon as the checkpoint is
    loaded, before the training data loader is iterated, which is the order of events of the uninterrupted run.

    What the module must provide: nothing. Under DDP each rank's states are gathered when a checkpoint is written
    (one ``all_gather_object`` per checkpoint, nothing per step) and rank ``r`` restores entry ``r``; a resume on a
    different number of ranks restores the ranks that exist in both and warns.

    Example::

        trainer = Trainer(callbacks=[RNGStateCallback(), ModelCheckpoint(save_last=True)])
        trainer.fit(model, ckpt_path="last")
    """

    @property
    @override
    def state_key(self) -> str:
        return "RNGStateCallback"

    @override
    def state_dict(self) -> dict[str, Any]:
        local = collect_rng_state()
        rank, world = _world()
        if world == 1:
            return {"ranks": [local]}
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, local)
        return {"ranks": gathered}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks", [])
        rank, world = _world()
        if len(ranks) != world:
            rank_zero_warn(
                f"RNGStateCallback: the checkpoint holds generator states of {len(ranks)} rank(s), this run has "
                f"{world}; ranks beyond the saved ones keep their seeded states."
            )
        if rank < len(ranks):
            restore_rng_state(ranks[rank])


# ----------------------------------------------------------------------------------------------------------------
# A checkpoint on SIGTERM
# ----------------------------------------------------------------------------------------------------------------


class CheckpointOnSigterm(Callback):
    """Write ``last.ckpt`` when ``fit`` stops on SIGTERM, so a preempted run resumes from where it stopped.

    Lightning handles SIGTERM by finishing the running training batch and raising ``SIGTERMException``; it saves
    nothing unless told to. This callback then saves a full checkpoint into the folder of the trainer's
    ``ModelCheckpoint`` (else ``<default_root_dir>/checkpoints``) under that callback's ``last`` name, where
    ``fit --ckpt_path last`` looks. It saves only mid-epoch: when the signal lands in the last batch of an epoch,
    Lightning raises only after the end-of-epoch work, and Lightning 2.6 resumes from a checkpoint taken there one
    logging step and one epoch's data order off; the last periodic checkpoint is kept instead (the batches since are
    replayed, exactly).

    Only SIGTERM saves: any other exception may arrive in the middle of an update (one player stepped, the other
    not), so the last periodic checkpoint is kept instead. A SIGTERM that arrives during validation stops the
    validation without saving (Lightning cannot resume a validation half-way); the last periodic checkpoint stays.
    Sanity checks, ``fast_dev_run`` and stages other than ``fit`` never save.

    Example::

        trainer = Trainer(callbacks=[CheckpointOnSigterm(), ModelCheckpoint(save_last=True, every_n_train_steps=50)])
    """

    def __init__(self) -> None:
        super().__init__()
        self.saved_path: str | None = None

    @staticmethod
    def target_path(trainer: pl.Trainer) -> str:
        """Where the SIGTERM checkpoint goes: the ``last`` file of the trainer's ``ModelCheckpoint`` folder."""
        ckpt = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)
        if ckpt is not None and ckpt.dirpath is not None:
            return os.path.join(ckpt.dirpath, ckpt.CHECKPOINT_NAME_LAST + ckpt.FILE_EXTENSION)
        # no ModelCheckpoint folder: the logger's run folder (never the working directory, which may be a repo);
        # the logger's own ``log_dir`` is used, not ``trainer.log_dir``, which is a collective under DDP
        logger_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        return os.path.join(logger_dir or trainer.default_root_dir, "checkpoints", "last.ckpt")

    def _save(self, trainer: pl.Trainer) -> None:
        path = self.target_path(trainer)
        ckpt = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)
        if ckpt is not None and ckpt.save_last:
            # the file becomes that callback's own `last`: after the resume it overwrites it instead of writing
            # `last-v1.ckpt` beside it
            ckpt.last_model_path = path
        trainer.save_checkpoint(path)
        self.saved_path = path
        rank_zero_info(f"SIGTERM: checkpoint of step {trainer.global_step} written to {path}")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or trainer.fast_dev_run:
            return
        if trainer.validating:
            rank_zero_warn(
                "SIGTERM during validation: no checkpoint written (a validation cannot be resumed half-way); "
                "resume from the last periodic checkpoint."
            )
            return
        if trainer.fit_loop.epoch_loop.done:
            # raised after the end-of-epoch work, with the epoch counted complete: not a state Lightning resumes
            # from exactly (see the class docstring)
            rank_zero_warn("SIGTERM at the end of an epoch: no checkpoint written; resume from the last periodic one.")
            return
        self._save(trainer)


# ----------------------------------------------------------------------------------------------------------------
# Atomic checkpoint files
# ----------------------------------------------------------------------------------------------------------------

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _temp_path(path: str) -> str:
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(path: str) -> None:
    """Remove temporaries of ``path`` left by processes that died while writing it (a kill during a save)."""
    folder, name = os.path.split(path)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(folder or "."):
            m = _TMP.match(entry)
            if m and m.group("name") == name and not _pid_alive(int(m.group("pid"))):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, entry))


def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot open or sync a directory
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or the complete new one.

    The object is written to ``.<name>.tmp-<pid>`` in the same folder (so the rename never crosses file systems),
    flushed and ``fsync`` ed, then renamed over ``path`` with :func:`os.replace` (atomic on POSIX and Windows), and the
    folder is ``fsync`` ed so the rename survives a crash. A process killed at any point leaves ``path`` untouched;
    its temporary is removed by the next save of the same file. The temporary's name never ends in ``.ckpt``, so
    ``ckpt_path="last"`` cannot pick it up.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    _remove_stale_temps(path)
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(folder)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic, durable writes of local checkpoints (:func:`atomic_torch_save`).

    Lightning's default serialises the checkpoint into memory and moves a temporary from the system's temp folder
    into place; when that folder is on another file system (a node-local ``/tmp``, checkpoints on shared storage)
    the move is a copy that a kill can cut short, and nothing is ``fsync`` ed. Here the temporary lives beside the
    target and is renamed over it. Remote paths (``s3://`` …) keep Lightning's transaction. Loading is unchanged
    (``weights_only`` as the caller asks; ``fit --ckpt_path`` uses torch's default, ``weights_only=True``).

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if "://" in str(path) and not str(path).startswith("file://"):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, str(path).removeprefix("file://"))
