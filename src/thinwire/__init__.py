"""thinwire: train neural networks across machines joined by slow or uneven networks.

The package is laid out by what each part does:

* :mod:`thinwire.compress`: what goes on the wire (casting, 1-bit sign+scale, error feedback);
* :mod:`thinwire.comm`: how it is exchanged (process groups, collectives, DDP comm hooks,
  byte accounting);
* :mod:`thinwire.optim`: what uses it (LAMB, 1-bit Adam, 1-bit LAMB);
* :mod:`thinwire.localsgd`: communicating less often (DiLoCo, asynchronous Local-SGD);
* :mod:`thinwire.analysis` and :mod:`thinwire.testbed`: how it is measured;
* :mod:`thinwire.train` and :mod:`thinwire.cli`: how a user drives it.

Below them all: :mod:`thinwire.errors`, :mod:`thinwire.safeload` (loading files as
plain data, never code), :mod:`thinwire.runlock` and :mod:`thinwire.rundir` (one run
per output directory, output paths checked before the work).
"""

from thinwire.errors import ConfigError, DivergedError

__version__ = "0.1.0"

__all__ = ["ConfigError", "DivergedError", "__version__"]
