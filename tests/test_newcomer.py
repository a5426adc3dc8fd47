"""A newcomer's first hour, as subprocesses running the README's commands: a clean console with progress lines, one
``error:`` line (exit 2, no traceback) for each usual mistake, and a quick ``fit --help`` listing only families."""

import json
import os
import re
import resource
import subprocess
import sys
import time

import pytest
from helpers import ROOT

MAIN = ["fit", "--config", os.path.join(ROOT, "configs", "preference_ensemble.yaml")]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop("ALIGNMENT_GAMES_VERBOSE", None)
# what a warning, an advert or an empty FLOPs count looks like on the console
NOISE = re.compile(r"Warning|warn\(|deprecated|💡|Tip:|FLOPs|Flops|eval mode at the start", re.IGNORECASE)


def _train(*args: str, cwd: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def _malformed(folder) -> str:
    """A JSON Lines file whose 8th line does not parse (the 7 before it do)."""
    rows = [json.dumps({"prompt": f"{i} + 1?", "chosen": f"{i + 1}", "rejected": "0"}) for i in range(9)]
    rows[7] = '{"prompt": "7 + 1?", "chosen": "8", "rejected": '
    (folder / "pairs.jsonl").write_text("\n".join(rows) + "\n")
    return str(folder / "pairs.jsonl")


BAD_INPUTS = {  # the mistake: (arguments, what the one error line must name); {tmp} is the test's folder
    "typo_on_command_line": (["--trainer.max_epoch=1"], "did you mean --trainer.max_epochs?"),
    "typo_in_config_file": (["--config", "{tmp}/typo.yaml"], "trainer.max_epocs'; did you mean trainer.max_epochs?"),
    "typo_in_model_option": (["--model.init_args.num_member=3"], "num_member is not an option of Preference"),
    "missing_data_file": (["--data.init_args.path={tmp}/nope.jsonl"], "data.path: '{tmp}/nope.jsonl' does not exist"),
    "malformed_jsonl_row": (["--data.init_args.path={tmp}/pairs.jsonl"], "line 8: not valid JSON"),
    "negative_max_steps": (["--trainer.max_steps=-5"], "trainer.max_steps must be at least -1, got -5"),
    "range_check": (["--data.init_args.val_fraction=1.5"], "val_fraction must be in [0, 1), got 1.5"),
    "wrong_family_name": (["--model=PreferenceEnsembl"], "no family named PreferenceEnsembl; did you mean Preference"),
    "wrong_builtin_model": (["--model.init_args.lm.name_or_path=builtin:nope"], "unknown builtin model 'builtin:nope'"),
    "bad_value_type": (["--trainer.max_epochs=abc"], "trainer.max_epochs: expected int, got abc"),
}


@pytest.mark.e2e  # a subprocess each, 10-30 s on 2 busy cores (the imports)
@pytest.mark.parametrize("mistake", sorted(BAD_INPUTS))
def test_a_mistake_ends_in_one_error_line_naming_it(mistake, tmp_path):
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_epocs: 1\n")
    _malformed(tmp_path)
    args, culprit = BAD_INPUTS[mistake]
    # were the mistake accepted, the run stays short and writes under tmp_path
    guard = ["--trainer.logger=false", "--trainer.max_steps=1", "--test_after_fit=false"]
    given = [a.format(tmp=tmp_path) for a in [*MAIN, *guard, *args]]
    proc = _train(*given, "--trainer.default_root_dir", str(tmp_path / "runs"), cwd=str(tmp_path))
    console = proc.stdout + proc.stderr
    errors = [line for line in console.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, console[-3000:]
    assert len(errors) == 1 and culprit.format(tmp=tmp_path) in errors[0], console[-3000:]
    assert "Traceback" not in console and "usage:" not in console
    assert not (tmp_path / "runs").exists()  # refused before anything ran


@pytest.mark.e2e  # about 10 s of CPU
def test_fit_help_is_quick_and_lists_only_families(tmp_path):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = _train("fit", "--help", cwd=str(tmp_path))
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # its CPU time: the wall time on a shared machine measures the other jobs (10 s measured quiet, README)
    assert cpu <= 10.0, f"fit --help took {cpu:.1f} s of CPU ({wall:.1f} s wall)"
    listed = "".join(proc.stdout.split())
    assert "alignment_games.modules.preference.PreferenceEnsemble" in listed
    for internal in ("modules.base.", "lightning.LightningModule,", "lightning.LightningDataModule,"):
        assert internal not in listed
    top = _train("--help", cwd=str(tmp_path))
    assert "{fit,validate,test,predict,export}" in top.stdout.splitlines()[0]


@pytest.mark.e2e  # the main job shrunk to 4 training and 2 held-out batches: 2-3 minutes on 2 busy cores
def test_the_main_jobs_console_is_clean_and_never_silent_for_30_s(tmp_path):
    """The README's first command with fewer batches (the same console code: bar, lines, summary, report)."""
    shrink = ["--trainer.max_epochs=1", "--trainer.log_every_n_steps=1"]
    shrink += [f"--trainer.limit_{k}_batches={n}" for k, n in (("train", 4), ("val", 2), ("test", 2))]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *MAIN, *shrink]
    cmd += ["--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    lines, start = [], time.monotonic()
    with subprocess.Popen(cmd, cwd=str(tmp_path), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for raw in proc.stdout:
            lines.append((time.monotonic() - start, raw.decode(errors="replace").rstrip()))
    console = "\n".join(text for _, text in lines)
    assert proc.returncode == 0, console[-3000:]
    assert [text for _, text in lines if NOISE.search(text)] == []
    # from the first line on (before it: the imports), never 30 s without one
    gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1:])]
    assert max(gaps) <= 30.0, console
    folder = str(tmp_path / "runs" / "preference_ensemble" / "version_0")
    progress = re.compile(rf"\[\d+:\d\d\] (fit|sanity check|validate|test): .*; writing to {re.escape(folder)}")
    assert any(progress.match(text) for _, text in lines)
    assert os.path.isfile(os.path.join(folder, "report.json"))


UNION = "  Does not validate against any of the Union subtypes\n  Errors:\n"
# jsonargparse 4.53's reports, as printed before this suite condensed them
REPORTS = {
    'Parser key "trainer.max_epochs":\n' + UNION + "    - Expected a <class 'int'>\n"
    "    - Expected a <class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: abc": "trainer.max_epochs: "
    "expected int, got abc",
    'Parser key "model":\n' + UNION + "    - Problem with given class_path 'alignment_games.modules.preference."
    "PreferenceEnsemble':\n        Option 'num_member' is not accepted\n    - Expected a <class 'NoneType'>\n"
    "  Given value: NestedArg(key='num_member', val='3')": "model.init_args.num_member is not an option of "
    "PreferenceEnsemble; did you mean num_members?",
    'Parser key "model":\n  - Expected a path but GRP either not accessible or invalid\n' + UNION + "    - Expected a "
    "dot import path string: GRP\n  Given value: GRP": "model: no family named GRP; did you mean GRPO? (python "
    "train.py fit --help lists them)",
}


@pytest.mark.parametrize("report", sorted(REPORTS))
def test_a_jsonargparse_report_becomes_one_line_with_a_suggestion(report):
    from alignment_games import train
    from alignment_games.modules import preference  # noqa: F401  (the family whose options are suggested)

    assert train.one_line_error(report, None) == REPORTS[report]
