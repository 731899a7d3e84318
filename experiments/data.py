"""Training tasks, generated or read locally; each batch is a function of (seed, step).

A batch is a dict of numpy arrays:

- ``inputs`` ``[B, L]`` int32 tokens;
- ``targets`` ``[B, L]`` int32 (language tasks: the token to predict at each
  position) or ``[B]`` (classification);
- ``weights`` ``[B, L]`` float32: which positions count in the loss and the
  metrics (language tasks);
- ``lengths`` ``[B]`` int32: valid tokens per example (padded classification);
- ``segment_ids`` ``[B, L]`` int32: packed rows (a task made of documents, with
  packing): the document of each input token, non-decreasing along the row.

``batch(seed, step)`` draws from ``numpy.random.default_rng((seed, step,
split))``, so a resumed run sees exactly the batches it would have seen, on
any number of devices, and no state needs checkpointing. (A pipeline library
such as grain would add a dependency and a checkpointable iterator for what
is here a pure function of two integers.)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sysconfig
from collections.abc import Callable

import numpy as np

TRAIN, VALID = 0, 1


@dataclasses.dataclass(frozen=True)
class Task:
  """A task: its vocabulary, kind and batch generator."""

  name: str
  vocab_size: int
  causal: bool  # Language modelling / recall (decoder) or classification (encoder).
  num_classes: int | None  # Classification only.
  batch: Callable[[int, int, int, int, int], dict[str, np.ndarray]]  # (seed, step, split, B, L)
  describe: str
  # The same rows with the documents in them told apart (``segment_ids``, and no target
  # across a boundary): for tasks whose text is made of documents; None for the others.
  packed_batch: Callable[[int, int, int, int, int], dict[str, np.ndarray]] | None = None


def _rng(seed: int, step: int, split: int) -> np.random.Generator:
  return np.random.default_rng((seed, step, split))


# ----------------------------------------------------------------- char_lm ---

CORPUS_BYTES = 8 * 2**20  # The first 8 MiB of standard-library source, by sorted path.


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[list[bytes], list[bytes]]:
  """The training and held-out source files, in sorted order (see :func:`stdlib_corpus`)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  parts: tuple[list[bytes], list[bytes]] = ([], [])
  total = 0
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if "site-packages" in rel or rel.startswith("test"):
      continue
    text = path.read_bytes()
    if not text:
      continue
    held_out = hashlib.sha256(rel.encode()).digest()[0] % 10 == 0
    parts[held_out].append(text)
    total += len(text)
    if total >= CORPUS_BYTES:
      break
  train, valid = (sum(len(t) for t in p) for p in parts)
  if valid < 2**16 or train < 2**20:
    raise RuntimeError(f"standard library sources under {root} are too small "
                       f"({train} / {valid} bytes).")
  return parts


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> tuple[np.ndarray, np.ndarray]:
  """``(train, valid)`` byte arrays from this Python's standard library sources.

  Files are read in sorted order up to ``CORPUS_BYTES`` and laid end to end;
  about one file in ten (by a hash of its relative path) is held out, so
  validation text comes from files never trained on.
  """
  train, valid = (np.frombuffer(b"".join(p), np.uint8) for p in _stdlib_files())
  return train, valid


@functools.lru_cache(maxsize=1)
def stdlib_document_starts() -> tuple[np.ndarray, np.ndarray]:
  """``(train, valid)``: where each file (a document) starts in :func:`stdlib_corpus`'s arrays."""
  return tuple(np.cumsum([0] + [len(t) for t in p[:-1]]) for p in _stdlib_files())


def unigram_entropy_bits() -> float:
  """Entropy of the training bytes' unigram distribution, in bits per character."""
  train, _ = stdlib_corpus()
  p = np.bincount(train, minlength=256) / len(train)
  p = p[p > 0]
  return float(-(p * np.log2(p)).sum())


def char_lm_window_starts(seed: int, step: int, split: int, B: int, L: int) -> np.ndarray:
  """The first positions ``[B]`` of the batch's windows of ``L + 1`` bytes."""
  text = stdlib_corpus()[split]
  return _rng(seed, step, split).integers(0, len(text) - L - 1, size=B)


def char_lm_batch(seed: int, step: int, split: int, B: int, L: int) -> dict[str, np.ndarray]:
  """Windows of the files laid end to end, each predicting its next byte everywhere."""
  text = stdlib_corpus()[split]
  windows = np.stack([text[s:s + L + 1] for s in char_lm_window_starts(seed, step, split, B, L)])
  windows = windows.astype(np.int32)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
          "weights": np.ones((B, L), np.float32)}


def char_lm_packed_batch(seed: int, step: int, split: int, B: int,
                         L: int) -> dict[str, np.ndarray]:
  """:func:`char_lm_batch`'s rows, packed: the files in them told apart.

  The same windows of the files laid end to end (the same bytes in the same order),
  with ``segment_ids`` ``[B, L]``, the file of each input byte counted from the row's
  first (0), and the weight of a target in another file than its input (the first
  byte of a file predicted from the last of the one before) set to 0.
  """
  batch = char_lm_batch(seed, step, split, B, L)
  first = char_lm_window_starts(seed, step, split, B, L)
  starts = stdlib_document_starts()[split]
  files = np.searchsorted(starts, first[:, None] + np.arange(L + 1), side="right") - 1
  files = files - files[:, :1]  # [B, L + 1]
  batch["segment_ids"] = files[:, :-1].astype(np.int32)
  batch["weights"] = (files[:, 1:] == files[:, :-1]).astype(np.float32)
  return batch


# -------------------------------------------------------------------- mqar ---

MQAR_VOCAB = 64  # 32 keys, 32 values: CPU-sized (Zoology sweeps up to 8192).


def mqar_batch(seed: int, step: int, split: int, B: int, L: int) -> dict[str, np.ndarray]:
  """Multi-query associative recall (Arora et al., 2023, "Zoology").

  ``P = min(L // 4, 31)`` key–value pairs ``k_1 v_1 k_2 v_2 ...`` come first
  (keys distinct, from the lower half of the vocabulary, values from the
  upper half), then P queries: each a key of an earlier pair followed by its
  value, which the model must predict. Only those predictions are scored
  (``weights``); any rest of the sequence is padding (token 0). The
  vocabulary is small (``MQAR_VOCAB``) so that a CPU-sized model learns it in
  minutes; Zoology sweeps vocabularies up to 8192 on GPUs.
  """
  rng = _rng(seed, step, split)
  half = MQAR_VOCAB // 2
  pairs = min(L // 4, half - 1)
  if pairs < 1:
    raise ValueError(f"mqar needs --seq_len >= 4; got {L}.")
  keys = np.stack([rng.choice(np.arange(1, half), pairs, replace=False) for _ in range(B)])
  values = rng.integers(half, MQAR_VOCAB, size=(B, pairs))
  tokens = np.zeros((B, L + 1), np.int64)
  tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values
  asked = rng.integers(0, pairs, size=(B, pairs))  # Which pair each query asks for.
  rows = np.arange(B)[:, None]
  q_pos = 2 * pairs + 2 * np.arange(pairs)
  tokens[:, q_pos], tokens[:, q_pos + 1] = keys[rows, asked], values[rows, asked]
  weights = np.zeros((B, L), np.float32)
  weights[:, q_pos] = 1.0  # At a query key, predict its value.
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
          "weights": weights}


# -------------------------------------------------------------------- copy ---

COPY_VOCAB = 64
SEPARATOR = 1


def copy_batch(seed: int, step: int, split: int, B: int, L: int) -> dict[str, np.ndarray]:
  """Copy a random sequence of ``L // 2`` tokens after a separator token."""
  rng = _rng(seed, step, split)
  n = L // 2
  seq = rng.integers(2, COPY_VOCAB, size=(B, n))
  tokens = np.zeros((B, L + 1), np.int64)
  tokens[:, :n], tokens[:, n] = seq, SEPARATOR
  tokens[:, n + 1:2 * n + 1] = seq
  weights = np.zeros((B, L), np.float32)
  weights[:, n:2 * n] = 1.0  # From the separator on, predict the copy.
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
          "weights": weights}


# ----------------------------------------------------------------- listops ---

LISTOPS_OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
LISTOPS_TOKENS = ("<pad>",) + tuple(str(d) for d in range(10)) + LISTOPS_OPERATORS + ("]",)
_TOKEN = {t: i for i, t in enumerate(LISTOPS_TOKENS)}


def _listops_tree(rng: np.random.Generator, depth: int, max_depth: int, max_args: int):
  if depth >= max_depth or (depth > 0 and rng.random() < 0.3):
    return int(rng.integers(0, 10))
  op = LISTOPS_OPERATORS[rng.integers(0, 4)]
  args = [_listops_tree(rng, depth + 1, max_depth, max_args)
          for _ in range(rng.integers(2, max_args + 1))]
  return (op, args)


def listops_value(tree) -> int:
  """The value of a ListOps expression (Nangia & Bowman, 2018; Tay et al., 2021, LRA)."""
  if isinstance(tree, int):
    return tree
  op, args = tree
  vals = [listops_value(a) for a in args]
  if op == "[MAX":
    return max(vals)
  if op == "[MIN":
    return min(vals)
  if op == "[MED":
    return int(np.median(vals))  # LRA takes the integer part of the median.
  return sum(vals) % 10


def _listops_tokens(tree) -> list[int]:
  if isinstance(tree, int):
    return [_TOKEN[str(tree)]]
  op, args = tree
  return [_TOKEN[op]] + [t for a in args for t in _listops_tokens(a)] + [_TOKEN["]"]]


def listops_batch(seed: int, step: int, split: int, B: int, L: int) -> dict[str, np.ndarray]:
  """ListOps: nested MAX, MIN, MED, SUM_MOD over digits; the label is the value (10 classes).

  Expressions (depth up to 6, up to 5 arguments per operator) are redrawn
  until they fit ``L`` tokens; shorter ones are right-padded (``lengths``).
  """
  rng = _rng(seed, step, split)
  inputs = np.zeros((B, L), np.int32)
  targets = np.zeros((B,), np.int32)
  lengths = np.zeros((B,), np.int32)
  for b in range(B):
    while True:
      tree = _listops_tree(rng, 0, max_depth=6, max_args=5)
      tokens = _listops_tokens(tree)
      if len(tokens) <= L:
        break
    inputs[b, :len(tokens)] = tokens
    targets[b], lengths[b] = listops_value(tree), len(tokens)
  return {"inputs": inputs, "targets": targets, "lengths": lengths}


TASKS = {
    "char_lm": Task("char_lm", 256, True, None, char_lm_batch,
                    "bytes of the standard library's own sources; held-out files",
                    packed_batch=char_lm_packed_batch),
    "mqar": Task("mqar", MQAR_VOCAB, True, None, mqar_batch,
                 "multi-query associative recall (Zoology)"),
    "copy": Task("copy", COPY_VOCAB, True, None, copy_batch,
                 "copy a random sequence after a separator"),
    "listops": Task("listops", len(LISTOPS_TOKENS), False, 10, listops_batch,
                    "ListOps (Long Range Arena), 10 classes"),
}
