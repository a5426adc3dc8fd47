"""ProgressLines: a line at once when a stage starts (a run shorter than the interval still says where it writes),
then one every interval with the phase, until teardown."""

import re
import time
from types import SimpleNamespace

from lightning.pytorch.trainer.states import TrainerFn

from alignment_games.callbacks.progress import ProgressLines


def test_a_line_at_setup_then_one_per_interval_until_teardown(capsys, tmp_path):
    trainer = SimpleNamespace(log_dir=str(tmp_path), default_root_dir=None, is_global_zero=True)
    lines = ProgressLines(every=0.2)
    lines.setup(trainer, None, TrainerFn.FITTING)  # what Lightning passes: its str() is "TrainerFn.FITTING"
    time.sleep(0.05)
    first = capsys.readouterr().out.splitlines()
    assert first == [f"[0:00] fit: setting up; writing to {tmp_path}"]
    lines.doing = "fit: Epoch 0/0, batch 2/4"
    time.sleep(0.5)
    lines.teardown(trainer, None, "fit")
    later = capsys.readouterr().out.splitlines()
    line = rf"\[0:00\] fit: Epoch 0/0, batch 2/4; writing to {re.escape(str(tmp_path))}"
    assert 1 <= len(later) <= 3 and all(re.fullmatch(line, x) for x in later)
    time.sleep(0.4)
    assert capsys.readouterr().out == ""  # stopped at teardown


def test_other_ranks_print_nothing(capsys, tmp_path):
    trainer = SimpleNamespace(log_dir=str(tmp_path), default_root_dir=None, is_global_zero=False)
    lines = ProgressLines(every=0.05)
    lines.setup(trainer, None, "fit")
    time.sleep(0.2)
    lines.teardown(trainer, None, "fit")
    assert capsys.readouterr().out == ""
