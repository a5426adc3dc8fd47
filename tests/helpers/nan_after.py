"""A function wrapper that turns its output to NaN from a chosen call on: the fault of the non-finite-loss tests."""


class NaNAfter:
    """Wraps a function: its output becomes NaN from the ``after``-th call on (calls counted from 1)."""

    def __init__(self, fn, after):
        self.fn, self.after, self.calls = fn, after, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        out = self.fn(*args, **kwargs)
        return out * float("nan") if self.calls >= self.after else out
