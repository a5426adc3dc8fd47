"""Resume after kills sent from outside: ``python train.py fit`` as a subprocess, SIGKILL/SIGTERM at moments read
from its folder (a checkpoint written, a save under way, validation running), ``--ckpt_path last``, then every
checkpoint tensor and value, every output file and every logged number against an uninterrupted run (exactly).

Harness: ``helpers/outside_kill.py``; figures per family: docs/outside-kill.md. Each test prints its figures and CPU
seconds (``-s`` shows them); the ones over ~20 CPU seconds are marked ``slow``.
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.outside_kill import Kill, Moment, OutsideRunner, _children_cpu, compare_runs, kill_and_resume
from helpers.recipes import TINY_LORA
from helpers.resume_families import FAMILIES
from helpers.resume_harness import _ENV, TESTS, Family

ROOT = Path(__file__).resolve().parent.parent

_PREF_LORA = (*FAMILIES["preference_ensemble"].args, "--model.init_args.sharing=lora", *TINY_LORA[1:])
_DEBATE = FAMILIES["debate_ab"]
_POOL_GRPO_ARGS = tuple(a for a in FAMILIES["pool_dpo"].args if "duels" not in a) + (
    "--model.init_args.duels_per_iteration=1",
    "--model.init_args.followers.policy_gradient.group_size=2",
    "--model.init_args.followers.batch_size=2",
)

#: the families of ``resume_families`` and the protocols and sharing modes it does not cover
OUTSIDE: dict[str, Family] = {
    **FAMILIES,
    "preference_lora": dataclasses.replace(FAMILIES["preference_ensemble"], name="preference_lora", args=_PREF_LORA),
    "preference_separate": dataclasses.replace(
        FAMILIES["preference_ensemble"],
        name="preference_separate",
        args=(*FAMILIES["preference_ensemble"].args, "--model.init_args.sharing=separate"),
    ),
    "pool_grpo": dataclasses.replace(
        FAMILIES["pool_dpo"], name="pool_grpo", config="pool_grpo.yaml", args=_POOL_GRPO_ARGS
    ),
    "debate_a": dataclasses.replace(_DEBATE, name="debate_a", config="debate_rlaif_a.yaml"),
    "debate_aba": dataclasses.replace(_DEBATE, name="debate_aba", config="debate_aba.yaml"),
    "debate_rlvr": dataclasses.replace(_DEBATE, name="debate_rlvr", config="debate_rlvr.yaml"),
}

# The chain every family gets: SIGTERM once the first periodic last.ckpt is written (the fault-tolerance path: a
# checkpoint at the batch it stops at), then SIGKILL while the next last.ckpt is being written (the previous one must
# stay whole and be resumed from), then the run to the end.
_CHAIN = (Kill("SIGTERM", Moment("checkpoint", n=1)), Kill("SIGKILL", Moment("save", n=1)))


def _validating(step: int, key: str) -> tuple[Kill, ...]:
    """SIGKILL while the validation after the training row of ``step`` runs, then the chain."""
    return (Kill("SIGKILL", Moment("validation", step=step, key=key)), *_CHAIN)


#: the kills of each family (those with a validation inside the run are also killed during it)
KILLS: dict[str, tuple[Kill, ...]] = {
    "smida_tabular": _CHAIN,
    "preference_ensemble": _CHAIN,
    "preference_lora": _CHAIN,
    "preference_separate": _CHAIN,
    "deep_smida": _CHAIN,
    "sft_tiny": _CHAIN,
    "grpo": _validating(8, "val/accuracy"),  # validation after batch 9 (logged at step 8)
    "grpo_4bit": _validating(8, "val/accuracy"),
    "pool_dpo": _CHAIN,
    "pool_grpo": _CHAIN,
    "debate_a": _validating(8, "val/accuracy"),  # validation after batch 9 (logged at step 8)
    "debate_ab": _validating(8, "val/accuracy"),  # validation after batch 9 (logged at step 8)
    "debate_aba": _validating(8, "val/accuracy"),  # validation after batch 9 (logged at step 8)
    "debate_rlvr": _validating(8, "val/accuracy"),  # validation after batch 9 (logged at step 8)
}
#: every family's chain costs 26-45 CPU seconds of train.py processes (docs/outside-kill.md): all are marked slow
SLOW = set(KILLS)


@pytest.fixture(scope="module")
def runner(tiny_lm_dir):
    return OutsideRunner(str(tiny_lm_dir))


def _params():
    return [
        pytest.param(
            n,
            marks=[pytest.mark.slow] if n in SLOW else [],
        )
        for n in KILLS
    ]


@pytest.mark.parametrize("name", _params())
def test_killed_from_outside_and_resumed_ends_where_the_uninterrupted_run_ends(name, runner, tmp_path):
    family = OUTSIDE[name]
    report, stages = kill_and_resume(runner, family, KILLS[name], tmp_path)
    print(f"\n{name}: {report.figures()}; kills landed: {[s.kill.moment.kind for s in stages[:-1]]}")
    assert report.differences == [], "\n".join(report.differences[:40])
    assert report.tensors > 0 and report.files > 0 and report.rows > 0
    for stage in stages[:-1]:  # the moments were hit: a SIGKILL during a save left its temporary behind
        if stage.kill.moment.kind == "save" and stage.kill.signal == "SIGKILL":
            assert stage.temps_left, "the kill did not land during a save"


@pytest.mark.e2e  # a train.py process, about 10 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_the_comparison_finds_one_changed_number_moment_and_file(runner, tmp_path):
    """The harness must fail: a copy of a run folder with one RNG bit, the step, one game-state number, one file and
    one logged number changed differs from the original in exactly those five."""
    family = OUTSIDE["smida_tabular"]
    ref = runner.run(family, tmp_path / "ref", None, resume=False, tag="reference")
    assert ref.returncode == 0, ref.log[-3000:]
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "ref", copy)
    shutil.copy(copy / "reference.metrics.csv", copy / "stage0.metrics.csv")
    same = compare_runs(tmp_path / "ref", copy, ["stage0"], family)
    assert same.differences == [] and same.tensors > 0 and same.files >= 3 and same.rows > 100
    run_dir = copy / "runs" / family.name / "version_0"
    final = torch.load(run_dir / "checkpoints" / "final.ckpt", weights_only=True)
    final["callbacks"]["RNGStateCallback"]["ranks"][0]["torch"][100] ^= 1  # one bit of the torch generator
    final["global_step"] += 1
    torch.save(final, run_dir / "checkpoints" / "final.ckpt")
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    game = next(k for k, v in last["state_dict"].items() if v.is_floating_point())
    last["state_dict"][game] = last["state_dict"][game].clone()
    last["state_dict"][game].view(-1)[0] += 1e-6  # one number of the game state, the step unchanged
    torch.save(last, run_dir / "checkpoints" / "last.ckpt")
    (run_dir / "hparams.yaml").write_text((run_dir / "hparams.yaml").read_text() + "\n")
    rows = (copy / "stage0.metrics.csv").read_text().splitlines()
    rows[2] = rows[2].replace(",0.", ",1.", 1)
    (copy / "stage0.metrics.csv").write_text("\n".join(rows) + "\n")
    found = compare_runs(tmp_path / "ref", copy, ["stage0"], family).differences
    assert len(found) == 5, found
    assert any(d.startswith("runs/smida_tabular/version_0/checkpoints/final.ckpt['callbacks']") for d in found)
    assert any("final.ckpt['global_step']" in d for d in found)
    assert any(f"last.ckpt['state_dict'][{game!r}]" in d for d in found)
    assert any(d.startswith("runs/smida_tabular/version_0/hparams.yaml") for d in found)
    assert any(d.startswith("metrics (") for d in found)


@pytest.mark.e2e  # a train.py process, about 10 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_a_signal_is_delivered_only_at_its_moment(runner, tmp_path):
    """SIGKILL at the second write of last.ckpt: the run dies then (a checkpoint from a step after the first cadence
    point), not before and not at its end."""
    family = OUTSIDE["smida_tabular"]
    stage = runner.run(family, tmp_path, Kill("SIGKILL", Moment("checkpoint", n=2)), resume=False, tag="stage0")
    assert stage.returncode == -signal.SIGKILL
    ckpt = torch.load(tmp_path / "runs" / family.name / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 * family.ckpt_every * family.steps_per_batch  # the second periodic save, whole


#: two-process DDP on CPU (gloo): the signal goes to the whole process group, both ranks, as a scheduler sends it
_DDP_OVERLAY = ("--config", str(ROOT / "configs" / "overlays" / "ddp.yaml"), "--trainer.devices=2")
# SIGKILL of both ranks while the second periodic last.ckpt is being written (the first stays), then while the next
# one is. Not right after a completed write: a SIGKILL between a checkpoint and its batch's metrics row loses that
# row for good (docs/outside-kill.md, findings)
_DDP_CHAIN = (Kill("SIGKILL", Moment("save", n=2)), Kill("SIGKILL", Moment("save", n=1)))
#: the chain of each family under DDP. Pool GRPO's run writes two periodic checkpoints (steps 15 and 30), too few for
#: two kills during saves: it gets the single-process chain (SIGTERM after the first, SIGKILL in the next save)
DDP = {"grpo": _DDP_CHAIN, "pool_dpo": _DDP_CHAIN, "pool_grpo": _CHAIN}


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP)
def test_two_process_ddp_killed_from_outside_and_resumed_ends_where_the_uninterrupted_run_ends(
    name, tiny_lm_dir, tmp_path
):
    runner = OutsideRunner(str(tiny_lm_dir), extra=_DDP_OVERLAY)
    family = dataclasses.replace(OUTSIDE[name], name=f"{name}_ddp")
    report, stages = kill_and_resume(runner, family, DDP[name], tmp_path)
    print(f"\n{family.name}: {report.figures()}")
    assert report.differences == [], "\n".join(report.differences[:40])
    assert report.tensors > 0 and report.files > 0 and report.rows > 0
    for stage in stages[:-1]:
        if stage.kill.moment.kind == "save":
            assert stage.temps_left, "the kill did not land during a save"
    ckpt = torch.load(
        tmp_path / "resumed" / "runs" / family.name / "version_0" / "checkpoints" / "final.ckpt", weights_only=True
    )
    assert len(ckpt["callbacks"]["RNGStateCallback"]["ranks"]) == 2  # both ranks' generators were compared


@pytest.mark.slow
def test_two_process_ddp_sigterm_from_outside_writes_a_checkpoint_and_exits(tiny_lm_dir, tmp_path):
    """SIGTERM to both ranks once the first periodic checkpoint is written: both stop after the same batch, write
    ``last.ckpt`` together and exit 143 within the time limit (Lightning's own handler hung here: a broadcast inside
    the signal handler); resumed with ``--ckpt_path last``, the run ends where the uninterrupted one ends."""
    runner = OutsideRunner(str(tiny_lm_dir), extra=_DDP_OVERLAY, timeout=150)
    # 16 training prompts: 4 batches per rank and epoch, so the batch after the first periodic checkpoint (step 5)
    # is not an epoch's last (where a SIGTERM writes nothing and the periodic checkpoint is resumed)
    grpo = OUTSIDE["grpo"]
    family = dataclasses.replace(grpo, name="grpo_ddp", args=(*grpo.args, "--data.init_args.num_prompts=17"))
    report, stages = kill_and_resume(runner, family, (Kill("SIGTERM", Moment("checkpoint", n=1)),), tmp_path)
    print(f"\n{family.name}, SIGTERM: {report.figures()}")
    assert stages[0].returncode == 143, stages[0].log[-3000:]
    assert "SIGTERM: checkpoint of step" in stages[0].log
    assert report.differences == [], "\n".join(report.differences[:40])
    assert report.tensors > 0 and report.files > 0 and report.rows > 0


#: SFT on a tiny random model: the cheapest family with a validation, here with a two-batch sanity check that
#: ``SlowSanityCheck`` makes last 2 x 3 s on rank 1 and marks (``sanity-rank<r>`` holds the rank's pid)
_SFT_SANITY = dataclasses.replace(
    OUTSIDE["sft_tiny"],
    name="sft_ddp_sanity",
    args=(
        *(a for a in OUTSIDE["sft_tiny"].args if "num_sanity_val_steps" not in a and "limit_val_batches" not in a),
        "--trainer.num_sanity_val_steps=2",
        "--trainer.limit_val_batches=2",
    ),
)


@pytest.mark.distributed
def test_sigterm_to_one_ddp_rank_during_the_sanity_check_stops_both_ranks_and_writes_nothing(tmp_path):
    """SIGTERM to rank 1 only while it is in the sanity check: both ranks stop within 60 s, exit 143 with the message
    that nothing was trained, and no checkpoint is written. Lightning's handler ran a broadcast inside the signal
    handler of rank 1 alone, which rank 0 never matched: both ranks waited for minutes."""
    runner = OutsideRunner(
        extra=_DDP_OVERLAY,
        callbacks=({"class_path": "resume_harness.SlowSanityCheck", "init_args": {"seconds": 3, "ranks": [1]}},),
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS]), **_ENV}
    marker, log_path = tmp_path / "sanity-rank1", tmp_path / "run.log"
    cpu0 = _children_cpu()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            runner.argv(_SFT_SANITY, tmp_path, resume=False),
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: both ranks, for the check that none is left
        )
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():  # rank 1 is in its sanity check
                assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before rank 1's sanity check"
                assert time.monotonic() < deadline, "rank 1 did not reach its sanity check within 300 s"
                time.sleep(0.01)
            rank1 = int(marker.read_text())
            assert rank1 != proc.pid  # the launcher's child: rank 0 is not signalled
            os.kill(rank1, signal.SIGTERM)
            sent = time.monotonic()
            while _group_alive(proc.pid) and time.monotonic() - sent < 60:
                proc.poll()  # reaps rank 0 (rank 1 is reaped by rank 0, or once orphaned)
                time.sleep(0.05)
            stopped_after = time.monotonic() - sent
        finally:
            if _group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text(errors="replace")
    print(f"\nboth ranks stopped {stopped_after:.1f} s after the SIGTERM to rank 1; {_children_cpu() - cpu0:.0f} CPU s")
    assert stopped_after < 60, f"the ranks were still running 60 s after the SIGTERM to rank 1:\n{log[-3000:]}"
    assert proc.returncode == 143, log[-3000:]
    assert "SIGTERM before the first training step: nothing was trained, no checkpoint written" in log, log[-3000:]
    assert not list(tmp_path.rglob("*.ckpt")), "a checkpoint was written before any training step"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
