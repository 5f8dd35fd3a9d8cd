"""Is the network the bottleneck? Profiling, what-if simulation and reports."""
