"""Entry point of the suite: one LightningCLI in subclass mode for every model and data family.

python train.py fit --config configs/preference_ensemble.yaml   # --help, --model.help DeepSMIDA, --print_config
python train.py export --config <cfg.yaml> --ckpt_path <ckpt> --out <dir> [--merge]   # docs/export.md
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import importlib.metadata
import inspect
import os
import re
import shutil
import sys
import warnings

import lightning as L
import yaml
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO, CheckpointOnSigterm, RNGStateCallback
from alignment_games.callbacks.functional.files import disk_full_error
from alignment_games.callbacks.given_settings import GivenOptimizerSettings
from alignment_games.callbacks.progress import console_callbacks, quiet_lightning_console
from alignment_games.callbacks.run_config import RunConfigRecord
from alignment_games.datamodules.files import check_data_file
from alignment_games.modules.algorithms.checks import MissingFileError, UserError, require_at_least
from alignment_games.modules.checkpoints.run_identity import check_resumed_run, run_inputs
from alignment_games.modules.checkpoints.trust import check_checkpoint_matches, check_checkpoint_source, read_checkpoint
from alignment_games.modules.distributed.deepspeed_checkpoints import safe_deepspeed_strategy
from alignment_games.modules.distributed.launch import follow_the_launcher
from alignment_games.modules.training.artifacts import recover_folder
from alignment_games.modules.training.registry import data_families, model_families
from alignment_games.modules.training.run_lock import LOCK_NAME, RunFolderLock, live_owner

# ``last.ckpt``, and Lightning's ``last-v1.ckpt`` … beside another run's ``last.ckpt`` in a shared folder
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")
_INTERRUPTED = re.compile(r"^\.(?P<name>last(-v?\d+)?\.ckpt)\.(previous|partial)$")


def recover_interrupted_saves(folder: str) -> None:
    """Finish or undo sharded ``last*.ckpt`` saves in ``folder`` that a kill cut short (see ``recover_folder``)."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder):
            if m := _INTERRUPTED.match(entry):
                with contextlib.suppress(OSError):  # another rank may be recovering the same folder
                    recover_folder(os.path.join(folder, m.group("name")))


# Options LightningCLI adds for a module that lets the CLI build its optimizer; every family here builds its own.
_OWN_OPTIMIZERS = ("--optimizer", "--lr_scheduler")
#: Options folded into the ``policy_gradient`` group, per family: old name -> new name, refused naming the new one.
RENAMED_OPTIONS = {
    "GRPO": {
        "num_generations": "group_size",
        "beta": "kl_coef",
        "clip": "clip",
        "updates_per_rollout": "updates_per_batch",
        "scale_rewards": "scale_advantages",
        "logprob_micro_batch": "logprob_micro_batch",
        "train_micro_batch": "micro_batch",
    },
    "DebateSelfPlay": {
        **{k: k for k in ("group_size", "clip", "updates_per_batch", "scale_advantages", "logprob_micro_batch")},
        "kl_beta": "kl_coef",
    },
    "StackelbergPool": {
        "followers.grpo_rollouts": "group_size",
        "followers.grpo_beta": "kl_coef",
        "followers.grpo_clip": "clip",
    },
}
# How jsonargparse begins its report of a class that could not be built (the class's own exception is its cause).
_UNION_SUMMARY = "Does not validate against any of the Union subtypes"
#: User mistakes: reported as one ``error:`` line with exit code 2 (a traceback with ALIGNMENT_GAMES_VERBOSE=1)
USER_ERRORS = (UserError, MisconfigurationException)
VERBOSE = "ALIGNMENT_GAMES_VERBOSE"
# jsonargparse's lines that frame the complaint: a union's alternatives, the value echoed back
_FRAME = re.compile(r"(Does not validate|Subtypes: |Errors:|Given value( type)?: |Expected a <class 'NoneType'>)")


def _did_you_mean(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _init_names(class_path: str) -> list[str]:
    """The ``__init__`` argument names of a class and its bases (where ``**kwargs`` passes them on)."""
    module, _, name = class_path.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    inits = [vars(k)["__init__"] for k in getattr(cls, "__mro__", ()) if "__init__" in vars(k)]
    return [n for f in inits for n, p in inspect.signature(f).parameters.items() if n != "self" and p.kind <= 3]


def one_line_error(message: str, parser) -> str:
    """A jsonargparse report of a bad argument as one line: the full key, the innermost complaint, a "did you mean"."""
    keys, details, family, value = [], [], None, None
    for line in (raw.strip().removeprefix("- ") for raw in message.splitlines()):
        if m := re.match(r'Parser key "([^"]+)":\s*(.*)', line):
            keys, line = [*keys, m[1]], m[2]
        if m := re.match(r"Problem with given class_path '([^']+)':\s*(.*)", line):
            family, line = m[1], m[2]
            keys += [] if keys and keys[-1].endswith("init_args") else ["init_args"]
        if line.startswith("Given value: "):
            value = line.removeprefix("Given value: ")
        elif line and not _FRAME.match(line):
            line = re.sub(r"Expected an? <class '([\w.]+)'>", r"expected \1", line)
            details.append(line.replace(". Got value:", ", got"))
    key = ".".join(keys)
    if m := re.search(r"Expected a dot import path string: (\S+)", message):
        families = model_families() if key == "model" else data_families()
        return f"{key}: no family named {m[1]}{_did_you_mean(m[1], families)} (python train.py fit --help lists them)"
    if details and (m := re.fullmatch(r"Option '([^']+)' is not accepted", details[-1])) and family:
        return f"{key}.{m[1]} is not an option of {family.rsplit('.', 1)[-1]}{_did_you_mean(m[1], _init_names(family))}"
    if m := re.search(r"does not accept option '([^']+)'", message):  # a config file's key
        options = [o.lstrip("-") for a in parser._actions for o in a.option_strings]
        return f"{message.rstrip('.')}{_did_you_mean(m[1], options)}"
    if m := re.match(r"(?i)unrecognized arguments: (.*)", message):
        unknown = [a.split("=", 1)[0] for a in m[1].split() if a.startswith("-")] or m[1].split()
        options = [o for a in parser._actions for o in a.option_strings]
        return f"unrecognized argument {unknown[0]}{_did_you_mean(unknown[0], options)}"
    detail = details[-1] if details else " ".join(message.split())
    return f"{key}: {detail}{f', got {value}' if value and ', got' not in detail else ''}" if key else detail


class AlignmentArgumentParser(LightningArgumentParser):
    """Lightning's parser: a bad argument in one ``error:`` line (ALIGNMENT_GAMES_VERBOSE=1: all), no abbreviation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    @override
    def add_lightning_class_args(self, lightning_class, nested_key: str, subclass_mode: bool = False, required=True):
        """``model`` and ``data`` list the families (:mod:`alignment_games.modules.training.registry`), not bases."""
        added = super().add_lightning_class_args(lightning_class, nested_key, subclass_mode, required)
        families = {"model": model_families, "data": data_families}.get(nested_key) if subclass_mode else None
        for action in (a for a in self._actions if a.dest == nested_key and families is not None):
            names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in families().values())
            action.extra_help = lambda names=names: f", the families: {names}"  # jsonargparse's: every subclass
        return added

    @override
    def error(self, message: str, ex: Exception | None = None):
        if os.environ.get(VERBOSE) or not self.exit_on_error:
            super().error(message, ex)
        sys.stderr.write(f"error: {one_line_error(message, getattr(ex, 'subcommand_parser', None) or self)}\n")
        self.exit(2)


def checkpoint_folders(trainer: L.Trainer) -> list[str]:
    """Each ``ModelCheckpoint``'s explicit ``dirpath``, and without a logger ``<default_root_dir>/checkpoints``."""
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    folders = [os.fspath(cb.dirpath) for cb in callbacks if cb.dirpath is not None]
    if trainer.logger is None and any(cb.dirpath is None for cb in callbacks):
        folders.append(os.path.join(trainer.default_root_dir, "checkpoints"))
    return list(dict.fromkeys(folders))


def _newest_last(folders: list[tuple[str, str]]) -> str | None:
    """The newest ``last*.ckpt`` of ``(checkpoint folder, its locked folder)`` pairs, interrupted saves finished."""
    for checkpoints, locked in folders:
        if live_owner(locked, above=True) is None:  # never under a live run: its save may be in progress
            recover_interrupted_saves(checkpoints)
    found = [
        os.path.join(checkpoints, name)
        for checkpoints, _ in folders
        for name in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else ())
        if _LAST.match(name)
    ]
    return max(found, key=os.path.getmtime) if found else None


def find_last_checkpoint(trainer: L.Trainer) -> str | None:
    """The newest ``last*.ckpt`` of :func:`checkpoint_folders`, else of ``<save_dir>/<name>/version_*/`` (adopted)."""
    if folders := checkpoint_folders(trainer):
        return _newest_last([(f, f) for f in folders])
    logger = trainer.logger
    if getattr(logger, "save_dir", None) is None:
        return None
    root = os.path.join(logger.save_dir, str(logger.name or ""))
    fixed = getattr(logger, "_version", None)
    folder = "version_*" if fixed is None else (fixed if isinstance(fixed, str) else f"version_{fixed}")
    pattern = os.path.join(glob.escape(root), folder, "checkpoints")
    newest = _newest_last([(c, os.path.dirname(c)) for c in glob.glob(pattern)])
    if newest is not None and fixed is None:
        version = os.path.basename(os.path.dirname(os.path.dirname(newest)))
        logger._version = int(version[len("version_") :]) if re.fullmatch(r"version_\d+", version) else version
    return newest


def take_run_folder(trainer: L.Trainer, fresh: bool = False) -> RunFolderLock | None:
    """On rank 0, lock the run folder (the logger's ``log_dir``); ``fresh`` (resuming nothing) refuses one with files.

    Raises:
        FileExistsError: naming the folder, what it holds and the remedies.
    """
    if trainer.global_rank != 0:
        return None
    # reading log_dir fixes a fresh run's version (the logger numbers on from the folders it finds)
    folder = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    if not isinstance(folder, (str, os.PathLike)) or not folder:
        return None
    lock = RunFolderLock.acquire(os.fspath(folder))
    held = sorted(e for e in os.listdir(lock.folder) if not e.startswith(LOCK_NAME)) if fresh else []
    if held:
        lock.release()
        raise FileExistsError(
            f"run folder {lock.folder} already holds another run's files ({', '.join(held[:5])}"
            f"{' …' if len(held) > 5 else ''}): a new run there would overwrite its config and mix its TensorBoard "
            "curves. Continue that run with --ckpt_path last, give this one another "
            "--trainer.logger.init_args.version, or remove the folder"
        )
    return lock


def take_checkpoint_folders(trainer: L.Trainer) -> list[RunFolderLock]:
    """On rank 0, lock every folder of :func:`checkpoint_folders` like the run folder (see :class:`RunFolderLock`)."""
    locks: list[RunFolderLock] = []
    if trainer.global_rank != 0:
        return locks
    try:
        for folder in checkpoint_folders(trainer):
            if not os.path.isdir(folder):  # Lightning's "not empty" warning would be about this lock alone
                pattern = f"Checkpoint directory {re.escape(folder)} exists and is not empty"
                warnings.filterwarnings("ignore", message=pattern)
            locks.append(RunFolderLock.acquire(folder))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def remove_failed_start(trainer: L.Trainer, lock: RunFolderLock | None) -> list[str]:
    """After an exception, remove (and return) the run folder this process created if it holds no checkpoint."""
    if lock is None or not lock.created or not lock.held() or trainer.global_step > 0 or trainer.global_rank != 0:
        return []
    if glob.glob(os.path.join(glob.escape(lock.folder), "**", "*.ckpt"), recursive=True):
        return []
    for logger in trainer.loggers:  # close open event/metrics files before their folder goes
        with contextlib.suppress(Exception):  # best effort: the folder is removed either way
            logger.finalize("failed")
    shutil.rmtree(lock.folder, ignore_errors=True)
    return [lock.folder]


def _callbacks_replacement(args: list[str]) -> int | None:
    """The index of the first argument replacing the whole ``trainer.callbacks`` list (not ``+=``, ``[]``, ``null``)."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key != "--trainer.callbacks":
            continue
        if (value if eq else (args[i + 1] if i + 1 < len(args) else "")) not in ("[]", "null"):
            return i
    return None


def _as_list(value: object) -> list:
    """``value`` as a list: ``None`` empty, a list or tuple copied, anything else alone."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _callback_classes(config) -> list[str]:
    """The class path of each ``trainer.callbacks`` entry of a parsed config (of its subcommand's section if any)."""
    section = config.get(config.get("subcommand")) if config.get("subcommand") else config
    value = (section or {}).get("trainer", {}) or {}
    return [
        str(c.get("class_path")) if hasattr(c, "get") else f"{type(c).__module__}.{type(c).__qualname__}"
        for c in _as_list(value.get("callbacks") if hasattr(value, "get") else None)
    ]


def _model_options(args: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The model class's short name and ``(option under init_args, where given)`` from the arguments and configs."""
    family, given = None, []

    def from_config(model: object, where: str) -> None:
        nonlocal family
        if isinstance(model, str):
            family = model
        elif isinstance(model, dict):
            family = model.get("class_path", family)
            init = model.get("init_args") or {}
            for key, value in init.items() if isinstance(init, dict) else ():
                given.append((key, where))
                if key == "followers" and isinstance(value, dict):
                    given.extend((f"followers.{k}", where) for k in value)

    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if name == "--config" and os.path.isfile(value):
            with open(value) as f, contextlib.suppress(yaml.YAMLError):
                config = yaml.safe_load(f)  # plain values only: nothing in it is imported or run
                from_config(config.get("model") if isinstance(config, dict) else None, value)
        elif name in ("--model", "--model.class_path"):
            family = value
        elif name.startswith("--model."):
            given.append((name.removeprefix("--model.").removeprefix("init_args."), "the command line"))
    return (family.rsplit(".", 1)[-1] if isinstance(family, str) else None), given


def renamed_options(args: list[str]) -> list[str]:
    """A message for each option given by a name :data:`RENAMED_OPTIONS` retired for the model's family."""
    family, given = _model_options(args)
    renamed = RENAMED_OPTIONS.get(family or "", {})
    return [
        f"model.init_args.{key} ({where}) is now model.init_args."
        f"{'followers.' if key.startswith('followers.') else ''}policy_gradient.{renamed[key]} for {family}"
        for key, where in given
        if key in renamed
    ]


class AlignmentCLI(LightningCLI):
    """LightningCLI with ``--test_after_fit``, TensorBoard by default, no ``--optimizer`` (families build theirs)."""

    @override
    def parse_arguments(self, parser, args) -> None:
        """Refuse ``--optimizer``/``--lr_scheduler`` with the reason, before jsonargparse's generic error."""
        given = sys.argv[1:] if args is None else args
        given = [str(a) for a in given] if isinstance(given, (list, tuple)) else None
        for name in (arg.split("=", 1)[0].split(".", 1)[0] for arg in given or ()):
            if name in _OWN_OPTIMIZERS:
                parser.error(
                    f"{name} is not an option: every family builds its own optimizers (one per player), and "
                    "LightningCLI's would replace them. Name another with --model.init_args.optimizer and set "
                    "the rates on the model: "
                    "--model.init_args.lr (preference, SFT, GRPO, debate), leader_lr/follower_lr (deep-SMIDA), "
                    "followers.lr (pool), eta_leader/eta_follower (tabular SMIDA); see docs/configuration.md"
                )
        if given and (renamed := renamed_options(given)):
            parser.error("; ".join(renamed))
        super().parse_arguments(parser, args)
        if given is not None:
            self._refuse_dropped_callbacks(parser, given)

    def _refuse_dropped_callbacks(self, parser, given: list[str]) -> None:
        """Refuse ``--trainer.callbacks=X`` dropping the configs' callbacks (``=[]`` or ``null`` then ``+=`` may)."""
        first = _callbacks_replacement(given)
        if first is None or any(a in ("-h", "--help") for a in given):
            return
        before, after = _callback_classes(parser.parse_args(given[:first])), _callback_classes(self.config)
        if dropped := [c for c in dict.fromkeys(before) if after.count(c) < before.count(c)]:
            parser.error(
                f"--trainer.callbacks: the value given replaces the config's callbacks and drops {dropped}. Add a "
                "callback with --trainer.callbacks+=CLASS (init args: --trainer.callbacks+=CLASS "
                "--trainer.callbacks.init_args.NAME=VALUE); to replace the config's on purpose, clear them first "
                "with --trainer.callbacks=[] and add with +="
            )

    @override
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After fit, run test on the datamodule's held-out set (best checkpoint when one is tracked).",
        )
        parser.add_argument(
            "--trusted_checkpoint_sources",
            type=list[str],
            default=[],
            help="URL prefixes (e.g. https://host/models/) a remote --ckpt_path may be fetched from; any other remote "
            "path is refused. Checkpoints are read with weights_only=True wherever they come from.",
        )

    @override
    def instantiate_classes(self) -> None:
        """Build the model, data and trainer after checking the data files and limits; a family's refusal as is."""
        self._check_inputs()
        try:
            super().instantiate_classes()
        except ValueError as err:
            cause: BaseException = err
            while str(cause).startswith(_UNION_SUMMARY) and (cause.__cause__ or cause.__context__) is not None:
                cause = cause.__cause__ or cause.__context__  # one summary per nested class (model, its utility)
            if type(cause) in (ValueError, FileNotFoundError):  # a family's own refusal of a value or file
                raise (MissingFileError if isinstance(cause, FileNotFoundError) else UserError)(str(cause)) from cause
            if cause is err:
                raise
            raise cause from None

    def _check_inputs(self) -> None:
        """Refuse a missing or unparsable ``data.path`` (``predict_path`` for predict) and negative trainer limits."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        init = (config.get("data") or {}).get("init_args") or {}
        for key in ("path", "predict_path") if self.subcommand == "predict" else ("path",):
            if isinstance(init.get(key), str):
                check_data_file(init[key], f"data.{key}")
        limits = {f"trainer.{k}": (config.get("trainer", {}).get(k), -1) for k in ("max_steps", "max_epochs")}
        require_at_least(**{k: v for k, v in limits.items() if isinstance(v[0], int)})

    @override
    def _parse_ckpt_path(self) -> None:
        """Never parse the checkpoint's hyper-parameters over the config (they could name code to run)."""

    def _check_checkpoint(self) -> None:
        """Refuse a ``--ckpt_path`` of another family, not fitting the model, or remote untrusted, up front."""
        config = self.config_init[self.subcommand]
        path = config.get("ckpt_path")
        if path:
            check_checkpoint_source(str(path), config.get("trusted_checkpoint_sources") or ())
        if not path or not os.path.isfile(path):  # "best"/"last" (Lightning's), a sharded folder: checked on load
            return
        # mapped, not read: only the names and shapes are needed here (Lightning reads the tensors when it restores)
        check_checkpoint_matches(self.model, read_checkpoint(path, mmap=True), source=f"--ckpt_path {path}")

    def before_validate(self) -> None:
        """Check ``--ckpt_path`` before validating, testing or predicting; then lock the run folder."""
        self._check_checkpoint()
        self._take_run_folder()

    before_test = before_predict = before_validate

    @override
    def instantiate_trainer(self, **kwargs):
        """Atomic checkpoint files, DeepSpeed only as ``SafeDeepSpeedStrategy``, and the console callbacks."""
        config = self._get(self.config_init, "trainer", default={}) or {}
        strategy = kwargs.get("strategy", config.get("strategy"))
        if (safe := safe_deepspeed_strategy(strategy)) is not strategy:
            kwargs["strategy"] = safe
        plugins = _as_list(kwargs.get("plugins", config.get("plugins")))
        if "deepspeed" not in str(config.get("strategy", "")) and not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]  # unless a config brings its own CheckpointIO
        callbacks = _as_list(kwargs.get("callbacks", config.get("callbacks")))
        shown = [config.get(f"enable_{k}") is not False for k in ("progress_bar", "model_summary")]
        kwargs["callbacks"] = [*callbacks, *console_callbacks(callbacks, *shown)]
        trainer = super().instantiate_trainer(**kwargs)
        # Lightning's ModelCheckpoint still writes `save_last`'s file at the end of a fast_dev_run
        for callback in trainer.checkpoint_callbacks if trainer.fast_dev_run else ():
            if isinstance(callback, ModelCheckpoint):
                callback.save_last = False
        return trainer

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        """Run holding the run folder's lock: a failed start leaves no ``version_N/``, a full disk names its file."""
        self._run_lock, self._checkpoint_locks = None, []
        try:
            super()._run_subcommand(subcommand)
        except BaseException as err:
            remove_failed_start(self.trainer, self._run_lock)
            if (named := disk_full_error(err)) is not None:
                raise named from err
            raise
        finally:
            for lock in [self._run_lock, *self._checkpoint_locks]:
                if lock is not None:
                    lock.release()
            self._run_lock, self._checkpoint_locks = None, []

    def _take_run_folder(self, fresh: bool = False) -> None:
        """Lock the run folder and the checkpoint folders before the run writes there (:func:`take_run_folder`)."""
        if getattr(self, "_run_lock", None) is None:
            self._run_lock = take_run_folder(self.trainer, fresh)
            self._checkpoint_locks = take_checkpoint_folders(self.trainer)

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path last`` (:func:`find_last_checkpoint`), check the run identity, lock the folders."""
        config = self.config_init[self.subcommand]
        text = self._config_yaml()
        inputs = run_inputs(yaml.safe_load(text) or {}) if text is not None else {}
        given = config.get("ckpt_path")
        if given == "last":
            path = find_last_checkpoint(self.trainer)
            config["ckpt_path"] = path  # None: nothing to resume, a fresh run
            if path is not None:
                rank_zero_info(f"resuming from {path}")
                self._check_same_run(path, text, inputs, strict=True, source=f"--ckpt_path last ({path})")
        elif given and os.path.exists(str(given)):  # an explicit checkpoint (file or sharded folder)
            self._check_same_run(str(given), text, inputs, strict=False, source=f"--ckpt_path {given}")
        # a fresh run refuses another run's folder; `last` with nothing to resume restarts its own (a preempted job)
        self._take_run_folder(fresh=not given)  # before anything is written there
        if text is not None:
            self.trainer.callbacks.append(RunConfigRecord(text, inputs))
        self._check_checkpoint()

    def _config_yaml(self) -> str | None:
        """The resolved config of this run as YAML text (``None``, with a warning, when it cannot be dumped)."""
        try:
            return self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False, skip_check=True)
        except Exception as err:
            rank_zero_warn(f"the run's config could not be recorded in its checkpoints ({err})")
            return None

    def _check_same_run(self, path: str, config_yaml: str | None, inputs: dict, strict: bool, source: str) -> None:
        """Refuse a checkpoint unreadable, of another experiment (``strict``) or inputs; other settings run as given."""
        if (changed := check_resumed_run(path, config_yaml, inputs, strict, source)) is None:
            rank_zero_warn(f"{path} records no run config: not checked to belong to this experiment")
        elif changed:
            rank_zero_info(f"{source}: continuing with the given settings, which differ in {changed}")
            self.trainer.callbacks.append(GivenOptimizerSettings())

    def after_fit(self) -> None:
        """Test on the held-out set with the best checkpoint (or the final weights) when the family has a test set."""
        if not self.config[self.subcommand].get("test_after_fit", True) or self.trainer.interrupted:
            return
        if not is_overridden("test_step", self.model) or not is_overridden("test_dataloader", self.datamodule):
            return
        ckpt = self.trainer.checkpoint_callback
        best = ckpt.best_model_path if ckpt is not None and getattr(ckpt, "best_model_path", "") else None
        if getattr(self.trainer.strategy, "zero_stage_3", False):
            rank_zero_warn(
                "test_after_fit is skipped under DeepSpeed ZeRO-3: DeepSpeed cannot load a ZeRO-3 checkpoint for "
                "testing (deepspeedai/DeepSpeed#7272). Convert the checkpoint with "
                "lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict and run "
                "`train.py test --ckpt_path <converted>` without ZeRO-3 (one device, DDP or ZeRO-2)."
            )
            return
        self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best, weights_only=True)


#: the trainer's default_root_dir: where a run without a logger writes its checkpoints and results
NO_LOGGER_DIR = os.path.join("runs", "no_logger")
_DESCRIPTION = (
    "The alignment-games trainer. Subcommands: fit, validate, test, predict (LightningCLI's) and export: "
    "python train.py export --config <run's config.yaml> --ckpt_path <ckpt> --out <dir> [--merge true] writes a "
    "checkpoint's trained players as peft adapter folders (python train.py export --help; docs/export.md)."
)


def main(args: list[str] | None = None, run: bool = True) -> AlignmentCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]`` (tests call it this way)."""
    # imported before the parser is built, so ``fit --help`` lists the families and ``--model GRPO`` resolves
    model_families()
    data_families()
    # The state after the optimizer step, which this warning is about, is the state a resume needs.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization and every_n_train_steps")
    quiet_lightning_console()
    # no placeholder hp_metric (-1 at the start, never updated): docs/tensorboard.md
    tensorboard = {"save_dir": "runs", "name": "default", "default_hp_metric": False}
    trainer_defaults = {
        # without a logger (and in a fast_dev_run) what the run writes goes here, not in the working folder
        "default_root_dir": NO_LOGGER_DIR,
        "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": tensorboard},
        "callbacks": [RNGStateCallback(), CheckpointOnSigterm()],  # persistent: added to a config's callbacks
    }
    return AlignmentCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,  # the families own their optimizers (see AlignmentCLI)
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_class=AlignmentArgumentParser,
        parser_kwargs={
            "description": _DESCRIPTION,
            "usage": "train.py [-h] [-c CONFIG] {fit,validate,test,predict,export} ...",
        },
        trainer_defaults=trainer_defaults,
    )


def dispatch(args: list[str] | None = None) -> bool:
    """Run ``export`` (:mod:`alignment_games.modules.checkpoints.export`), which LightningCLI lacks; whether it ran."""
    args = sys.argv[1:] if args is None else args
    if not args or args[0] != "export":
        return False
    from alignment_games.modules.checkpoints.export import export_command

    export_command(args[1:])
    return True


def require_games_extra() -> None:
    """Exit 2 naming the ``games`` extra when its packages are missing (the callbacks-only install)."""
    missing = []  # by distribution metadata: find_spec would look peft up on every --help
    for name in ("jsonargparse", "transformers", "peft"):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        print(
            f"error: the trainer needs the games extra ({', '.join(missing)} not installed): "
            'pip install "alignment-games[games]" (in a clone: pip install -r requirements.txt)',
            file=sys.stderr,
        )
        sys.exit(2)


if __name__ == "__main__":
    require_games_extra()
    follow_the_launcher()  # a DDP rank launched by rank 0 ends with it, even before the process group forms
    try:
        dispatch() or main()
    except SIGTERMException:
        sys.exit(143)  # stopped by SIGTERM (128 + 15), after writing last.ckpt: not a finished run
    except USER_ERRORS as err:  # a bad config value, file or row: its message is the whole report
        if os.environ.get(VERBOSE):
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)
