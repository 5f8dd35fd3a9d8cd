"""Handing rank 0's run key to the launched workers without sending it in clear.

When the user gives no token, rank 0 generates one; the workers started with it need
the run key too. They share a process group with rank 0 (the launch's), so the key goes
over that, wrapped: rank 0 and each worker agree on a one-off secret by a Diffie-Hellman
exchange (the 2048-bit MODP group 14 of RFC 3526, 256-bit exponents), and rank 0 sends
the run key XORed with a SHA-256 of that secret, plus an HMAC under it that the worker
checks. Someone who only listens on the network learns nothing of the key. Someone who
could rewrite the launch's connections while the run starts could still sit in the
middle; on networks you do not trust, give every rank the token yourself
(``THINWIRE_RUN_TOKEN``), and a worker then also checks that rank 0's key is its own.

This is a collective over every rank (a broadcast, a gather, a scatter), run once, at
start-up, on a gloo group (the launch's group when it is gloo, else a new gloo group).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import torch
import torch.distributed as dist

from thinwire.errors import ConfigError
from thinwire.localsgd.runtime.auth import RunKey

__all__ = ["share_run_key"]

# RFC 3526, section 3: the 2048-bit MODP group (generator 2).
_P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A0879"
    "8E3404DDEF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B"
    "0BFF5CB6F406B7EDEE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA4836"
    "1C55D39A69163FA8FD24CF5F83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804"
    "F1746C08CA18217C32905E462E36CE3BE39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6"
    "955817183995497CEA956AE515D2261898FA051015728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
_G = 2
_LEN = 256  # bytes of a group element


def _element(x: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(x.to_bytes(_LEN, "big")), dtype=torch.uint8)


def _number(t: torch.Tensor) -> int:
    return int.from_bytes(bytes(t.numpy()), "big")


def _wrap_key(shared: int, a_pub: int, b_pub: int) -> bytes:
    parts = (b"thinwire keyshare v1", a_pub.to_bytes(_LEN, "big"), b_pub.to_bytes(_LEN, "big"))
    return hashlib.sha256(b"".join(parts) + shared.to_bytes(_LEN, "big")).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def share_run_key(key: RunKey | None, group: dist.ProcessGroup | None = None) -> RunKey:
    """Rank 0's ``key`` on every rank of ``group`` (call on every rank; ``key`` is
    ignored elsewhere). Rank 0 passes None when it failed to make one: every rank then
    raises instead of waiting.

    Raises:
        ConfigError: rank 0 had no key, or a wrapped key did not verify (tampered with).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    secret = secrets.randbits(256) | (1 << 255)
    mine = pow(_G, secret, _P)
    head = torch.zeros(_LEN + 1, dtype=torch.uint8)
    if rank == 0:
        head[0] = 1 if key is not None else 0
        head[1:] = _element(mine)
    dist.broadcast(head, src=0, group=group)
    if head[0].item() != 1:
        raise ConfigError("rank 0 could not set up the run's key (see its error)")
    a_pub = _number(head[1:])
    pubs = [torch.zeros(_LEN, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
    dist.gather(_element(mine), pubs, dst=0, group=group)
    box = torch.zeros(64, dtype=torch.uint8)
    parcels, bad = None, []
    if rank == 0:
        assert key is not None and pubs is not None
        parcels = [torch.zeros(64, dtype=torch.uint8)]
        for r in range(1, world):
            b_pub = _number(pubs[r])
            if not 1 < b_pub < _P - 1:
                bad.append(r)  # it gets nothing that verifies; raised after the scatter
                parcels.append(torch.zeros(64, dtype=torch.uint8))
                continue
            k = _wrap_key(pow(b_pub, secret, _P), a_pub, b_pub)
            wrapped = _xor(key.secret, hashlib.sha256(k + b"wrap").digest())
            tag = hmac.new(k, b"confirm" + wrapped, hashlib.sha256).digest()
            parcels.append(torch.frombuffer(bytearray(wrapped + tag), dtype=torch.uint8))
    dist.scatter(box, parcels, src=0, group=group)
    if rank == 0:
        assert key is not None
        if bad:
            raise ConfigError(f"rank {bad[0]} sent a degenerate key-exchange value")
        return key
    if not 1 < a_pub < _P - 1:
        raise ConfigError("rank 0 sent a degenerate key-exchange value")
    k = _wrap_key(pow(a_pub, secret, _P), a_pub, mine)
    raw = bytes(box.numpy())
    wrapped, tag = raw[:32], raw[32:]
    if not hmac.compare_digest(tag, hmac.new(k, b"confirm" + wrapped, hashlib.sha256).digest()):
        raise ConfigError(
            "the run key rank 0 sent did not verify (tampered with on the way?); give every "
            "rank the same THINWIRE_RUN_TOKEN"
        )
    return RunKey(_xor(wrapped, hashlib.sha256(k + b"wrap").digest()))
