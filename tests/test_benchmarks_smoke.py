"""Benchmark scripts run end to end at a tiny size (gpu.sh: tests/benchmarks/test_gpu_bench.py)."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

THIRD_PARTY_LOG = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] ")


def _run(script: str, *args: str, timeout: int = 600) -> tuple[dict, list[str]]:
    """Run ``benchmarks/<script>`` with ``args``, offline, one thread a process: its JSON line and its stdout's lines
    (those of the benchmark: without third-party log lines)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed's logger writes "[2026-12-07 18:40:04,290] [WARNING] [real_accelerator.py:213:get_accelerator] ..." to
    # stdout when a library imports it for the first time in a fresh environment: not the benchmark's output
    lines = [line for line in proc.stdout.strip().splitlines() if not THIRD_PARTY_LOG.match(line)]
    return json.loads(next(line for line in lines if line.startswith("{"))), lines


def _sharded_generate(script: str) -> tuple[dict, list[str]]:
    """Run a sharded-generation benchmark on 2 CPU processes (2 rows x 6 tokens, 1 round): its JSON line and lines."""
    return _run(script, "--rows", "2", "--tokens", "6", "--repeats", "1")


@pytest.mark.distributed
def test_zero3_generate_gathers_each_parameter_once_per_call():
    """benchmarks/zero3_generate.py on 2 CPU processes: the families' ZeRO-3 gathering partitions every parameter once
    per generate call, while DeepSpeed's own hooks (with or without GatheredParameters around the call) partition
    layers again for every token; all three give the same greedy tokens."""
    result, lines = _sharded_generate("zero3_generate.py")
    assert result["same_tokens"]
    params, releases = result["params"], result["releases"]
    assert releases["once"] == params  # one partition per parameter, at the end of the call
    assert releases["gathered"] > 6 * params // 2 and releases["per_module"] > 6 * params // 2  # per token
    assert lines[-1].startswith("speedup_once_vs_per_module=")


@pytest.mark.distributed
def test_fsdp2_generate_gathers_each_unit_once_per_call():
    """benchmarks/fsdp2_generate.py on 2 CPU processes: under the families' FSDP2 gathering each fully_shard unit is
    all-gathered once per generate call, while FSDP2's own hooks gather every block again for every token; both give
    the same greedy tokens."""
    result, lines = _sharded_generate("fsdp2_generate.py")
    assert result["same_tokens"]
    units, gathers = result["units"], result["all_gathers"]
    assert gathers["once"] == units  # one all-gather per unit for the whole call
    assert gathers["per_unit"] == (units - 1) * 6 + 1  # each block per token; the root keeps its parameters
    assert lines[-1].startswith("speedup_once_vs_per_unit=")


def _tiny(script: str, *args: str, timeout: int = 300) -> tuple[dict, list[str]]:
    """Run a benchmark with ``--tiny`` (and ``args``): its JSON line and its stdout's lines."""
    return _run(script, "--tiny", *args, timeout=timeout)


@pytest.mark.e2e  # about 13 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_logprob_memory_benchmark_measures_both_paths_at_tiny_size():
    """``benchmarks/logprob_memory.py --tiny``: both paths run forward + backward, and its last line is the ratio."""
    result, lines = _tiny("logprob_memory.py")
    assert result["full_peak_bytes"] >= result["one_fp32_logits_bytes"] > 0
    assert 0 < result["chunked_peak_bytes"] < result["full_peak_bytes"]  # chunks of 4 of 32 tokens
    name, ratio = lines[-1].split("=")
    assert name == "logprob_mem_ratio_vs_full"
    assert float(ratio) == pytest.approx(result["chunked_peak_bytes"] / result["full_peak_bytes"], abs=1e-4)


def test_judge_prefill_benchmark_prints_the_ratio_with_the_same_votes():
    """benchmarks/judge_prefill.py at a tiny size: the judge phase before and after, the host, identical texts."""
    args = ["--shapes", "tiny", "--prompt_words", "20", "--judge_tokens", "4", "--repeats", "1", "--threads", "1"]
    result, lines = _run("judge_prefill.py", *args)
    assert result["host"]["torch_threads"] == 1 and result["host"]["cpu"]
    (row,) = result["results"]
    assert row["same_texts"] and row["votes"] == 8 and row["before_s"] > 0 and row["after_s"] > 0
    assert row["speedup"] == pytest.approx(row["before_s"] / row["after_s"], rel=0.02)  # of the unrounded times
    assert lines[0].startswith("host: ")


def test_token_budget_benchmark_measures_both_updates_at_tiny_size():
    """``benchmarks/token_budget.py --tiny``: one update all rows at once and one in budget micro-batches, the same
    gradients, the host, and the peak ratio as its last line."""
    result, lines = _tiny("token_budget.py")
    assert result["all_rows_micro_batch_tokens"] == [result["padded_tokens_all_rows"]] > [result["budget"]]
    assert len(result["budget_micro_batch_tokens"]) > 1 and max(result["budget_micro_batch_tokens"]) <= result["budget"]
    assert 0 < result["budget_peak_bytes"] < result["all_rows_peak_bytes"]
    assert result["budget_loss"] == pytest.approx(result["all_rows_loss"], abs=1e-6) and result["all_rows_loss"] != 0
    assert result["max_grad_diff"] <= 1e-6 < result["max_grad"]
    assert any(line.startswith("host: ") for line in lines)
    name, ratio = lines[-1].split("=")
    assert name == "token_budget_mem_ratio_vs_all_rows"
    assert float(ratio) == pytest.approx(result["budget_peak_bytes"] / result["all_rows_peak_bytes"], abs=1e-4)


def test_pool_decode_benchmark_prints_both_phases_ratios_with_the_same_judgements():
    """benchmarks/pool_decode.py at a tiny size: m = 3 players' answers and judgements, player by player and batched."""
    args = ["--shapes", "tiny", "--duels", "3", "--rollouts", "2", "--answer_tokens", "3", "--judge_tokens", "3"]
    result, lines = _run("pool_decode.py", *args, "--repeats", "1", "--threads", "1")
    assert result["host"]["torch_threads"] == 1 and result["host"]["cpu"]
    (row,) = result["results"]
    assert row["players"] == 3
    # 3 duels, 2 sides, 2 rollouts each; each duel has one judge outside it, who judges both sides
    assert (row["answer"]["rows"], row["answer"]["tokens"]) == (12, 3)
    assert (row["judge"]["rows"], row["judge"]["tokens"]) == (6, 3) and row["judge"]["same_texts"]
    for phase in ("answer", "judge"):
        x = row[phase]
        assert x["before_s"] > 0 and x["after_s"] > 0
        assert x["speedup"] == pytest.approx(x["before_s"] / x["after_s"], rel=0.02)
    assert lines[0].startswith("host: ")
    assert any(line.startswith("tiny judge: m=3, 6 rows x 3 tokens: player by player ") for line in lines)


@pytest.mark.e2e  # about 25 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_qlora_cpu_benchmark_times_both_bases_and_prints_the_step_ratio():
    """``benchmarks/qlora_cpu.py --tiny``: the 4-bit and fp32 bases' forward, step and decode, footprints, the host."""
    result, lines = _tiny("qlora_cpu.py")
    r = result["result"]
    assert 0 < r["weights_mib"]["nf4"] < r["weights_mib"]["fp32"]
    for phase in ("forward", "step", "decode"):
        assert r[phase]["fp32_s"] > 0 and r[phase]["nf4_s"] > 0 and r[phase]["ratio"] > 0
    assert lines[0].startswith("host: ") and any(line.startswith("load average (1 min): ") for line in lines)
    name, ratio = lines[-1].split("=")
    assert name == "nf4_step_ratio_vs_fp32" and float(ratio) == r["step"]["ratio"]


@pytest.mark.e2e  # about 3 minutes on the loaded 2-core host (vLLM starts, TRL's and ours' GRPO workers)
def test_engines_benchmark_prints_every_engines_ratio_against_its_peer_with_the_load():
    """``benchmarks/engines.py --tiny``: the decode (2 prompts, one prompt), the pool's 3-adapter decode and the GRPO
    step, each engine's seconds and load average, its ratio against generate (or TRL) from the same numbers; vLLM's
    rows, or the line saying why it is not available."""
    result, lines = _tiny("engines.py", "--threads", "1", timeout=900)
    assert lines[0].startswith("host: ")
    vllm = result["vllm"] == "available"
    assert vllm or any(line.startswith("vllm: engine not available: ") for line in lines)
    shapes = [(r["section"], r["prompts"]) for r in result["results"]]
    assert shapes == [("decode", 2), ("decode", 1), ("pool", 3), ("grpo", 2)]
    for r in result["results"]:
        peer = "trl" if r["section"] == "grpo" else "generate"
        want = {"generate": {"generate", "own"}, "trl": {"trl", "ours_own"}}[peer]
        want |= {"ours_vllm" if peer == "trl" else "vllm"} if vllm else set()
        assert set(r["rows"]) == want
        for name, x in r["rows"].items():
            assert x["seconds"] > 0 and x["load"] >= 0
            if name != peer:
                ratio = r["rows"][peer]["seconds"] / x["seconds"]
                head = f"{r['section']} {r['prompts']} prompts"
                line = next(s for s in lines if s.startswith(head) and f": {name} " in s)
                assert line.endswith(f"{peer}/{name} {ratio:.2f}x") and f"(load {x['load']:.1f})" in line
