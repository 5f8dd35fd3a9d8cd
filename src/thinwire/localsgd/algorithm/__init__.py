"""The algorithm of Local-SGD: the math and the rules, what a run computes and decides.

The outer optimizers, DyLU, the parameter server's core and a worker's training core,
the push checks, the shards, the codecs of compressed pushes and pulls, the paper's
methods, synchronous DiLoCo (which talks only through :mod:`thinwire.comm`'s
collectives) and the virtual-clock simulator. The asynchronous cores know no transport
and no clock: the runtime feeds them the wall clock and real messages, the simulator a
virtual clock, so a simulation runs exactly the code a real run does. Nothing here
imports :mod:`thinwire.localsgd.runtime` (checked by ``tests/test_architecture.py``).
The public names are :mod:`thinwire.localsgd`'s; ``docs/architecture.md`` maps the files.
"""

__all__: list[str] = []
