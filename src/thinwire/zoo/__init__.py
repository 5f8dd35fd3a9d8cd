"""A zoo of models that are not thinwire's GPT, to hold every piece to its baseline.

:mod:`~thinwire.zoo.tasks` holds the models and their tasks, :mod:`~thinwire.zoo.loop`
the one training loop every piece runs in, :mod:`~thinwire.zoo.run` the driver that
spawns the ranks and compares each piece with its uncompressed baseline.
"""

from thinwire.zoo.loop import BASELINES, PIECES, PieceResult, train_piece
from thinwire.zoo.run import Job, run_jobs
from thinwire.zoo.tasks import SIZES, TASKS, ZooTask, task

__all__ = [
    "BASELINES",
    "PIECES",
    "SIZES",
    "TASKS",
    "Job",
    "PieceResult",
    "ZooTask",
    "run_jobs",
    "task",
    "train_piece",
]
