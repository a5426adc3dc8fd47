"""PolicyBank: several players' prompts decoded in one batch, each row with its own adapter (generate_each)."""

import pytest
import torch

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.row_adapters import plain_lora_layers
from alignment_games.modules.lm.sampling import Sampling

PLAYERS = ["m0", "m1", "m2"]
REQUESTS = [
    ("m0", ["7-2=", "the sum of 3 and 4 is "]),
    ("m1", ["a much longer prompt here: 12*3=", "q"]),
    ("m2", ["name a colour: "]),
]


@pytest.fixture(scope="module")
def banks(tiny_decoder_dir):
    """The players' bank of an ``lm.decode`` (built on first use), the same adapters in each."""
    made = {}

    def bank(decode: str = "auto", load_in_4bit: bool = False) -> PolicyBank:
        if (decode, load_in_4bit) not in made:
            torch.manual_seed(0)  # peft draws lora_A's initial values from the global generator
            lm = ModelConfig(tiny_decoder_dir, lora_r=4, lora_alpha=8, decode=decode, load_in_4bit=load_in_4bit)
            b = PolicyBank(lm, players=PLAYERS)
            with torch.no_grad():  # each adapter off its zero init, differently, so that the players answer differently
                for i, p in enumerate(PLAYERS):
                    gen = torch.Generator().manual_seed(10 + i)
                    for w in b.player_parameters(p):
                        w.add_(0.3 * torch.randn(w.shape, generator=gen))
            made[decode, load_in_4bit] = b
        return made[decode, load_in_4bit]

    return bank


@pytest.fixture(scope="module")
def bank(banks):
    return banks()


def _same(a: Rollout, b: Rollout) -> None:
    assert a.prompt_width == b.prompt_width and a.group_size == b.group_size
    assert a.texts == b.texts
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.completion_mask, b.completion_mask)


@pytest.mark.parametrize("decode", ["auto", "grouped_forward", "generate", "static"])
@pytest.mark.parametrize("num_samples", [1, 2])
def test_one_greedy_decode_of_three_players_equals_each_players_own(banks, decode, num_samples):
    """auto: the lean decoder on CPU; grouped_forward: the grouped cascade through the model's forward."""
    bank = banks(decode)
    s = Sampling(max_new_tokens=8)
    together = bank.generate_each(REQUESTS, num_samples, s, greedy=True)
    alone = [bank.generate(p, x, num_samples, s, greedy=True) for p, x in REQUESTS]
    for a, b in zip(together, alone):
        _same(a, b)
    # the adapters differ: the same prompt answered by each player gives three different replies, so a row decoded
    # with another row's adapter could not pass the comparison above (token ids: the byte tokenizer renders distinct
    # invalid bytes as the same replacement character)
    replies = {p: tuple(bank.generate(p, ["7-2="], 1, s, greedy=True).sequences[0].tolist()) for p in PLAYERS}
    assert len(set(replies.values())) == 3, replies


@pytest.mark.parametrize("decode, num_samples", [("auto", 1), ("static", 2)])  # generate; the cascade's forward
def test_three_players_over_a_4bit_base_decode_in_one_batch_equal_to_each_players_own(banks, decode, num_samples):
    """A 4-bit base cannot take merged adapters, but each row's own update added to its layers' output needs none."""
    bank = banks(decode, load_in_4bit=True)
    assert bank.mixes_players(PLAYERS)
    s = Sampling(max_new_tokens=8)
    together = bank.generate_each(REQUESTS, num_samples, s, greedy=True)
    for a, (p, x) in zip(together, REQUESTS):
        _same(a, bank.generate(p, x, num_samples, s, greedy=True))
    replies = {p: tuple(bank.generate(p, ["7-2="], 1, s, greedy=True).sequences[0].tolist()) for p in PLAYERS}
    assert len(set(replies.values())) == 3, replies


def test_the_reference_and_a_player_decode_together(bank):
    s = Sampling(max_new_tokens=6)
    requests = [(None, ["7-2="]), ("m1", ["7-2=", "q"])]
    together = bank.generate_each(requests, 1, s, greedy=True)
    for a, (p, x) in zip(together, requests):
        _same(a, bank.generate(p, x, 1, s, greedy=True))
    assert together[0].texts[0] != together[1].texts[0]


def test_sampled_decodes_together_are_seeded(bank):
    torch.manual_seed(3)
    first = bank.generate_each(REQUESTS, 2, Sampling(max_new_tokens=6))
    torch.manual_seed(3)
    again = bank.generate_each(REQUESTS, 2, Sampling(max_new_tokens=6))
    for a, b in zip(first, again):
        _same(a, b)
    assert [r.sequences.shape[0] for r in first] == [4, 4, 2]


def test_the_hooks_are_removed_after_the_decode(bank):
    from peft.tuners.lora import LoraLayer

    bank.generate_each(REQUESTS, 1, Sampling(max_new_tokens=2), greedy=True)
    layers = [m for m in bank.model.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m._forward_hooks or hasattr(m, "_row_adapter") for m in layers)


def test_bad_player_lists_name_the_problem(bank):
    with pytest.raises(ValueError, match="2 players for 3 prompts"):
        bank.generate(["m0", "m1"], ["a", "b", "c"], 1, Sampling(max_new_tokens=2))
    with pytest.raises(KeyError, match="unknown player 'zz' of prompt 1"):
        bank.generate(["m0", "zz"], ["a", "b"], 1, Sampling(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"request 1 \(player 'm1'\) has no prompts"):
        bank.generate_each([("m0", ["a"]), ("m1", [])], 1, Sampling(max_new_tokens=2))


def test_split_refuses_counts_that_do_not_tile_the_rows(bank):
    out = bank.generate(["m0", "m1", "m1"], ["a", "b", "c"], 2, Sampling(max_new_tokens=2), greedy=True)
    with pytest.raises(ValueError, match=r"counts \[1, 1\] \(x group_size 2\) do not tile the 6 rows"):
        out.split([1, 1])
    assert [r.sequences.shape[0] for r in out.split([1, 2])] == [2, 4]


def test_separate_copies_decode_player_by_player(tiny_lm_dir):
    bank = PolicyBank(ModelConfig(tiny_lm_dir, players="separate"), players=["a", "b"])
    with torch.no_grad():
        for w in bank.player_parameters("b"):
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    assert not bank.mixes_players(["a", "b"])
    with pytest.raises(ValueError, match="cannot decode in one batch"):
        bank.generate(["a", "b"], ["x", "y"], 1, Sampling(max_new_tokens=2))
    s, requests = Sampling(max_new_tokens=5), [("a", ["1+1="]), ("b", ["1+1="])]
    for a, (p, x) in zip(bank.generate_each(requests, 1, s, greedy=True), requests):
        _same(a, bank.generate(p, x, 1, s, greedy=True))


def test_interleaved_players_each_get_their_own_adapter(bank):
    s = Sampling(max_new_tokens=6)
    out = bank.generate(["m0", "m1", "m0", None], ["7-2=", "7-2=", "q", "7-2="], 2, s, greedy=True)
    for i, p in enumerate(["m0", "m1", "m0", None]):
        alone = bank.generate(p, [["7-2=", "7-2=", "q", "7-2="][i]], 2, s, greedy=True)
        assert out.texts[2 * i : 2 * i + 2] == alone.texts


def test_an_adapter_with_a_lora_bias_is_neither_merged_nor_mixed(tiny_lm_dir):
    """W + s·BA leaves out a LoRA bias: such an adapter decodes through peft's own forward, one player at a time."""
    from peft import LoraConfig

    b = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), players=["plain"])
    b.model.add_adapter("biased", LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "v_proj"]))
    b.player_names.append("biased")
    with torch.no_grad():
        for n, w in b.model.named_parameters():
            if ".biased." in n:
                w.add_(0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(len(n))))
    assert plain_lora_layers(b.model, "plain") and plain_lora_layers(b.model, "biased") is None
    assert not b.mixes_players(["plain", "biased"])
    with b.using("biased") as model:  # peft's forward with the adapter active, the bias included
        kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": b.tokenizer.pad_token_id}
        expected = model.generate(**b.encode_prompts(["7-2="]), **kw)
    assert torch.equal(b.generate("biased", ["7-2="], 1, Sampling(max_new_tokens=6), greedy=True).sequences, expected)


JUDGE = "You judge replies. Rate the reply below from 1 to 9 and say why.\nReply: "
SHARED = [  # one instruction prefix before every row's own part (a judge template); the shortest is the prefix + 1
    ("m0", [JUDGE + "4", JUDGE + "the answer is 5 because 7-2=5"]),
    ("m1", [JUDGE + "seven", JUDGE + "no idea, sorry", JUDGE + "x"]),
    ("m2", [JUDGE + "five"]),
]


@pytest.mark.parametrize(("decode", "g"), [("auto", 1), ("auto", 2), ("grouped_forward", 2), ("static", 1)])
def test_a_common_prompt_prefix_is_prefilled_once_per_player_with_the_same_tokens(banks, decode, g):
    """The judge template's prefix: one prefill row per player, then each row's rest; every reply as its own player's.

    Each player alone decodes without the shared prefix (its whole prompts prefilled), so equal tokens mean the
    shared-prefix cache is the unshared one. A batch whose prompts differ from the first token prefills them whole.
    (grouped_forward: the grouped cascade through the model's forward, which decodes G > 1 only.)
    """
    s, bank = Sampling(max_new_tokens=8), banks(decode)
    embed = bank.model.get_base_model().get_input_embeddings()
    widths = []
    hook = embed.register_forward_pre_hook(lambda mod, args: widths.append(tuple(args[0].shape)))
    try:
        together = bank.generate_each(SHARED, g, s, greedy=True)
        prefills, widths[:] = [s for s in widths if s[1] > 1], []
        different = bank.generate_each(SHARED + [("m2", ["name a colour: "])], g, s, greedy=True)
        whole = [s for s in widths if s[1] > 1]
        hook.remove()
        for a, (p, x) in zip(together, SHARED):
            _same(a, bank.generate(p, x, g, s, greedy=True))
        for a, (p, x) in zip(different, SHARED + [("m2", ["name a colour: "])]):
            _same(a, bank.generate(p, x, g, s, greedy=True))
    finally:
        hook.remove()
    prefix = len(bank.tokenizer(JUDGE, add_special_tokens=False)["input_ids"])
    width = together[0].prompt_width
    assert prefills == [(3, prefix), (6, width - 1 - prefix)]  # the prefix once per player, then the 6 rows' rests
    assert whole == [(7, different[0].prompt_width - 1)]  # no common prefix: every prompt whole, as before
    assert len({t for r in together for t in r.texts}) > 1
