"""The runtime of asynchronous Local-SGD: the processes and the wire.

What every launched rank runs, rank 0's server process and its loop, a worker's loop,
the transport and its links, the run's store, admission (the run's token, the seal on
every message, the key handed to the launched workers), a killed worker's rejoin, and
the trained model read back. It drives the transport-free cores of
:mod:`thinwire.localsgd.algorithm` with the wall clock and real messages. The public
names are :mod:`thinwire.localsgd`'s; ``docs/architecture.md`` maps the files.
"""

__all__: list[str] = []
