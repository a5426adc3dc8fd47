"""benchmarks/real_shape.py at a tiny size: its code path, both GRPO sides, and the last line's ratios."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.e2e  # about 40 s on 2 cores: run by `python -m pytest -m e2e` (.ci/run, after the default set)
def test_real_shape_tiny_measures_ours_and_trl(tmp_path):
    """``--tiny --families grpo,trl`` (two worker processes and the log-probability benchmark; about a minute on a
    quiet 2-core machine): same generated tokens on both sides, every phase measured, the ratios on the last line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "real_shape.py"), "--tiny", "--families", "grpo,trl",
         "--workdir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-3])
    host = result["host"]  # the ratios depend on it: CPU model, vector flags, cores, threads
    assert host["cores"] == os.cpu_count() and host["torch_threads"] >= 1 and host["cpu"]
    assert lines[-2].startswith(f"host: {host['cpu']} [") and f"{host['cores']} cores" in lines[-2]
    ours, trl = result["families"]["grpo"], result["families"]["trl"]
    assert ours["generated_tokens"] == trl["generated_tokens"] == 4 * 8  # 4 rows x 8 tokens
    assert {"generate", "score", "ref_logprobs", "backward", "optimizer", "step"} <= set(ours)
    assert {"generate", "score", "ref_logprobs", "forward", "backward", "step"} <= set(trl)
    assert all(ours[p]["peak_bytes"] <= ours["step"]["peak_bytes"] for p in ("generate", "score", "backward"))
    expected = ours["step"]["peak_bytes"] / trl["step"]["peak_bytes"]
    lp = result["logprob"]["chunked_peak_bytes"] / result["logprob"]["full_peak_bytes"]
    assert lines[-1] == f"peak_mem_ratio_vs_trl={expected:.4f} logprob_mem_ratio_vs_full={lp:.4f}"


@pytest.mark.parametrize(("args", "message"), [(["--rows", "6"], "--rows"), (["--families", "grpo,ppo"], "ppo")])
def test_real_shape_refuses_bad_arguments(args, message):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "real_shape.py"), *args],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr
