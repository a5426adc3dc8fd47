"""IFEval accuracy of exported followers: the Stackelberg paper's App. G.5 Leader ablation (Table 5).

Each policy answers every prompt greedily (one user message after ``--system-prompt``, no Leader reply). An
instruction id with no checker is counted under ``unsupported`` and left out of the accuracies (its prompt too).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from alignment_games.datamodules.validation import require_file
from alignment_games.modules.algorithms.ifeval_checks import check_kwargs, follows, is_supported
from alignment_games.modules.evaluation.game_eval import interval_ends, resample_prompts

#: the four accuracies, in Table 5's order
METRICS = ("prompt_loose", "instruction_loose", "prompt_strict", "instruction_strict")


def read_ifeval(path: str) -> list[dict[str, Any]]:
    """The rows of an IFEval-format jsonl (``key``, ``prompt``, ``instruction_id_list``, ``kwargs``), checked up front.

    Raises:
        FileNotFoundError: naming a missing file.
        ValueError: naming the file, line, key and field of a bad row, or no rows, or a path that is not a file.
    """
    require_file(path, "--data")
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {n}"
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            if "key" not in row:
                raise ValueError(f"{where}: field 'key' is missing")
            where += f" (key {row['key']!r})"
            if row["key"] in seen:
                raise ValueError(f"{where}: field 'key' repeats an earlier row's")
            seen.add(row["key"])
            if missing := [k for k in ("prompt", "instruction_id_list", "kwargs") if k not in row]:
                raise ValueError(f"{where}: field {missing[0]!r} is missing")
            ids, kwargs = row["instruction_id_list"], row["kwargs"]
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise ValueError(f"{where}: field 'prompt' must be a non-empty string")
            if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
                raise ValueError(f"{where}: field 'instruction_id_list' must be a non-empty list of strings")
            if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
                raise ValueError(
                    f"{where}: field 'kwargs' must be a list of {len(ids)} objects, one per instruction, got {kwargs!r}"
                )
            for i, (iid, kw) in enumerate(zip(ids, kwargs)):
                if is_supported(iid):
                    try:
                        check_kwargs(iid, kw)
                    except ValueError as err:
                        raise ValueError(f"{where}: field 'kwargs[{i}]' ({iid}): {err}") from err
            rows.append({k: row[k] for k in ("key", "prompt", "instruction_id_list", "kwargs")})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def score_responses(rows: Sequence[Mapping[str, Any]], responses: Sequence[str]) -> dict[str, Any]:
    """Strict and loose following of every instruction, IFEval's four accuracies, unsupported and per-category counts.

    Raises:
        ValueError: for a different number of rows and responses.
    """
    if len(rows) != len(responses):
        raise ValueError(f"{len(rows)} rows but {len(responses)} responses")
    results, unsupported = [], Counter()
    per_category: dict[str, list[int]] = {}
    for row, response in zip(rows, responses):
        strict, loose = [], []
        for iid, kw in zip(row["instruction_id_list"], row["kwargs"]):
            s = lo = None
            if is_supported(iid):
                s, lo = follows(iid, kw, response), follows(iid, kw, response, loose=True)
                cell = per_category.setdefault(iid.split(":")[0], [0, 0, 0])
                cell[0], cell[1], cell[2] = cell[0] + s, cell[1] + lo, cell[2] + 1
            else:
                unsupported[iid] += 1
            strict.append(s)
            loose.append(lo)
        results.append({"key": row["key"], "response": response, "strict": strict, "loose": loose})
    hits = _per_prompt(results)
    full, n_instr, accuracy = hits["complete"], int(hits["instructions"].sum()), {}
    for mode in ("loose", "strict"):
        accuracy[f"prompt_{mode}"] = float(hits[f"all_{mode}"][full].mean()) if full.any() else math.nan
        accuracy[f"instruction_{mode}"] = float(hits[mode].sum() / n_instr) if n_instr else math.nan
    return {
        "accuracy": {m: accuracy[m] for m in METRICS},
        "counts": {"prompts": len(results), "prompts_scored": int(full.sum()), "instructions_scored": n_instr},
        "unsupported": {
            "instructions": sum(unsupported.values()),
            "prompts": len(results) - int(full.sum()),
            "ids": dict(sorted(unsupported.items())),
        },
        "by_category": {
            c: {"strict": v[0] / v[2], "loose": v[1] / v[2], "instructions": v[2]}
            for c, v in sorted(per_category.items())
        },
        "results": results,
    }


def _per_prompt(results: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Per prompt: followed counts (strict, loose), supported instructions, all followed, and fully supported."""
    out = {"instructions": torch.tensor([sum(x is not None for x in r["strict"]) for r in results]).double()}
    for mode in ("strict", "loose"):
        out[mode] = torch.tensor([sum(x is True for x in r[mode]) for r in results], dtype=torch.float64)
        out[f"all_{mode}"] = torch.tensor([all(x is True for x in r[mode]) for r in results], dtype=torch.float64)
    return out | {"complete": torch.tensor([all(x is not None for x in r["strict"]) for r in results])}


def paired_difference(
    first: Mapping[str, Any], second: Mapping[str, Any], n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """Each accuracy of :data:`METRICS` for both policies and their difference (first − second), paired by prompt.

    Each prompt resample recomputes both accuracies as ratios of sums; empty resamples are left out.

    Raises:
        ValueError: when the two were scored on different prompts (keys or instructions), or ``n_boot`` is below 1.
    """
    a, b = first["results"], second["results"]
    if [r["key"] for r in a] != [r["key"] for r in b] or [len(r["strict"]) for r in a] != [len(r["strict"]) for r in b]:
        raise ValueError("the two policies were scored on different prompts: a paired comparison needs the same ones")
    ha, hb, idx = _per_prompt(a), _per_prompt(b), resample_prompts(len(a), n_boot, seed)
    complete = ha["complete"].double()
    out: dict[str, Any] = {"n_boot": n_boot, "level": level}
    for metric in METRICS:
        kind, mode = metric.split("_")
        if kind == "prompt":
            num_a, num_b, den = ha[f"all_{mode}"] * complete, hb[f"all_{mode}"] * complete, complete
        else:
            num_a, num_b, den = ha[mode], hb[mode], ha["instructions"]
        total = float(den.sum())
        if total == 0:
            out[metric] = {"first": math.nan, "second": math.nan, "difference": math.nan, "ci": [math.nan] * 2}
            continue
        boot_den = den[idx].sum(dim=1)
        boot = ((num_a[idx].sum(dim=1) - num_b[idx].sum(dim=1)) / boot_den)[boot_den > 0]
        lo, hi = torch.quantile(boot, interval_ends(level)).tolist()
        fa, fb = float(num_a.sum()) / total, float(num_b.sum()) / total
        out[metric] = {"first": fa, "second": fb, "difference": fa - fb, "ci": [lo, hi]}
    return out


def load_policy(folder: str, base: str | None = None) -> tuple[Any, Any]:
    """A policy and its tokenizer from an exported folder: a full model, or a peft adapter merged over its base.

    The base is ``base`` or the adapter's own, the tokenizer the folder's or else the base's.

    Raises:
        FileNotFoundError: naming the folder when it does not exist.
        ValueError: for an adapter folder whose config is not JSON or names no base when ``base`` is not given.
    """
    from alignment_games.modules.lm.models import load_model, load_tokenizer

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"policy folder {folder!r} does not exist")
    adapter_config = os.path.join(folder, "adapter_config.json")
    tokenizer_source = folder if os.path.exists(os.path.join(folder, "tokenizer_config.json")) else base
    if not os.path.exists(adapter_config):
        return load_model(folder, task="causal_lm"), load_tokenizer(tokenizer_source or folder)
    from peft import PeftModel

    if base is None:
        try:
            with open(adapter_config, encoding="utf-8") as f:
                base = json.load(f).get("base_model_name_or_path")
        except ValueError as err:
            raise ValueError(f"{adapter_config}: not valid JSON ({err})") from err
        if not isinstance(base, str) or not base:
            raise ValueError(f"{adapter_config}: names no base_model_name_or_path; pass the base with --base")
    model = PeftModel.from_pretrained(load_model(base, task="causal_lm"), folder).merge_and_unload()
    return model, load_tokenizer(tokenizer_source or base)
