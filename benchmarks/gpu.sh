#!/usr/bin/env bash
# One command for a lent GPU machine (PyTorch, transformers, Lightning, peft installed; no internet):
# generation vs the HBM bound, training MFU, one deep-SMIDA step by phase. Writes gpu_results.json (copied to $OUT
# when the device tool provides that folder). Budget: under 8 minutes on one H200. Extra arguments go to gpu_bench.py
# (e.g. --skip compiled).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -c "import torch, transformers, lightning, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"
status=0
timeout 470 python benchmarks/gpu_bench.py --out gpu_results.json "$@" || status=$?
if [ -n "${OUT:-}" ] && [ -f gpu_results.json ]; then cp gpu_results.json "$OUT/"; fi
exit $status
