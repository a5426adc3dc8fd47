#!/usr/bin/env bash
# One command for a lent GPU machine (needs only PyTorch, transformers, Lightning and peft; no internet; where the
# image also has vllm and TRL, the engines section times them beside the own decoder and GRPO step, else says so):
#   bash benchmarks/gpu.sh [gpu_bench.py arguments, e.g. --skip deep_smida; --tiny: the smoke test on any device]
# Every section runs in its own process with its own deadline (benchmarks/gpu_bench.py, SECTIONS); the whole run,
# imports included, is held under GPU_BENCH_LIMIT seconds (default 420: 7 minutes). gpu_results.json and
# gpu_bench.log go to $OUT when that variable is set (the device tool's folder), else to the repository root; the
# JSON is rewritten after every section and printed once at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
limit="${GPU_BENCH_LIMIT:-420}"
dest="${OUT:-.}"
mkdir -p "$dest"
# the driver keeps a margin inside the limit to write its results; timeout is the backstop (SIGKILL 10 s later)
timeout -k 10 "$limit" python3 benchmarks/gpu_bench.py --limit "$limit" --out "$dest/gpu_results.json" \
  --log "$dest/gpu_bench.log" "$@"
