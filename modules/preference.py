"""An ensemble of general preference models (GPM) whose disagreement flags likely errors (§3.1, §5.2, App. E.2)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from alignment_games.callbacks.items import gather_unique_items
from alignment_games.callbacks.media import log_figure
from alignment_games.modules.algorithms.checks import require_at_least, require_positive
from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance
from alignment_games.modules.base import AutomaticFamily
from alignment_games.modules.checkpoints.export import Player
from alignment_games.modules.checkpoints.trust import seal_checkpoint
from alignment_games.modules.distributed.collectives import any_rank, average_gradients, lockstep
from alignment_games.modules.distributed.sharding import is_fsdp2, shard_for_strategy
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import check_exists, resolve_name_or_path
from alignment_games.modules.lm.precision import cast_frozen_for_strategy
from alignment_games.modules.lm.text import encode_prompt_responses, pad_sequences, sequence_key
from alignment_games.modules.scorers.preference_heads import BTHead, GPMHead, skew_symmetric_block_matrix
from alignment_games.modules.scorers.utility import UTILITY_KINDS, Utility, UtilityKind, utility_from_member_probs
from alignment_games.modules.training.artifacts import atomic_write_text
from alignment_games.modules.training.faults import reset_stale_epoch_metrics


class PreferenceEnsemble(AutomaticFamily):
    """k general preference models trained on prompt-disjoint partitions; their disagreement is the game's utility.

    Args:
        lm: The backbone (:class:`~alignment_games.modules.lm.model_config.ModelConfig`; ``None``: ``builtin:minilm-l6``
          with LoRA r 8).
        backbone_task: ``"encoder"`` for encoders (BERT-like), ``"causal_lm"`` for decoders (their hidden states).
        num_members: Ensemble size ``k``.
        member_type: ``"gpm"`` (eq. 27) or ``"bt"`` (Bradley–Terry scalar reward).
        embed_dim: ``d`` of the GPM embedding (even).
        init_scale: Initial λ of every GPM member.
        pooling: ``"mean"``, ``"cls"``, ``"last"`` (last real token), or ``"auto"`` (last for decoders, else mean).
        sharing: ``"frozen"`` (one backbone, a head each), ``"lora"`` (an adapter each) or ``"separate"`` (copies).
        cache_features: Cache frozen backbone features by sequence content (``sharing="frozen"`` only).
        lr: Learning rate of the heads.
        backbone_lr: Learning rate of LoRA adapters or fine-tuned backbones.
        weight_decay: AdamW weight decay.
        seed: Base seed; member ``i`` initialises its head with ``seed + 1000 * (i + 1)``.
        max_length: Tokens per sequence in :meth:`score`.
        report_bootstrap: Prompt-bootstrap resamples for the report's 95% bands.
        **training: :class:`~alignment_games.modules.base.AutomaticFamily`'s arguments (non-finite limit, optimizer).
    """

    def __init__(
        self,
        lm: ModelConfig | None = None,
        backbone_task: Literal["encoder", "causal_lm"] = "encoder",
        num_members: int = 5,
        member_type: Literal["gpm", "bt"] = "gpm",
        embed_dim: int = 16,
        init_scale: float = 20.0,
        pooling: Literal["auto", "mean", "cls", "last"] = "auto",
        sharing: Literal["frozen", "lora", "separate"] = "frozen",
        cache_features: bool = True,
        lr: float = 1e-2,
        backbone_lr: float = 2e-5,
        weight_decay: float = 0.0,
        seed: int = 0,
        max_length: int = 256,
        report_bootstrap: int = 200,
        **training: Any,
    ) -> None:
        super().__init__(**training)
        require_positive(num_members=num_members)
        if member_type not in ("gpm", "bt"):
            raise ValueError(f"member_type must be 'gpm' or 'bt', got {member_type!r}")
        if sharing not in ("frozen", "lora", "separate"):
            raise ValueError(f"sharing must be 'frozen', 'lora' or 'separate', got {sharing!r}")
        if member_type == "gpm":
            skew_symmetric_block_matrix(embed_dim)  # validates d
        # a negative rate would train by gradient ascent and exit 0
        require_positive(init_scale=init_scale, lr=lr, backbone_lr=backbone_lr)
        require_at_least(weight_decay=(weight_decay, 0.0), max_length=(max_length, 1))
        lm = ModelConfig("builtin:minilm-l6", lora_r=8, lora_alpha=16) if lm is None else ModelConfig.coerce(lm)
        self.save_hyperparameters(ignore=["lm", "optimizer"])
        self.hparams.update(lm=lm.as_dict(), max_consecutive_nonfinite=self.max_consecutive_nonfinite)
        if lm.load_in_4bit and sharing == "separate":
            raise ValueError("lm.load_in_4bit: 4-bit weights cannot be fine-tuned in full; use sharing: lora or frozen")
        self.adapter_names = [f"member_{i}" for i in range(num_members)]

        check_exists("lm.name_or_path", resolve_name_or_path(lm.name_or_path))
        self.tokenizer = lm.load_tokenizer(padding_side="right")
        # a frozen backbone runs no backward: checkpointing its activations would only cost time
        load = dataclasses.replace(lm, gradient_checkpointing=lm.gradient_checkpointing and sharing != "frozen")
        if sharing == "separate":
            self.backbones = nn.ModuleList(load.load_model(backbone_task) for _ in range(num_members))
            hidden = self.backbones[0].config.hidden_size
        else:
            model = load.load_model(backbone_task, frozen=True).requires_grad_(False)
            hidden = model.config.hidden_size
            self.backbone = lm.with_adapters(model, self.adapter_names) if sharing == "lora" else model
            if sharing == "lora":  # peft leaves only the first adapter trainable; every member's adapter trains
                for p in self._adapter_parameters():
                    p.requires_grad_(True)
        seeds = [seed + 1000 * (i + 1) for i in range(num_members)]
        self.head = (
            GPMHead(hidden, num_members, embed_dim, init_scale, seeds)
            if member_type == "gpm"
            else BTHead(hidden, num_members, seeds)
        )
        self.pooling = pooling if pooling != "auto" else ("last" if backbone_task == "causal_lm" else "mean")
        self._feature_cache: dict[int, Tensor] = {}
        self.cache_hits = 0
        self.strict_loading = False  # frozen base weights are not stored; on_load_checkpoint checks the rest
        self.train_acc = torchmetrics.classification.BinaryAccuracy()
        # the epoch's running counts travel in checkpoints, so a run resumed mid-epoch reports the whole epoch
        self.train_acc.persistent(True)
        # per stage: this rank's (rows, member probabilities, labels, prompt ids) batches, gathered once at the end
        self._collected: dict[str, list[tuple[Tensor, ...]]] = {"val": [], "test": []}
        self.last_report: dict[str, Any] | None = None

    @override
    def train(self, mode: bool = True):
        super().train(mode)
        if self.hparams.sharing == "frozen":
            self.backbone.eval()  # a frozen backbone never drops out, so cached features stay valid
        return self

    def _pool(self, hidden: Tensor, mask: Tensor) -> Tensor:
        if self.pooling == "mean":
            m = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        if self.pooling == "cls":
            return hidden[:, 0]
        last = mask.sum(1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def _run_backbone(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        if self.hparams.backbone_task == "encoder":
            hidden = model(**inputs).last_hidden_state
        else:
            inputs.pop("token_type_ids", None)
            hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]
        return self._pool(hidden, inputs["attention_mask"]).float()

    def _frozen_features(self, batch: dict[str, Tensor]) -> Tensor:
        """Pooled features of every sequence in the batch, from the cache where possible."""
        if not self.hparams.cache_features:
            with torch.no_grad():
                return self._run_backbone(self.backbone, batch)
        keys = batch["seq_keys"].tolist()
        missing = [i for i, k in enumerate(keys) if k not in self._feature_cache]
        self.cache_hits += len(keys) - len(missing)
        if lockstep(self._trainer) and any_rank(bool(missing), self.device) and not missing:
            # another rank runs the sharded backbone (its gathers are collectives): take part with one row, unused
            with torch.no_grad():
                self._run_backbone(self.backbone, self._trim(batch, torch.zeros(1, dtype=torch.long)))
        if missing:
            rows = torch.tensor(missing, device=batch["input_ids"].device)
            with torch.no_grad():
                feats = self._run_backbone(self.backbone, self._trim(batch, rows))
            for i, f in zip(missing, feats):
                self._feature_cache[keys[i]] = f
        return torch.stack([self._feature_cache[k] for k in keys])

    @staticmethod
    def _trim(batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        """Select rows and drop the padding columns none of them needs."""
        out = {k: batch[k][rows] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        width = int(out["attention_mask"].sum(1).max())
        return {k: v[:, :width] for k, v in out.items()}

    def _member_features(self, batch: dict[str, Tensor], member: int) -> Tensor:
        if self.hparams.sharing == "separate":
            return self._run_backbone(self.backbones[member], batch)
        # peft's set_adapter freezes the other adapters (dropping them from the optimizer's gradients and from the
        # checkpoint) and unfreezes this one (even in a frozen scorer): whether each trains is kept as it was
        trainable = [p.requires_grad for p in self._adapter_parameters()]
        self.backbone.set_adapter(self.adapter_names[member])
        for p, grad in zip(self._adapter_parameters(), trainable):
            p.requires_grad_(grad)
        return self._run_backbone(self.backbone, batch)

    def _adapter_parameters(self) -> list[nn.Parameter]:
        """The LoRA parameters of every member (``sharing="lora"``), in a fixed order."""
        names = tuple(f".{a}." for a in self.adapter_names)
        return [p for n, p in self.backbone.named_parameters() if any(a in n for a in names)]

    def member_logits(self, batch: dict[str, Tensor]) -> Tensor:
        """Logits ``[B, k]`` of every member for the triplets ``(idx_a, idx_b)`` of the batch."""
        ia, ib = batch["idx_a"], batch["idx_b"]
        if self.hparams.sharing == "frozen":
            z = self.head.embed(self._frozen_features(batch))  # [k, U, d]
            return self.head.logits(z[:, ia], z[:, ib])
        cols = []
        for i in range(self.hparams.num_members):
            z = self.head.embed(self._member_features(batch, i), member=i)
            cols.append(self.head.logits(z[ia], z[ib], member=i))
        return torch.stack(cols, dim=1)

    @override
    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Member probabilities ``P_i(a ≻ b | x)``, shape ``[B, k]``."""
        return torch.sigmoid(self.member_logits(batch))

    def _own_member_logits(self, batch: dict[str, Tensor]) -> Tensor:
        """The logit of each row's own member only, so no member sees another member's partition."""
        member = batch["member"]
        if (member < 0).any() or (member >= self.hparams.num_members).any():
            raise ValueError(
                f"training rows must carry a member in [0, {self.hparams.num_members}), got {member.unique().tolist()}"
            )
        if self.hparams.sharing == "frozen":
            return self.member_logits(batch).gather(1, member[:, None]).squeeze(1)
        out = torch.zeros(member.shape[0], device=member.device)
        # under a sharding strategy every rank runs every member (alignment_games.modules.distributed.collectives)
        for i in range(self.hparams.num_members) if lockstep(self._trainer) else member.unique().tolist():
            rows = (member == i).nonzero().squeeze(1)
            if rows.numel() == 0:  # lockstep: no row of member i here; one row through its backbone, weight 0, so
                # the forward's gathers and the backward's gradient reduction run on every rank alike
                z = self.head.embed(self._member_features(self._trim(batch, batch["idx_a"][:1]), i), member=i)
                out = out + 0.0 * z.sum()
                continue
            seqs = torch.cat([batch["idx_a"][rows], batch["idx_b"][rows]]).unique()
            remap = torch.full((batch["input_ids"].shape[0],), -1, dtype=torch.long, device=member.device)
            remap[seqs] = torch.arange(seqs.numel(), device=member.device)
            z = self.head.embed(self._member_features(self._trim(batch, seqs), i), member=i)
            out = out.index_put(
                (rows,), self.head.logits(z[remap[batch["idx_a"][rows]]], z[remap[batch["idx_b"][rows]]], member=i)
            )
        return out

    @override
    def on_train_epoch_start(self) -> None:
        reset_stale_epoch_metrics(self.trainer, [self.train_acc])

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self._own_member_logits(batch)
        # Soft-label binary cross-entropy = −log P(y_w ≻ y_l) for 0/1 labels (App. E.2), exact for averaged labels.
        loss = F.binary_cross_entropy_with_logits(logits, batch["label"])
        if not self.check_finite(loss, "losses"):
            return None  # no backward, no optimizer step (the same on every rank)
        self.train_acc(logits, (batch["label"] > 0.5).long())
        bs = batch["label"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, batch_size=bs)
        if self.hparams.member_type == "gpm":
            self.log("train/lambda_mean", self.head.scale().mean(), batch_size=bs)
        return loss

    @override
    def configure_model(self) -> None:
        """FSDP2: shard the backbone(s) (the small heads stay whole); bf16-mixed: hold frozen weights in bf16."""
        sharing = self.hparams.sharing
        one = None if sharing == "separate" else self.backbone.get_base_model() if sharing == "lora" else self.backbone
        for model in self.backbones if one is None else [one]:
            shard_for_strategy(self, model, "the preference ensemble")
        if sharing != "separate":  # bf16-mixed: frozen weights held in bf16, not recast every forward
            cast_frozen_for_strategy(self.backbone, self.trainer.strategy)

    @override
    def on_after_backward(self) -> None:
        """FSDP2: average the heads' gradients over the ranks (FSDP2 reduces only the sharded backbones')."""
        if self._trainer is not None and is_fsdp2(self.trainer.strategy):
            average_gradients(list(self.head.parameters()))

    @override
    def configure_optimizers(self):
        head = [p for p in self.head.parameters() if p.requires_grad]
        groups = [{"params": head, "lr": self.hparams.lr}]
        if body := [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("head.")]:
            groups.append({"params": body, "lr": self.hparams.backbone_lr})
        return self.make_optimizer(groups, self.hparams.lr, weight_decay=self.hparams.weight_decay)

    @override
    def validation_step(self, batch, batch_idx):
        probs = self(batch).detach().double()
        self._collected["test" if self.trainer.testing else "val"].append(
            (batch["row"], probs, batch["label"].double(), batch["prompt_id"])
        )

    test_step = validation_step

    def _summary(self, stage: str, full: bool) -> dict[str, Any]:
        from alignment_games.modules.evaluation.preference_report import build_report

        # every data row once across ranks: the distributed sampler's padding repeats rows, which the row ids drop
        rows, probs, labels, prompts = (torch.cat(c) for c in zip(*self._collected[stage]))
        self._collected[stage] = []
        rows, kept = gather_unique_items(rows, {"probs": probs, "labels": labels, "prompts": prompts})
        probs, labels, prompts = kept["probs"], kept["labels"], kept["prompts"]
        # §5.2 counts errors against the binary oracle label, which a 0/1 label is (oracle protocol "binary"); a label
        # averaged over several queries ("query_mean", a deviation) or a file's soft label counts by its majority.
        binary = (labels.cpu() > 0.5).double()
        n_boot = self.hparams.report_bootstrap if full else 0
        report = build_report(probs.cpu(), binary, prompts.cpu(), n_boot=n_boot, seed=self.hparams.seed)
        flat = {"ensemble_acc": report["ensemble_accuracy"], "variance_mean": report["variance_summary"]["mean"]}
        flat |= {k: report[k] for k in ("overall_error_rate", "top10_error_rate", "top10_lift")}
        flat |= {f"auroc_{k}": report["auroc"][k] for k in ("variance", "decision_uncertainty", "jsd")}
        if "ensemble_nll" in report:
            flat["ensemble_nll"] = report["ensemble_nll"]
        flat |= {f"member_{i}_acc": acc for i, acc in enumerate(report["member_accuracy"])}
        for k, v in flat.items():  # identical on every rank (gathered): the mean is the value
            self.log(f"{stage}/{k}", float(v), sync_dist=True)
        return {"report": report, "probs": probs.cpu(), "labels": binary, "prompts": prompts.cpu(), "rows": rows.cpu()}

    @override
    def on_validation_epoch_end(self) -> None:
        if self._collected["val"]:
            self._summary("val", full=False)

    @override
    def on_test_epoch_end(self) -> None:
        out = self._summary("test", full=True)
        report, datamodule = out["report"], self.trainer.datamodule
        report["n_truncated"] = int(getattr(datamodule, "num_truncated", 0) or 0)
        # how the labels were made: the oracle, its protocol and queries per label, what it left out (None: from data)
        oracle_summary = getattr(datamodule, "oracle_summary", None)
        report["oracle"] = oracle_summary() if callable(oracle_summary) else None
        self.last_report = report
        if self.trainer.fast_dev_run:  # a smoke run writes nothing (its dummy logger has no folder)
            return
        # trainer.log_dir is a collective under DDP: every rank asks, only rank zero writes
        self._write_report(out, self.trainer.log_dir or self.trainer.default_root_dir)

    @rank_zero_only
    def _write_report(self, out: dict[str, Any], log_dir: str) -> None:
        from alignment_games.modules.evaluation.audit import run_provenance
        from alignment_games.modules.evaluation.figures import make_figures
        from alignment_games.modules.evaluation.preference_report import json_safe

        # per held-out pair (its data row): what a bootstrap over runs and pairs, or a paired comparison, needs
        per_row = zip(*(out[k].tolist() for k in ("rows", "prompts", "labels", "probs")))
        lines = [json.dumps({"row": r, "prompt": g, "label": y, "members": p}) for r, g, y, p in per_row]
        rows = "".join(f"{line}\n" for line in lines)
        # the rows file by hash, and what the run read: the report vouches for both
        record = {"file": "report.rows.jsonl", "rows": len(lines), "sha256": hashlib.sha256(rows.encode()).hexdigest()}
        report = {**out["report"], "per_row": record, "provenance": run_provenance(self._trainer, self)}
        # atomic: an old report is never half-overwritten; a full disk is raised naming the report
        text = json.dumps(json_safe(report), indent=2, allow_nan=False)
        atomic_write_text(os.path.join(log_dir, "report.json"), text)
        atomic_write_text(os.path.join(log_dir, "report.rows.jsonl"), rows)
        data, hp = (out[k] for k in ("probs", "labels", "prompts")), self.hparams
        figures = make_figures(*data, n_boot=hp.report_bootstrap, seed=hp.seed, report=out["report"])
        for name, fig in figures.items():
            fig.savefig(os.path.join(log_dir, f"{name}.png"), dpi=110, bbox_inches="tight")
            log_figure(self._trainer, f"test/{name}", fig, self.global_step)
        rank_zero_info(f"report written to {os.path.join(log_dir, 'report.json')}")

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> list[dict[str, Any]]:
        """Score pairs: member probabilities, their mean and the three disagreement scores, one dict per row."""
        p = self(batch)
        scores = {"variance": ensemble_variance(p), "decision_uncertainty": decision_uncertainty(p)}
        scores["jsd"] = ensemble_jsd(p)
        return [
            {"row": int(batch["row"][j]), "member_probs": [float(x) for x in p[j]], "prob": float(p[j].mean())}
            | {k: float(v[j]) for k, v in scores.items()}
            for j in range(p.shape[0])
        ]

    def trainable_state_names(self) -> set[str]:
        """State-dict names of the tensors that train (heads, adapters or fine-tuned copies)."""
        return {n for n, p in self.named_parameters() if p.requires_grad}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop frozen base weights (reloaded from ``lm``); record the family; refuse NaN or inf (``RuntimeError``)."""
        checkpoint["nonfinite"] = self.nonfinite_state()
        frozen = {n for n, p in self.named_parameters() if not p.requires_grad and not n.startswith("head.")}
        sd = checkpoint["state_dict"]
        for name in list(sd):
            if name in frozen or (
                self.hparams.sharing != "separate" and name.startswith("backbone.") and "lora_" not in name
            ):
                del sd[name]
        seal_checkpoint(self, checkpoint, "the preference ensemble")

    @classmethod
    def load_frozen(
        cls, checkpoint_path: str, map_location: str | torch.device = "cpu", **kwargs: Any
    ) -> PreferenceEnsemble:
        """A trained ensemble as a frozen scorer (eval mode, no gradients) for the game modules.

        Built from ``kwargs`` (the run's arguments), never from the checkpoint's hyper-parameters (they could name code
        to run); only its tensors are read. One of another family, or whose tensors do not fit, is refused.
        """
        with warnings.catch_warnings():  # the frozen base is reloaded from `lm`, not missing by mistake
            warnings.filterwarnings("ignore", message="Found keys that are in the model state dict but not in")
            model = cls.load_from_checkpoint(checkpoint_path, map_location=map_location, weights_only=True, **kwargs)
        model.eval().requires_grad_(False)
        return model

    def export_players(self) -> list[Player]:
        """Each member's LoRA adapter (``sharing: lora``) or fine-tuned copy (``separate``); none over a frozen base."""
        lm, task, names = ModelConfig.coerce(self.hparams.lm), self.hparams.backbone_task, self.adapter_names
        if self.hparams.sharing == "lora":
            return [Player(name, lm, self.backbone, name, self.tokenizer, task) for name in names]
        models = self.backbones if self.hparams.sharing == "separate" else []
        return [Player(name, lm, model, None, self.tokenizer, task) for name, model in zip(names, models)]

    def export_files(self, folder: str, source: dict[str, Any]) -> None:
        """``heads.safetensors`` (every member's head) and ``ensemble.json`` (the arguments that rebuild it)."""
        from safetensors.torch import save_file

        heads = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        save_file(heads, os.path.join(folder, "heads.safetensors"), metadata={"format": "pt"})
        keys = ("lm", "backbone_task", "num_members", "member_type", "embed_dim", "pooling", "sharing", "max_length")
        record = {"arguments": {k: self.hparams[k] for k in keys}, "members": self.adapter_names, **source}
        atomic_write_text(os.path.join(folder, "ensemble.json"), json.dumps(record, indent=2, default=str))

    @classmethod
    def from_export(cls, folder: str, **kwargs: Any) -> PreferenceEnsemble:
        """A frozen scorer from ``train.py export``'s folder, ``kwargs`` over its record (no ``trust_remote_code``)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        with open(os.path.join(folder, "ensemble.json"), encoding="utf-8") as f:
            args = json.load(f)["arguments"]
        args["lm"] = {**args["lm"], "trust_remote_code": False}
        model = cls(**{**args, **kwargs})
        model.head.load_state_dict(load_file(os.path.join(folder, "heads.safetensors")))
        for i, name in enumerate(model.adapter_names if model.hparams.sharing != "frozen" else ()):
            if model.hparams.sharing == "lora":
                weights = load_file(os.path.join(folder, name, "adapter_model.safetensors"))
                set_peft_model_state_dict(model.backbone, weights, adapter_name=name)
            else:  # a transformers model folder, loaded as the base is (trust_remote_code as in lm)
                lm = dataclasses.replace(ModelConfig.coerce(model.hparams.lm), name_or_path=os.path.join(folder, name))
                model.backbones[i] = lm.load_model(model.hparams.backbone_task)
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, prompts: list[str], responses_a: list[str], responses_b: list[str], batch_size: int = 64) -> Tensor:
        """Member probabilities ``[N, k]`` that each ``a`` is preferred to ``b``; tokenised as in training."""
        if not (len(prompts) == len(responses_a) == len(responses_b)):
            raise ValueError(
                f"score: lengths differ: prompts={len(prompts)}, responses_a={len(responses_a)}, "
                f"responses_b={len(responses_b)}"
            )
        out = []
        for i in range(0, len(prompts), batch_size):
            xs = list(prompts[i : i + batch_size]) * 2
            ys = list(responses_a[i : i + batch_size]) + list(responses_b[i : i + batch_size])
            enc = encode_prompt_responses(self.tokenizer, xs, ys, self.hparams.max_length, warn=False)
            batch = pad_sequences(enc.input_ids, self.tokenizer.pad_token_id, enc.token_type_ids)
            batch["seq_keys"] = torch.tensor([sequence_key(s) for s in enc.input_ids])
            n = len(xs) // 2
            batch["idx_a"], batch["idx_b"] = torch.arange(n), torch.arange(n, 2 * n)
            out.append(self({k: v.to(self.device) for k, v in batch.items()}).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.hparams.num_members)


UNTRAINED_REFUSAL = (
    "EnsembleUtility: no checkpoint, so the game would be played against an untrained ensemble with random heads. "
    "Train one with `python train.py fit --config configs/preference_ensemble.yaml` (the main job) and give "
    "--model.init_args.utility.init_args.checkpoint=runs/preference_ensemble/version_<n>/checkpoints/last.ckpt; "
    "for a smoke test, ask for the untrained one by name with "
    "--model.init_args.utility.init_args.allow_untrained=true"
)


class EnsembleUtility(Utility):
    """A utility of a frozen preference ensemble built from these arguments (:meth:`PreferenceEnsemble.load_frozen`).

    Args:
        checkpoint: A trained :class:`PreferenceEnsemble` as the arguments here describe it (``None``: refused).
        kind: Which utility (:func:`utility_from_member_probs`).
        scale: Multiplier of the variance.
        lam: λ of the directed objective.
        member: Member ``j`` of the directed objective, or the one preference model of ``kind: preference``.
        batch_size: Pairs scored per ensemble call.
        num_members: Members of the ensemble.
        backbone: Backbone of the ensemble (e.g. the policy's own folder, as the paper's Qwen members).
        backbone_task: ``encoder`` or ``causal_lm`` for that backbone.
        ensemble: Further :class:`PreferenceEnsemble` arguments of the trained run (``member_type``, ``sharing``, ...).
        allow_untrained: Without ``checkpoint``, build an untrained ensemble (smoke tests only) instead of refusing.

    Raises:
        ValueError: without ``checkpoint`` unless ``allow_untrained``; for an unknown ``kind``.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        kind: UtilityKind = "variance",
        scale: float = 4.0,
        lam: float = 0.0,
        member: int = 0,
        batch_size: int = 64,
        num_members: int = 5,
        backbone: str = "builtin:minilm-l6",
        backbone_task: str = "encoder",
        ensemble: dict[str, Any] | None = None,
        allow_untrained: bool = False,
    ) -> None:
        super().__init__()
        if kind not in UTILITY_KINDS:
            raise ValueError(f"utility kind {kind!r} is not one of {', '.join(UTILITY_KINDS)}")
        args: dict[str, Any] = {"lm": ModelConfig(backbone), "backbone_task": backbone_task, "num_members": num_members}
        args.update(ensemble or {})
        if checkpoint is None:
            if not allow_untrained:
                raise ValueError(UNTRAINED_REFUSAL)
            model = PreferenceEnsemble(**args).eval().requires_grad_(False)
        else:
            model = PreferenceEnsemble.load_frozen(checkpoint, **args)
        utility_from_member_probs(torch.full((1, model.hparams.num_members), 0.5), kind, scale, lam, member)
        self.ensemble = model
        self.checkpoint = checkpoint  # what the game's utility read: the reports it writes record its sha256
        self.kind, self.scale, self.lam, self.member, self.batch_size = kind, scale, lam, member, batch_size
        self.last_member_probs: Tensor | None = None

    def member_probs(self, prompts: Sequence[str], leader: Sequence[str], follower: Sequence[str]) -> Tensor:
        """``[N, k]`` member probabilities that the leader's response is preferred."""
        return self.ensemble.score(list(prompts), list(leader), list(follower), batch_size=self.batch_size)

    @override
    @torch.no_grad()
    def forward(self, prompts, leader, follower):
        p = self.member_probs(prompts, leader, follower)
        self.last_member_probs = p  # read by the game for diagnostics (variance shares) without scoring twice
        return utility_from_member_probs(p, self.kind, self.scale, self.lam, self.member).float()
