"""Reading a torch.distributed.checkpoint (DCP) folder without unpickling code from it.

DCP itself unpickles ``.metadata`` and non-tensor entries; here only its metadata classes and weights-only entries.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# Modules whose own classes (DCP's metadata dataclasses and enums) may be built; nothing they import.
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_ALLOWED |= {("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata dataclasses and enums, dtypes, ``torch.Size``, layouts and paths; refuses all else."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        # a dotted name would reach through attributes (``filesystem`` + ``os.system``): undotted own classes only
        if "." not in name:
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            found = getattr(sys.modules.get(module), name, None) if module in _ALLOWED_MODULES else None
            # DCP's metadata is dataclasses and enums; readers and planners are neither
            record = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
            if record and found.__module__ == module:
                return found
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{self.source}: refusing to build {module}.{name} (a DCP metadata file holds only DCP's metadata "
            "classes, dtypes and sizes; this one names code)"
        )


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The ``Metadata`` of the DCP folder ``path``, read with :class:`_MetadataUnpickler`.

    Raises:
        FileNotFoundError: naming the folder when it has no ``.metadata``.
        pickle.UnpicklingError: naming the file and the global it refers to, for anything but metadata.
    """
    file = os.path.join(os.fspath(path), ".metadata")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"sharded checkpoint {os.fspath(path)!r} has no .metadata (an incomplete save?)")
    with open(file, "rb") as f:
        metadata = _MetadataUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{file}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with the metadata read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The folder's metadata (:func:`read_dcp_metadata`), stamped with this reader's load id as DCP does."""
        metadata = read_dcp_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Put a non-tensor entry, read with ``weights_only=True``, where the state dict expects it."""
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
