"""What a checkpoint may do: carry weights and state into a model the caller's config built, never configure it.

Stored hyper-parameters could name remote code, so loaders build from the config and read weights only.
"""

from __future__ import annotations

import os
import pickle
import urllib.parse
from typing import Any

import torch
from torch import nn

from alignment_games.callbacks.functional.digests import verify_manifest, verify_sidecar
from alignment_games.modules.training.faults import nonfinite_entries, refuse_nonfinite_checkpoint
from alignment_games.modules.training.provenance import made_by

FAMILY_KEY = "family"  #: where a checkpoint records the class (module path and name) of the model that wrote it


def family_name(module: nn.Module | type) -> str:
    """The import path of a model's class, e.g. ``alignment_games.modules.preference.PreferenceEnsemble``."""
    cls = module if isinstance(module, type) else type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def stamp_family(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Record which family wrote ``checkpoint`` (call from ``on_save_checkpoint``)."""
    checkpoint[FAMILY_KEY] = family_name(module)


def seal_checkpoint(module: nn.Module, checkpoint: dict[str, Any], what: str) -> None:
    """:func:`stamp_family` on ``checkpoint``, then refuse it when a kept tensor or optimizer moment is NaN or inf.

    Raises:
        RuntimeError: from :func:`~alignment_games.modules.training.faults.refuse_nonfinite_checkpoint`, naming
          ``what``.
    """
    stamp_family(module, checkpoint)
    refuse_nonfinite_checkpoint(checkpoint, what)


def checkpoint_family(checkpoint: dict[str, Any]) -> str | None:
    """The family that wrote ``checkpoint``: its stamp, else LightningCLI's ``_class_path`` record, else ``None``."""
    family = checkpoint.get(FAMILY_KEY)
    if family is None:
        hparams = checkpoint.get("hyper_parameters")
        family = hparams.get("_class_path") if isinstance(hparams, dict) else None
    return family if isinstance(family, str) else None


def trainable_names(module: nn.Module) -> set[str]:
    """State-dict names of the tensors that train (``trainable_state_names`` where defined)."""
    own = getattr(module, "trainable_state_names", None)
    return set(own()) if callable(own) else {name for name, p in module.named_parameters() if p.requires_grad}


def check_checkpoint_matches(
    module: nn.Module, checkpoint: dict[str, Any], trainable: set[str] | None = None, source: str = "the checkpoint"
) -> None:
    """Refuse a checkpoint of another family, with missing, unknown or misshapen tensors, or NaN/inf; before loading.

    Raises:
        ValueError: naming both families, a tensor with both shapes, the unknown tensors, or the first NaN/inf.
        KeyError: naming the trainable tensors the checkpoint lacks.
    """
    if source == "the checkpoint":
        path = getattr(getattr(module, "_trainer", None), "ckpt_path", None)
        source = f"checkpoint {str(path)!r}" if path else source
    here, there = family_name(module), checkpoint_family(checkpoint)
    if there is not None and there != here:
        raise ValueError(
            f"{source} was written by {there}, but the config's model is {here}: a checkpoint only continues the "
            "family that wrote it (give the config of that family, or a checkpoint of this one)"
        )
    state = checkpoint.get("state_dict")
    if state is not None:
        _check_tensors_fit(module, state, trainable, here, there, source)
    if found := nonfinite_entries(checkpoint, getattr(module, "minus_inf_allowed", ())):
        raise ValueError(
            f"{source} holds NaN or inf in {found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}: "
            "it is not a state to continue from; resume from an earlier checkpoint"
        )


def _check_tensors_fit(
    module: nn.Module, state: dict[str, Any], trainable: set[str] | None, here: str, there: str | None, source: str
) -> None:
    """The tensor checks of :func:`check_checkpoint_matches`."""
    expected = trainable_names(module) if trainable is None else trainable
    if missing := sorted(expected - set(state)):
        raise KeyError(
            f"{source} lacks trainable tensors of the config's model ({here}): {missing[:5]}"
            f"{' …' if len(missing) > 5 else ''}"
        )
    own = module.state_dict(keep_vars=True)
    if unknown := sorted(set(state) - set(own)):
        raise ValueError(
            f"{source} holds tensors the config's model ({here}) does not have: {unknown[:5]}"
            f"{' …' if len(unknown) > 5 else ''} (a checkpoint of another configuration of {there or here}?)"
        )
    for name, value in state.items():
        saved, built = (list(t.shape) if isinstance(t, torch.Tensor) else None for t in (value, own[name]))
        if saved is not None and built is not None and saved != built:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {saved} in the checkpoint but {built} in the config's model "
                f"({here}); the config must describe the model the checkpoint was trained as"
            )


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """A one-file checkpoint's tensors and plain values (``weights_only=True``; ``mmap`` maps the tensors).

    The file is checked against its ``.sha256`` sidecar first; one without a sidecar loads with a warning.

    Raises:
        FileNotFoundError: naming the path when it is not a file (and the config that makes it, when one does).
        ValueError: naming a truncated or corrupt file (or one whose sha256 is not its sidecar's) and the newest
            intact checkpoint beside it.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is not a file{'' if os.path.exists(path) else made_by(path)}"
        )
    return read_checkpoint_or_explain(path, mmap, map_location)  # a file: its sidecar checked, then weights only


class CheckpointLoading:
    """Mixin of the families: ``load_from_checkpoint`` builds from the caller's ``**kwargs``, never the file's."""

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
        """The model ``cls(**kwargs)`` (the config's arguments) with the checkpoint's tensors and state loaded.

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

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check with :func:`check_checkpoint_matches`, then restore the ``NonFiniteGuard`` counters."""
        check_checkpoint_matches(self, checkpoint, self.trainable_state_names())  # type: ignore[arg-type, attr-defined]
        self.load_nonfinite_state(checkpoint.get("nonfinite"))  # type: ignore[attr-defined]


RUN_CONFIG_KEY = "run_config"  #: where a checkpoint records the resolved config (YAML text) of the run that wrote it

#: config keys (dotted, with everything under them) a resumed run may change
RESUME_SAFE_KEYS = ("config", "ckpt_path", "test_after_fit", "print_config", "trusted_checkpoint_sources") + tuple(
    f"trainer.{key}"
    for key in "max_steps max_epochs min_steps min_epochs max_time logger callbacks log_every_n_steps "
    "enable_progress_bar enable_model_summary enable_checkpointing devices num_nodes accelerator strategy plugins "
    "profiler default_root_dir".split()
)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _segments(path: str) -> list[str] | None:
    """A URL path's segments, decoded, ``.``/``..`` resolved; None when ``..`` climbs above ``/``."""
    out: list[str] = []
    for segment in urllib.parse.unquote(path).split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if not out:
                return None
            out.pop()
        else:
            out.append(segment)
    return out


def _url_under(url: str, prefix: str) -> bool:
    """Whether ``url`` lies under ``prefix``: same scheme, host, port and user, and whole resolved path segments."""
    try:
        a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(prefix)
        ports = a.port or _DEFAULT_PORTS.get(a.scheme.lower()), b.port or _DEFAULT_PORTS.get(b.scheme.lower())
    except ValueError:  # a port that is not a number, a malformed host
        return False
    if not b.scheme or a.scheme.lower() != b.scheme.lower() or a.hostname != b.hostname or ports[0] != ports[1]:
        return False
    if a.username != b.username or a.password != b.password:  # credentials are part of whom it is fetched as
        return False
    path, base = _segments(a.path), _segments(b.path)
    return path is not None and base is not None and path[: len(base)] == base


def check_checkpoint_source(path: str | os.PathLike, trusted: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse a remote checkpoint (``scheme://``, not ``file://``) unless a ``trusted`` source holds it.

    Raises:
        ValueError: naming the path and the option that trusts it.
    """
    path = os.fspath(path)
    if "://" not in path or path.startswith("file://"):
        return
    if not any(prefix and _url_under(path, prefix) for prefix in trusted):
        raise ValueError(
            f"--ckpt_path {path!r} is remote and not trusted: fetch it yourself, or name its source with "
            f"--trusted_checkpoint_sources {path.rsplit('/', 1)[0]}/ (it is then still read with weights_only=True)"
        )


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint folder: ``meta.pt`` and ``.metadata`` in it."""
    return os.path.isfile(os.path.join(path, "meta.pt")) and os.path.isfile(os.path.join(path, ".metadata"))


def _read_any(path: str, mmap: bool, map_location: Any = "cpu") -> dict[str, Any]:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "latest")):  # DeepSpeed's folder: its Lightning state, weights-only
            from alignment_games.modules.distributed.deepspeed_checkpoints import read_deepspeed_client_state

            verify_manifest(path)
            return read_deepspeed_client_state(path)
        if not is_sharded_checkpoint(path):
            raise ValueError("a folder without meta.pt and .metadata, or DeepSpeed's latest (an incomplete save?)")
        from alignment_games.modules.distributed.dcp_safe import read_dcp_metadata

        verify_manifest(path)
        read_dcp_metadata(path)
        return torch.load(os.path.join(path, "meta.pt"), map_location="cpu", weights_only=True)
    verify_sidecar(path)
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def newest_intact_checkpoint(folder: str | os.PathLike, exclude: str | os.PathLike | None = None) -> str | None:
    """The newest ``*.ckpt`` (file or sharded folder) in ``folder`` that reads whole, other than ``exclude``."""
    folder = os.fspath(folder)
    skip = os.path.abspath(exclude) if exclude is not None else None
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".ckpt") and not n.startswith(".")]
    except OSError:
        return None
    paths = [os.path.join(folder, n) for n in names if os.path.abspath(os.path.join(folder, n)) != skip]
    for path in sorted(paths, key=os.path.getmtime, reverse=True):
        try:
            _read_any(path, mmap=True)
        except Exception:
            continue
        return path
    return None


def read_checkpoint_or_explain(path: str | os.PathLike, mmap: bool = True, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint's plain contents (a file, a sharded folder's ``meta.pt``, a DeepSpeed folder's Lightning state).

    Raises:
        FileNotFoundError: naming the path.
        ValueError: naming the unreadable (truncated, corrupt) checkpoint and the newest intact one beside it.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        return _read_any(path, mmap, map_location)
    except pickle.UnpicklingError:  # a global refused (weights_only, DCP metadata): the message names it
        raise
    except Exception as err:  # torch raises OSError, RuntimeError, EOFError … for a torn file
        raise _unreadable(path, err) from err


def _unreadable(path: str, err: Exception) -> ValueError:
    """The error naming an unreadable checkpoint, the cause, and the newest intact one beside it."""
    intact = newest_intact_checkpoint(os.path.dirname(path) or ".", exclude=path)
    offer = (
        f"the newest intact checkpoint beside it is {intact!r} (give --ckpt_path {intact})"
        if intact
        else "no intact checkpoint lies beside it"
    )
    return ValueError(
        f"checkpoint {path!r} cannot be read (truncated or corrupt: {type(err).__name__}: {err}); {offer}"
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def config_differences(
    stored: dict[str, Any], given: dict[str, Any], safe: tuple[str, ...] = RESUME_SAFE_KEYS
) -> list[str]:
    """The dotted config keys whose values differ between ``stored`` and ``given``, resume-safe keys left out."""
    a, b = _flatten(stored), _flatten(given)
    missing = object()
    differ = (k for k in set(a) | set(b) if a.get(k, missing) != b.get(k, missing))
    return sorted(k for k in differ if not any(k == s or k.startswith(f"{s}.") for s in safe))


def check_resume_config(checkpoint: dict[str, Any], given_yaml: str, source: str = "the checkpoint") -> bool:
    """Refuse a config differing from the checkpoint's beyond :data:`RESUME_SAFE_KEYS`; ``False`` if none recorded.

    Raises:
        ValueError: naming ``source`` and every differing key with both values.
    """
    import yaml

    stored = checkpoint.get(RUN_CONFIG_KEY)
    if not isinstance(stored, str):
        return False
    old, new = yaml.safe_load(stored) or {}, yaml.safe_load(given_yaml) or {}
    if diff := config_differences(old, new):
        a, b = _flatten(old), _flatten(new)
        shown = "; ".join(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in diff[:8])
        raise ValueError(
            f"{source} belongs to another experiment: its config differs from the given one in {diff} ({shown}"
            f"{' …' if len(diff) > 8 else ''}). Only {', '.join(RESUME_SAFE_KEYS)} may change on a resume; "
            "give the same config, or another logger name/version to start a new run"
        )
    return True
