"""Peak memory per phase of a training step, on CPU (profiler timeline) or CUDA (allocator statistics).

A phase is any ``with meter.phase(name):`` block inside ``with meter.step():``. The figure kept for each phase is the
most bytes that tensors held at once during it, above what they held when the step began (so the rollout a phase
inherits from the one before counts, the weights and optimizer state made before the step do not); ``"step"`` is the
same over the whole step.

* CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak at each phase's start.
* CPU: CPU tensors have no allocator statistics, so the step runs under ``torch.profiler`` with ``profile_memory``;
  every allocation and release is an event with its size and time, and each phase is a ``record_function`` range.
  The running sum of sizes from the step's start, maximised over a phase's range, is its peak. The profiler slows
  the step down, so its seconds are not the unprofiled speed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PhaseMemory", "peak_from_events"]

_PREFIX = "phase::"


def peak_from_events(allocations: list[tuple[int, int]], ranges: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Peak of the running sum of allocation sizes within each time range, from the sum's zero at the first event.

    Args:
        allocations: ``(time, bytes)`` per event, bytes negative for a release, in any order.
        ranges: ``name -> (start, end)`` in the same clock.

    Returns:
        ``name -> peak bytes``: the largest running sum at an event inside the range, or the sum at its start.
    """
    events = sorted(allocations)
    times = [t for t, _ in events]
    running, total = [], 0
    for _, size in events:
        total += size
        running.append(total)
    out = {}
    for name, (start, end) in ranges.items():
        before = [r for t, r in zip(times, running) if t < start]
        inside = [r for t, r in zip(times, running) if start <= t <= end]
        out[name] = max([before[-1] if before else 0, *inside])
    return out


class PhaseMemory:
    """Per-phase peak bytes and seconds of successive steps on one device.

    Args:
        device: Where the step's tensors live (``cpu`` or ``cuda``).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.steps: list[dict[str, dict[str, float]]] = []
        self._current: dict[str, dict[str, float]] = {}
        self._prof = None
        self._base = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Measure one step; its phases and ``"step"`` land in :attr:`steps` as ``{name: {peak_bytes, seconds}}``."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def begin(self) -> None:
        """Start a step (the callback form of :meth:`step`)."""
        self._current = {}
        self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def end(self) -> None:
        """Finish the step started by :meth:`begin`."""
        seconds = time.perf_counter() - self._t0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            step_peak = torch.cuda.max_memory_allocated(self.device) - self._base
            step_peak = max(step_peak, *(p["peak_bytes"] for p in self._current.values()), 0)
            self._current["step"] = {"peak_bytes": step_peak, "seconds": seconds}
            self.steps.append(self._current)
            return
        from torch._C._profiler import _EventType

        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        allocations, ranges, stack = [], {}, list(prof.profiler.kineto_results.experimental_event_tree())
        first, last = None, None
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            first = node.start_time_ns if first is None else min(first, node.start_time_ns)
            last = max(last or 0, node.end_time_ns, node.start_time_ns)
            if node.tag == _EventType.Allocation:
                if node.extra_fields.device.type == "cpu":
                    allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
            elif node.name.startswith(_PREFIX):
                name = node.name[len(_PREFIX) :]
                start, end = ranges.get(name, (node.start_time_ns, node.end_time_ns))
                # a phase entered twice in a step (a debate's plies, several updates) spans both entries
                ranges[name] = (min(start, node.start_time_ns), max(end, node.end_time_ns))
        ranges["step"] = (first or 0, last or 0)
        peaks = peak_from_events(allocations, ranges)
        for name, peak in peaks.items():
            self._current.setdefault(name, {"seconds": 0.0})["peak_bytes"] = peak
        self._current["step"]["seconds"] = seconds
        self.steps.append(self._current)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure a phase of the current step (seconds add up over repeated entries; the peak is the largest)."""
        entry = self._current.setdefault(name, {"peak_bytes": 0, "seconds": 0.0})
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            try:
                yield
            finally:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device) - self._base
                entry["peak_bytes"] = max(entry["peak_bytes"], peak)
                entry["seconds"] += time.perf_counter() - t0
            return
        with torch.profiler.record_function(_PREFIX + name):
            try:
                yield
            finally:
                entry["seconds"] += time.perf_counter() - t0

    def instrument(self, module) -> None:
        """Route a :class:`~alignment_games.modules.base.LanguageModelGame`'s ``_timed`` phases via :meth:`phase`."""
        timed = module._timed

        @contextmanager
        def measured(name: str) -> Iterator[None]:
            with timed(name), self.phase(name):
                yield

        module._timed = measured
