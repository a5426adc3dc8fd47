"""The arithmetic behind ``gpu_bench.py``'s expected H200 figures: model shapes, runs, HBM bounds, FLOPs, MFU.

Pure functions of the shapes and constants, tested against hand values (tests/benchmarks/test_gpu_bench.py).
"""

from __future__ import annotations

DATASHEET = {"bf16_dense_tflops": 989.0, "hbm_tb_s": 4.8}  # H200 SXM datasheet
REFERENCE = {"bf16_dense_tflops": 790.0, "hbm_tb_s": 4.3}  # attained on such a machine: the expected figures' constants
ASSUMED_MFU = 0.40  # of the reference peak, for the expected GRPO update (LoRA forward + backward at ~20k tokens)


QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
QWEN25_15B = {
    **QWEN25_05B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
}
SHAPES = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}
TINY = {
    "vocab_size": 300,  # past the byte tokenizer's 260, as the real vocabulary is
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
TINY_SHAPES = {"0.5b": {**TINY, "num_hidden_layers": 1}, "1.5b": TINY}

# what each section runs on the H200, and at --tiny
DECODE = {"groups": ((16, 4), (64, 4)), "prompt_len": 64, "new_tokens": 512}
DECODE_TINY = {"groups": ((2, 2), (4, 2)), "prompt_len": 16, "new_tokens": 12}
GRPO_RUN = {"prompts": 16, "group": 4, "prompt_len": 64, "new_tokens": 256, "steps": 2}
GRPO_TINY = {"prompts": 2, "group": 2, "prompt_len": 16, "new_tokens": 8, "steps": 2}
DEEP_SMIDA = {"B": 4, "D": 4, "M": 4, "new_tokens": 128, "batches": 2, "leader_prompt_len": 128}
DEEP_SMIDA_TINY = {"B": 2, "D": 2, "M": 2, "new_tokens": 8, "batches": 2, "leader_prompt_len": 128}
# the engines section: decode (own static, transformers' generate, vLLM) at the 1.5B shape; a GRPO step against TRL's
# at the 0.5B shape (benchmarks/vs_trl.py's workers)
ENGINES = {
    "groups": ((16, 4),),
    "prompt_len": 64,
    "new_tokens": 256,
    "grpo": {"prompts": 16, "group": 4, "tokens": 128},
}
ENGINES_TINY = {"groups": ((2, 2),), "prompt_len": 16, "new_tokens": 8, "grpo": {"prompts": 2, "group": 2, "tokens": 4}}
STATIC_BUCKET = 64  # StaticDecoder.bucket: the compiled static decode pads prompt parts to a multiple of it


# ---------------------------------------------------------------------- pure arithmetic (tested by hand values)


def param_count(cfg: dict) -> int:
    """Parameters of a Qwen2 decoder of ``cfg``: embedding, per layer biased q/k/v, o, gate/up/down and two norms,
    the final norm, and an output layer unless tied to the embedding."""
    h, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + heads * hd + 2 * (h * kvh * hd + kvh * hd) + heads * hd * h
    layer = attn + 3 * h * cfg["intermediate_size"] + 2 * h
    head = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * h
    return cfg["vocab_size"] * h + cfg["num_hidden_layers"] * layer + h + head


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    """Bytes of K and V one token adds to the cache: 2 x layers x KV heads x head dim x element size."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def decode_bound_steps_per_s(
    weight_bytes: int,
    kv_token_bytes: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    hbm_tb_s: float,
    group: int = 1,
    own_slots: int | None = None,
) -> float:
    """Decode steps per second if every step only read the weights and the KV cache at HBM bandwidth.

    A step reads every weight once, each prompt's cache once per ``group`` of rows that share it (1: every row its
    own copy; the suite's cascades: G), and every row's own tokens: ``new_tokens / 2`` on average over the run when
    the cache grows with them (``own_slots`` None), or ``own_slots`` when it is allocated at full length and read
    whole at every step (the static decode: ``max_new_tokens``). Logits and sampling are not counted.
    """
    own = new_tokens / 2 if own_slots is None else own_slots
    per_step = weight_bytes + (batch / group) * prompt_len * kv_token_bytes + batch * own * kv_token_bytes
    return hbm_tb_s * 1e12 / per_step


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over the peak."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)


def grpo_update_flops(params: int, rows: int, seq_len: int, kl: bool = True, lora: bool = True) -> float:
    """FLOPs of a GRPO update over ``rows`` sequences of ``seq_len`` tokens (prompt and completion, as forwarded).

    Per token: the policy's forward 2N and its activation gradients 2N (+ 2N weight gradients without LoRA: the
    frozen base has none), and the reference's forward 2N with the KL. ``N`` counts a tied embedding once, as the
    output layer's matmul; attention's own FLOPs (under 1% at a few hundred tokens) are left out.
    """
    per_token = 2 * params + 2 * params + (0 if lora else 2 * params) + (2 * params if kl else 0)
    return float(per_token) * rows * seq_len


def prefix_slots(prompt_len: int, bucket: int) -> int:
    """The static decode's prompt part: all but the prompt's last token, padded to a multiple of ``bucket``."""
    return -(-(prompt_len - 1) // bucket) * bucket


def expected_decode(cfg: dict, run: dict, compiled: bool, constants: dict = REFERENCE) -> dict:
    """Per group shape (``"16x4"``), the static decode's HBM bound: steps/s and tokens/s, bf16 weights and cache."""
    weights, kv = param_count(cfg) * 2, kv_bytes_per_token(cfg, 2)
    prefix = prefix_slots(run["prompt_len"], STATIC_BUCKET if compiled else 1)
    out = {}
    for b, g in run["groups"]:
        steps = decode_bound_steps_per_s(
            weights, kv, b * g, prefix, run["new_tokens"], constants["hbm_tb_s"], group=g, own_slots=run["new_tokens"]
        )
        out[f"{b}x{g}"] = {"bound_steps_per_s": steps, "bound_tokens_per_s": steps * b * g}
    return out


def expected_grpo(cfg: dict, run: dict, constants: dict = REFERENCE, assumed_mfu: float = ASSUMED_MFU) -> dict:
    """A GRPO step's expected figures: the rollout at the HBM bound of the static decode (an upper bound: the
    uncompiled decode is launch-bound), the update's FLOPs at ``assumed_mfu`` of the peak."""
    b, g, p, new = run["prompts"], run["group"], run["prompt_len"], run["new_tokens"]
    params, rows = param_count(cfg), run["prompts"] * run["group"]
    steps = decode_bound_steps_per_s(
        params * 2, kv_bytes_per_token(cfg, 2), rows, p - 1, new, constants["hbm_tb_s"], group=g, own_slots=new
    )
    flops = grpo_update_flops(params, b * g, p + new)
    update_s = flops / (assumed_mfu * constants["bf16_dense_tflops"] * 1e12)
    return {
        "rollout_tokens_per_s_bound": steps * rows,
        "update_flops": flops,
        "update_seconds": update_s,
        "trained_tokens_per_s": rows * new / update_s,
        "update_mfu": assumed_mfu,
        "step_seconds": new / steps + update_s,
    }


def expected_deep_smida(cfg: dict, run: dict, constants: dict = REFERENCE) -> dict:
    """Deep-SMIDA's generate phase at the HBM bound: the leader's B·D rows, then the follower's B·D·M rows, whose
    prompts hold the leader's reply (``leader_prompt_len`` + new tokens), each through the static decode."""
    weights, kv, new = param_count(cfg) * 2, kv_bytes_per_token(cfg, 2), run["new_tokens"]
    p, bd = run["leader_prompt_len"], run["B"] * run["D"]
    leader = decode_bound_steps_per_s(weights, kv, bd, p, new, constants["hbm_tb_s"], group=run["D"], own_slots=new)
    follower = decode_bound_steps_per_s(
        weights, kv, bd * run["M"], p + new, new, constants["hbm_tb_s"], group=run["M"], own_slots=new
    )
    return {"generate_seconds_bound": new / leader + new / follower}
