"""The families, read from the code: public LightningModules of ``modules/``, DataModules of ``datamodules/``."""

import importlib
import inspect
import pkgutil

import lightning as L


def _public_subclasses(package: str, base: type, skip: tuple[str, ...] = ()) -> dict[str, type]:
    """``{class name: class}`` of the public subclasses of ``base`` defined in the top-level files of ``package``."""
    found: dict[str, type] = {}
    root = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda i: i.name):
        if info.ispkg or info.name in skip or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, base) and cls.__module__ == module.__name__ and name[0] != "_":
                if name in found:  # short names must resolve to one class (``--model GRPO``)
                    raise TypeError(f"two families named {name}: {found[name].__module__} and {module.__name__}")
                found[name] = cls
    return found


def model_families() -> dict[str, type[L.LightningModule]]:
    """Every model family by class name, importing its file (cheap: families load models only when built)."""
    return _public_subclasses("alignment_games.modules", L.LightningModule, skip=("base",))


def data_families() -> dict[str, type[L.LightningDataModule]]:
    """Every data family by class name, importing its file."""
    return _public_subclasses("alignment_games.datamodules", L.LightningDataModule)
