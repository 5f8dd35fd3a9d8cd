"""The product's workflow as library calls: analyze a job, train it with the algorithm that
fits, and compare, with the numbers side by side (:func:`run_demo`, what ``thinwire
demo`` runs). It sits above the analysis, the testbed and the trainer, and below the CLI,
which only parses flags into :class:`DemoSettings`.
"""

from thinwire.workflow.demo import DemoSettings, default_workers, run_demo

__all__ = ["DemoSettings", "default_workers", "run_demo"]
