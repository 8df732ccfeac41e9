"""Opening llama.cpp GGUF files: the one reader both the tokenizer and the weight loader use.

- `open_gguf(path)`: a `GGUFFile` over the file (metadata fields and tensor views, memory-mapped),
  after checking the magic bytes; a corrupt or truncated file is a `ValueError` naming it.
- `has_gguf_magic(path)`: whether a file starts with the GGUF magic bytes.

`text.tokenizer.tokenizer_from_gguf` reads the vocabulary from the reader, `models.checkpoint`
the architecture metadata and the tensors; both open the file here, so it is parsed once per load.
"""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np

__all__ = ["GGUF_MAGIC", "GGUFFile", "open_gguf", "has_gguf_magic"]

GGUF_MAGIC = b"GGUF"


class GGUFFile(gguf.GGUFReader):
  """A `GGUFReader` whose `data` is a plain-ndarray view of the memmap; `path` is the file.

  Parsing the 49k-entry vocabulary and dequantising do ~10^6 small slices, and the memmap
  subclass's per-slice bookkeeping made loading ~3x slower. Same file mapping, same reader otherwise.
  """

  @property
  def data(self):
    return self._plain_data

  @data.setter
  def data(self, value):
    self.path = getattr(value, "filename", None)
    self._plain_data = value.view(np.ndarray)


def has_gguf_magic(path: str | os.PathLike) -> bool:
  """Whether the file at `path` starts with the GGUF magic bytes (False if it cannot be read)."""
  try:
    with open(path, "rb") as f:
      return f.read(4) == GGUF_MAGIC
  except OSError:
    return False


def open_gguf(path: str | os.PathLike) -> GGUFFile:
  """A `GGUFFile` over `path`.

  Raises:
    ValueError: the file does not start with the GGUF magic, or the reader fails on it (truncated
      or corrupt data); the message names the file and its size.
  """
  path = pathlib.Path(path)
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}).")
  try:
    return GGUFFile(str(path))
  except Exception as e:  # the reader raises ValueError/IndexError/... on truncated or corrupt data
    raise ValueError(f"{path}: corrupt or truncated GGUF file ({os.path.getsize(path)} bytes): "
                     f"{type(e).__name__}: {e}") from e
