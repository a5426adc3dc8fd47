"""Count a PolicyBank's batched decodes, whichever path runs them (transformers' generate, or the grouped decode)."""


def spy_decodes(bank) -> list[int]:
    """Patch ``bank`` so that every batched decode appends its number of rows to the returned list."""
    calls: list[int] = []
    hf, grouped = bank.model.generate, bank._decode_grouped

    def on_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return hf(*args, **kwargs)

    def on_grouped(model, once, g, *args):
        calls.append(once["input_ids"].shape[0] * g)
        return grouped(model, once, g, *args)

    bank.model.generate, bank._decode_grouped = on_generate, on_grouped
    return calls
