"""The layering the tree promises, read from the source: pure math imports no Lightning, callbacks import nothing of
the suite, only the distributed subpackage names a strategy, and the top of ``modules/`` is the catalogue of families.
"""

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT

from alignment_games.modules.training.registry import model_families

ROOT_PATH = Path(ROOT)
PURE = ["modules/algorithms", "callbacks/functional"]
CODE = ("modules", "datamodules", "callbacks", "commands")
STRATEGY_NAMES = {
    "DDPStrategy",
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "ModelParallelStrategy",
    "FSDP2Strategy",
    "FullyShardedDataParallel",
    "fully_shard",
}
STRATEGY_MODULES = (
    "deepspeed",
    "torch.distributed.fsdp",
    "lightning.pytorch.strategies",
    "lightning.fabric.strategies",
)


def _sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT_PATH / f).rglob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "alignment_games":
            out.update(f"alignment_games.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _suite_folder(module: str) -> str | None:
    """The suite's top-level folder (or ``train``) that an imported name lies in; ``None`` outside the suite."""
    parts = module.split(".")
    if parts[0] == "alignment_games":
        return parts[1] if len(parts) > 1 else ""
    return parts[0] if parts[0] in ("modules", "datamodules", "callbacks", "commands", "train") else None


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name a strategy)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def strategy_mentions(path: Path) -> list[str]:
    """Names of strategy classes or imports of strategy packages in ``path``'s code (docstrings and comments aside)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = [m for m in _imports(tree) if m.startswith(STRATEGY_MODULES)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in STRATEGY_NAMES:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in STRATEGY_NAMES:
            found.append(node.attr)
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in STRATEGY_NAMES:
            found.append(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found.extend(n for n in STRATEGY_NAMES if n == node.value.strip())
    return found


@pytest.mark.parametrize("path", _sources(*PURE), ids=lambda p: str(p.relative_to(ROOT_PATH)))
def test_pure_math_imports_no_lightning(path):
    bad = [m for m in _imports(ast.parse(path.read_text())) if m.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not bad, f"{path.relative_to(ROOT_PATH)} imports {bad}"


#: The folders from the bottom up: a file imports only from its own folder and the folders listed before it (the
#: callbacks import nothing of the suite; pure math sits under everything that computes with models; command-line
#: tools and ``train.py`` are the top). A new folder has to be placed here.
LAYERS = (
    "callbacks/functional",
    "callbacks",
    "modules/algorithms",
    "modules/training",
    "modules/distributed",
    "modules/lm",
    "modules/checkpoints",
    "modules/scorers",
    "datamodules",
    "modules/games",
    "modules/evaluation",
    "modules",
    "commands",
    "train",
)


def _folder(parts: list[str], root: Path) -> str:
    """The deepest existing folder of the suite along ``parts`` (``train`` for train.py)."""
    if parts[:1] == ["train"]:
        return "train"
    depth = max(i for i in range(1, len(parts) + 1) if (root / Path(*parts[:i])).is_dir())
    return "/".join(parts[:depth])


def layer_violations(root: Path, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """``file imports module (folder above its own)`` for every import against ``layers``, and unplaced folders."""
    rank = {name: i for i, name in enumerate(layers)}
    out = []
    files = sorted(p for top in ("callbacks", "commands", "datamodules", "modules") for p in (root / top).rglob("*.py"))
    for path in [*files, root / "train.py"]:
        rel = path.relative_to(root)
        own = "train" if rel == Path("train.py") else _folder(list(rel.parent.parts), root)
        if own not in rank:
            out.append(f"{rel}: folder {own} is not in LAYERS")
            continue
        for module in sorted(_imports(ast.parse(path.read_text()))):
            if _suite_folder(module) is None:
                continue
            parts = module.split(".")[1:] if module.startswith("alignment_games") else module.split(".")
            theirs = _folder(parts, root)
            if rank.get(theirs, len(layers)) > rank[own]:
                out.append(f"{rel} imports {module} ({theirs} is above {own})")
    return out


def test_folders_import_one_way():
    assert not layer_violations(ROOT_PATH)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    for folder in ("callbacks", "modules/lm", "modules/new"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "callbacks/a.py").write_text("from alignment_games.modules.lm.x import y\n")
    (tmp_path / "modules/lm/b.py").write_text("import alignment_games.callbacks.a\n")
    (tmp_path / "modules/new/c.py").write_text("")
    assert layer_violations(tmp_path, ("callbacks", "modules/lm", "train")) == [
        "callbacks/a.py imports alignment_games.modules.lm.x (modules/lm is above callbacks)",
        "modules/new/c.py: folder modules/new is not in LAYERS",
    ]


def test_only_the_distributed_subpackage_names_a_strategy():
    outside = [p for p in _sources("modules", "datamodules", "callbacks") if "distributed" not in p.parts]
    offenders = {str(p.relative_to(ROOT_PATH)): m for p in outside if (m := strategy_mentions(p))}
    assert not offenders, f"strategy names outside modules/distributed/: {offenders}"


def test_the_strategy_scan_sees_a_strategy_name(tmp_path):
    """The scan above can fail: code naming a strategy is caught, a docstring naming one is not."""
    code = tmp_path / "x.py"
    code.write_text('"""Runs under DeepSpeedStrategy."""\nfrom lightning.pytorch.strategies import DDPStrategy\n')
    assert strategy_mentions(code) == ["lightning.pytorch.strategies", "DDPStrategy"]
    code.write_text('"""Runs under DeepSpeedStrategy."""\nkind = "ModelParallelStrategy"\n')
    assert strategy_mentions(code) == ["ModelParallelStrategy"]
    code.write_text('"""Runs under DeepSpeedStrategy."""\n')
    assert strategy_mentions(code) == []


def test_the_top_of_modules_is_the_catalogue_of_families():
    top = {p.stem for p in (ROOT_PATH / "modules").glob("*.py")} - {"__init__", "base"}
    assert top == {cls.__module__.rsplit(".", 1)[1] for cls in model_families().values()}, "a file defining no family"
    folders = {p.name for p in (ROOT_PATH / "modules").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"algorithms", "checkpoints", "distributed", "evaluation", "games", "lm", "scorers", "training"}


def test_no_module_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT_PATH)): n for p in _sources(*CODE) if (n := len(p.read_text().splitlines())) > 600}
    assert not long


def test_no_source_edits_sys_path():
    edits = [
        str(p.relative_to(ROOT_PATH))
        for p in [
            *_sources("modules", "datamodules", "callbacks", "commands", "tests", "benchmarks"),
            ROOT_PATH / "train.py",
        ]
        if re.search(r"sys\.path(\.insert|\.append|\.extend|\[| *[+]?=)", p.read_text())
    ]
    assert not edits
