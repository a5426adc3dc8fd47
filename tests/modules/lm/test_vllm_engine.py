"""The vLLM engine (``lm.decode: vllm``) against the own decoders and transformers' ``generate`` (+ peft).

One engine per bank, each bank built once for the module. Needs the vllm extra (``pip install -e ".[vllm]"``).
"""

import dataclasses
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from alignment_games.modules.algorithms.debate import Transcript, split_reply
from alignment_games.modules.lm.decoders import make_decoder
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import build_tiny_causal_lm, resolve_name_or_path
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import HFJudge

pytestmark = pytest.mark.engines

PLAYERS = ["m0", "m1", "m2"]
PROMPTS = ["7-2=", "the sum of 3 and 4 is ", "q", "name a colour: "]
#: a tiny Llama whose head size (64) vLLM's CPU attention serves (the suite's tiny models have 16)
TINY_LLAMA = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256}
GREEDY = Sampling(max_new_tokens=10)


def perturbed_bank(lm: ModelConfig, players: list[str], scale: float) -> PolicyBank:
    """A bank whose adapters are moved off their zero init, differently per player (seeded)."""
    torch.manual_seed(0)
    bank = PolicyBank(lm, players=players)
    with torch.no_grad():
        for i, p in enumerate(players):
            gen = torch.Generator().manual_seed(10 + i)
            for w in bank.player_parameters(p):
                w.add_(scale * torch.randn(w.shape, generator=gen))
    return bank


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny_llama64"), config=TINY_LLAMA, architecture="llama")


@pytest.fixture(scope="module")
def bank(tiny):
    lm = ModelConfig(tiny, lora_r=8, lora_alpha=16, decode="vllm", vllm_kv_cache_gib=0.25)
    return perturbed_bank(lm, PLAYERS, 0.3)


def completions(sequences: torch.Tensor, width: int, eos: int) -> list[list[int]]:
    """Each row's completion tokens up to and with its first EOS."""
    out = []
    for row in sequences[:, width:].tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def rollout_completions(r: Rollout, eos: int) -> list[list[int]]:
    return completions(r.sequences, r.prompt_width, eos)


def own_decode(bank: PolicyBank, monkeypatch, *args, **kwargs) -> Rollout:
    """``bank.generate`` by the own decoder of ``lm.decode: auto`` on the same bank (the same adapters)."""
    with monkeypatch.context() as m:
        tok = bank.tokenizer
        own = make_decoder(dataclasses.replace(bank.lm, decode="auto"), tok.eos_token_id, tok.pad_token_id)
        m.setattr(bank, "decoder", own)
        return bank.generate(*args, **kwargs)


def transformers_greedy(bank: PolicyBank, player: str | None, prompts: list[str], folder, new: int) -> list[list[int]]:
    """transformers' ``generate`` on a fresh load of the base, with ``player``'s adapter loaded by peft from disk."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(resolve_name_or_path(bank.lm.name_or_path), dtype=torch.float32)
    if player is not None:
        bank.model.save_pretrained(folder, selected_adapters=[player])
        model = PeftModel.from_pretrained(model, folder / player)
    tok = bank.tokenizer
    enc = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
    out = model.eval().generate(
        **enc, do_sample=False, max_new_tokens=new, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    return completions(out, enc["input_ids"].shape[1], tok.eos_token_id)


def assert_three_agree(bank, monkeypatch, tmp_path, player, prompts, new, g=2):
    """The engine's greedy rows equal the own decoder's and transformers+peft's; the engine's completions returned."""
    s = Sampling(max_new_tokens=new)
    eos = bank.tokenizer.eos_token_id
    engine = bank.generate(player, prompts, g, s, greedy=True)
    own = own_decode(bank, monkeypatch, player, prompts, g, s, greedy=True)
    assert torch.equal(engine.sequences, own.sequences)
    assert torch.equal(engine.completion_mask, own.completion_mask) and engine.texts == own.texts
    reference = transformers_greedy(bank, player, prompts, tmp_path, new)
    got = rollout_completions(engine, eos)
    assert all(got[i::g] == reference for i in range(g))
    return got[::g]


def test_greedy_tokens_equal_own_decoder_and_transformers_peft_on_a_tiny_llama(bank, monkeypatch, tmp_path):
    base = assert_three_agree(bank, monkeypatch, tmp_path / "none", None, PROMPTS, 10)
    adapted = assert_three_agree(bank, monkeypatch, tmp_path / "m0", "m0", PROMPTS, 10)
    assert adapted != base  # the adapter reached the engine


def test_greedy_tokens_equal_own_decoder_and_transformers_peft_on_smollm2(monkeypatch, tmp_path):
    lm = ModelConfig("builtin:smollm2-135m-instruct", lora_r=8, lora_alpha=16, decode="vllm", vllm_kv_cache_gib=0.5)
    smol = perturbed_bank(lm, ["m0"], 0.05)
    prompts = [smol.chat(None, "What is 2+2?"), smol.chat(None, "Name a colour.")]
    base = assert_three_agree(smol, monkeypatch, tmp_path / "none", None, prompts, 12, g=1)
    adapted = assert_three_agree(smol, monkeypatch, tmp_path / "m0", "m0", prompts, 12, g=1)
    assert adapted != base


@pytest.mark.parametrize("write", ["sgd", "data"])
def test_after_an_optimizer_step_the_next_rollout_is_the_updated_adapters(bank, monkeypatch, tmp_path, write):
    """``data``: values written through ``.data`` (as a fused optimizer step does) leave ``_version`` as it was."""
    eos = bank.tokenizer.eos_token_id
    before = rollout_completions(bank.generate("m1", PROMPTS, 1, GREEDY, greedy=True), eos)
    kept = bank.decoder.adapters["m0"][1] if "m0" in bank.decoder.adapters else None
    r = bank.generate("m1", PROMPTS, 1, GREEDY, greedy=True)
    if write == "sgd":
        opt = torch.optim.SGD(bank.player_parameters("m1"), lr=5.0)
        bank.token_logprobs("m1", r, temperature=1.0).sum().backward()  # down the current greedy tokens' likelihood
        opt.step()
        opt.zero_grad()
    else:
        g = torch.Generator().manual_seed(11)
        for p in bank.player_parameters("m1"):
            p.data.add_(torch.randn(p.shape, generator=g) * 0.5)
    after = assert_three_agree(bank, monkeypatch, tmp_path, "m1", PROMPTS, 10)
    assert after != before
    if kept is not None:  # another player's adapter, unchanged, is not rewritten
        assert bank.decoder.adapter(bank, "m0") is kept


def test_a_three_adapter_pool_batch_equals_three_single_adapter_decodes(bank):
    requests = [("m0", PROMPTS[:2]), ("m1", PROMPTS[2:]), ("m2", PROMPTS[1:3]), (None, PROMPTS[:1])]
    for greedy in (True, False):
        s = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=8)
        torch.manual_seed(5)
        together = bank.generate_each(requests, 2, s, greedy=greedy)
        torch.manual_seed(5)  # the same per-row seeds, drawn in the same order
        alone = [bank.generate(p, x, 2, s, greedy=greedy) for p, x in requests]
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a.sequences, b.sequences) and a.texts == b.texts
            assert torch.allclose(a.sample_logprobs, b.sample_logprobs, atol=1e-5)
    assert len({tuple(r.sequences[0].tolist()) for r in alone[:3]}) > 1  # the players answer differently


def test_seeded_sampling_repeats_and_the_logprobs_are_the_trainers(bank):
    s = Sampling(temperature=0.7, max_new_tokens=10)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(bank.generate("m2", PROMPTS, 3, s))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert not torch.equal(runs[0].sequences[:, -10:], runs[2].sequences[:, -10:])
    r = runs[0]
    trainer = bank.token_logprobs("m2", r, temperature=0.7).detach()
    assert r.sample_logprobs.shape == trainer.shape
    assert torch.equal(r.sample_logprobs == 0, r.completion_mask == 0)
    torch.testing.assert_close(r.sample_logprobs, trainer, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_a_grpo_step_on_engine_rollouts_logs_the_logprob_gap_and_trains_the_adapter(tiny, tmp_path, tis_cap):
    import lightning as L
    from helpers.callback_helpers import make_trainer

    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.algorithms.rl_losses import PolicyGradient
    from alignment_games.modules.grpo import GRPO

    L.seed_everything(0)
    model = GRPO(
        lm=ModelConfig(tiny, lora_r=8, lora_alpha=16, decode="vllm", vllm_kv_cache_gib=0.25),
        policy_gradient=PolicyGradient(group_size=2, tis_cap=tis_cap),
        sampling=Sampling(temperature=1.0, max_new_tokens=6),
        reward_models=[tiny],  # the tiny LM's folder as a classifier: a seeded score head, rewards that vary
        answer_reward=False,
        lr=5e-2,
        chat_template=False,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logged = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    trainer = make_trainer(tmp_path, [Collect()], max_steps=2, max_epochs=None, limit_val_batches=0)
    trainer.fit(model, PromptDataModule(num_prompts=12, batch_size=2))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".policy." in n and "lora_" in n for n in changed)
    # the engine's log-probs of its samples are the trainer's to fp32 noise, on the adapter's second version too
    assert all(0 <= row["rollout/logprob_gap"] < 1e-4 for row in logged) and len(logged) == 2


def test_a_grpo_run_on_the_engine_killed_and_resumed_logs_what_the_uninterrupted_run_logs(tiny, tmp_path):
    """SIGKILL after batch 3, resumed from the checkpoint of batch 2: every logged number equals the reference's.

    Exact because each row's seed comes from torch's generator (restored by the checkpoint), the engine's own draws
    from that generator are forked off, and the first decode after the resume writes the adapter the checkpoint holds.
    """
    from helpers.recipes import GRPO_RUN
    from helpers.resume_families import resume_points
    from helpers.resume_harness import Family, Kill, Runner, compare

    keep = [
        a for a in GRPO_RUN if not a.startswith(("--trainer.max_steps", "--trainer.val_check", "--trainer.limit_val"))
    ]
    family = Family(
        name="grpo_vllm",
        config="grpo_tiny.yaml",
        args=(
            *keep,
            "--model.init_args.lm.decode=vllm",
            "--model.init_args.lm.vllm_kv_cache_gib=0.25",
            "--trainer.max_steps=6",
            "--trainer.limit_val_batches=0",
        ),
        batches_per_epoch=4,
        ckpt_every=2,
        kills=(Kill("SIGKILL", after_batch=3),),
        needs_tiny_lm=True,
    )
    runner = Runner(None, tiny)  # fresh processes, as after an outside kill
    ref = runner.fit(family, tmp_path / "reference", tag="reference")
    assert ref.returncode == 0, ref.log[-4000:]
    killed = runner.fit(family, tmp_path / "chain", kill=family.kills[0], tag="stage0")
    assert killed.returncode != 0
    final = runner.fit(family, tmp_path / "chain", resume=True, tag="final")
    assert final.returncode == 0, final.log[-4000:]
    assert min(step for _, step in final.metrics) == resume_points(family)[0]
    assert max(step for _, step in final.metrics) == max(step for _, step in ref.metrics)
    assert any(key == "rollout/logprob_gap" for key, _ in final.metrics)
    diffs = compare(ref.metrics, final.metrics, 0.0)
    assert diffs == [], "\n".join(diffs)


#: the judge's settings of both paths: greedy votes (the engine refuses a near-greedy temperature such as 1e-4)
JUDGE = {"chain_of_thought": False, "num_votes": 2, "greedy": True, "sampling": Sampling(max_new_tokens=12)}
DEBATES = [("What is 2 + 2?", [r"2 + 2 = 4, so \boxed{4}.", "Correct."]), ("1 + 1?", ["It is 3.", "No: it is 2."])]


@pytest.fixture(scope="module")
def judge_model(tiny, tmp_path_factory):
    """The tiny Llama with its matrices moved (seeded), so that its greedy text depends on the prompt (the fresh
    model's is newlines whatever it reads)."""
    folder = tmp_path_factory.mktemp("judge") / "model"
    shutil.copytree(tiny, folder)  # its tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():
            if w.dim() == 2:
                w.add_(0.1 * torch.randn(w.shape, generator=gen))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def engine_judge(judge_model):
    return HFJudge(judge_model, decode="vllm", vllm_kv_cache_gib=0.25, **JUDGE)


def judge_votes(judge: HFJudge, seed: int = 7):
    """The judge's votes on :data:`DEBATES` from the generator state of ``seed``."""
    judge.load_state_dict({"generator": torch.Generator().manual_seed(seed).get_state()})
    debates = [Transcript(x, "4", "debate_ab", [split_reply(r, required=False) for r in rs]) for x, rs in DEBATES]
    return judge.vote(debates)


def test_the_judge_on_the_engine_gives_the_verdicts_of_transformers_generate(judge_model, engine_judge):
    assert engine_judge.model is None  # the engine's weights only
    default = judge_votes(HFJudge(judge_model, **JUDGE))
    engine = judge_votes(engine_judge)
    assert engine.texts == default.texts and engine.texts[0] != engine.texts[1]  # a text of its own per prompt
    assert torch.equal(engine.votes.nan_to_num(-1), default.votes.nan_to_num(-1))
    assert all(len(set(row)) == 1 for row in engine.texts)  # greedy: every vote the same text


def test_the_judge_on_the_engine_samples_from_its_own_generator(engine_judge):
    engine_judge.greedy = False
    try:
        torch.manual_seed(0)
        state = torch.get_rng_state()
        first, again, other = judge_votes(engine_judge), judge_votes(engine_judge), judge_votes(engine_judge, 8)
        assert torch.equal(torch.get_rng_state(), state)  # the players' stream is untouched
    finally:
        engine_judge.greedy = True
    assert first.texts == again.texts and first.texts != other.texts
    assert any(len(set(row)) > 1 for row in first.texts)  # sampled: the votes differ
