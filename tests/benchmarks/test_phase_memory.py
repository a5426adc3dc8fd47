"""benchmarks/_phase_memory.py: the per-phase peak from an allocation timeline (hand values) and on real tensors."""

import torch

from benchmarks._phase_memory import PhaseMemory, peak_from_events


def test_peak_from_events_by_hand():
    # +4 at t1, +8 at t2, -4 at t3, +2 at t5, -10 at t6: running 4, 12, 8, 10, 0
    events = [(6, -10), (1, 4), (2, 8), (3, -4), (5, 2)]
    ranges = {"a": (0, 2), "b": (3.5, 4.5), "b0": (3, 4), "c": (5, 6), "empty_before": (-5, -1), "step": (0, 6)}
    # b holds 8 from its start; b0 starts holding 12 (the release at t3 is inside it)
    expected = {"a": 12, "b": 8, "b0": 12, "c": 10, "empty_before": 0, "step": 12}
    assert peak_from_events(events, ranges) == expected


def test_phases_on_cpu_count_what_they_hold_above_the_step_start():
    meter = PhaseMemory("cpu")
    kept = torch.zeros(1)  # held before the step: not counted
    with meter.step():
        with meter.phase("alloc"):
            a = torch.ones(1_000_000)  # 4 MB, held into the next phase
            tmp = torch.ones(500_000)  # 2 MB, released inside
            del tmp
        with meter.phase("more"):
            b = torch.ones(250_000)  # 1 MB on top of a
        del a, b
        with meter.phase("alloc"):  # entered again: the peak is the larger, the seconds add up
            c = torch.ones(10)
            del c
    step = meter.steps[-1]
    assert step["alloc"]["peak_bytes"] == 6_000_000
    assert step["more"]["peak_bytes"] == 5_000_000
    assert step["step"]["peak_bytes"] == 6_000_000
    assert step["alloc"]["seconds"] > 0 and kept.numel() == 1


def test_instrument_routes_a_phase_timer_through_the_meter():
    from alignment_games.modules.base import LanguageModelGame

    class Module(LanguageModelGame):
        def work(self):
            self.phase_times = {}
            with self._timed("generate"):
                x = torch.ones(100_000)
            return x

    module, meter = Module(), PhaseMemory("cpu")
    meter.instrument(module)
    with meter.step():
        module.work()
    assert meter.steps[-1]["generate"]["peak_bytes"] == 400_000
    assert module.phase_times["generate"] > 0  # the module's own timing still runs
