"""Trained players out of the suite: an adapter folder per player, a record of its base (layout: docs/export.md)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from alignment_games.callbacks.run_config import RUN_CONFIG_KEY, RunConfigRecord
from alignment_games.modules.checkpoints.trust import CheckpointLoading, family_name, read_checkpoint
from alignment_games.modules.distributed.sharding import check_exportable, full_tensors
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.decoding import base_model
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import resolve_name_or_path
from alignment_games.modules.training.artifacts import write_error
from alignment_games.modules.training.provenance import looks_local

EXPORT_RECORD = "export.json"
MERGED = "merged"  #: the folder under ``<out>`` holding the merged models
#: top-level ``train.py fit`` options that export reads from a config and ignores
FIT_ONLY_KEYS = tuple(
    "trainer data seed_everything test_after_fit trusted_checkpoint_sources weights_only optimizer lr_scheduler".split()
)


@dataclass
class Player:
    """One trained player as a family holds it (``adapter=None``: ``model`` is the player's full copy)."""

    name: str
    lm: ModelConfig
    model: nn.Module
    adapter: str | None
    tokenizer: Any
    task: str = "causal_lm"


def select_players(module: nn.Module, names: Sequence[str] | None = None) -> list[Player]:
    """The players of ``module`` to export: all, or those named.

    Raises:
        TypeError: for a model that has no language-model players (``export_players``), naming its class.
        ValueError: when the model has no trained player (a frozen backbone), or for a player named ``merged``.
        KeyError: naming an unknown player and the players there are.
    """
    own = getattr(module, "export_players", None)
    if not callable(own):
        raise TypeError(f"{family_name(module)} has no language-model players to export")
    players = own()
    if not players and not callable(getattr(module, "export_files", None)):  # a frozen ensemble: heads only
        raise ValueError(f"{family_name(module)} holds no trained language-model weights to export (frozen backbone?)")
    by_name = {p.name: p for p in players}
    if MERGED in by_name:
        raise ValueError(f"a player is named {MERGED!r}, the folder of the merged models; rename the player")
    if names is None:
        return players
    if unknown := [n for n in names if n not in by_name]:
        raise KeyError(f"players: unknown player(s) {unknown}; {family_name(module)} has {sorted(by_name)}")
    return [by_name[n] for n in dict.fromkeys(names)]


def gather_weights(player: Player, strategy: Any = None, keep: bool = True) -> dict[str, Tensor]:
    """The player's trained tensors, whole, on CPU (adapter or full state dict)."""
    if player.adapter is None:
        names = set(player.model.state_dict().keys())
        named = dict(player.model.named_parameters())
        named.update({n: b for n, b in player.model.named_buffers() if n in names})
        return full_tensors(strategy, named, keep)
    from peft import get_peft_model_state_dict

    part = f".{player.adapter}."  # a whole name component: adapter "m1" is not "m10"
    own = {n: p for n, p in player.model.named_parameters() if part in n}
    whole = full_tensors(strategy, own, keep)
    if not keep:
        return {}
    return get_peft_model_state_dict(
        player.model, state_dict=whole, adapter_name=player.adapter, save_embedding_layers=False
    )


def base_location(name_or_path: str) -> str:
    """Where the base is found from any folder: a local path made absolute, a hub id (or ``builtin:``) as is."""
    resolved = resolve_name_or_path(name_or_path)
    return os.path.abspath(os.path.expanduser(resolved)) if looks_local(resolved) else resolved


def record_of(player: Player, kind: str, source: dict[str, Any]) -> dict[str, Any]:
    """What ``export.json`` says: the base (configured, resolved, revision, commit, identity), and the adapter."""
    base_config = getattr(base_model(player.model), "config", None)
    return {
        "player": player.name,
        "kind": kind,
        "adapter": player.adapter,
        "task": player.task,
        "base_model_name_or_path": player.lm.name_or_path,
        "base_resolved_path": base_location(player.lm.name_or_path),
        "base_revision": player.lm.revision,
        "base_commit": getattr(base_config, "_commit_hash", None),
        "base_identity": base_identity(player.lm.name_or_path, player.lm.revision),
        "dtype": player.lm.dtype,
        "trained_in_4bit": player.lm.load_in_4bit,
        **source,
    }


def run_record(config_yaml: str | None = None, trainer: Any = None) -> dict[str, Any]:
    """The run's seed and the sha256 of its resolved config (sorted JSON without ``ckpt_path``)."""
    import yaml

    if trainer is not None:
        config_yaml = next((c.config_yaml for c in trainer.callbacks if isinstance(c, RunConfigRecord)), None)
    if not isinstance(config_yaml, str):
        seed = os.environ.get("PL_GLOBAL_SEED")
        return {"seed": None if seed is None else int(seed), "config_sha256": None}
    config = yaml.safe_load(config_yaml) or {}
    config.pop("ckpt_path", None)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return {"seed": config.get("seed_everything"), "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _write_player(player: Player, weights: dict[str, Tensor], folder: str, source: dict[str, Any]) -> None:
    """One player's folder: a peft adapter folder, or a full transformers model."""
    os.makedirs(folder)
    if player.adapter is None:
        base_model(player.model).save_pretrained(folder, state_dict=weights)
        kind = "full_model"
    else:
        from safetensors.torch import save_file

        config = copy.deepcopy(player.model.peft_config[player.adapter])
        config.inference_mode = True
        config.base_model_name_or_path = base_location(player.lm.name_or_path)
        config.revision = player.lm.revision
        config.save_pretrained(folder)
        save_file(weights, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
        kind = "lora_adapter"
    player.tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, EXPORT_RECORD), "w") as f:
        json.dump(record_of(player, kind, source), f, indent=2)


def _write_merged(player: Player, adapter_folder: str, folder: str, source: dict[str, Any]) -> None:
    """The base loaded afresh (full precision, no 4 bits) with the adapter merged in."""
    from peft import PeftModel

    lm = dataclasses.replace(player.lm, load_in_4bit=False, gradient_checkpointing=False)
    merged = PeftModel.from_pretrained(lm.load_model(player.task), adapter_folder).merge_and_unload()
    merged.save_pretrained(folder)
    player.tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, EXPORT_RECORD), "w") as f:
        json.dump(record_of(player, "merged_model", source), f, indent=2)


def check_out_folder(out: str | os.PathLike) -> None:
    """Refuse an ``out`` that exists and is not an empty folder, naming it.

    Raises:
        FileExistsError: ``out`` is a file or a folder with something in it.
    """
    out = os.fspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"out: {out!r} exists and is not an empty folder; give a new or empty folder")


def export_module(
    module: nn.Module,
    out: str | os.PathLike,
    strategy: Any = None,
    write: bool = True,
    merge: bool = False,
    replace: bool = False,
    players: Sequence[str] | None = None,
    source: dict[str, Any] | None = None,
) -> list[str]:
    """Export ``module``'s players to ``out`` (every rank; only ``write`` writes); the player names written.

    Raises:
        FileExistsError: ``out`` is not empty and ``replace`` is off.
        OSError: naming ``out`` when it cannot be written; an earlier export there is left whole.
        KeyError, TypeError, ValueError: see :func:`select_players`.
    """
    out = os.path.abspath(os.fspath(out))
    if not replace:
        check_out_folder(out)
    chosen = select_players(module, players)
    weights = {p.name: gather_weights(p, strategy, keep=write) for p in chosen}  # every rank: a collective
    if not write:
        return [p.name for p in chosen]
    source = {"family": family_name(module), **(source or {})}
    parent = os.path.dirname(out)
    stage = None
    try:
        os.makedirs(parent, exist_ok=True)
        stage = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.", suffix=".tmp")
        for player in chosen:
            folder = os.path.join(stage, player.name)
            _write_player(player, weights.pop(player.name), folder, source)
            if merge and player.adapter is not None:
                _write_merged(player, folder, os.path.join(stage, MERGED, player.name), source)
        if callable(files := getattr(module, "export_files", None)):  # what the players need besides (heads)
            files(stage, source)
        _put_in_place(stage, out, replace)
    except BaseException as err:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if isinstance(err, OSError):  # a full disk names no file: name the export folder
            raise write_error(err, out) from err
        raise
    return [p.name for p in chosen]


def export_at_fit_end(module: Any, log_dir: str | None, label: str) -> list[str]:
    """At the end of ``fit`` (every rank): every player to ``<log_dir>/export``; the names written."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    trainer = module.trainer
    if trainer.fast_dev_run or not module.export_players():  # nothing trained as a language model: nothing to write
        return []
    try:
        check_exportable(trainer.strategy)
    except ValueError as err:
        rank_zero_warn(f"{label}: the players were not exported at the end of fit: {err}")
        return []
    out = os.path.join(log_dir or trainer.default_root_dir, "export") if trainer.is_global_zero else ""
    source = {"global_step": trainer.global_step, "written_at": "end of fit", **run_record(trainer=trainer)}
    written = export_module(module, out, trainer.strategy, write=trainer.is_global_zero, replace=True, source=source)
    rank_zero_info(f"{label}: exported {written} to {out}")
    trainer.strategy.barrier("export")
    return written


def _put_in_place(stage: str, out: str, replace: bool) -> None:
    """Rename ``stage`` to ``out``; with ``replace`` an existing ``out`` is moved aside first, then removed."""
    if os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)
    if replace and os.path.exists(out):
        old = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.", suffix=".old")
        os.replace(out, os.path.join(old, "export"))
        try:
            os.replace(stage, out)
        except OSError:  # the old export back in place before the error is raised
            os.replace(os.path.join(old, "export"), out)
            shutil.rmtree(old, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(stage, out)  # an empty or absent ``out``: one rename (a non-empty one was refused before)


def _parser() -> Any:
    """``train.py export``'s arguments: a fit config's ``model`` (other sections ignored) and ours."""
    import lightning as L
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(
        prog="python train.py export",
        description="Write a checkpoint's trained players as peft adapter folders (and, with --merge, merged models). "
        "The model is built from the config; the checkpoint gives tensors only (weights_only=True).",
        env_prefix="ALIGNMENT_GAMES_EXPORT",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="The run's config (several: applied in order).")
    parser.add_lightning_class_args(L.LightningModule, "model", subclass_mode=True, required=True)
    parser.add_argument("--ckpt_path", type=str, required=True, help="A one-file checkpoint of the config's family.")
    parser.add_argument("--out", type=str, required=True, help="The export folder: new, or empty.")
    parser.add_argument("--merge", type=bool, default=False, help="Also write merged models under <out>/merged/.")
    parser.add_argument("--players", type=list[str] | None, default=None, help="Only these players (default: all).")
    # every other top-level key of a fit config, as ``fit`` saves it in the run's config.yaml (train.py's parser)
    for key in FIT_ONLY_KEYS:
        parser.add_argument(f"--{key}", type=Any, default=None, help="Read from a fit config and not used.")
    return parser


def export_command(args: Sequence[str]) -> list[str]:
    """``python train.py export --config <cfg.yaml> --ckpt_path <ckpt> --out <dir> [--merge] [--players ...]``.

    Raises:
        FileNotFoundError: naming a checkpoint that does not exist.
        IsADirectoryError: for a sharded checkpoint folder.
        FileExistsError: for an ``--out`` that is not empty.
    """
    parser = _parser()
    cfg = parser.parse_args(list(args))
    ckpt = cfg.ckpt_path
    if os.path.isdir(ckpt):
        raise IsADirectoryError(
            f"--ckpt_path {ckpt!r} is a sharded checkpoint folder; export reads one-file checkpoints: convert it "
            "first (DeepSpeed: lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict; "
            "FSDP2: train with --trainer.strategy.init_args.save_distributed_checkpoint=false)"
        )
    if not os.path.isfile(ckpt):
        raise FileNotFoundError(f"--ckpt_path: checkpoint {ckpt!r} is not a file")
    check_out_folder(cfg.out)

    failures: list[BaseException] = []  # jsonargparse wraps what the instantiator raises: re-raised as it was

    def from_checkpoint(cls: type, *a: Any, **kwargs: Any) -> Any:
        try:
            # only the suite's loader: Lightning's own would build the model from the checkpoint's hyper-parameters
            if not issubclass(cls, CheckpointLoading) or a:
                raise TypeError(f"model: {cls.__qualname__} has no language-model players to export")
            return cls.load_from_checkpoint(ckpt, **kwargs)  # weights_only=True, configured by kwargs only
        except Exception as err:
            failures.append(err)
            raise

    import lightning as L

    parser.add_instantiator(from_checkpoint, L.LightningModule, subclasses=True)
    try:
        model = parser.instantiate_classes(cfg).model
    except Exception:
        if failures:
            raise failures[0] from None
        raise
    checkpoint = read_checkpoint(ckpt, mmap=True)  # verified against its sidecar when the model was built
    source = {"checkpoint": os.path.abspath(ckpt), "global_step": checkpoint.get("global_step")}
    source.update(run_record(checkpoint.get(RUN_CONFIG_KEY)))  # the run's own config, as its checkpoint records it
    written = export_module(model, cfg.out, merge=cfg.merge, players=cfg.players, source=source)
    merged = f" (merged models in {os.path.join(cfg.out, MERGED)})" if cfg.merge else ""
    print(f"exported {written} to {cfg.out}{merged}")
    return written
