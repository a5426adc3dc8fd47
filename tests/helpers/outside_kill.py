"""Outside-kill resume harness: ``python train.py fit`` as a real subprocess, killed by a signal sent from outside.

What one check does (:func:`kill_and_resume`):

1. an uninterrupted reference run of a family, in its own folder;
2. in a second folder, the same command; the harness polls that folder (every millisecond) for a :class:`Moment`
   (the n-th completed write of ``last.ckpt``, a checkpoint temporary present = during a save, a logged row = after
   a training batch or during validation) and sends ``SIGKILL`` or ``SIGTERM`` to the run's process group, the way a
   scheduler does. The next run of the chain starts with ``--ckpt_path last``; the last one runs to the end;
3. everything the two folders hold is compared (:func:`compare_runs`): every tensor of every checkpoint (weights and
   adapters, every optimizer state tensor, the callbacks' and the module's game state, every rank's RNG states) and
   every plain value in it, exactly; every output file byte for byte; the logged numbers.

Determinism of the moment: once the marker is seen the harness freezes the process group with ``SIGSTOP``, checks
that the marker still holds (the temporary is still there, the validation row has not appeared yet), then sends the
signal (and ``SIGCONT``, so a SIGTERM is handled). A marker that no longer holds once frozen is let go and the next
occurrence is waited for. The result (which batch the kill landed after, what checkpoint it resumed from) may vary
with the machine's load, the comparison must not: the resumed run has to end bit for bit where the reference ends
whichever batch it was killed at. A run that ends before its moment is a harness failure (:class:`MissedMoment`).

Runs reuse the families of :mod:`resume_families` (configs, tiny overrides, checkpoint cadence) and the overlay of
:mod:`resume_harness` (CSV logger, ``deterministic``, ``ModelCheckpoint(save_last, every_n_train_steps)``), without
its in-process kill switch.

Not compared, and why: the processes' own stdout/stderr (timings, warnings, paths); ``metrics.csv`` as a file
(Lightning's ``CSVLogger`` deletes the file of an existing version folder when a resumed run first saves, so the
harness copies it after every stage and compares the rows the stages logged, merged, with the reference's rows;
columns under ``time/`` hold wall-clock times); in ``config.yaml`` (LightningCLI's copy of the resolved config) the
``ckpt_path`` line, which is ``last`` only in the resumed runs (also left out of the config recorded in the
checkpoints); in the checkpoints, absolute paths are compared with
the run's own folder replaced by ``<RUN>``; ``last.ckpt`` when the two hold different steps (Lightning writes the
end-of-training ``last`` only in a process that wrote none before), while ``final.ckpt``, written at the end of
training by ``final_state.FinalState`` in both runs, always is.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from .resume_harness import _ENV, ROOT, SKIP_KEYS, TESTS, Family, overlay_config

HARNESS_FILES = ("config_", "stage", "reference.log")  # the harness's own files in a run folder


# ----------------------------------------------------------------------------------------------------------------
# Moments
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Moment:
    """When to send the signal, judged from outside by what the run's folder holds.

    Attributes:
        kind: ``"checkpoint"``: the ``n``-th completed write of ``last.ckpt`` (a new file: the writes are atomic
            renames) has been seen; ``"save"``: a temporary of ``last.ckpt`` is present, i.e. a save is under way
            (the ``n``-th one seen); ``"row"``: ``metrics.csv`` holds a row at ``step`` with a ``key`` column;
            ``"validation"``: the training row of ``step`` is there, the validation row (column ``key``) is not
            yet, i.e. the run is validating (or finishing the batch before it).
        n: Which occurrence (``checkpoint``/``save``).
        step: The logged step (``row``/``validation``).
        key: The column (``row``: present at ``step``; ``validation``: absent, the validation metric).
    """

    kind: str
    n: int = 1
    step: int = 0
    key: str = ""


@dataclass(frozen=True)
class Kill:
    """One interruption of the chain: ``signal`` (``"SIGKILL"`` or ``"SIGTERM"``) at ``moment``."""

    signal: str
    moment: Moment


class MissedMoment(AssertionError):
    """The run ended before the moment it was to be killed at."""


class _Watch:
    """Polls a run folder for a :class:`Moment`; state kept across polls (writes and saves seen so far)."""

    def __init__(self, log_dir: Path, moment: Moment) -> None:
        self.log_dir, self.moment = log_dir, moment
        self.ckpt_dir = log_dir / "checkpoints"
        self.writes: set[tuple[int, int]] = set()
        self.saves, self.saving = 0, False
        self.first_write: tuple[int, int] | None = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.ckpt_dir / "last.ckpt")
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def _temps(self) -> list[str]:
        try:
            return [e for e in os.listdir(self.ckpt_dir) if e.startswith(".last.ckpt.tmp-")]
        except FileNotFoundError:
            return []

    def _rows(self) -> list[dict[str, str]]:
        try:
            text = (self.log_dir / "metrics.csv").read_text()
        except FileNotFoundError:
            return []
        if not text.endswith("\n"):  # a row being written: judge by the complete ones
            text = text[: text.rfind("\n") + 1]
        return list(csv.DictReader(io.StringIO(text)))

    def _has(self, key: str, step: int) -> bool:
        return any(r.get("step") == str(step) and r.get(key, "") != "" for r in self._rows())

    def seen(self) -> bool:
        """Whether the moment has come (updates what has been seen)."""
        m = self.moment
        if m.kind == "checkpoint":
            st = self._stat()
            if st is not None and st != self.first_write:
                self.writes.add(st)
            return len(self.writes) >= m.n
        if m.kind == "save":
            # a save begins when a temporary appears (one process reuses its temporary's name for every save)
            present = bool(self._temps())
            self.saves += present and not self.saving
            self.saving = present
            return self.saves >= m.n and present
        if m.kind == "row":
            return self._has(m.key, m.step)
        if m.kind == "validation":
            return any(r.get("step") == str(m.step) for r in self._rows()) and not self._has(m.key, m.step)
        raise ValueError(f"unknown moment {m.kind!r}")

    def holds(self) -> bool:
        """Whether the moment still holds, checked while the run is frozen."""
        m = self.moment
        if m.kind == "save":
            return bool(self._temps())
        if m.kind == "validation":
            return not self._has(m.key, m.step)
        return True


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Stage:
    """One process of a chain: its exit code, the kill (if any), where it stood when killed, its CPU seconds."""

    returncode: int
    kill: Kill | None
    log: str
    cpu_s: float
    temps_left: list[str] = field(default_factory=list)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class OutsideRunner:
    """Runs ``train.py fit`` for a family as a fresh subprocess in its own session, and kills it from outside.

    Args:
        tiny_lm_dir: Filled into ``{tiny_lm_dir}`` of the family's overrides.
        extra: Overrides added to every run (e.g. a DDP overlay's ``--config``).
        timeout: Seconds one process may take.
        callbacks: Callbacks added to every run's config (``class_path``/``init_args`` entries).
    """

    def __init__(
        self,
        tiny_lm_dir: str | None = None,
        extra: tuple[str, ...] = (),
        timeout: float = 900,
        callbacks: tuple[dict[str, Any], ...] = (),
    ) -> None:
        self.tiny_lm_dir, self.extra, self.timeout, self.callbacks = tiny_lm_dir, extra, timeout, callbacks

    def argv(self, family: Family, workdir: Path, resume: bool) -> list[str]:
        config = overlay_config(family, workdir, None)
        overlay = yaml.safe_load(config.read_text())  # plus the final state, written when training ends
        overlay["trainer"]["callbacks"] += [{"class_path": "final_state.FinalState"}, *self.callbacks]
        config.write_text(yaml.safe_dump(overlay))
        args = [a.replace("{tiny_lm_dir}", str(self.tiny_lm_dir)) for a in family.args]
        argv = [sys.executable, os.path.join(ROOT, "train.py"), "fit", "--config", str(config), *args, *self.extra]
        return [*argv, "--ckpt_path=last"] if resume else argv

    def run(self, family: Family, workdir: Path, kill: Kill | None, resume: bool, tag: str) -> Stage:
        """One process: to the end, or until ``kill`` is sent at its moment (then waited for)."""
        workdir.mkdir(parents=True, exist_ok=True)
        log_dir = workdir / "runs" / family.name / "version_0"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), **_ENV}
        log_path = workdir / f"{tag}.log"
        cpu0 = _children_cpu()
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                self.argv(family, workdir, resume),
                cwd=workdir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the signal reaches DDP's other ranks too
            )
            try:
                temps = self._wait(proc, log_dir, kill)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        stage = Stage(proc.returncode, kill, log_path.read_text(errors="replace"), _children_cpu() - cpu0, temps)
        if (log_dir / "metrics.csv").exists():  # CSVLogger deletes it when the next run of the chain saves
            shutil.copy(log_dir / "metrics.csv", workdir / f"{tag}.metrics.csv")
        return stage

    def _wait(self, proc: subprocess.Popen, log_dir: Path, kill: Kill | None) -> list[str]:
        deadline = time.monotonic() + self.timeout
        watch = None if kill is None else _Watch(log_dir, kill.moment)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"train.py ran past {self.timeout} s")
            if watch is not None and watch.seen():
                os.killpg(proc.pid, signal.SIGSTOP)  # frozen: the marker cannot change while it is checked
                if watch.holds():
                    temps = watch._temps()
                    os.killpg(proc.pid, getattr(signal, kill.signal))
                    os.killpg(proc.pid, signal.SIGCONT)
                    proc.wait(timeout=self.timeout)
                    _reap_group(proc.pid)
                    return temps
                os.killpg(proc.pid, signal.SIGCONT)  # missed (the save finished): wait for the next occurrence
            time.sleep(0.001)
        if watch is not None:
            raise MissedMoment(f"the run ended (rc {proc.returncode}) before {kill.moment}")
        _reap_group(proc.pid)
        return []


def _reap_group(pgid: int, timeout: float = 60) -> None:
    """Wait until no process of the group is left (DDP's other ranks die with the launcher, or are killed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """What was compared and what differed."""

    tensors: int = 0
    values: int = 0
    files: int = 0
    rows: int = 0
    cpu_s: float = 0.0
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def figures(self) -> str:
        return (
            f"{self.tensors} tensors, {self.values} other values, {self.files} files, {self.rows} logged numbers: "
            f"{len(self.differences)} differences ({self.cpu_s:.0f} CPU s in train.py processes)"
            + "".join(f"; {n}" for n in self.notes)
        )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values (NaN where NaN, both sides)."""
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _compare_objects(a: Any, b: Any, where: str, report: Report, roots: tuple[str, str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        report.tensors += 1
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            report.differences.append(f"{where}: a tensor on one side only")
        elif a.dtype != b.dtype or a.shape != b.shape:
            report.differences.append(f"{where}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}")
        elif not _same_tensor(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num().max().item() if a.is_floating_point() else "integer"
            report.differences.append(f"{where}: values differ (max abs {diff})")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        # a report's provenance names its own stage's command and the checkpoint it resumed from: it differs by design
        for k in sorted((set(a) | set(b)) - {"provenance"}, key=str):
            if k not in a or k not in b:
                report.differences.append(f"{where}[{k!r}]: only in the {'reference' if k in a else 'resumed run'}")
            else:
                _compare_objects(a[k], b[k], f"{where}[{k!r}]", report, roots)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            report.differences.append(f"{where}: length {len(a)} against {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _compare_objects(x, y, f"{where}[{i}]", report, roots)
        return
    report.values += 1
    if isinstance(a, str) and isinstance(b, str):
        a, b = a.replace(roots[0], "<RUN>"), b.replace(roots[1], "<RUN>")
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    if not same or type(a) is not type(b):
        report.differences.append(f"{where}: {a!r} against {b!r}")


def _read_rows(paths: list[Path]) -> dict[tuple[str, int], list[str]]:
    """``{(column, step): [values]}`` of CSVLogger files (stages merged: a later stage replaces a step it logged)."""
    merged: dict[tuple[str, int], list[str]] = {}
    for path in paths:
        own: dict[tuple[str, int], list[str]] = {}
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(row.pop("step"))
                for key, value in row.items():
                    if value != "" and not key.startswith(SKIP_KEYS):
                        own.setdefault((key, step), []).append(value)
        merged.update(own)
    return merged


def _output_files(workdir: Path) -> dict[str, Path]:
    out = {}
    for path in workdir.rglob("*"):
        rel = path.relative_to(workdir).as_posix()
        # a checkpoint's .sha256 sidecar (a sharded one's SHA256SUMS) follows its bytes, which differ with the
        # recorded ckpt_path: the checkpoints themselves are compared by value
        skip = rel.startswith(HARNESS_FILES) or rel.endswith(("metrics.csv", ".ckpt.sha256", ".ckpt/SHA256SUMS"))
        if path.is_file() and not skip:
            out[rel] = path
    return out


def compare_runs(reference: Path, resumed: Path, stages: list[str], family: Family) -> Report:
    """Compare every output of the run folder ``resumed`` with the uninterrupted run's ``reference``.

    Checkpoints (``*.ckpt``) are loaded and compared value by value (every tensor bitwise, every plain value
    exactly); JSON and JSONL files value by value, each run folder's own path read as ``<RUN>`` (an export records
    its base's absolute path), a report's ``provenance`` (its stage's command) left out; other files byte for byte
    (``config.yaml`` without its ``ckpt_path`` line); the logged numbers of the stages (``<stage>.metrics.csv``,
    merged) against the reference's, as text, so to the last digit.
    """
    report = Report()
    roots = (str(reference), str(resumed))
    ref_files, res_files = _output_files(reference), _output_files(resumed)
    for rel in sorted(set(ref_files) | set(res_files)):
        if rel not in ref_files or rel not in res_files:
            # a temporary of a killed save is removed by the next save; one left at the end is a difference
            report.differences.append(f"{rel}: only in the {'reference' if rel in ref_files else 'resumed run'}")
            continue
        a, b = ref_files[rel], res_files[rel]
        if rel.endswith((".ckpt", ".pt")):  # torch files: loaded, every tensor and value compared
            load = {"map_location": "cpu", "weights_only": True}
            x, y = torch.load(a, **load), torch.load(b, **load)
            if rel.endswith("/last.ckpt") and x["global_step"] != y["global_step"]:
                # Lightning's end-of-training `last` is written only by a process that wrote none before, so at
                # the end it holds the final state or the last periodic one, by process history (final.ckpt
                # holds the final state in both): compared only when both are of the same step
                report.notes.append(f"{rel}: steps {x['global_step']} and {y['global_step']} (not compared)")
                continue
            for ckpt in (x, y):  # the recorded config (callbacks/run_config.py) says `ckpt_path: last` when resumed
                if isinstance(ckpt.get("run_config"), str):
                    ckpt["run_config"] = re.sub(r"(?m)^ckpt_path: .*\n?", "", ckpt["run_config"])
            _compare_objects(x, y, rel, report, roots)
            report.files += 1
            continue
        report.files += 1
        if rel.endswith("config.yaml"):
            x, y = (yaml.safe_load(p.read_text()) for p in (a, b))
            x.pop("ckpt_path", None), y.pop("ckpt_path", None)
            if x != y:
                report.differences.append(f"{rel}: the resolved configs differ")
        elif rel.endswith(".json"):  # values compared, the two run folders' own paths read as one (<RUN>)
            _compare_objects(json.loads(a.read_text()), json.loads(b.read_text()), rel, report, roots)
        elif rel.endswith(".jsonl"):  # line by line, as JSON
            lines = ([json.loads(x) for x in p.read_text().splitlines()] for p in (a, b))
            _compare_objects(*lines, rel, report, roots)
        elif a.read_bytes() != b.read_bytes():
            report.differences.append(f"{rel}: contents differ")
    ref_rows = _read_rows([reference / "reference.metrics.csv"])
    res_rows = _read_rows([resumed / f"{s}.metrics.csv" for s in stages if (resumed / f"{s}.metrics.csv").exists()])
    for key in sorted(set(ref_rows) | set(res_rows)):
        report.rows += 1
        if ref_rows.get(key) != res_rows.get(key):
            report.differences.append(f"metrics {key}: {ref_rows.get(key)} against {res_rows.get(key)}")
    return report


def replay_agrees(resumed: Path, stages: list[str]) -> list[str]:
    """Steps logged by two stages of a chain (replayed after a SIGKILL) must hold the same numbers in both.

    A stage killed inside a step logged only the first rows of that step (the training row, not yet the validation
    row), so what the earlier stage logged must be where the replay's values begin.
    """
    problems, seen = [], {}
    for s in stages:
        path = resumed / f"{s}.metrics.csv"
        if not path.exists():
            continue
        for key, values in _read_rows([path]).items():
            if key in seen and values[: len(seen[key][1])] != seen[key][1]:
                problems.append(f"{key}: {seen[key][0]} logged {seen[key][1]}, the replay in {s} {values}")
            seen[key] = (s, values)
    return problems


def kill_and_resume(
    runner: OutsideRunner, family: Family, kills: tuple[Kill, ...], tmp_path: Path, reference: Path | None = None
) -> tuple[Report, list[Stage]]:
    """Reference run (unless given), then the chain of ``kills`` and a final resumed run; the comparison."""
    cpu = 0.0
    if reference is None:
        reference = tmp_path / "reference"
        ref = runner.run(family, reference, None, resume=False, tag="reference")
        assert ref.returncode == 0, ref.log[-4000:]
        cpu = ref.cpu_s
    resumed = tmp_path / "resumed"
    stages = []
    for i, kill in enumerate(kills):
        stage = runner.run(family, resumed, kill, resume=i > 0, tag=f"stage{i}")
        expected = -signal.SIGKILL if kill.signal == "SIGKILL" else 143
        assert stage.returncode == expected, f"stage {i} ({kill}): rc {stage.returncode}\n{stage.log[-4000:]}"
        stages.append(stage)
    final = runner.run(family, resumed, None, resume=True, tag=f"stage{len(kills)}")
    assert final.returncode == 0, final.log[-4000:]
    stages.append(final)
    names = [f"stage{i}" for i in range(len(stages))]
    for folder in (reference, resumed):  # the final state of both is compared (see final_state.py)
        assert (folder / "runs" / family.name / "version_0" / "checkpoints" / "final.ckpt").is_file(), folder
    report = compare_runs(reference, resumed, names, family)
    report.differences += replay_agrees(resumed, names)
    report.cpu_s = cpu + sum(s.cpu_s for s in stages)
    return report, stages
