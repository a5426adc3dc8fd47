"""Per-phase wall time of a training step (a phase entered twice adds up; CUDA synchronised around it)."""

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
