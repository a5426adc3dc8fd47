"""Text, histograms and figures reach TensorBoard, W&B (offline), MLflow (a file store) and CSV alike.

A tiny fit logs one text, one histogram and one figure through ``alignment_games.callbacks.media`` to all four
loggers at once; each is then read back from what its logger wrote, with the logger's own reader where it has one
(TensorBoard's ``EventAccumulator``, ``MlflowClient``), the W&B offline run's files and its ``.wandb`` record log, and
the CSV logger's folder, and must hold the same text, the same buckets and the same pixels.
"""

import io
import json
import time
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.util import tensor_util
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from alignment_games.callbacks import EloRating, media
from alignment_games.callbacks.media import Histogram, log_figure, log_histogram, log_text

TEXT = "#### 1\n\n**reply**  \n&#35; caf\u00e9 \u2014 *(empty)*"
VALUES = np.array([0.0, 0.25, 0.25, 1.0, -2.0, float("nan"), float("inf")])  # the two non-finite ones left out
STEP = 0  # one training batch, then the validation that logs (before Lightning counts the batch, as its scalars)


def figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1.5))
    FigureCanvasAgg(fig)
    fig.add_subplot().plot([0, 1, 2], [1, 0, 2], "-o")
    return fig


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))


def expected_pixels() -> np.ndarray:
    buffer = io.BytesIO()
    figure().savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return pixels(buffer.getvalue())


class MediaModule(pl.LightningModule):
    """A linear regression that logs the same text, histogram and figure at the end of each validation."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        log_text(self.trainer, "samples/text", TEXT)
        log_histogram(self.trainer, "values/hist", Histogram.of_values(VALUES, bins=4))
        log_figure(self.trainer, "plots/figure", figure())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, loggers, module=None, callbacks=()):
    data = DataLoader(TensorDataset(torch.ones(2, 2)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=loggers,
        callbacks=list(callbacks),
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module or MediaModule(), data, data)
    return trainer


EXPECTED_HISTOGRAM = {  # 0, .25, .25, 1, -2 in four equal buckets over [-2, 1]
    "edges": [-2.0, -1.25, -0.5, 0.25, 1.0],
    "counts": [1.0, 0.0, 1.0, 3.0],
    "num": 5.0,
    "sum": -0.5,
    "sum_squares": 5.125,
    "min": -2.0,
    "max": 1.0,
}


# ------------------------------------------------------------------------------------------------ reading back
def tensorboard_media(logger: TensorBoardLogger):
    acc = ea.EventAccumulator(logger.log_dir, size_guidance={ea.TENSORS: 0, ea.HISTOGRAMS: 0, ea.IMAGES: 0})
    acc.Reload()
    ((text_event,),) = [acc.Tensors("samples/text/text_summary")]
    (hist_event,) = acc.Histograms("values/hist")
    (image_event,) = acc.Images("plots/figure")
    h = hist_event.histogram_value
    histogram = {
        "edges": [h.min, *h.bucket_limit],  # TensorBoard names a bucket by its right edge
        "counts": list(h.bucket),
        **{k: getattr(h, k) for k in ("num", "sum", "sum_squares", "min", "max")},
    }
    text = tensor_util.make_ndarray(text_event.tensor_proto).item().decode()
    steps = {text_event.step, hist_event.step, image_event.step}
    return text, histogram, pixels(image_event.encoded_image_string), steps


def wandb_records(path) -> list:
    """Every record of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB holding protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or (length == 0 and kind == 0):  # the end of a block is zero padding
            position += left if left < 7 or length == 0 else 0
            continue
        if position + 7 + length > len(data):  # a record still being written
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_media(logger: WandbLogger):
    run = logger.experiment
    run_dir, files = run.dir.rsplit("/files", 1)[0], run.dir
    run.finish()
    from pathlib import Path

    (table,) = Path(files).glob("media/table/samples/text_*.table.json")
    (image,) = Path(files).glob("media/images/plots/figure_*.png")
    log, deadline = next(Path(run_dir).glob("run-*.wandb")), time.monotonic() + 60
    records = wandb_records(log)
    while not any(r.HasField("exit") for r in records):  # wandb-core may still be writing when finish() returns
        assert time.monotonic() < deadline, "the offline run's record log never got its exit record"
        time.sleep(0.2)
        records = wandb_records(log)
    rows = []
    for record in records:
        if record.HasField("history"):  # a logged object's fields come as items keyed [key, field]
            row = {}
            for item in record.history.item:
                *outer, last = list(item.nested_key) or [item.key]
                target = row
                for key in outer:
                    target = target.setdefault(key, {})
                target[last] = json.loads(item.value_json)
            rows.append(row)
    (row,) = [r for r in rows if "values/hist" in r]
    histogram = {"edges": row["values/hist"]["bins"], "counts": [float(c) for c in row["values/hist"]["values"]]}
    text = json.loads(table.read_text())["data"]
    return text, histogram, pixels(image.read_bytes()), row["trainer/global_step"]


def mlflow_media(logger: MLFlowLogger, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(logger._tracking_uri)
    listed = {
        a.path
        for folder in ("samples/text", "values/hist", "plots/figure")
        for a in client.list_artifacts(logger.run_id, f"media/{folder}")
    }
    assert listed == {
        f"media/samples/text/step_{STEP}.md",
        f"media/values/hist/step_{STEP}.json",
        f"media/plots/figure/step_{STEP}.png",
    }
    local = client.download_artifacts(logger.run_id, "media", str(tmp_path / "downloaded"))
    return read_files(local)


def read_files(folder):
    from pathlib import Path

    folder = Path(folder)
    text = (folder / f"samples/text/step_{STEP}.md").read_text()
    histogram = json.loads((folder / f"values/hist/step_{STEP}.json").read_text())
    return text, histogram, pixels((folder / f"plots/figure/step_{STEP}.png").read_bytes())


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline and quiet, its settings under ``tmp_path``; MLflow's file store allowed (mlflow 3 asks for it)."""
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(key, value)


# ------------------------------------------------------------------------------------------------ the four loggers
def test_every_logger_holds_the_same_text_histogram_and_figure(tmp_path, offline):
    tb = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    wb = WandbLogger(save_dir=str(tmp_path), project="media", offline=True)
    mlf = MLFlowLogger(experiment_name="media", tracking_uri=f"file:{tmp_path}/mlruns")
    csv = CSVLogger(tmp_path, name="csv")
    fit(tmp_path, [tb, wb, mlf, csv])
    want_pixels = expected_pixels()

    text, histogram, image, steps = tensorboard_media(tb)
    assert text == TEXT and histogram == EXPECTED_HISTOGRAM and steps == {STEP}
    assert np.array_equal(image, want_pixels)

    text, histogram, image, step = wandb_media(wb)
    assert text == [[TEXT]] and step == STEP
    assert histogram == {"edges": EXPECTED_HISTOGRAM["edges"], "counts": EXPECTED_HISTOGRAM["counts"]}
    assert np.array_equal(image, want_pixels)

    for text, histogram, image in (mlflow_media(mlf, tmp_path), read_files(f"{csv.log_dir}/media")):
        assert text == TEXT and histogram == EXPECTED_HISTOGRAM and np.array_equal(image, want_pixels)


def test_a_failing_and_an_unknown_logger_lose_none_of_the_others_data(tmp_path):
    class Scalars(Logger):  # a logger of the user's own that takes scalars only
        name, version = "scalars", 0

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    tb = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    failing, csv = CSVLogger(tmp_path, name="failing", version=0), CSVLogger(tmp_path, name="csv")
    (tmp_path / "failing" / "version_0").mkdir(parents=True)
    (tmp_path / "failing" / "version_0" / "media").write_text("a file where the media folder would go")
    media._warned.discard("Scalars")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, [failing, Scalars(), tb, csv])
    messages = [str(w.message) for w in caught]
    unknown = [m for m in messages if m.startswith("Scalars takes only scalars")]
    assert len(unknown) == 1  # once, though it was passed over three times
    failures = [m for m in messages if m.startswith("CSVLogger could not log")]
    assert [m.split(":")[0] for m in failures] == [
        f"CSVLogger could not log the text 'samples/text' at step {STEP}",
        f"CSVLogger could not log the histogram 'values/hist' at step {STEP}",
        f"CSVLogger could not log the figure 'plots/figure' at step {STEP}",
    ]
    assert all(m.endswith("the other loggers have it") for m in failures)
    text, histogram, image, _ = tensorboard_media(tb)  # written after the failure, in the list's order
    assert text == TEXT and histogram == EXPECTED_HISTOGRAM
    want = (TEXT, EXPECTED_HISTOGRAM)
    text, histogram, image = read_files(f"{csv.log_dir}/media")
    assert (text, histogram) == want and np.array_equal(image, expected_pixels())
    assert (tmp_path / "failing" / "version_0" / "metrics.csv").exists()  # its scalars are still written


def test_no_logger_or_another_rank_writes_nothing(tmp_path):
    csv = CSVLogger(tmp_path)

    class Rank1:
        is_global_zero, loggers = False, [csv]

    assert media.media_loggers(Rank1()) == [] and media.media_loggers(None) == []
    log_text(Rank1(), "samples/text", TEXT, step=0)
    assert not (tmp_path / "lightning_logs").exists()


def test_tags_cannot_leave_the_run_folder(tmp_path):
    csv = CSVLogger(tmp_path, name="csv")

    class Trainer:
        is_global_zero, loggers = True, [csv]

    log_text(Trainer(), "../../out/../x y", TEXT, step=3)
    (written,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == tmp_path / "csv" / "version_0" / "media" / "__" / "__" / "out" / "__" / "x_y" / "step_3.md"


def test_histogram_of_a_distribution_and_of_nothing():
    h = Histogram.of_distribution([0.5, 0.25, 0.25])
    assert h.edges == (-0.5, 0.5, 1.5, 2.5) and h.counts == (0.5, 0.25, 0.25)
    assert (h.num, h.sum, h.sum_squares) == (1.0, 0.75, 1.25)
    assert Histogram.of_values([float("nan")]) is None


def test_elo_figure_reaches_every_logger(tmp_path):
    tb, csv = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False), CSVLogger(tmp_path, name="csv")

    class Quiet(MediaModule):
        def on_validation_epoch_end(self):
            pass

    elo = EloRating(["alice", "bob"], figure_path=tmp_path / "elo.png")
    fit(tmp_path, [tb, csv], Quiet(), [elo])
    acc = ea.EventAccumulator(tb.log_dir, size_guidance={ea.IMAGES: 0})
    acc.Reload()
    (event,) = acc.Images("elo/trajectories")
    written = (tmp_path / "csv" / "version_0" / "media" / "elo" / "trajectories" / "step_1.png").read_bytes()
    assert event.step == 1 and np.array_equal(pixels(event.encoded_image_string), pixels(written))
    assert (tmp_path / "elo.png").exists()
