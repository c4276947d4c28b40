"""A real corpus that ships with every Python: the standard library's own source files.

The built-in corpus (:mod:`composer_cloud.corpus`) is templated and has a low
loss floor that one replica reaches as well as four, so it cannot show that
communicating replicas learn faster. This corpus is natural code: the ``.py``
files of the running interpreter's standard library (about 10 MB after the
exclusions below), split deterministically by relative path into

* ``train`` (80%): what replicas train on (each reads its ``rank::W`` rows),
* ``bpe`` (10%): what the byte-level BPE tokenizer is trained on,
* ``heldout`` (10%): whole files never trained on, for the held-out loss.

Everything is a pure function of the file contents and the parameters: the
split hashes relative paths (sha256), files are read in sorted order, the BPE
is trained single-threaded on a fixed list. Two processes on one machine (or
two machines with the same Python version) build the same splits, tokenizer
and token rows. The packed token stream is cached on local disk
(``$COMPOSER_CLOUD_CACHE`` or ``~/.cache/composer-cloud/stdlib``) under a key
that hashes the tokenizer and the texts, so only the first replica start on a
machine tokenizes.

Use it with ``trainer.name = "causal-lm"``, ``trainer.corpus = "stdlib"`` and a
model whose tokenizer is the stdlib BPE: :func:`write_model_dir` writes one
(``model.name = <that dir>``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from composer_cloud import env

logger = logging.getLogger(__name__)

SPLITS = ("train", "bpe", "heldout")
#: Directories left out anywhere in the tree: test suites (huge, repetitive fixtures), third-party code,
#: generated tables (encodings, pydoc topics) and demo/GUI packages.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "pydoc_data", "encodings",
    "turtledemo", "__pycache__", "lib2to3", "ensurepip", "config-3", "tkinter",
})
#: Files larger than this are skipped (generated tables, not code a model should learn from).
MAX_FILE_BYTES = 400_000
DEFAULT_VOCAB = 4096
#: Characters of bpe-split text the tokenizer is trained on (enough for a 4k vocabulary, ~2 s).
BPE_TRAIN_CHARS = 1_500_000
#: Qwen2's pre-tokenizer split (``transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX``). The model
#: directory is a Qwen2 model, and transformers 5's ``AutoTokenizer`` loads its tokenizer as ``Qwen2Tokenizer``,
#: which *replaces* the saved normalizer and pre-tokenizer with NFC + this split + ByteLevel. The BPE is trained
#: with exactly those, so the in-memory tokenizer and the one a replica loads from the directory agree
#: (``tests/test_corpus.py`` checks).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """``train`` / ``bpe`` / ``heldout`` for a path relative to the stdlib root (posix separators)."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < 10 else "bpe" if bucket < 20 else "train"


@lru_cache(maxsize=4)
def stdlib_files(root: str | None = None) -> tuple[str, ...]:
    """Sorted relative paths (posix) of the stdlib's ``.py`` files, exclusions applied."""
    base = Path(root) if root else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            out.append(path.relative_to(base).as_posix())
    return tuple(sorted(out))


def _order_key(relpath: str) -> bytes:
    # Within a split, files are taken in hash order (not alphabetical), so a byte budget samples the whole
    # library rather than its first packages.
    return hashlib.sha256(b"order:" + relpath.encode()).digest()


def split_files(split: str, root: str | None = None) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    return sorted((p for p in stdlib_files(root) if split_of(p) == split), key=_order_key)


def read_split(split: str, max_bytes: int | None = None, root: str | None = None) -> list[str]:
    """Texts of ``split`` in its fixed order, whole files, until ``max_bytes`` (UTF-8) is reached."""
    base = Path(root) if root else stdlib_root()
    texts, total = [], 0
    for rel in split_files(split, root):
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            text = (base / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text.encode())
    return texts


def texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(len(t).to_bytes(8, "big"))
        h.update(t.encode())
    return h.hexdigest()


def cache_dir() -> Path:
    return env.cache_root() / "stdlib"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- tokenizer
def train_bpe_json(vocab_size: int = DEFAULT_VOCAB, max_chars: int = BPE_TRAIN_CHARS) -> str:
    """The stdlib byte-level BPE as ``tokenizers`` JSON (deterministic; cached on disk).

    Special tokens as the built-in tiny tokenizer: ``<|pad|>`` (id 0) and ``<|endoftext|>`` (eos/bos).
    """
    texts = read_split("bpe", max_bytes=max_chars)
    key = hashlib.sha256(f"bpe-v2:{vocab_size}:{texts_digest(texts)}".encode()).hexdigest()[:24]
    path = cache_dir() / f"bpe-{key}.json"
    if path.exists():
        return path.read_text()
    env.single_threaded_tokenizers()  # one thread: the merges do not depend on timing
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = tok.to_str()
    _atomic_write(path, out.encode())
    return out


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB) -> Any:
    """The stdlib BPE wrapped as a ``PreTrainedTokenizerFast`` (pad/eos/bos like the tiny model's)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(train_bpe_json(vocab_size)),
                                   pad_token="<|pad|>", eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.padding_side = "left"
    return fast


def write_model_dir(path: str | Path, *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB,
                    config: Any = None) -> Path:
    """Write a freshly initialised tiny Qwen2 + the stdlib tokenizer as a local model directory.

    ``config`` is a :class:`composer_cloud.model.TinyModelConfig` (its vocab size is replaced by the
    tokenizer's). Use the directory as ``model.name``: every replica loads the same weights with
    transformers, and the tokenizer matches the one :func:`token_rows` packs with.
    """
    from composer_cloud.model import build_tiny_model

    path = Path(path)
    tokenizer = build_tokenizer(vocab_size)
    model = build_tiny_model(tokenizer, seed=seed, config=config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------------------- token rows
@dataclass(frozen=True)
class CorpusInfo:
    split: str
    files: int
    bytes: int
    tokens: int
    cache_key: str
    cached: bool


def token_stream(tokenizer: Any, split: str, max_bytes: int | None) -> tuple[Any, CorpusInfo]:
    """1-D ``torch.long`` tensor: the split's files tokenized, each followed by eos (cached on disk)."""
    import torch
    from safetensors.torch import load_file, save_file

    texts = read_split(split, max_bytes=max_bytes)
    tok_json = tokenizer.backend_tokenizer.to_str()
    key = hashlib.sha256(
        f"stream-v1:{split}:{tokenizer.eos_token_id}:".encode()
        + hashlib.sha256(tok_json.encode()).digest() + texts_digest(texts).encode()).hexdigest()[:24]
    path = cache_dir() / f"tokens-{split}-{key}.safetensors"
    nbytes = sum(len(t.encode()) for t in texts)
    if path.exists():
        try:
            ids = load_file(str(path))["ids"]
            return ids, CorpusInfo(split, len(texts), nbytes, int(ids.numel()), key, True)
        except Exception as exc:  # noqa: BLE001 - a damaged cache entry is rebuilt, never trusted
            logger.warning("stdlib token cache %s unreadable (%s); rebuilding", path, exc)
    enc = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    flat: list[int] = []
    for e in enc:
        flat.extend(e.ids)
        flat.append(eos)
    ids = torch.tensor(flat, dtype=torch.long)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"ids": ids}, str(tmp), metadata={"split": split, "files": str(len(texts))})
    os.replace(tmp, path)
    return ids, CorpusInfo(split, len(texts), nbytes, int(ids.numel()), key, False)


def token_rows(tokenizer: Any, split: str, seq_len: int, max_bytes: int | None = None,
               max_rows: int | None = None) -> Any:
    """``[n, seq_len]`` rows of the split's token stream; ``max_rows`` picks evenly spaced rows."""
    import torch

    ids, info = token_stream(tokenizer, split, max_bytes)
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"stdlib {split} split too small for seq_len={seq_len}")
    rows = ids[: n * seq_len].view(n, seq_len)
    if max_rows is not None and max_rows < n:
        # Evenly spaced over the whole split (the stream is file by file: the first rows would be few files).
        rows = rows[torch.linspace(0, n - 1, max_rows).round().long()]
    logger.info("stdlib %s: %d files, %.1f MB, %d tokens (%s), %d rows of %d", split, info.files,
                info.bytes / 1e6, info.tokens, "cached" if info.cached else "tokenized", len(rows), seq_len)
    return rows.contiguous()


def describe() -> dict[str, Any]:
    """Counts per split (for benchmark reports)."""
    files = stdlib_files()
    return {"root": str(stdlib_root()), "files": len(files),
            "per_split": {s: sum(1 for p in files if split_of(p) == s) for s in SPLITS},
            "excluded_dirs": sorted(EXCLUDED_DIRS), "max_file_bytes": MAX_FILE_BYTES}


__all__ = ["SPLITS", "build_tokenizer", "describe", "read_split", "split_files", "split_of", "stdlib_files",
           "token_rows", "token_stream", "train_bpe_json", "write_model_dir"]


if __name__ == "__main__":  # python -m composer_cloud.stdlib_corpus: sizes and timings
    import time

    t0 = time.monotonic()
    print(json.dumps(describe(), indent=1))
    tok = build_tokenizer()
    t1 = time.monotonic()
    print(f"tokenizer: {len(tok)} tokens in {t1 - t0:.1f}s")
    for split in ("train", "heldout"):
        t = time.monotonic()
        rows = token_rows(tok, split, 128)
        print(f"{split}: {tuple(rows.shape)} in {time.monotonic() - t:.1f}s")
