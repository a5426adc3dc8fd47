"""The host a benchmark ran on: CPU model, the vector flags its kernels use, cores and torch's threads.

CPU ratios move with these (AMX or AVX-512 bf16 change which side of a comparison the matmuls favour), so every
benchmark that prints a ratio prints this line with it.
"""

import os
import platform

#: the /proc/cpuinfo flags that decide torch's CPU kernels
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def host() -> dict:
    """The CPU model, its relevant flags, logical cores, torch's version and threads (a GPU's name when one is used)."""
    import torch

    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("unknown", platform.processor()):
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    info = {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def host_line(info: dict) -> str:
    """One printed line: ``host: <cpu> [flags], N cores, torch V on T threads[, gpu G]``."""
    flags = " ".join(info["flags"]) or "no AVX2"
    gpu = f", gpu {info['gpu']}" if "gpu" in info else ""
    return (
        f"host: {info['cpu']} [{flags}], {info['cores']} cores, torch {info['torch']} on {info['torch_threads']} "
        f"threads{gpu}"
    )
