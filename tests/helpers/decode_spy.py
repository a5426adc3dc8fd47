"""Count a PolicyBank's batched decodes, whichever decoder runs them."""


def spy_decodes(bank) -> list[int]:
    """Patch ``bank``'s decoder so that every batched decode appends its number of rows to the returned list."""
    calls: list[int] = []
    decode = bank.decoder.decode

    def spy(model, ids, mask, group, *args, **kwargs):
        calls.append(ids.shape[0] * group)
        return decode(model, ids, mask, group, *args, **kwargs)

    bank.decoder.decode = spy
    return calls
