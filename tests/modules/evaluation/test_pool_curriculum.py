"""The pool curriculum report (modules/evaluation/pool_curriculum.py): hand values, the rebuilt pool, bad files."""

import json

import pytest
import yaml
from helpers.provenance import check_provenance

from alignment_games.commands.pool_curriculum import main
from alignment_games.datamodules.pool import InstructionPoolDataModule
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.evaluation.pool_curriculum import (
    feature_extremes,
    load_weights,
    pool_operations,
    sharpening,
)


def test_sharpening_hand_computed():
    rows = [[0.25] * 4, [0.4, 0.3, 0.2, 0.1]]  # K = 4: n is capped at 2
    out = sharpening(rows, n=5)
    assert out[0] == {"iteration": 0, "top": pytest.approx(1.0), "bottom": pytest.approx(1.0)}
    assert out[1]["top"] == pytest.approx(0.35 * 4) and out[1]["bottom"] == pytest.approx(0.15 * 4)


def test_feature_extremes_hand_computed_and_ties_by_position():
    probs = [0.1, 0.4, 0.1, 0.3, 0.1]
    ops = [2, 4, 3, 4, 2]
    # top 2: items 1, 3 (4, 4); bottom 2 of the order [1, 3, 0, 2, 4]: items 2, 4 (3, 2)
    assert feature_extremes(probs, ops, 2) == {"top": 4.0, "bottom": 2.5, "all": 3.0}
    with pytest.raises(ValueError, match="n must be in"):
        feature_extremes(probs, ops, 3)
    with pytest.raises(ValueError, match="5 probabilities for 4"):
        feature_extremes(probs, ops[:4], 1)


def test_pool_operations_rebuild_the_leaders_instructions():
    data = {"num_problems": 30, "val_fraction": 0.2, "seed": 3}
    ops = pool_operations(data)
    dm = InstructionPoolDataModule(num_problems=30, val_fraction=0.2, seed=3)
    dm.setup("fit")
    by_question = {p.question: len(p.ops) for p in generate_problems(30, seed=3 + 2_000_003)}
    assert ops == [by_question[r["prompt"]] for r in dm.splits["train"]] and len(ops) == 24
    assert set(ops) <= {2, 3, 4}
    with pytest.raises(ValueError, match="data.seed"):
        pool_operations({"seed": "zero"})


def test_bad_history_files_name_the_file_and_row(tmp_path):
    with pytest.raises(FileNotFoundError, match="no pool_history.json"):
        load_weights(str(tmp_path))
    bad = tmp_path / "pool_history.json"
    for record, message in [
        ({"ratings": []}, "no 'weights'"),
        ({"weights": [[0.5, 0.5], [1.0]]}, "row 1 is not a list of 2"),
        ({"weights": [[0.5, float("nan")]]}, "row 0 holds a negative or non-finite"),
    ]:
        bad.write_text(json.dumps(record))
        with pytest.raises(ValueError, match=message):
            load_weights(str(tmp_path))


def test_command_line_reports_each_run(tmp_path, capsys):
    data = {"num_problems": 20, "val_fraction": 0.2, "seed": 0}
    k = len(pool_operations(data))
    run = tmp_path / "run"
    run.mkdir()
    final = [1.0] * k
    final[0] = 3.0
    total = sum(final)
    (run / "pool_history.json").write_text(json.dumps({"weights": [[1 / k] * k, [w / total for w in final]]}))
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"class_path": "x", "init_args": data}}))
    out = main(["--run", f"a={run}", "--top", "1", "--feature-top", "1", "--out", str(tmp_path / "c.json")])
    assert out["a"]["sharpening"][1]["top"] == pytest.approx(3.0 / total * k)
    assert out["a"]["operations"]["top"] == pool_operations(data)[0]
    assert json.loads((tmp_path / "c.json").read_text()) == out
    check_provenance(out, {"a": str(run / "pool_history.json"), "a config": str(run / "config.yaml")})
    assert "a: iteration 1" in capsys.readouterr().out
    for odd in ("- a list\n", "data: [1, 2]\n", "data: {init_args: 3}\n"):  # not a pool's config: sharpening only
        (run / "config.yaml").write_text(odd)
        out = main(["--run", f"a={run}", "--top", "1", "--out", str(tmp_path / "c.json")])
        assert "operations" not in out["a"] and len(out["a"]["sharpening"]) == 2
    with pytest.raises(SystemExit, match="NAME=RUN_FOLDER"):
        main(["--run", str(run)])
