"""torch's distributed-checkpoint (DCP) format, read safely: the one module that knows its private
names. It checks a checkpoint directory before it is loaded: complete, whole, and free of
code-running pickles.

megatron-core's distributed checkpoints are written by torch's distributed checkpointing (DCP),
which stores its index, ``.metadata``, as a pickle and reads it with plain ``pickle.load``; it
also unpickles every non-tensor item ("bytes" items: megatron's ShardedObjects) with
``torch.load(weights_only=False)``. Loading a crafted checkpoint would therefore run its code. So
before any load, ``verify_checkpoint`` reads:

- ``.metadata`` through ``_MetadataUnpickler``, which resolves only the classes and functions DCP
  metadata is made of (``_ALLOWED``) and refuses every other global;
- every bytes item through ``torch.load(weights_only=True)`` (torch's own restricted unpickler);
- ``common.pt`` the same way, where megatron-core keeps one (0.16; 0.19 stores that state as
  bytes items).

A file that passes contains only those objects, so the loaders' own unpickling of the same bytes
builds nothing else. (Trust boundary: a checkpoint rewritten between this check and the load, by
someone with write access to it, is outside it; so is Transformer Engine's FP8 extra state, which
TE itself unpickles when a TE layer loads it.)

It also checks completeness: ``state.json`` (written last by every save) and ``metadata.json``
exist, every file the index names is a plain file name inside the directory, present, and long
enough for the bytes the index places in it. A truncated or half-copied checkpoint is named with
its first problem instead of failing somewhere inside the load (bit flips inside tensor data are
not detected: DCP keeps no checksums).

Checked against torch 2.13.0 with megatron-core 0.16.1 and torch 2.14.1 with megatron-core 0.19.2;
the test
``tests/test_compat_dcp.py`` verifies a freshly saved real checkpoint, so a release that adds a
class to the metadata fails there, loudly, rather than refusing users' checkpoints.

Cost: one read of ``.metadata`` (O(number of tensor shards): MBs at 70B), one ``stat`` per data
file (O(ranks)), and the bytes items (small).
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch

_DCP = "torch.distributed.checkpoint"
_ALLOWED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    f"{_DCP}.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name, e.g. torch.strided
    "torch": frozenset({"Size"}),  # and the dtypes, below
    "collections": frozenset({"OrderedDict"}),
}
"""Every global that DCP metadata written by torch 2.13 pickles (read off real checkpoints)."""
_METADATA_FILE = ".metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only ``_ALLOWED`` names and torch dtypes."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which checkpoint metadata "
                                     f"never holds (a crafted file?)")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("holds a persistent reference, which metadata never has")


def read_metadata(path: Path):
    """The DCP index of checkpoint ``path``, read without running code; ValueError if it cannot
    be read so."""
    file = Path(path) / _METADATA_FILE
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ValueError(f"{file} is missing") from None
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is a bad file
        raise ValueError(f"{file} is not plain checkpoint metadata: {e}") from None


def verify_checkpoint(path: Path) -> str:
    """'' if checkpoint ``path`` is complete and safe to load, else its first problem."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    state = path / "state.json"
    if not state.is_file():
        return f"{path} is incomplete: no state.json (a save that did not finish)"
    try:
        json.loads(state.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{state} is unreadable: {e}"
    try:
        backends = json.loads((path / "metadata.json").read_text())
    except FileNotFoundError:
        return f"{path / 'metadata.json'} is missing"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{path / 'metadata.json'} is unreadable: {e}"
    try:
        meta = read_metadata(path)
        _check_storage(path, meta)
    except ValueError as e:
        return str(e)
    # megatron-core 0.16 keeps the common (non-sharded) state in common.pt and says so here; 0.19
    # keeps it inside the DCP files, as bytes items (checked above)
    if isinstance(backends, dict) and backends.get("common_backend"):
        try:
            torch.load(path / "common.pt", map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return f"{path / 'common.pt'} is missing"
        except Exception as e:  # noqa: BLE001 - truncated zip, or a pickle of more than plain data
            return f"{path / 'common.pt'} is unreadable or not plain data: {str(e)[:300]}"
    return ""


def _check_storage(path: Path, meta) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sizes: dict[str, int] = {}
    for index, info in (meta.storage_data or {}).items():
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{path / _METADATA_FILE} names the data file {name!r}, which is not "
                             f"a file of the checkpoint directory (a crafted file?)")
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{path / _METADATA_FILE}: item {index.fqn} is stored with "
                             f"transforms {info.transform_descriptors}, which this tool never "
                             f"writes")
        if name not in sizes:
            file = path / name
            if not file.is_file():
                raise ValueError(f"{file} is missing (the index names it)")
            sizes[name] = file.stat().st_size
        if info.offset + info.length > sizes[name]:
            raise ValueError(f"{path / name} is truncated: {sizes[name]} bytes, the index needs "
                             f"{info.offset + info.length}")
        if isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(path / name, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - refused by torch's restricted unpickler
                raise ValueError(f"{path / name}: item {index.fqn} is not plain data "
                                 f"({str(e)[:200]})") from None
