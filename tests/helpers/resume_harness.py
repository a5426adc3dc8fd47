"""Kill/resume harness: run ``train.py fit`` in child processes, kill them, resume with ``--ckpt_path last``, compare.

A family is one :class:`Family` entry (a config, small overrides, its batches per epoch and checkpoint cadence);
adding a family to the resume tests is adding one entry to ``resume_families.FAMILIES``.

How a family is exercised (``tests/test_resume.py``):

1. a reference run, uninterrupted, to ``max_steps``;
2. a chain of runs in one log folder: each is killed by :class:`KillSwitch` (SIGTERM or SIGKILL, after a given
   training batch or at the start of an epoch), the next one starts with ``--ckpt_path last``; the last one runs to
   the end. Every resumed run must start exactly where the newest checkpoint stood and log, step for step, the
   numbers the reference run logged (exact equality on CPU unless the family says otherwise).

Runs are children of a *fork server*: one Python process imports ``train`` and the suite once and forks a child per
run, which then executes exactly what ``python train.py fit ...`` executes (``train.main`` with that argv, the same
signal handling and exit code); this saves the 5-10 s import per run. ``RESUME_HARNESS_SPAWN=1`` runs each as a fresh
``python train.py`` instead. Metrics come from a ``CSVLogger`` overlay (full float64 precision); keys under ``time/``
(wall times) are not compared.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(TESTS))
SKIP_KEYS = ("time/",)


# ----------------------------------------------------------------------------------------------------------------
# The callback that kills a run from inside (deterministic: no polling, no timing)
# ----------------------------------------------------------------------------------------------------------------


class _KillWhenPickled:
    """Sends SIGKILL to its own process when ``torch.save`` pickles it, i.e. in the middle of writing a checkpoint."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached


class SlowSanityCheck(Callback):
    """A sanity check an outside signal can land in, and a marker that says it is running.

    At the start of each sanity-check batch, rank ``r`` writes its pid to ``sanity-rank<r>`` in the working folder
    (written whole, then renamed); the ranks in ``ranks`` then sleep ``seconds``, so the sanity check lasts a few
    seconds and a test can signal one rank while it is inside it (and the others, not slowed, wait for it in the
    sanity check's collectives, as ranks out of step do).
    """

    def __init__(self, seconds: float = 3.0, ranks: list[int] | None = None) -> None:
        super().__init__()
        self.seconds, self.ranks = seconds, ranks

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            return
        marker = Path(f"sanity-rank{trainer.global_rank}")
        marker.with_suffix(".tmp").write_text(str(os.getpid()))
        os.replace(marker.with_suffix(".tmp"), marker)
        if self.ranks is None or trainer.global_rank in self.ranks:
            time.sleep(self.seconds)


class KillSwitch(Callback):
    """Kill this process with ``signal`` after training batch ``after_batch`` (1-based, counted over the whole run,
    resumes included), at the start of epoch ``at_epoch_start``, or while writing the checkpoint of global step
    ``during_save_at`` (``save_mode``: ``"pickle"``, during serialisation; ``"replace"``, after the temporary file is
    written, before it is renamed over the target).
    """

    def __init__(
        self,
        signal: str = "SIGKILL",
        after_batch: int | None = None,
        at_epoch_start: int | None = None,
        during_save_at: int | None = None,
        save_mode: str = "pickle",
    ) -> None:
        super().__init__()
        self.signal = getattr(signal_module, signal)
        self.after_batch, self.at_epoch_start = after_batch, at_epoch_start
        self.during_save_at, self.save_mode = during_save_at, save_mode

    def _kill(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), self.signal)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        if self.after_batch is not None and done == self.after_batch:
            self._kill()

    def on_train_epoch_start(self, trainer, pl_module):
        if self.at_epoch_start is not None and trainer.current_epoch == self.at_epoch_start:
            self._kill()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.during_save_at is None or trainer.global_step != self.during_save_at:
            return
        if self.save_mode == "pickle":
            checkpoint["harness_kill"] = _KillWhenPickled()
        else:
            original = os.replace

            def replace_then_die(src, dst, *a, **k):
                if str(dst).endswith(".ckpt"):
                    os.kill(os.getpid(), signal_module.SIGKILL)
                return original(src, dst, *a, **k)

            os.replace = replace_then_die


signal_module = signal


# ----------------------------------------------------------------------------------------------------------------
# Families
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """One interruption: ``signal`` after batch ``after_batch`` (whole-run count) or at the start of epoch ``epoch``."""

    signal: str
    after_batch: int | None = None
    epoch: int | None = None


@dataclass(frozen=True)
class Family:
    """What the harness needs to know about one model family.

    Attributes:
        name: Test id and logger name.
        config: Config file under ``configs/``.
        args: Small CLI overrides (``{tiny_lm_dir}`` is filled in); include ``--trainer.max_steps``.
        batches_per_epoch: Training batches per epoch with those overrides.
        ckpt_every: Checkpoint cadence in training batches (``every_n_train_steps`` = this × steps_per_batch). Keep
            it off the last batch of an epoch and off the batches that trigger validation (see docs/resuming.md: a step
            checkpoint written just before that work resumes without it).
        steps_per_batch: ``global_step`` per batch (2 for a two-optimizer manual-optimization game, else 1).
        kills: The chain of interruptions (the last run then finishes).
        rel_tol: 0.0 for bitwise equality of every logged number; else the relative tolerance allowed.
        needs_tiny_lm: The overrides use the ``tiny_lm_dir`` fixture.
    """

    name: str
    config: str
    args: tuple[str, ...]
    batches_per_epoch: int
    ckpt_every: int
    steps_per_batch: int = 1
    kills: tuple[Kill, ...] = field(default_factory=tuple)
    rel_tol: float = 0.0
    needs_tiny_lm: bool = False


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------


def overlay_config(family: Family, workdir: Path, kill: Kill | dict[str, Any] | None) -> Path:
    """The family's config with the harness's overlay: CSV logger, checkpoint cadence, quiet, CPU, the kill switch."""
    config = yaml.safe_load(open(os.path.join(ROOT, "configs", family.config)))
    trainer = config.setdefault("trainer", {})
    trainer["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": family.name, "flush_logs_every_n_steps": 1},
    }
    trainer.update(
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, accelerator="cpu", devices=1
    )
    trainer["deterministic"] = True
    callbacks = [
        c for c in trainer.get("callbacks") or [] if not str(c.get("class_path", "")).endswith("ModelCheckpoint")
    ]
    callbacks.append(
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "save_last": True,
                "save_top_k": 0,
                "every_n_train_steps": family.ckpt_every * family.steps_per_batch,
            },
        }
    )
    if kill is not None:
        kw = kill if isinstance(kill, dict) else {"signal": kill.signal}
        if isinstance(kill, Kill):
            if kill.after_batch is not None:
                kw["after_batch"] = kill.after_batch
            else:
                kw["at_epoch_start"] = kill.epoch
        callbacks.append({"class_path": "resume_harness.KillSwitch", "init_args": kw})
    trainer["callbacks"] = callbacks
    config["test_after_fit"] = False
    path = workdir / f"config_{len(list(workdir.glob('config_*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class RunResult:
    returncode: int
    log: str
    metrics: dict[tuple[str, int], list[float]]
    log_dir: Path


class ForkServer:
    """One process that has imported the suite; forks a child per run (see the module docstring)."""

    PRELOAD = (
        "train",
        "resume_harness",
        "alignment_games.modules.preference",
        "alignment_games.modules.deep_smida",
        "alignment_games.modules.nlhf",
        "alignment_games.modules.slhf",
        "alignment_games.modules.sft",
        "alignment_games.modules.tabular_smida",
        "alignment_games.datamodules.preference",
        "alignment_games.datamodules.prompts",
        "alignment_games.datamodules.sft",
        "alignment_games.datamodules.steps",
        "lightning.pytorch.loggers",
    )

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), **_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", *self.PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )
        assert json.loads(self.proc.stdout.readline())["ready"]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def run(self, argv: list[str], cwd: Path, log: Path, timeout: float) -> int:
        pid = self._ask({"argv": argv, "cwd": str(cwd), "log": str(log)})["pid"]
        return self._ask({"wait": pid, "timeout": timeout})["returncode"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONHASHSEED": "0",
    # one thread per run: these tiny models are overhead-bound, and two threads per run on a shared 2-core machine
    # were 5x slower (pool: 73 s against 15 s)
    "OMP_NUM_THREADS": "1",
}


class Runner:
    """Runs ``train.py fit`` for a family in a working folder, through the fork server or as fresh processes."""

    def __init__(self, server: ForkServer | None, tiny_lm_dir: str | None = None, timeout: float = 300) -> None:
        self.server, self.tiny_lm_dir, self.timeout = server, tiny_lm_dir, timeout

    def fit(self, family: Family, workdir: Path, kill=None, resume: bool = False, tag: str = "run") -> RunResult:
        workdir.mkdir(parents=True, exist_ok=True)
        config = overlay_config(family, workdir, kill)
        argv = [
            "fit",
            "--config",
            str(config),
            *(a.replace("{tiny_lm_dir}", str(self.tiny_lm_dir)) for a in family.args),
        ]
        if resume:
            argv.append("--ckpt_path=last")
        log = workdir / f"{tag}.log"
        if self.server is not None:
            rc = self.server.run(argv, workdir, log, self.timeout)
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), **_ENV}
            with open(log, "w") as out:
                rc = subprocess.run(
                    [sys.executable, os.path.join(ROOT, "train.py"), *argv],
                    cwd=workdir,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=self.timeout,
                ).returncode
        log_dir = workdir / "runs" / family.name / "version_0"
        return RunResult(rc, log.read_text(errors="replace"), read_metrics(log_dir / "metrics.csv"), log_dir)


def read_metrics(path: Path) -> dict[tuple[str, int], list[float]]:
    """``{(key, step): [values in logging order]}`` from a CSVLogger file; empty when there is none."""
    out: dict[tuple[str, int], list[float]] = {}
    if not path.exists():
        return out
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            for key, value in row.items():
                if value != "" and not key.startswith(SKIP_KEYS):
                    out.setdefault((key, step), []).append(float(value))
    return out


def compare(
    reference: dict[tuple[str, int], list[float]], resumed: dict[tuple[str, int], list[float]], rel_tol: float = 0.0
) -> list[str]:
    """Differences between what a resumed run logged and what the reference run logged at the same steps.

    Also every number the reference logged from the resumed run's first step to its last must be there.
    """
    problems = []
    if resumed:
        steps = [step for _, step in resumed]
        first, last = min(steps), max(steps)
        for key in sorted(reference):
            if first <= key[1] <= last and key not in resumed:
                problems.append(f"{key}: logged by the reference run, missing after the resume")
    for key, values in sorted(resumed.items()):
        ref = reference.get(key)
        if ref is None:
            problems.append(f"{key}: logged after the resume, never by the reference run")
            continue
        if len(ref) != len(values) or any(
            not (a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0))
            for a, b in zip(ref, values)
        ):
            problems.append(f"{key}: reference {ref} != resumed {values}")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# The fork server's own side
# ----------------------------------------------------------------------------------------------------------------


def _child(argv: list[str], cwd: str, log: str) -> None:
    code = 1
    try:
        os.chdir(cwd)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdin = open(os.devnull)
        sys.argv = ["train.py", *argv]
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from alignment_games import train

        try:
            train.main()
            code = 0
        except SIGTERMException:
            code = 143  # what `python train.py` exits with
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(preload: list[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "argv" in request:
            pid = os.fork()
            if pid == 0:
                _child(request["argv"], request["cwd"], request["log"])
            print(json.dumps({"pid": pid}), flush=True)
        elif "wait" in request:
            pid, deadline = request["wait"], time.monotonic() + request["timeout"]
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    done, status = os.waitpid(pid, 0)
                    break
                time.sleep(0.02)
            print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--serve":
    _serve(sys.argv[2:])
