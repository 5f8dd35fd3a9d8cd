"""The old name of :mod:`thinwire.localsgd.virtual_clock`; import that module instead.

Kept only so that ``thinwire.cli.simulate`` and ``thinwire.testbed.async_compare``, which
still import this name, keep working until they move to the new one; then it goes.
"""

from thinwire.localsgd.virtual_clock import (
    HETEROGENEITY,
    METHODS,
    SimClock,
    for_method,
    simulate,
    time_to_reach,
)

__all__ = ["HETEROGENEITY", "METHODS", "SimClock", "for_method", "simulate", "time_to_reach"]
