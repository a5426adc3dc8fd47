"""Preference triplets (prompt, response_a, response_b, label) for training an ensemble of preference models."""

from __future__ import annotations

import itertools
import math
import random
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from alignment_games.datamodules.files import _TableDataModule, check_columns, iter_rows, open_table
from alignment_games.datamodules.formats import as_messages, extract_implicit_prompt, render_prompt_completion
from alignment_games.datamodules.prompts import shuffled_cuts
from alignment_games.datamodules.resumable import split_loader
from alignment_games.datamodules.validation import require_number, require_text
from alignment_games.modules.algorithms.arithmetic import CORRUPTIONS, generate_problems, make_response
from alignment_games.modules.algorithms.checks import require_in_range, require_positive
from alignment_games.modules.lm.text import encode_prompt_responses, pad_sequences, sequence_key
from alignment_games.modules.scorers.oracle import PreferenceOracle, ProgrammaticOracle

PREFERENCE_FORMATS = ("auto", "columns", "trl")


def resolve_preference_columns(
    present: Sequence[str], data_format: str, columns: dict[str, str | None]
) -> dict[str, str | None]:
    """The columns to read (field → column): ``trl`` (``chosen``/``rejected``), ``columns`` (as configured) or ``auto``.

    Raises:
        ValueError: for an unknown ``data_format``.
    """
    if data_format not in PREFERENCE_FORMATS:
        raise ValueError(f"data.format must be one of {list(PREFERENCE_FORMATS)}, got {data_format!r}")
    trl_like = {"chosen", "rejected"} <= set(present) and columns["response_a"] not in present
    if data_format == "trl" or (data_format == "auto" and trl_like):
        resolved = {"prompt": "prompt" if "prompt" in present else None, "response_a": "chosen"}
        resolved.update(response_b="rejected", label=None)
        if columns.get("reference") is not None:
            resolved["reference"] = columns["reference"]
        return resolved
    return dict(columns)


def read_preference_table(
    path: str | None = None,
    name: str | None = None,
    split: str = "train",
    columns: dict[str, str | None] | None = None,
    data_format: str = "columns",
    config_name: str | None = None,
    revision: str | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str | None], str]:
    """Read rows through ``datasets`` as stored, mapped to ``prompt``, ``response_a``, ``response_b``, ``label``.

    Returns ``(rows, columns read, source description)``; a ``None`` label column means ``response_a`` is preferred.

    Raises:
        FileNotFoundError: naming a missing ``path``.
        ValueError: naming the missing column and the columns present.
    """
    cols: dict[str, str | None] = {f: f for f in ("prompt", "response_a", "response_b", "label")}
    cols.update(columns or {})
    ds, where = open_table(path, name, split, {}, config_name, revision)
    cols = resolve_preference_columns(ds.column_names, data_format, cols)
    check_columns(ds.column_names, where, cols)
    chosen_first = {"label": 1.0} if cols["label"] is None else {}  # without labels: response_a is preferred
    rows = [{f: rec[c] for f, c in cols.items() if c is not None} | chosen_first for _, rec in iter_rows(ds, where)]
    return rows, cols, where


def rows_as_text(rows: list[dict[str, Any]], tokenizer: Any, source: str = "data") -> list[dict[str, Any]]:
    """Rows with text ``prompt``, ``response_a`` and ``response_b``: implicit prompts split off, messages rendered.

    Raises:
        ValueError: naming the row and field of a malformed message list or a text-versus-conversation pair.
    """
    out = []
    for i, row in enumerate(rows, 1):
        row = dict(row)
        where = f"{source}: row {i}"
        if "prompt" not in row:
            a, b = row.get("response_a"), row.get("response_b")
            if isinstance(a, str) != isinstance(b, str) or not isinstance(a, (str, list, tuple)):
                raise ValueError(f"{where}: an implicit prompt needs two texts or two conversations as responses")
            row["prompt"], row["response_a"], row["response_b"] = extract_implicit_prompt(a, b)
        if any(isinstance(row.get(f), (list, tuple)) for f in ("prompt", "response_a", "response_b")):
            msgs = {}
            for field, role in (("prompt", "user"), ("response_a", "assistant"), ("response_b", "assistant")):
                value = row.get(field)
                if isinstance(value, str):
                    msgs[field] = [{"role": role, "content": value}]
                elif isinstance(value, (list, tuple)) and (len(value) or field == "prompt"):
                    msgs[field] = as_messages(value, f"{where}, field {field!r}") if len(value) else []
                else:
                    raise ValueError(f"{where}: field {field!r} must be text or a list of messages, got {value!r:.80}")
            prompt, row["response_a"] = render_prompt_completion(tokenizer, msgs["prompt"], msgs["response_a"], where)
            _, row["response_b"] = render_prompt_completion(tokenizer, msgs["prompt"], msgs["response_b"], where)
            row["prompt"] = prompt
        out.append(row)
    return out


def validate_rows(rows: list[dict[str, Any]], source: str = "data") -> list[dict[str, Any]]:
    """Check every row; return rows with ``label`` as float.

    Raises:
        ValueError: naming row and field: a missing or blank text, or a label not a finite number in [0, 1].
    """
    out = []
    for i, row in enumerate(rows, 1):
        for field in ("prompt", "response_a", "response_b"):  # an empty or whitespace prompt is refused too
            require_text(row.get(field), field, source, i)
        out.append({**row, "label": require_number(row.get("label"), "label", source, i, 0.0, 1.0)})
    return out


def check_relabelling(
    has_data: bool, relabel: bool, oracle: PreferenceOracle | None, reference_column: str | None
) -> None:
    """Refuse relabelling options that cannot apply, naming the option to set.

    Raises:
        ValueError: ``relabel`` without data, an ``oracle`` or (programmatic) ``reference_column``; the column alone.
    """
    if relabel and not has_data:
        raise ValueError(
            "data.relabel: generated data are always labelled by data.oracle; relabel needs data.path or data.name"
        )
    if relabel and oracle is None:
        raise ValueError("data.relabel: true needs data.oracle (the oracle that relabels the pairs)")
    if reference_column is not None and not relabel:
        raise ValueError(
            f"data.reference_column={reference_column!r} is read only to relabel the pairs with the oracle; "
            "set data.relabel: true, or drop reference_column to keep the file's labels"
        )
    if relabel and isinstance(oracle, ProgrammaticOracle) and reference_column is None:
        raise ValueError(
            "data.relabel with the ProgrammaticOracle needs the reference answers: set data.reference_column"
        )


class PreferenceDataModule(_TableDataModule):
    """Prompt-disjoint partitions of preference triplets for a k-member ensemble.

    The tokenizer and ``num_members`` default to the model's, so a config names the backbone once.

    Args:
        format: ``columns`` (the column options), ``trl`` (``chosen``/``rejected``, text or messages) or ``auto``.
        prompt_column: Column holding the prompt; ``None``: the responses' shared beginning (TRL's implicit prompt).
        response_a_column: Column holding the first response (the chosen one when ``label_column`` is ``None``).
        response_b_column: Column holding the second response.
        label_column: Column holding P(a ≻ b) in [0, 1]; ``None`` for chosen/rejected data (pairs then shuffled).
        num_members: Training partitions; ``None`` takes ``num_members`` from the model.
        val_fraction: Share of prompts in the shared validation set.
        heldout_fraction: Share of prompts held out for ``test`` (the report).
        max_length: Tokens per (prompt, response) sequence; longer prompts are cut from the left, with a warning.
        batch_size: Triplets per batch.
        num_workers: DataLoader workers.
        seed: Seed of generation, order and partitioning.
        num_prompts: Generated problems (offline default data).
        responses_per_prompt: Generated solutions per problem; every pair of them becomes a triplet.
        oracle: Labels generated data (default :class:`~alignment_games.modules.scorers.oracle.ProgrammaticOracle`).
        relabel: Relabel every pair of the file or hub data with ``oracle`` (the paper's synthetic-oracle setup).
        reference_column: Column with the reference final answer, read only with ``relabel``.
        predict_path: jsonl of pairs (prompt, response_a, response_b) to score in ``predict``.
        tokenizer: Tokenizer name or path; ``None`` takes the model's tokenizer.
        **table: The triplets' file or hub set (:class:`~alignment_games.datamodules.files._TableDataModule`'s
            arguments); with neither ``path`` nor ``name``, arithmetic data is generated.
    """

    def __init__(
        self,
        format: str = "auto",
        prompt_column: str | None = "prompt",
        response_a_column: str = "response_a",
        response_b_column: str = "response_b",
        label_column: str | None = "label",
        num_members: int | None = None,
        val_fraction: float = 0.1,
        heldout_fraction: float = 0.25,
        max_length: int = 256,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        num_prompts: int = 1500,
        responses_per_prompt: int = 5,
        oracle: PreferenceOracle | None = None,
        relabel: bool = False,
        reference_column: str | None = None,
        predict_path: str | None = None,
        tokenizer: str | None = None,
        **table: Any,
    ) -> None:
        super().__init__(**table)
        for field, frac in (("val_fraction", val_fraction), ("heldout_fraction", heldout_fraction)):
            require_in_range(field, frac, 0, 1, open_high=True)
        if val_fraction + heldout_fraction >= 1.0:
            raise ValueError(f"val_fraction + heldout_fraction must be below 1, got {val_fraction + heldout_fraction}")
        require_in_range("responses_per_prompt", responses_per_prompt, 2, len(CORRUPTIONS))
        require_positive(batch_size=batch_size)
        if num_members is not None:
            require_positive(num_members=num_members)
        if format not in PREFERENCE_FORMATS:
            raise ValueError(f"data.format must be one of {list(PREFERENCE_FORMATS)}, got {format!r}")
        check_relabelling(self.table_given, relabel, oracle, reference_column)
        self.save_hyperparameters(ignore=["oracle"], logger=False)  # the saved config.yaml records them
        self.hparams.update(self.table)
        self.oracle = oracle
        self.splits: dict[str, list[dict[str, Any]]] = {}
        self.sequences: list[list[int]] = []
        self.type_ids: list[list[int]] | None = None
        self.keys: list[int] = []
        self.prompts_by_split: dict[str, int] = {}
        self.num_truncated = self.num_unlabelled = self.pad_id = 0
        self.labelled_by: PreferenceOracle | None = None  # the oracle that labelled the rows, if one did
        self._tokenizer = None

    def generate_rows(self) -> list[dict[str, Any]]:
        """Generated arithmetic triplets: every pair of ``responses_per_prompt`` solutions, labelled by the oracle."""
        hp = self.hparams
        rng, kinds, rows = random.Random(hp.seed), CORRUPTIONS[: hp.responses_per_prompt], []
        for p in generate_problems(hp.num_prompts, seed=hp.seed):
            responses = [make_response(p, k, rng) for k in kinds]
            rng.shuffle(responses)
            pairs, ref = itertools.combinations(responses, 2), str(p.answer)
            rows += [{"prompt": p.question, "response_a": a, "response_b": b, "reference": ref} for a, b in pairs]
        oracle = self.oracle or ProgrammaticOracle(seed=hp.seed)
        return self._labelled_rows(rows, oracle, [r["reference"] for r in rows])

    def _labelled_rows(
        self, rows: list[dict[str, Any]], oracle: PreferenceOracle, refs: list[str | None] | None
    ) -> list[dict[str, Any]]:
        """``rows`` labelled by ``oracle``; those without a valid verdict (a NaN label) dropped and counted."""
        labels = oracle.label(
            [r["prompt"] for r in rows], [r["response_a"] for r in rows], [r["response_b"] for r in rows], refs
        )
        for r, y in zip(rows, labels.tolist()):
            r["label"] = y
        self.labelled_by = oracle
        kept = [r for r in rows if not math.isnan(r["label"])]
        self.num_unlabelled = len(rows) - len(kept)
        if self.num_unlabelled:
            warnings.warn(
                f"{self.num_unlabelled} of {len(rows)} pairs got no valid oracle verdict in {oracle.num_queries} "
                "queries and were dropped",
                stacklevel=3,
            )
        return kept

    def oracle_summary(self) -> dict[str, Any] | None:
        """The labelling oracle's summary with ``pairs_dropped``; ``None`` when the data came labelled."""
        if self.labelled_by is None:
            return None
        return {**self.labelled_by.summary(), "pairs_dropped": self.num_unlabelled}

    def read_rows(self) -> list[dict[str, Any]]:
        """Rows of the configured source as validated text, labelled by the oracle when generated or relabelled."""
        hp = self.hparams
        if not self.table_given:
            return self.generate_rows()
        columns = self._columns(hp.label_column)
        if hp.relabel:  # the oracle's labels replace the file's, which need not exist
            columns["label"] = None
            if hp.reference_column is not None:
                columns["reference"] = hp.reference_column
        rows, columns, source = read_preference_table(columns=columns, data_format=hp.format, **self.table)
        rows = rows_as_text(rows, self._tokenizer_if_conversational(rows), source)
        if hp.relabel:
            rows = validate_rows([{**r, "label": 0.5} for r in rows], source)  # the oracle sets the label next
            refs = None
            if hp.reference_column is not None:  # as text, like the generated rows' (a file may hold numbers)
                refs = [None if r.get("reference") is None else str(r["reference"]) for r in rows]
            rows = self._labelled_rows(rows, self.oracle, refs)
        else:
            if self.oracle is not None:
                rank_zero_info(
                    "data.oracle labels generated data only; the labels of "
                    f"{source} are kept (data.relabel: true relabels them with the oracle)"
                )
            rows = validate_rows(rows, source)
        if columns["label"] is None:  # chosen/rejected rows: half swapped, so position carries no signal
            rng = random.Random(hp.seed)
            for r in rows:
                if rng.random() < 0.5:
                    r["response_a"], r["response_b"], r["label"] = r["response_b"], r["response_a"], 1.0 - r["label"]
        return rows

    def _columns(self, label: str | None) -> dict[str, str | None]:
        """The configured columns of ``prompt``, ``response_a`` and ``response_b``, and ``label``'s."""
        hp = self.hparams
        a, b = hp.response_a_column, hp.response_b_column
        return {"prompt": hp.prompt_column, "response_a": a, "response_b": b, "label": label}

    def _tokenizer_if_conversational(self, rows: list[dict[str, Any]]) -> Any:
        """The tokenizer when a row holds messages (their chat template renders them), else ``None``."""
        fields = ("prompt", "response_a", "response_b")
        if any(isinstance(r.get(f), (list, tuple)) for r in rows for f in fields):
            return self._resolve_tokenizer()
        return None

    @staticmethod
    def partition_prompts(
        prompts: list[str], num_members: int, val_fraction: float, heldout_fraction: float, seed: int
    ) -> dict[str, Any]:
        """Split distinct prompts into ``train_0..train_{k-1}``, ``val`` and ``test``: a mapping prompt → split name."""
        test, val, train = shuffled_cuts(sorted(set(prompts)), seed, heldout_fraction, val_fraction)
        if len(train) < num_members:
            raise ValueError(
                f"{len(set(prompts))} distinct prompts leave {len(train)} for training, fewer than "
                f"num_members={num_members}; add data or lower val_fraction/heldout_fraction"
            )
        train_of = {x: f"train_{j % num_members}" for j, x in enumerate(train)}
        return dict.fromkeys(test, "test") | dict.fromkeys(val, "val") | train_of

    def _resolve_tokenizer(self):
        if self._tokenizer is not None:
            return self._tokenizer
        if self.hparams.tokenizer is not None:
            from alignment_games.modules.lm.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.hparams.tokenizer)
        elif self.trainer is not None and getattr(self.trainer.lightning_module, "tokenizer", None) is not None:
            self._tokenizer = self.trainer.lightning_module.tokenizer
        else:
            raise ValueError("PreferenceDataModule needs a tokenizer: set data.tokenizer or use a model with one")
        return self._tokenizer

    def _num_members(self) -> int:
        if self.hparams.num_members is not None:
            return self.hparams.num_members
        module = self.trainer.lightning_module if self.trainer is not None else None
        k = getattr(getattr(module, "hparams", None), "num_members", None)
        if k is None:
            raise ValueError("set data.num_members or use a model with hparams.num_members")
        return int(k)

    def _encode(self, rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
        """Tokenise each distinct (prompt, response) once; return sequence indices (a, b) per row."""
        tok = self._resolve_tokenizer()
        index: dict[tuple[str, str], int] = {}  # each distinct (prompt, response): its sequence's index
        for r in rows:
            for field in ("response_a", "response_b"):
                index.setdefault((r["prompt"], r[field]), len(self.sequences) + len(index))
        pairs = [(index[r["prompt"], r["response_a"]], index[r["prompt"], r["response_b"]]) for r in rows]
        prompts, responses = [x for x, _ in index], [y for _, y in index]
        enc = encode_prompt_responses(tok, prompts, responses, self.hparams.max_length, warn=True)
        self.num_truncated += len(enc.truncated)
        self.sequences.extend(enc.input_ids)
        if enc.token_type_ids is not None:
            self.type_ids = (self.type_ids or []) + enc.token_type_ids
        self.keys.extend(sequence_key(s) for s in enc.input_ids)
        self.pad_id = tok.pad_token_id
        return pairs

    def setup(self, stage: str | None = None) -> None:
        """Read, validate, partition and tokenise; idempotent."""
        if stage == "predict":
            if self.hparams.predict_path is None:
                raise ValueError("predict needs data.predict_path (a jsonl of prompt, response_a, response_b)")
            if "predict" not in self.splits:
                rows, _, source = read_preference_table(
                    self.hparams.predict_path, columns=self._columns(None), data_format=self.hparams.format
                )
                rows = validate_rows(rows_as_text(rows, self._tokenizer_if_conversational(rows), source), source)
                pairs = self._encode(rows)
                self.splits["predict"] = [
                    {"seq_a": a, "seq_b": b, "label": float("nan"), "prompt_id": i, "member": -1, "row": i}
                    for i, (a, b) in enumerate(pairs)
                ]
            return
        if "val" in self.splits:
            return
        rows = self.read_rows()
        k, hp, prompts = self._num_members(), self.hparams, [r["prompt"] for r in rows]
        assignment = self.partition_prompts(prompts, k, hp.val_fraction, hp.heldout_fraction, hp.seed)
        prompt_ids = {x: i for i, x in enumerate(sorted(assignment))}
        pairs = self._encode(rows)
        if self.num_truncated:
            warnings.warn(f"{self.num_truncated} sequences truncated to max_length={hp.max_length}", stacklevel=2)
        splits: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "test": []}
        for i, (r, (a, b)) in enumerate(zip(rows, pairs)):
            split = assignment[r["prompt"]]
            member = int(split.split("_")[1]) if split.startswith("train_") else -1
            item = dict(seq_a=a, seq_b=b, label=r["label"], prompt_id=prompt_ids[r["prompt"]], member=member, row=i)
            splits["train" if member >= 0 else split].append(item)
        self.splits = splits
        self.prompts_by_split = {s: len({it["prompt_id"] for it in items}) for s, items in splits.items()}

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad the distinct sequences of a batch once; triplets index into them with ``idx_a`` / ``idx_b``."""
        seqs = list(dict.fromkeys(s for it in items for s in (it["seq_a"], it["seq_b"])))
        order = {s: i for i, s in enumerate(seqs)}
        types = [self.type_ids[s] for s in seqs] if self.type_ids is not None else None
        batch = pad_sequences([self.sequences[s] for s in seqs], self.pad_id, types)
        batch["seq_keys"] = torch.tensor([self.keys[s] for s in seqs], dtype=torch.long)
        batch["idx_a"] = torch.tensor([order[it["seq_a"]] for it in items], dtype=torch.long)
        batch["idx_b"] = torch.tensor([order[it["seq_b"]] for it in items], dtype=torch.long)
        batch["label"] = torch.tensor([it["label"] for it in items], dtype=torch.float32)
        for key in ("prompt_id", "member", "row"):
            batch[key] = torch.tensor([it[key] for it in items], dtype=torch.long)
        return batch

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        if split not in self.splits:
            raise RuntimeError(f"call setup() before asking for the {split} loader")
        hp = self.hparams
        kwargs = dict(shuffle=shuffle, seed=hp.seed, num_workers=hp.num_workers)
        return split_loader(self.splits[split], hp.batch_size, self.collate, train=split == "train", **kwargs)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
