"""Per-phase wall time of a training step, shared by the modules that generate (deep-SMIDA, GRPO, debate).

A module resets ``self.phase_times = {}`` at the start of a step and wraps each phase in ``with self._timed(name):``.
A phase entered twice in one step (several updates per rollout, one generation per debate ply) adds up. On CUDA the
device is synchronised before and after, so queued kernels are charged to the phase that launched them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Mixin for a LightningModule: ``_timed(phase)`` adds the phase's wall time to ``self.phase_times[phase]``."""

    phase_times: dict[str, float]

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        device = self.device if isinstance(getattr(self, "device", None), torch.device) else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.phase_times[phase] = self.phase_times.get(phase, 0.0) + time.perf_counter() - start
