"""Count a PolicyBank's batched decodes, whichever path runs them (transformers' generate, the grouped or the static
decode)."""


def spy_decodes(bank) -> list[int]:
    """Patch ``bank`` so that every batched decode appends its number of rows to the returned list."""
    calls: list[int] = []
    hf, grouped, static = bank.model.generate, bank._decode_grouped, bank._decode_static

    def on_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return hf(*args, **kwargs)

    def on_cascade(decode):
        def spy(model, once, g, *args):
            calls.append(once["input_ids"].shape[0] * g)
            return decode(model, once, g, *args)

        return spy

    bank.model.generate = on_generate
    bank._decode_grouped, bank._decode_static = on_cascade(grouped), on_cascade(static)
    return calls
