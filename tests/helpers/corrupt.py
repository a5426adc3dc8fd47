"""Finite corruption of a saved checkpoint: one stored number changed in place, the file's size and zip intact."""

import torch


def change_a_number(path, tensor: torch.Tensor) -> None:
    """Add 0.5 to the first element of ``tensor`` where its bytes lie in the file at ``path`` (found by content)."""
    flat = tensor.detach().reshape(-1).cpu()
    with open(path, "rb") as f:
        data = f.read()
    at = data.find(flat[: min(4, flat.numel())].numpy().tobytes())
    assert at >= 0, "the tensor's bytes are not in the file"
    with open(path, "r+b") as f:
        f.seek(at)
        f.write((flat[:1] + 0.5).numpy().tobytes())
