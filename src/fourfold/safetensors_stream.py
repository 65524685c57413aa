"""Writing a safetensors file one tensor at a time, so that the writer never holds the whole
model: the header (names, dtypes, shapes, byte offsets) is computed from the tensors' specs
before any data arrives, then each tensor's bytes are appended as it comes. The file is written
under a temporary name and renamed at the end, so an interrupted export leaves no half-written
file behind."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from fourfold.files import atomic_path


@dataclass(frozen=True)
class TensorSpec:
    """A full tensor's name, dtype and shape, known without holding it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_HEADER_ALIGN = 8  # safetensors pads its JSON header so that the data starts aligned


def _nbytes(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=spec.dtype).element_size()


def header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `specs` in order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be written to safetensors")
        size = _nbytes(spec)
        header[spec.name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGN)
    return len(text).to_bytes(8, "little") + text


def write_streamed(path: Path | None, specs: Sequence[TensorSpec],
                   tensors: Iterable[tuple[TensorSpec, torch.Tensor | None]],
                   metadata: Mapping[str, str], rename: Mapping[str, str] | None = None) -> None:
    """Write the tensors of `specs` to `path`, taking them one at a time from `tensors`, which
    yields (spec, tensor) in the order of `specs`. With `rename` (source name -> name in the
    file) only the tensors it names are written. With path None this process writes nothing
    but still runs `tensors` to its end (its items may be collective, as on a grid)."""
    if path is None:
        for _ in tensors:
            pass
        return
    names = {s.name: (rename[s.name] if rename is not None else s.name) for s in specs
             if rename is None or s.name in rename}
    out_specs = [TensorSpec(names[s.name], s.dtype, s.shape) for s in specs if s.name in names]
    expected_specs = [s for s in specs if s.name in names]
    stream = iter(tensors)
    with atomic_path(path, durable=True) as tmp, open(tmp, "wb") as f:
        f.write(header_bytes(out_specs, metadata))
        done = 0
        for spec, tensor in stream if expected_specs else ():
            if spec.name not in names:
                continue
            expected = expected_specs[done] if done < len(expected_specs) else None
            if expected is None or expected.name != spec.name or tensor is None:
                raise RuntimeError(f"streamed export: got {spec.name}, expected "
                                   f"{expected.name if expected else 'nothing'}")
            if tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
                raise RuntimeError(f"streamed export: {spec.name} is {tuple(tensor.shape)} "
                                   f"{tensor.dtype}, its header says {expected.shape} "
                                   f"{expected.dtype}")
            f.write(_raw_bytes(tensor))
            del tensor  # hold one tensor at a time
            done += 1
            if done == len(expected_specs):
                break
        missing = [s.name for s in expected_specs[done:]]
        if missing:
            raise RuntimeError(f"streamed export: no data for {missing[:3]}")
    # The file is complete and in place: only now the rest of the stream (its items this file
    # leaves out and, on a grid, its end, where the other ranks wait for the writer)
    for _ in stream:
        pass


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach().to("cpu").contiguous()
    # little-endian raw bytes, as safetensors stores them (the view shares t's memory)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
