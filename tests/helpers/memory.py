"""Peak memory of a CPU computation, from the profiler's record of every tensor allocation and release."""

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Largest number of CPU bytes held at once by tensors ``fn`` allocated (above what was held when it started).

    CPU tensors have no allocator statistics like ``torch.cuda.max_memory_allocated``; the profiler's memory timeline
    (the one ``export_memory_timeline`` draws) lists each allocation and release with its size, so the running sum's
    maximum is the peak.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    held = peak = 0
    for _, action, (key, _), size in prof._memory_profile().timeline:
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            held += size
        elif action == Action.DESTROY:
            held -= size
        peak = max(peak, held)
    return peak
