"""The zoo's models, each with the task it learns: networks that are not thinwire's GPT.

Every 1-bit, local-SGD and asynchronous piece of thinwire is checked on these, in the
same training loop, against its uncompressed baseline (:mod:`thinwire.zoo.run`). Each
entry stresses something a user's model has and thinwire's GPT does not:

========== ====================================================== =====================
name       model                                                  what it stresses
========== ====================================================== =====================
relu-cnn   2 conv layers + fc 1024 -> 128 -> 8 (ReLU), gratings    inputs that never fire
bn-cnn     2 conv-BatchNorm-ReLU blocks + fc, the same gratings   running statistics
relu-mlp   MLP whose hidden units are half dead from the start    rows with ``v = 0``
embedding  a bag-of-words classifier, 4/5 of its rows never used  unused and rare rows
bert       BERT classifier from a ``transformers`` config         a user's HF encoder
gpt2       GPT-2 language model from a ``transformers`` config    a user's HF decoder
gpt        thinwire's own GPT (``tiny``)                          the home model
========== ====================================================== =====================

All data are generated (or, for the language models, cut from the bundled corpus) from
``(seed, step, rank)`` alone, so two runs of the same settings see the same batches and
every piece of a comparison trains on exactly the same stream. No weights are
downloaded: the ``transformers`` models are built from configs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from thinwire.train.data import TextData

__all__ = ["SIZES", "TASKS", "Batch", "ZooTask", "task"]

Batch = tuple[torch.Tensor, torch.Tensor]

SIZES = ("tiny", "small")
"""``tiny`` runs in CI (a few seconds per piece on 2 cores); ``small`` is the benchmark's."""


@dataclass(frozen=True)
class ZooTask:
    """One zoo entry: how to build its model and feed it.

    ``lr`` is the learning rate of each optimizer family at which the uncompressed
    baseline trains well on this task (a sweep of 3-4 values per family, at ``tiny``
    size and 150 steps; docs/results/zoo.md, "The model zoo"); the compressed piece runs
    at the same value.
    """

    name: str
    metric: str
    """``"accuracy"`` (higher is better) or ``"loss"`` (lower is better)."""
    build: Callable[[str], nn.Module]
    """``build(size)``: the model, initialised from the current torch seed."""
    batch: Callable[[int, int, int, int, int], Batch]
    """``batch(seed, step, rank, world_size, batch_size)``: one rank's training batch."""
    held_out: Callable[[int], list[Batch]]
    """``held_out(seed)``: the evaluation set, the same on every rank."""
    lr: dict[str, float]
    """Learning rate per family: ``"adam"`` (AdamW, 1-bit Adam, the hook, DiLoCo's inner
    optimizer) and ``"lamb"`` (LAMB, 1-bit LAMB)."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = _logits(model(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, seed: int) -> dict[str, float]:
        """Held-out loss and, for classifiers, accuracy."""
        was_training = model.training
        model.eval()
        loss_sum, right, count = 0.0, 0, 0
        for x, y in self.held_out(seed):
            logits = _logits(model(x))
            flat = logits.reshape(-1, logits.shape[-1])
            loss_sum += float(F.cross_entropy(flat, y.reshape(-1), reduction="sum"))
            right += int((flat.argmax(-1) == y.reshape(-1)).sum())
            count += y.numel()
        model.train(was_training)
        out = {"loss": loss_sum / count}
        if self.metric == "accuracy":
            out["accuracy"] = right / count
        return out


def _logits(out: object) -> torch.Tensor:
    """The logits of a model's output: a tensor, a ``(logits, ...)`` tuple (thinwire's
    GPT) or a ``transformers`` output object."""
    if isinstance(out, tuple):
        return out[0]
    return out.logits if hasattr(out, "logits") else out  # type: ignore[return-value]


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003) + step) * 1_009 + rank)


def _pick(size: str, tiny: int, small: int) -> int:
    if size not in SIZES:
        raise ValueError(f"zoo size must be one of {SIZES}, got {size!r}")
    return tiny if size == "tiny" else small


# ---------------------------------------------------------------- relu-cnn: gratings


def _gratings(g: torch.Generator, n: int) -> Batch:
    """Noisy 16x16 gratings; the class is one of 8 orientations."""
    label = torch.randint(8, (n,), generator=g)
    theta = label.float() * (math.pi / 8) + 0.08 * torch.randn(n, generator=g)
    freq = 0.25 + 0.35 * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    ax = torch.arange(16, dtype=torch.float32) - 7.5
    yy, xx = torch.meshgrid(ax, ax, indexing="ij")
    proj = xx[None] * torch.cos(theta)[:, None, None] + yy[None] * torch.sin(theta)[:, None, None]
    img = torch.sin(freq[:, None, None] * proj + phase[:, None, None])
    img = img + 0.8 * torch.randn(n, 16, 16, generator=g)
    return img.unsqueeze(1), label


class ReluCNN(nn.Module):
    """conv 1->8, ReLU, max-pool, conv 8->16, ReLU, fc 1024 -> 128 -> 8 (ReLU)."""

    def __init__(self, width: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8 * width, 3, padding=1)
        self.conv2 = nn.Conv2d(8 * width, 16 * width, 3, padding=1)
        self.fc1 = nn.Linear(16 * width * 64, 128 * width)
        self.fc2 = nn.Linear(128 * width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BatchNormCNN(nn.Module):
    """Two conv-BatchNorm-ReLU blocks (convs without bias, as in a ResNet), max-pool,
    fc 16*16 -> 8. Its running statistics are state no optimizer moves: each replica's
    forward passes change them, and the evaluation (eval mode) uses them."""

    def __init__(self, width: int = 1) -> None:
        super().__init__()
        c1, c2 = 8 * width, 16 * width
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c2)
        self.fc = nn.Linear(c2 * 16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


# ---------------------------------------------------------------- relu-mlp: dead units


def _parity_features(g: torch.Generator, n: int, dim: int = 32) -> Batch:
    """Gaussian inputs; the class (of 4) is the sign of two sums of 4 coordinates."""
    x = torch.randn(n, dim, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return x, y


class DeadReluMLP(nn.Module):
    """32 -> hidden -> hidden -> 4 with ReLU; half of the first layer's units are dead
    (bias -50: they never fire, so their weights' gradients, and ``v``, stay exactly 0)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 4),
        )
        with torch.no_grad():
            self.net[0].bias[: hidden // 2] = -50.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# ---------------------------------------------------------------- embedding: unused rows

_VOCAB_USED = 1000
_KEYWORDS = 8


def _bag_of_words(g: torch.Generator, n: int, length: int = 24) -> Batch:
    """Zipf-distributed tokens from the first 1000 ids (the rest of the vocabulary never
    appears); the class (of 4) is set by which of 8 rare keyword ids are present."""
    ranks = torch.arange(1, _VOCAB_USED + 1, dtype=torch.float32)
    weights = 1.0 / ranks
    tokens = torch.multinomial(weights.expand(n, -1), length, replacement=True, generator=g)
    label = torch.randint(4, (n,), generator=g)
    # Each class plants two of its own keywords (ids 900.. : rare under Zipf).
    kw = 900 + label * 2 + torch.randint(2, (n,), generator=g)
    pos = torch.randint(length, (n,), generator=g)
    tokens[torch.arange(n), pos] = kw
    return tokens, label


class BagOfWords(nn.Module):
    """EmbeddingBag (mean) -> ReLU MLP -> 4 classes; the table has ``vocab`` rows, of
    which only the first 1000 are ever looked up."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


# ---------------------------------------------------------------- bert: a classifier


def _order_task(g: torch.Generator, n: int, length: int = 16, vocab: int = 64) -> Batch:
    """Random token sequences holding a marker A (id 1) and a marker B (id 2) once each;
    the class says whether A comes before B (needs attention across positions)."""
    tokens = torch.randint(3, vocab, (n, length), generator=g)
    a = torch.randint(length, (n,), generator=g)
    b = (a + 1 + torch.randint(length - 1, (n,), generator=g)) % length
    rows = torch.arange(n)
    tokens[rows, a] = 1
    tokens[rows, b] = 2
    return tokens, (a < b).long()


def _bert(size: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    width = _pick(size, 32, 64)
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=4 * width,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _HFInput(BertForSequenceClassification(cfg))


class _HFInput(nn.Module):
    """Calls a ``transformers`` model with ``input_ids`` and hands back its logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens).logits


# ---------------------------------------------------------------- gpt2, gpt: the corpus

_TEXT_SEQ = 32
_TEXT: dict[str, TextData] = {}


def _text() -> TextData:
    """The bundled corpus, read once per process."""
    if "data" not in _TEXT:
        from thinwire.train.data import TextData

        _TEXT["data"] = TextData(seq_len=_TEXT_SEQ, seed=0)
    return _TEXT["data"]


def _text_batch(seed: int, step: int, rank: int, world: int, batch_size: int) -> Batch:
    data = _text()
    g = _generator(seed, step, 0)
    starts = torch.randint(data.train.num_windows(_TEXT_SEQ), (batch_size * world,), generator=g)
    return data.train.windows(starts[rank * batch_size : (rank + 1) * batch_size], _TEXT_SEQ)


def _text_held_out(seed: int) -> list[Batch]:
    del seed  # the validation windows are fixed
    return _text().val_batches(128, 64)


def _gpt2(size: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    width = _pick(size, 64, 128)
    cfg = GPT2Config(
        vocab_size=256,
        n_positions=_TEXT_SEQ,
        n_embd=width,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,  # GPT-2's own ids (50256) are outside a byte vocabulary
        eos_token_id=0,
    )
    return _HFInput(GPT2LMHeadModel(cfg))


def _gpt(size: str) -> nn.Module:
    from thinwire.train.model import GPT, GPTConfig

    width = _pick(size, 64, 128)
    return GPT(GPTConfig(seq_len=_TEXT_SEQ, n_layer=2, n_head=4, n_embd=width))


# ---------------------------------------------------------------- the table


def _synthetic(
    make: Callable[[torch.Generator, int], Batch], eval_size: int
) -> tuple[Callable[[int, int, int, int, int], Batch], Callable[[int], list[Batch]]]:
    def batch(seed: int, step: int, rank: int, world: int, batch_size: int) -> Batch:
        del world
        return make(_generator(seed, step, rank), batch_size)

    def held_out(seed: int) -> list[Batch]:
        # A stream no training step draws from (step -1), in batches of 500.
        g = _generator(seed, -1, 10_007)
        return [make(g, 500) for _ in range(eval_size // 500)]

    return batch, held_out


def _tasks() -> dict[str, ZooTask]:
    cnn = _synthetic(_gratings, 2000)
    mlp = _synthetic(_parity_features, 2000)
    bow = _synthetic(_bag_of_words, 2000)
    order = _synthetic(_order_task, 2000)
    return {
        "relu-cnn": ZooTask(
            "relu-cnn",
            "accuracy",
            lambda s: ReluCNN(_pick(s, 1, 2)),
            *cnn,
            lr={"adam": 2e-3, "lamb": 1e-2},
        ),
        "bn-cnn": ZooTask(
            "bn-cnn",
            "accuracy",
            lambda s: BatchNormCNN(_pick(s, 1, 2)),
            *cnn,
            lr={"adam": 1e-2, "lamb": 3e-2},
        ),
        "relu-mlp": ZooTask(
            "relu-mlp",
            "accuracy",
            lambda s: DeadReluMLP(_pick(s, 256, 1024)),
            *mlp,
            lr={"adam": 2e-3, "lamb": 1e-2},
        ),
        "embedding": ZooTask(
            "embedding",
            "accuracy",
            lambda s: BagOfWords(_pick(s, 5000, 20000), 32),
            *bow,
            lr={"adam": 5e-3, "lamb": 1e-2},
        ),
        "bert": ZooTask("bert", "accuracy", _bert, *order, lr={"adam": 5e-3, "lamb": 2e-2}),
        "gpt2": ZooTask(
            "gpt2", "loss", _gpt2, _text_batch, _text_held_out, lr={"adam": 1e-3, "lamb": 2e-2}
        ),
        "gpt": ZooTask(
            "gpt", "loss", _gpt, _text_batch, _text_held_out, lr={"adam": 1e-3, "lamb": 2e-2}
        ),
    }


TASKS: dict[str, ZooTask] = _tasks()
"""Every zoo entry by name, in the order reports list them."""


def task(name: str) -> ZooTask:
    """The zoo entry ``name``; a ValueError lists the names when it is unknown."""
    if name not in TASKS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]
