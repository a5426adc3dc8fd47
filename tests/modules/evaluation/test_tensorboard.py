"""What the games show in TensorBoard, read back with TensorBoard's own event reader and text renderer.

Short fits (a step or an iteration) of GRPO, debate, deep-SMIDA and the pool on the tiny random Qwen2 write to a
``TensorBoardLogger`` built as the configs build it; the events are read with ``EventAccumulator`` (size guidance 0:
everything kept) and the text rendered by TensorBoard's text plugin, so the checks see what a user would see.
"""

import html
import json
import random
import re
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from helpers import ROOT
from helpers.callback_helpers import PLAYERS, GameModule, make_trainer
from helpers.debate import tiny_debate_module
from helpers.deep_smida import tiny_deep_smida
from helpers.threads import one_torch_thread
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.text.text_plugin import text_array_to_html
from tensorboard.util import tensor_util

from alignment_games.callbacks import EloRating
from alignment_games.callbacks.media import media_loggers
from alignment_games.datamodules.pool import InstructionPoolDataModule
from alignment_games.datamodules.prompts import PromptDataModule, PromptSource
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.evaluation.tensorboard import GameBoard, escape_markdown, samples_markdown
from alignment_games.modules.games.pool_followers import FollowerTraining
from alignment_games.modules.grpo import GRPO
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.pool import StackelbergPool
from alignment_games.modules.scorers.peer_judges import PeerJudging
from alignment_games.modules.scorers.utility import Utility

EVERYTHING = {k: 0 for k in (ea.COMPRESSED_HISTOGRAMS, ea.IMAGES, ea.AUDIO, ea.SCALARS, ea.HISTOGRAMS, ea.TENSORS)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tiny model's ops gain nothing from more on a shared CPU (as tests/modules/test_pool)."""
    with one_torch_thread():
        yield


# ------------------------------------------------------------------------------------------------ reading back
def config_logger(tmp_path, config="grpo_tiny.yaml") -> TensorBoardLogger:
    """The TensorBoard logger exactly as ``configs/<config>`` builds it, writing under ``tmp_path``."""
    with open(f"{ROOT}/configs/{config}") as f:
        init_args = dict(yaml.safe_load(f)["trainer"]["logger"]["init_args"])
    init_args["save_dir"] = str(tmp_path)
    return TensorBoardLogger(**init_args)


def events(logger: TensorBoardLogger) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(logger.log_dir, size_guidance=EVERYTHING)
    acc.Reload()
    return acc


def rendered_samples(acc: ea.EventAccumulator, tag: str) -> list[list[dict[str, str]]]:
    """Every text event of ``tag``, rendered by TensorBoard's text plugin, as samples of ``{field: visible text}``.

    ``SummaryWriter.add_text`` files text under ``<tag>/text_summary``.
    """
    pages = [
        text_array_to_html(tensor_util.make_ndarray(e.tensor_proto), True) for e in acc.Tensors(f"{tag}/text_summary")
    ]
    return [page_samples(page) for page in pages]


def page_samples(page: str) -> list[dict[str, str]]:
    """The numbered sections of a rendered page as ``{field: visible text}``; only our own markup may appear."""
    assert {t.strip("/") for t in re.findall(r"<(/?\w+)", page)} <= OUR_TAGS
    samples = []
    for section in re.split(r"<h4>\d+</h4>", page)[1:]:
        fields = re.findall(r"<strong>(.*?)</strong><br ?/?>\n(.*?)</p>", section, flags=re.S)
        samples.append({html.unescape(k): EMPTY.get(v, visible(v)) for k, v in fields})
    return samples


OUR_TAGS = {"table", "tbody", "tr", "td", "h4", "p", "strong", "br", "hr", "em"}  # TensorBoard's cell, our fields
EMPTY = {"<em>(empty)</em>": "", "<em>(none)</em>": None}  # how an empty text and a missing one are shown


def visible(fragment: str) -> str:
    """What the browser shows of an HTML fragment: tags gone, hard breaks as newlines, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"<br ?/?>\n?", "\n", fragment)))


def as_shown(raw: str) -> str:
    """What a user should see of ``raw``: controls dropped, each line's leading blanks as no-break spaces (a tab as
    four), its trailing blanks dropped, a blank line as one no-break space; everything else as it is."""
    lines = []
    for line in re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", raw.replace("\r\n", "\n")).split("\n"):
        lead, body = re.match(r"[ \t]*", line).group().replace("\t", "    "), line.strip(" \t")
        lines.append("\xa0" * max(len(lead), not body) + body)
    return "\n".join(lines)


def histogram(acc: ea.EventAccumulator, tag: str) -> list[tuple[int, object]]:
    return [(e.step, e.histogram_value) for e in acc.Histograms(tag)]


def scalars(acc: ea.EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def trainer(logger, tmp_path, **kw) -> L.Trainer:
    return make_trainer(tmp_path, [], logger=logger, log_every_n_steps=1, **{"max_epochs": None, **kw})


# ------------------------------------------------------------------------------------------------ escaping
HOSTILE = (
    "# Heading\n    indented code\n\n\t \n  trailing   \n1. a list\n* star _em_ `tick` ```\n====\n"
    "<script>alert(1)</script> | a | b |\n> quote [link](http://x) ![img](y) &amp; \\ ~~~ <b>bold</b>"
)


def test_escaped_text_renders_as_itself_in_tensorboard():
    page = text_array_to_html(np.array([samples_markdown([{"prompt": HOSTILE}]).encode()]), enable_markdown=True)
    (sample,) = page_samples(page)  # no markup of the text's own survives TensorBoard's markdown and sanitiser
    assert sample == {"prompt": as_shown(HOSTILE)}
    assert as_shown(HOSTILE).split("\n")[1:5] == ["\xa0" * 4 + "indented code", "\xa0", "\xa0" * 5, "\xa0\xa0trailing"]


def test_escaping_drops_controls_and_cuts_long_text():
    assert escape_markdown("a\x00b\x1bc\r\nd") == "abc  \nd"
    cut = escape_markdown("x" * 30, max_chars=10)
    assert cut == "x" * 10 + " … (20 more characters)"


def test_log_samples_must_not_be_negative(tiny_lm_dir):
    with pytest.raises(ValueError, match="log_samples must be at least 0"):
        GameBoard(-1)
    with pytest.raises(ValueError, match="log_samples"):
        GRPO(lm=ModelConfig(tiny_lm_dir, lora_r=4), log_samples=-2)


def test_only_rank_zero_writes_and_to_every_logger_that_takes_media(tmp_path):
    tb, csv = TensorBoardLogger(tmp_path), CSVLogger(tmp_path)
    assert media_loggers(SimpleNamespace(is_global_zero=True, loggers=[csv, tb])) == [csv, tb]
    assert media_loggers(SimpleNamespace(is_global_zero=False, loggers=[tb])) == []
    assert media_loggers(None) == []


def test_no_config_and_no_default_logger_writes_a_placeholder_hp_metric(tmp_path, monkeypatch):
    import glob

    from alignment_games import train

    loggers = []
    for path in sorted(glob.glob(f"{ROOT}/configs/*.yaml")):
        with open(path) as f:
            logger = (yaml.safe_load(f).get("trainer") or {}).get("logger")
        if isinstance(logger, dict) and logger["class_path"].endswith("TensorBoardLogger"):
            loggers.append(path)
            assert logger["init_args"].get("default_hp_metric") is False, path
    assert len(loggers) >= 15  # every shipped config logs to TensorBoard
    monkeypatch.chdir(tmp_path)  # the default logger of a config that names none: train.py's
    args = ["--model=TabularSMIDA", "--data=StepDataModule"]  # run=False
    cli = train.main(args, run=False)
    assert isinstance(cli.trainer.logger, TensorBoardLogger) and cli.trainer.logger._default_hp_metric is False


# ------------------------------------------------------------------------------------------------ GRPO
def grpo(tiny_lm_dir, **kw):
    args = dict(
        lm=ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8),
        policy_gradient=PolicyGradient(group_size=2, kl_coef=0.04),
        sampling=Sampling(temperature=1.0, max_new_tokens=6),
        eval_max_new_tokens=6,
        lr=5e-2,
        chat_template=False,
    )
    return GRPO(**{**args, **kw})


def prompts_data():
    return PromptDataModule(num_prompts=24, batch_size=2)  # 6 validation prompts, 3 batches of 2


def fit_grpo(tiny_lm_dir, tmp_path, logger, **kw):
    L.seed_everything(0)
    model, data = grpo(tiny_lm_dir, **kw), prompts_data()
    trainer(logger, tmp_path, max_steps=2, val_check_interval=1, limit_val_batches=3).fit(model, data)
    return model, data


def test_grpo_shows_generations_histograms_and_no_hp_metric(tiny_lm_dir, tmp_path):
    logger = config_logger(tmp_path)
    _, data = fit_grpo(tiny_lm_dir, tmp_path, logger)
    acc = events(logger)
    assert "hp_metric" not in acc.Tags()["scalars"]
    pages = rendered_samples(acc, "val/generations")
    assert len(pages) == 2  # one text per validation
    val = data.splits["val"]
    for samples in pages:  # the first four held-out prompts (two batches of two), in order, with their references
        assert [s["prompt"] for s in samples] == [r["prompt"] for r in val[:4]]
        assert [s["reference"] for s in samples] == [r["reference"] for r in val[:4]]
        assert all(set(s) == {"prompt", "reference", "reply", "reward"} and s["reward"] in ("0", "1") for s in samples)
    rewards = scalars(acc, "train/reward")
    hists = histogram(acc, "train/reward_hist")
    assert [step for step, _ in hists] == sorted(rewards) == [0, 1]  # the scalars' steps
    for step, h in hists:  # B * G = 4 rewards per step, their mean the logged train/reward
        assert h.num == 4 and h.sum == pytest.approx(4 * rewards[step], abs=1e-6)
    for _, h in histogram(acc, "train/advantage_hist"):
        assert h.num == 4 and h.sum == pytest.approx(0.0, abs=1e-5)  # group-relative: each group sums to zero


def test_logging_changes_neither_training_nor_the_generators(tiny_lm_dir, tmp_path):
    results = []
    for logger in (False, config_logger(tmp_path)):
        model, _ = fit_grpo(tiny_lm_dir, tmp_path, logger)
        params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((params, torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()))
    (p0, t0, r0, n0), (p1, t1, r1, n1) = results
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    assert torch.equal(t0, t1) and r0 == r1 and np.array_equal(n0, n1)


def test_a_csv_logger_gets_what_tensorboard_gets_and_no_logger_nothing(tiny_lm_dir, tmp_path):
    tb, csv = config_logger(tmp_path), CSVLogger(tmp_path, name="csv")
    fit_grpo(tiny_lm_dir, tmp_path, [tb, csv])
    acc, folder = events(tb), f"{csv.log_dir}/media"
    texts = acc.Tensors("val/generations/text_summary")
    assert [e.step for e in texts] == [0, 1]  # one text per validation, in both loggers
    for e in texts:
        with open(f"{folder}/val/generations/step_{e.step}.md") as f:
            assert f.read() == tensor_util.make_ndarray(e.tensor_proto).item().decode()
    for tag in ("train/reward_hist", "train/advantage_hist"):
        hists = histogram(acc, tag)
        assert [step for step, _ in hists] == [0, 1]
        for step, h in hists:
            with open(f"{folder}/{tag}/step_{step}.json") as f:
                written = json.load(f)
            # TensorBoard names a bucket by its right edge (equal values: numpy's buckets around them)
            assert written["edges"][1:] == list(h.bucket_limit) and written["counts"] == list(h.bucket)
            assert (written["num"], written["sum"], written["min"], written["max"]) == (h.num, h.sum, h.min, h.max)
    model, _ = fit_grpo(tiny_lm_dir, tmp_path, False)  # no logger at all: nothing kept
    assert not model.board._samples and not model.board._values


# ------------------------------------------------------------------------------------------------ debate
def test_debate_shows_transcripts_and_histograms(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = tiny_debate_module(tiny_lm_dir, "debate_ab", log_samples=3)
    logger, data = config_logger(tmp_path, "debate_ab.yaml"), prompts_data()
    trainer(logger, tmp_path, max_steps=1, val_check_interval=1, limit_val_batches=2).fit(model, data)
    acc = events(logger)
    assert "hp_metric" not in acc.Tags()["scalars"]
    (samples,) = rendered_samples(acc, "val/debates")
    val = data.splits["val"]
    assert [s["problem"] for s in samples] == [r["prompt"] for r in val[:3]]  # log_samples=3
    for s in samples:
        assert {"answer", "answer reward", "critique", "critique reward", "judge verdict", "Alice's vote share"} <= set(
            s
        )
        assert s["judge verdict"] in ("alice", "bob", "tie", "unparsed")
    ((step, rewards),) = histogram(acc, "train/reward_hist")
    assert step == 0 and rewards.num == 4  # B * G forked-ply rewards
    assert histogram(acc, "train/advantage_hist")[0][1].num == 4


# ------------------------------------------------------------------------------------------------ deep-SMIDA
class FollowerLength(Utility):
    """u = distinct characters of the follower's reply / 50: a real function of the text; it keeps what it scored."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def forward(self, prompts, leader, follower):
        self.seen.extend(follower)
        return torch.tensor([len(set(y2)) / 50.0 for y2 in follower], dtype=torch.float32)


def test_deep_smida_shows_leader_follower_pairs_and_utilities(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = tiny_deep_smida(tiny_lm_dir, FollowerLength(), tau_leader=0.1, tau_follower=0.1)
    logger, data = config_logger(tmp_path, "deep_smida.yaml"), prompts_data()
    trainer(logger, tmp_path, max_steps=2, val_check_interval=1, limit_val_batches=1).fit(model, data)
    acc = events(logger)
    assert "hp_metric" not in acc.Tags()["scalars"]
    (samples,) = rendered_samples(acc, "val/leader_follower")
    val = data.splits["val"]
    # eval_pairs = 2 pairs per prompt: the first batch's two prompts, twice each
    assert [s["prompt"] for s in samples] == [val[0]["prompt"]] * 2 + [val[1]["prompt"]] * 2
    # the reply shown is the one scored (the random tiny model emits control characters and blank lines)
    shown = {as_shown(y): y for y in model.utility.seen}
    for s in samples:
        raw = shown[s["follower reply"]]
        assert float(s["utility"]) == pytest.approx(len(set(raw)) / 50.0, rel=1e-3)
    utility = scalars(acc, "follower/utility")
    ((step, u),) = histogram(acc, "follower/utility_hist")
    assert step in utility and u.num == 8 and u.sum == pytest.approx(8 * utility[step], rel=1e-5)  # B·D·M
    assert histogram(acc, "leader/cost_hist")[0][1].num == 4  # B·D


# ------------------------------------------------------------------------------------------------ the pool
PLAYERS_OF_POOL = ("m0", "m1", "m2")


def pool_data(tmp_path) -> InstructionPoolDataModule:
    """Eight short sums (short sequences keep the byte-level tiny model fast): six to duel on, two to validate."""
    path = tmp_path / "pool.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": str(2 * a + 1)}) for a in range(8)))
    source = PromptSource(path=str(path), prompt_column="question", reference_column="answer")
    return InstructionPoolDataModule(source=source, val_fraction=0.25, batch_size=4)


def pool(tiny_lm_dir, **kw) -> StackelbergPool:
    L.seed_everything(0)
    args = dict(
        lm={"name_or_path": str(tiny_lm_dir), "lora_r": 4, "lora_alpha": 8},
        duels_per_iteration=3,
        num_iterations=2,
        sampling=Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6),
        eval_max_new_tokens=6,
        judging=PeerJudging(template="{prompt} {response}", mode="constrained", max_new_tokens=6),
    )
    return StackelbergPool(**{**args, **kw})


def test_pool_shows_duels_exp3_elo_and_histograms(tiny_lm_dir, tmp_path):
    data = pool_data(tmp_path)
    model = pool(
        tiny_lm_dir,
        followers=FollowerTraining("grpo", lr=1e-2, batch_size=4, policy_gradient=PolicyGradient(group_size=2)),
    )
    logger = config_logger(tmp_path, "pool_grpo.yaml")
    trainer(logger, tmp_path, max_epochs=2, limit_val_batches=1).fit(model, datamodule=data)
    acc = events(logger)
    assert "hp_metric" not in acc.Tags()["scalars"]
    instructions = [r["prompt"] for r in data.splits["train"]]
    pages = rendered_samples(acc, "train/duels")
    assert len(pages) == 2  # one per validation (one per iteration here)
    for samples in pages:
        assert len(samples) == 3  # all three duels (fewer than log_samples=4)
        for s in samples:
            replies = [k for k in s if k.startswith("reply ")]
            players = {re.search(r"\((m\d),", k).group(1) for k in replies}
            (judge,) = set(PLAYERS_OF_POOL) - players  # three players: the one outside the duel judges
            assert s["judge scores, a vs b"].startswith(f"{judge}: ")
            assert s["instruction"] in instructions
    # the leader's distribution after each iteration, bucket i = instruction i
    exp3 = histogram(acc, "leader/exp3_probs")
    assert len(exp3) == 2
    for (_, h), weights in zip(exp3, model.history["weights"][1:]):
        assert list(h.bucket) == pytest.approx(weights, abs=1e-12) and h.num == pytest.approx(1.0)
        assert list(h.bucket_limit) == [i + 0.5 for i in range(len(weights))]
    # the Elo ratings: logged as scalars, and one custom-scalars chart naming every player's key and nothing else
    for p in PLAYERS_OF_POOL:
        assert scalars(acc, f"elo/{p}")
    ratings = custom_chart(acc, "ratings")
    matched = sorted(k for k in acc.Tags()["scalars"] if any(re.match(r, k) for r in ratings))
    assert matched == [f"elo/{p}" for p in PLAYERS_OF_POOL]  # not elo_volatility/, not another key
    # per iteration: D = 3 leader rewards, 2 scores per duel, 2 rollouts per side under GRPO
    counts = {"leader/reward_hist": 3, "duel/score_hist": 6, "follower/reward_hist": 12, "follower/advantage_hist": 12}
    for tag, count in counts.items():
        hists = histogram(acc, tag)
        assert len(hists) == 2 and all(h.num == count for _, h in hists), tag
    for _, h in histogram(acc, "follower/advantage_hist"):  # groups of two: ±a, summing to zero (float32)
        assert h.sum == pytest.approx(0.0, abs=1e-3) and h.min == -h.max


def test_pool_of_one_with_a_uniform_leader_and_dpo(tiny_lm_dir, tmp_path):
    """The self-rewarding baseline: the model duels and judges itself; SPARTA's flat distribution; no Elo, no GRPO."""
    data = pool_data(tmp_path)
    model = pool(tiny_lm_dir, num_players=1, leader="uniform", followers=FollowerTraining(lr=1e-2, batch_size=4))
    logger = config_logger(tmp_path, "pool_dpo.yaml")
    trainer(logger, tmp_path, max_epochs=1, limit_val_batches=1).fit(model, datamodule=data)
    acc = events(logger)
    (samples,) = rendered_samples(acc, "train/duels")  # one validation
    assert len(samples) == 3
    for s in samples:
        assert {"reply a (m0)", "reply b (m0)"} <= set(s) and s["judge scores, a vs b"].startswith("m0: ")
    ((_, h),) = histogram(acc, "leader/exp3_probs")
    assert list(h.bucket) == pytest.approx([1 / 6] * 6)  # six instructions to duel on, uniformly
    assert "custom_scalars__config__" not in acc.Tags()["tensors"]  # no ratings in a pool of one
    assert not [k for k in acc.Tags()["histograms"] if k.startswith("follower/")]  # DPO has no rollout advantages


def custom_chart(acc: ea.EventAccumulator, title: str) -> list[str]:
    """The tag regexes of the custom-scalars chart ``title`` in the run's (first) layout."""
    (event,) = acc.Tensors("custom_scalars__config__")[:1]
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())
    charts = [c for cat in layout.category for c in cat.chart if c.title == title]
    assert len(charts) == 1
    return list(charts[0].multiline.tag)


# ------------------------------------------------------------------------------------------------ Elo callback
def test_elo_callback_writes_one_chart_of_all_ratings(tmp_path):
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    make_trainer(
        tmp_path, [EloRating(PLAYERS)], logger=logger, max_epochs=1, limit_val_batches=0, log_every_n_steps=1
    ).fit(GameModule())
    acc = events(logger)
    keys = acc.Tags()["scalars"]
    for title, prefix in (("ratings", "elo/"), ("volatility", "elo_volatility/")):
        regexes = custom_chart(acc, title)
        assert sorted(k for k in keys if any(re.match(r, k) for r in regexes)) == sorted(prefix + p for p in PLAYERS)
