"""Text data: the bundled corpus or any UTF-8 file, a byte-level tokenizer, batches.

* **Tokenizer**: UTF-8 bytes, vocabulary 256. No vocabulary file, works on any language,
  and a model trained on one corpus can read another.
* **Split**: the last ``val_fraction`` of the bytes is validation, the rest training;
  deterministic, independent of the number of workers.
* **Batches**: step ``s`` draws the *global* batch (``batch_size * world`` windows) from a
  generator seeded with ``(seed, s)``; rank ``r`` takes rows ``r*B .. (r+1)*B``. So the
  data a step sees depends only on the step, never on how many steps ran before (resume
  is exact with no saved sampler state), and W ranks with batch B see exactly the samples
  one process sees with batch ``W*B`` (which is what the parity tests compare).
* **Shards**: :meth:`TextData.shards` cuts the training split into ``n`` pieces for
  Local-SGD workers, ``striped`` (the default: 4 KiB blocks dealt round-robin, so every
  shard samples the whole text, like the paper's iid shards) or ``contiguous`` (one
  stretch of text each: different works, different styles); :meth:`TextData.shard_batches`
  makes each a batch source (:class:`ShardBatches`) for :class:`thinwire.localsgd.Task`.
* **Byte-frequency loss**: :meth:`TextData.unigram_loss`, the validation loss of a model
  that knows only how often each byte occurs in the training split. A model whose loss
  sits there has learnt nothing about context.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from thinwire.errors import ConfigError

__all__ = [
    "BUILTIN_CORPORA",
    "BUILTIN_CORPUS",
    "SHARD_LAYOUTS",
    "ShardBatches",
    "TextData",
    "TokenSplit",
    "decode",
    "encode",
    "load_text",
]

BUILTIN_CORPUS = "shakespeare"
"""Name of the default bundled corpus (42 works of Shakespeare, ~5 MB of text)."""

BUILTIN_CORPORA: dict[str, tuple[str, str]] = {
    "shakespeare": ("shakespeare.txt.gz", "bundled corpus: Shakespeare (42 works)"),
    "moby-dick": ("mobydick.txt.gz", "bundled corpus: Moby-Dick (Herman Melville)"),
}
"""``--data`` names of the bundled public-domain corpora -> (file, description). The second
one exists so that every convergence claim can be checked on text it was not tuned on
(see ``src/thinwire/data/LICENSE.md`` for their sources)."""


SHARD_LAYOUTS = ("striped", "contiguous")
"""How :meth:`TextData.shards` cuts the training split (see the module docstring)."""

STRIPE_BYTES = 4096
"""Block size of ``striped`` shards: large enough that few windows of a small model's
context cross a seam between two blocks (1.6% at 64 bytes), small enough that each of a
few shards holds hundreds of blocks from all over the text."""


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a uint8 tensor."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode`; invalid byte sequences become U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def _read_builtin(name: str) -> bytes:
    ref = resources.files("thinwire") / "data" / BUILTIN_CORPORA[name][0]
    with ref.open("rb") as f:
        return gzip.decompress(f.read())


def load_text(source: str | Path | None) -> tuple[bytes, str]:
    """Read the corpus; returns ``(utf8_bytes, description)``.

    ``None`` is the default bundled corpus, a name of :data:`BUILTIN_CORPORA` (``shakespeare``,
    ``moby-dick``) that bundled corpus; anything else is a path to a UTF-8 text file
    (``.gz`` is decompressed). Missing, empty, binary or non-UTF-8 files raise
    :class:`ConfigError`.
    """
    name = BUILTIN_CORPUS if source is None else str(source)
    if name in BUILTIN_CORPORA:
        return _read_builtin(name), BUILTIN_CORPORA[name][1]
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"data path {path} is not a file")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ConfigError(f"data file {path} is not a valid gzip file: {exc}") from None
    if not raw.strip():
        raise ConfigError(f"data file {path} is empty")
    if b"\x00" in raw[: 1 << 20]:
        raise ConfigError(f"data file {path} looks binary (it contains NUL bytes); expected text")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"data file {path} is not UTF-8 text (bad byte at offset {exc.start})"
        ) from None
    return raw, f"{path} ({len(raw):,} bytes)"


@dataclass
class TokenSplit:
    """A contiguous run of tokens that windows of ``seq_len + 1`` are cut from."""

    tokens: torch.Tensor  # uint8, 1-D

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def num_windows(self, seq_len: int) -> int:
        return len(self) - seq_len

    def windows(self, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, ``(len(starts), seq_len)`` int64 each."""
        offsets = starts.unsqueeze(1) + torch.arange(seq_len + 1).unsqueeze(0)
        chunk = self.tokens[offsets].long()
        return chunk[:, :-1], chunk[:, 1:]


@dataclass(eq=False)
class ShardBatches:
    """One data shard as a batch source: ``source(step)`` is the batch of the ``step``-th
    inner step spent on the shard.

    The windows depend only on ``(seed, index, step)``, never on which worker asks, so a
    shard that changes hands continues the same stream and a run is reproducible.
    """

    split: TokenSplit
    index: int
    seq_len: int
    batch_size: int
    seed: int

    def __len__(self) -> int:
        return len(self.split)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.index) * 1_000_003 + step)
        starts = torch.randint(
            self.split.num_windows(self.seq_len), (self.batch_size,), generator=g
        )
        return self.split.windows(starts, self.seq_len)


class TextData:
    """Training and validation splits of a corpus, and deterministic batches from them."""

    def __init__(
        self,
        source: str | Path | None = None,
        seq_len: int = 64,
        val_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if seq_len < 1:
            raise ConfigError(f"sequence length must be >= 1, got {seq_len}")
        raw, self.description = load_text(source)
        tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        n_val = max(int(len(tokens) * val_fraction), seq_len + 1)
        self.train = TokenSplit(tokens[: len(tokens) - n_val])
        self.val = TokenSplit(tokens[len(tokens) - n_val :])
        self.seq_len = seq_len
        self.seed = seed
        for name, split in (("training", self.train), ("validation", self.val)):
            if split.num_windows(seq_len) < 1:
                raise ConfigError(
                    f"sequence length {seq_len} is too long for the {name} split of "
                    f"{self.description} ({len(split)} tokens); use a shorter --seq-len "
                    "or more data"
                )

    @property
    def vocab_size(self) -> int:
        return 256

    def batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of the global training batch of step ``step``."""
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            self.train.num_windows(self.seq_len), (batch_size * world_size,), generator=g
        )
        mine = starts[rank * batch_size : (rank + 1) * batch_size]
        return self.train.windows(mine, self.seq_len)

    def val_batches(
        self, num_sequences: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's part of a fixed validation set of ``num_sequences`` windows.

        The windows are evenly spaced over the validation split (the same every call), and
        dealt round-robin to ranks so the evaluation cost is shared.
        """
        n = self.val.num_windows(self.seq_len)
        starts = torch.linspace(0, n - 1, steps=min(num_sequences, n)).long()
        mine = starts[rank::world_size]
        return [
            self.val.windows(mine[i : i + batch_size], self.seq_len)
            for i in range(0, len(mine), batch_size)
        ]

    def shards(self, n: int, layout: str = "striped") -> list[TokenSplit]:
        """The training split cut into ``n`` equal shards (for Local-SGD workers).

        ``striped``: blocks of :data:`STRIPE_BYTES` dealt round-robin (shard ``i`` holds
        blocks ``i, i + n, ...``); ``contiguous``: ``n`` consecutive stretches.
        """
        if n < 1:
            raise ConfigError(f"number of shards must be >= 1, got {n}")
        if layout not in SHARD_LAYOUTS:
            raise ConfigError(f"unknown shard layout {layout!r}; choose one of {SHARD_LAYOUTS}")
        size = len(self.train) // n
        if size <= self.seq_len:
            raise ConfigError(
                f"{n} shards of {len(self.train)} tokens are too small for seq_len {self.seq_len}"
            )
        if layout == "contiguous" or size < 2 * STRIPE_BYTES:
            return [TokenSplit(self.train.tokens[i * size : (i + 1) * size]) for i in range(n)]
        rows = len(self.train) // (STRIPE_BYTES * n)  # whole rounds of blocks only
        blocks = self.train.tokens[: rows * n * STRIPE_BYTES].view(rows, n, STRIPE_BYTES)
        return [TokenSplit(blocks[:, i].reshape(-1).clone()) for i in range(n)]

    def shard_batches(self, n: int, batch_size: int, layout: str = "striped") -> list[ShardBatches]:
        """:meth:`shards` as batch sources of ``batch_size`` windows each."""
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        return [
            ShardBatches(split, i, self.seq_len, batch_size, self.seed)
            for i, split in enumerate(self.shards(n, layout))
        ]

    def unigram_loss(self) -> float:
        """Cross-entropy (nats per byte) of the validation split under the training
        split's byte frequencies, add-one smoothed: the loss of a model that has learnt
        the byte frequencies and nothing else. A trained model must end clearly below it.
        """
        counts = torch.bincount(self.train.tokens.long(), minlength=256).double() + 1.0
        logp = torch.log(counts / counts.sum())
        val = torch.bincount(self.val.tokens.long(), minlength=256).double()
        return float(-(val * logp).sum() / val.sum())
