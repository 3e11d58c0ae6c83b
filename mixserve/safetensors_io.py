"""Read safetensors files tensor by tensor through a memory map, with clear errors.

We parse the header ourselves (8-byte little-endian length, then JSON) so that a truncated or
corrupt file is reported with its name and the sizes involved, before numpy ever sees it, and so
that bfloat16 and float8 tensors come back as numpy arrays (ml_dtypes) without torch.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file or tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def read_header(path: str) -> dict[str, TensorInfo]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header needs {header_len} bytes, file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + header_len
    infos = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        info = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + start, base + end)
        expected = int(np.prod(info.shape, dtype=np.int64)) * np.dtype(DTYPES[info.dtype]).itemsize
        if info.end - info.start != expected:
            raise CheckpointError(f"{path}: tensor {name} has {info.end - info.start} bytes for shape {info.shape} {info.dtype}")
        if info.end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name} ends at byte {info.end}, file has {size} bytes"
            )
        infos[name] = info
    return infos


def checkpoint_files(directory: str) -> list[str]:
    """The shards of an HF checkpoint: from model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
        if missing:
            raise CheckpointError(f"{directory}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(directory, name) for name in files]
    files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return [os.path.join(directory, name) for name in files]


def index_tensors(directory: str) -> dict[str, TensorInfo]:
    """Headers of all shards (cheap: no tensor data is read)."""
    infos: dict[str, TensorInfo] = {}
    for path in checkpoint_files(directory):
        for name, info in read_header(path).items():
            if name in infos:
                raise CheckpointError(f"tensor {name} appears in both {infos[name].file} and {path}")
            infos[name] = info
    return infos


def load_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor, memory-mapped (no copy until the caller converts it)."""
    count = int(np.prod(info.shape, dtype=np.int64))
    array = np.memmap(info.file, dtype=DTYPES[info.dtype], mode="r", offset=info.start, shape=(count,))
    return array.reshape(info.shape)


def iter_tensors(infos: dict[str, TensorInfo]) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors in file order, so reads stream through each shard once."""
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].file, kv[1].start)):
        yield name, load_tensor(info)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write tensors (any dtype in DTYPES, bfloat16/float8 included) as one safetensors file."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset = {}, 0
    for name, array in tensors.items():
        dtype = np.dtype(array.dtype)
        if dtype not in names:
            raise CheckpointError(f"cannot write tensor {name} of dtype {dtype} to safetensors")
        header[name] = {"dtype": names[dtype], "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
