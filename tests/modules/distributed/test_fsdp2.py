"""FSDP2 (``fully_shard``) pieces of the policy bank, in this process over a one-process gloo group.

The two-process runs of the families under :class:`~alignment_games.modules.distributed.strategies.FSDP2Strategy` are in
``tests/test_sharded_training.py``;
here: what :meth:`PolicyBank.shard` makes, that generation gathers each unit once per call (not per token) and gives
the unsharded model's tokens, that the micro-batches' gradient sync is skipped and the sum reduced by the last one,
and the errors bad settings raise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from alignment_games.modules.distributed.sharding import fsdp2_gradient_sync, parameter_gathering, shard_for_strategy
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-process gloo group (FSDP2 needs a process group and a device mesh even for one rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _bank(tiny_lm_dir) -> PolicyBank:
    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(str(tiny_lm_dir), lora_r=4, lora_alpha=8), players=["leader", "follower"])
    with torch.no_grad():  # adapters off zero, so the players differ from the reference
        for name, p in bank.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return bank


class _ShardedAtEachCall:
    """Per model call inside ``generate`` (the input embedding runs in each), how many of the bank's parameters are
    sharded ``DTensor``s. A unit's parameters are plain whole tensors while it is unsharded and ``DTensor`` shards
    again once it reshards (with one rank, too: FSDP2 skips only the all-gather's communication)."""

    def __init__(self, bank: PolicyBank) -> None:
        from torch.distributed.tensor import DTensor

        self.calls: list[int] = []
        embed = bank.model.get_base_model().get_input_embeddings()
        self.handle = embed.register_forward_pre_hook(
            lambda m, a: self.calls.append(sum(isinstance(p, DTensor) for p in bank.parameters()))
        )


def test_shard_makes_one_unit_per_decoder_block_and_the_root(group, tiny_lm_dir):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    bank = _bank(tiny_lm_dir)
    blocks = len(bank.model.get_base_model().model.layers)
    bank.shard(group)
    units = [m for m in bank.modules() if isinstance(m, FSDPModule)]
    assert len(units) == blocks + 1  # each decoder layer, then the causal LM
    assert all(isinstance(p, DTensor) for p in bank.parameters())  # every tensor sharded, adapters included
    assert [u._ag_reshard_after_forward for u in units] == [False] + [True] * blocks  # the root keeps its own
    bank.shard(group)  # idempotent
    assert len([m for m in bank.modules() if isinstance(m, FSDPModule)]) == blocks + 1
    trainable = {n for n, p in bank.named_parameters() if p.requires_grad}
    assert trainable and all(".leader." in n or ".follower." in n for n in trainable)  # the base stays frozen


def test_generation_keeps_the_units_whole_for_the_whole_call_with_the_same_tokens(group, tiny_lm_dir):
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    plain = _bank(tiny_lm_dir)
    prompts, s = ["2 + 3 =", "seven minus four is"], Sampling(max_new_tokens=8)
    want = plain.generate("leader", prompts, 2, s, greedy=True)
    bank = _bank(tiny_lm_dir)
    bank.shard(group)
    assert bank.merge_for_generation is False  # FSDP2 owns the weights: no merged ones swapped in
    probe = _ShardedAtEachCall(bank)
    per_token = bank.generate("leader", prompts, 2, s, greedy=True)  # no gathering installed
    assert len(probe.calls) >= 8 and all(n > 0 for n in probe.calls[1:])  # the blocks resharded after each token
    bank.use_strategy(ModelParallelStrategy())
    probe.calls.clear()
    once = bank.generate("leader", prompts, 2, s, greedy=True)
    assert len(probe.calls) >= 8 and set(probe.calls) == {0}  # whole at every decoded token
    assert once.texts == per_token.texts == want.texts
    assert torch.equal(once.sequences, want.sequences)
    assert all(isinstance(p, DTensor) for p in bank.parameters())  # resharded afterwards
    plain_ref = plain.generate(None, prompts, 1, s, greedy=True)
    assert bank.generate(None, prompts, 1, s, greedy=True).texts == plain_ref.texts  # reference
    probe.calls.clear()
    out = bank.token_logprobs("leader", once, 0.7)  # training forward: FSDP2's own per-unit gathering again
    assert probe.calls and all(n > 0 for n in probe.calls)  # the blocks sharded when the embedding runs
    torch.testing.assert_close(out, plain.token_logprobs("leader", want, 0.7), rtol=1e-5, atol=1e-5)


def test_micro_batches_skip_the_gradient_sync_and_the_last_reduces_the_sum(group, tiny_lm_dir):
    plain, bank = _bank(tiny_lm_dir), _bank(tiny_lm_dir)
    bank.shard(group)
    roll = plain.generate("leader", ["1 + 1 =", "3 + 4 ="], 2, Sampling(max_new_tokens=6), greedy=True)
    halves = [(0, 2), (2, 4)]
    for model in (plain, bank):
        for i, (a, b) in enumerate(halves):
            with fsdp2_gradient_sync(model, enabled=i == len(halves) - 1):
                model.logprobs("leader", roll.rows(slice(a, b)), 0.7).sum().backward()
            if i == 0 and model is bank:  # accumulated locally, nothing reduced into the shards yet
                assert all(p.grad is None for p in bank.player_parameters("leader"))
    want = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad and ".leader." in n}
    got = {n: p.grad.full_tensor() for n, p in bank.named_parameters() if p.requires_grad and ".leader." in n}
    assert want.keys() == got.keys() and any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(p.grad is None for p in bank.player_parameters("follower"))  # the other player untouched


def test_gathering_is_a_no_op_for_a_bank_never_sharded(tiny_lm_dir):
    from lightning.pytorch.strategies import ModelParallelStrategy

    bank = _bank(tiny_lm_dir)
    with parameter_gathering(ModelParallelStrategy(), bank)():
        pass  # nothing to unshard, nothing raised
    with fsdp2_gradient_sync(bank, enabled=False):
        pass


class _Mesh:
    """What shard_for_strategy reads of a device mesh: its dimension names and each dimension's size."""

    mesh_dim_names = ("data_parallel", "tensor_parallel")

    def __init__(self, tp: int) -> None:
        self.sizes = {"data_parallel": 1, "tensor_parallel": tp}

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.sizes[name])


def test_bad_sharding_settings_are_refused_by_name(tiny_lm_dir):
    bank = _bank(tiny_lm_dir)
    shard_for_strategy(SimpleNamespace(_device_mesh=None), bank, "GRPO")  # no mesh (not FSDP2): nothing happens
    with pytest.raises(ValueError, match=r"trainer.strategy: GRPO .* tensor-parallel size of 2"):
        shard_for_strategy(SimpleNamespace(_device_mesh=_Mesh(tp=2)), bank, "GRPO")
    lm = bank.model.get_base_model()
    lm._no_split_modules = None
    with pytest.raises(ValueError, match=r"cannot shard Qwen2ForCausalLM with FSDP2: .*_no_split_modules"):
        bank.shard(None)


def test_fsdp2_strategy_puts_every_process_in_the_data_parallel_dimension(monkeypatch):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from alignment_games.modules.distributed.sharding import sharded_strategy_kind
    from alignment_games.modules.distributed.strategies import FSDP2Strategy

    seen = {}
    monkeypatch.setattr(  # the base builds the mesh from these sizes (it needs the processes running)
        ModelParallelStrategy, "setup_environment", lambda self: seen.update(dp=self._data_parallel_size)
    )
    strategy = FSDP2Strategy()
    assert sharded_strategy_kind(strategy) == "ModelParallelStrategy"
    assert strategy._tensor_parallel_size == 1
    strategy.num_nodes, strategy.parallel_devices = 3, [torch.device("cpu")] * 4
    strategy.setup_environment()
    assert seen == {"dp": 12}  # 3 nodes x 4 processes, all data-parallel (the base's "auto" would give 3)


def test_fsdp2_mixed_precision_gathers_in_bf16_and_keeps_fp32_shards(group, tiny_lm_dir):
    from torch.distributed.tensor import DTensor

    from alignment_games.modules.distributed.strategies import FSDP2Strategy

    policy = FSDP2Strategy(param_dtype="bfloat16", reduce_dtype="float32").mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert FSDP2Strategy().mixed_precision_policy is None  # FSDP2's default: the parameters' own dtype
    with pytest.raises(ValueError, match=r"param_dtype: unknown dtype 'bf17'"):
        FSDP2Strategy(param_dtype="bf17")
    bank = _bank(tiny_lm_dir)
    bank.shard(group, policy)
    seen = []
    embed = bank.model.get_base_model().get_input_embeddings()
    embed.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    bank.use_strategy(FSDP2Strategy())
    roll = bank.generate("leader", ["2 + 3 ="], 2, Sampling(max_new_tokens=4), greedy=True)
    assert seen and set(seen) == {torch.bfloat16}  # every decoded token on bf16 weights
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in bank.parameters())  # fp32 shards
    bank.logprobs("leader", roll, 0.7).sum().backward()
    grads = [p.grad for p in bank.player_parameters("leader")]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)  # reduced into fp32 shards
