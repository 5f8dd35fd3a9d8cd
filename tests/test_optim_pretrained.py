"""1-bit LAMB from a pretrained model: the regime its users run, where a byte
embedding's unused rows have second moments of ~1e-16 instead of 0."""

from __future__ import annotations

import pytest
import torch

from thinwire.comm.launch import spawn
from thinwire.train.data import TextData
from thinwire.train.model import GPT, GPTConfig

CFG = GPTConfig(seq_len=32, n_layer=1, n_head=2, n_embd=32)
PRETRAIN = 400
FREEZE = 30
STEPS = 50


def _pretrained() -> dict[str, torch.Tensor]:
    """AdamW on the bundled corpus until the rows of the bytes it never uses have gone
    quiet (their logits' probability is ~0)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    data = TextData(None, CFG.seq_len, 0.05, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(PRETRAIN):
        x, y = data.batch(step, 16)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _continue(rank: int, world: int, kind: str, start: dict[str, torch.Tensor]) -> list[float]:
    from thinwire.optim import Lamb, OneBitLamb

    torch.manual_seed(0)
    model = GPT(CFG)
    model.load_state_dict(start)
    data = TextData(None, CFG.seq_len, 0.05, 0)
    if kind == "lamb":
        opt: torch.optim.Optimizer = Lamb(model.parameters(), lr=1e-2)
    else:
        opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    losses = []
    for step in range(STEPS):
        x, y = data.batch(PRETRAIN + step, 16, rank, world)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(300)
def test_onebit_lamb_from_a_pretrained_gpt_has_no_loss_spike_at_the_freeze() -> None:
    """With the floor's reference taken over every element that saw a gradient, the
    unused rows (three quarters of the embedding) made the median, nothing was floored,
    and the first compressed steps threw those rows far: the loss rose 19% above LAMB's
    worst (3.07 against 2.58) within 4 steps of the freeze; on the 2-layer GPT after
    1,000 steps, from 1.9 to 15."""
    start = _pretrained()
    lamb = spawn(_continue, 2, ("lamb", start), timeout_s=120)[0]
    onebit = spawn(_continue, 2, ("onebit", start), timeout_s=120)[0]
    assert max(onebit[FREEZE:]) < 1.03 * max(lamb[FREEZE:]), (onebit, lamb)
    tail = STEPS - 10
    assert sum(onebit[tail:]) < 1.02 * sum(lamb[tail:]), (onebit, lamb)
