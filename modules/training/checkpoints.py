"""What a checkpoint may do: carry weights and state into a model the caller's config built, never configure it.

A checkpoint's hyper-parameters are a record, not an input: they could name a model folder with custom code and
``trust_remote_code: true``, a hub repository, a dtype or another class, and building a model from them would run
whatever that names. So every loader here builds the model from the caller's arguments (the config) and takes only
tensors and plain state from the file (``torch.load(weights_only=True)``). Before anything is loaded,
:func:`check_checkpoint_matches` refuses a checkpoint written by another family (the class stored under
:data:`FAMILY_KEY`) or whose tensors do not fit the model the config built (names and shapes), naming both.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from modules.training.provenance import made_by

__all__ = [
    "FAMILY_KEY",
    "CheckpointLoading",
    "check_checkpoint_matches",
    "checkpoint_family",
    "family_name",
    "read_checkpoint",
    "stamp_family",
    "trainable_names",
]

#: where a checkpoint records the class (module path and name) of the model that wrote it
FAMILY_KEY = "family"


def family_name(module: nn.Module | type) -> str:
    """The import path of a model's class, e.g. ``modules.preference.PreferenceEnsemble``."""
    cls = module if isinstance(module, type) else type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def stamp_family(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Record which family wrote ``checkpoint`` (call from ``on_save_checkpoint``)."""
    checkpoint[FAMILY_KEY] = family_name(module)


def checkpoint_family(checkpoint: dict[str, Any]) -> str | None:
    """The family that wrote ``checkpoint``: its stamp, else LightningCLI's ``_class_path`` record, else ``None``."""
    family = checkpoint.get(FAMILY_KEY)
    if family is None:
        hparams = checkpoint.get("hyper_parameters")
        family = hparams.get("_class_path") if isinstance(hparams, dict) else None
    return family if isinstance(family, str) else None


def trainable_names(module: nn.Module) -> set[str]:
    """State-dict names of the tensors that train (a family's ``trainable_state_names`` where it has one)."""
    own = getattr(module, "trainable_state_names", None)
    if callable(own):
        return set(own())
    return {name for name, p in module.named_parameters() if p.requires_grad}


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def check_checkpoint_matches(
    module: nn.Module, checkpoint: dict[str, Any], trainable: set[str] | None = None, source: str = "the checkpoint"
) -> None:
    """Refuse a checkpoint of another family, or whose tensors do not fit ``module``; before anything is loaded.

    Checks, in order: the family stamp (or LightningCLI's ``_class_path``) against ``module``'s class; then, when
    the checkpoint has a ``state_dict`` (DeepSpeed keeps weights in its own files), that it holds every trainable
    tensor (``trainable``; default :func:`trainable_names`), no tensor ``module`` does not have, and every tensor in
    the shape ``module`` has. A checkpoint without a stamp (written before stamps existed) is judged by its tensors.

    Raises:
        ValueError: naming both families, or the tensor with both its shapes, or the tensors the model lacks.
        KeyError: naming the trainable tensors the checkpoint lacks.
    """
    here, there = family_name(module), checkpoint_family(checkpoint)
    if there is not None and there != here:
        raise ValueError(
            f"{source} was written by {there}, but the config's model is {here}: a checkpoint only continues the "
            "family that wrote it (give the config of that family, or a checkpoint of this one)"
        )
    state = checkpoint.get("state_dict")
    if state is None:
        return
    expected = trainable_names(module) if trainable is None else trainable
    missing = sorted(expected - set(state))
    if missing:
        raise KeyError(
            f"{source} lacks trainable tensors of the config's model ({here}): {missing[:5]}"
            f"{' …' if len(missing) > 5 else ''}"
        )
    own = module.state_dict(keep_vars=True)
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(
            f"{source} holds tensors the config's model ({here}) does not have: {unknown[:5]}"
            f"{' …' if len(unknown) > 5 else ''} (a checkpoint of another configuration of {there or here}?)"
        )
    for name, value in state.items():
        saved, built = _shape(value), _shape(own[name])
        if saved is not None and built is not None and saved != built:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {saved} in the checkpoint but {built} in the config's model "
                f"({here}); the config must describe the model the checkpoint was trained as"
            )


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """A one-file checkpoint's contents, tensors and plain values only (``weights_only=True``).

    ``mmap`` maps the tensors instead of reading them (enough to check names and shapes of a large checkpoint).

    Raises:
        FileNotFoundError: naming the path when it is not a file (and the config that makes it, when one does).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is not a file{'' if os.path.exists(path) else made_by(path)}"
        )
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class CheckpointLoading:
    """Mixin of the families: ``load_from_checkpoint`` builds from the caller's arguments, never from the file's.

    Lightning's own ``load_from_checkpoint`` calls the class with the checkpoint's stored hyper-parameters (the
    model path, ``trust_remote_code``, the dtype); this one calls it with ``**kwargs`` only, checks the checkpoint
    against the model built (:func:`check_checkpoint_matches`, through the family's ``on_load_checkpoint``) and
    loads its tensors.
    """

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str | os.PathLike,
        map_location: Any = "cpu",
        hparams_file: str | None = None,
        strict: bool | None = None,
        weights_only: bool | None = True,
        **kwargs: Any,
    ) -> Any:
        """The model ``cls(**kwargs)`` with the checkpoint's tensors and state loaded into it.

        Args:
            checkpoint_path: A one-file checkpoint of this family.
            map_location: Where the tensors are loaded.
            hparams_file: Refused: the caller's arguments are the configuration.
            strict: Strict state-dict loading; ``None``: the model's ``strict_loading``.
            weights_only: Only ``True`` (or ``None``) is accepted.
            **kwargs: The model's arguments, as in its config.

        Raises:
            ValueError: for ``hparams_file`` or ``weights_only=False``, or a checkpoint that does not match.
        """
        if hparams_file is not None:
            raise ValueError(
                f"hparams_file: {cls.__name__} is built from the arguments given, never from stored hyper-parameters"
            )
        if weights_only is False:
            raise ValueError("weights_only: checkpoints are read with weights_only=True only (no pickled code)")
        checkpoint = read_checkpoint(checkpoint_path, map_location)
        model = cls(**kwargs)
        # named here with its path; the family's on_load_checkpoint checks it again and restores its state
        check_checkpoint_matches(model, checkpoint, source=f"checkpoint {str(checkpoint_path)!r}")  # type: ignore[arg-type]
        model.on_load_checkpoint(checkpoint)  # type: ignore[attr-defined]
        state = checkpoint.get("state_dict")
        if state is None:
            raise ValueError(f"checkpoint {str(checkpoint_path)!r} holds no state_dict (a DeepSpeed folder?)")
        model.load_state_dict(state, strict=getattr(model, "strict_loading", True) if strict is None else strict)  # type: ignore[attr-defined]
        return model
