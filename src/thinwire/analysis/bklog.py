"""Readers for the data released with "Is Network the Bottleneck of Distributed Training?".

Two formats (Zhang et al., arXiv 2006.10103, github.com/netx-repo/training-bottleneck):

* **backward profile** ``<model>.bk.log``::

      <one comment line>
      <number of batches>
      <number of parameters P>
      <wait_us>,<bytes>        # P rows per batch, in backward order

  ``wait_us`` is the time, in microseconds, since the previous gradient became ready
  (for the first row: since the backward pass started). Measurement noise made a few
  waits negative; they are clipped to 0, because a gradient cannot be ready before the
  one before it. With several batches the ready times are averaged per parameter.

* **vector-add table** ``cuda_vec_add.log``: ``<bytes>,<seconds>`` per line, the cost of
  adding two vectors on the paper's V100s; it prices the reduction inside an allreduce.

Every malformed line raises :class:`ConfigError` naming the file and the line.
The logs carry no iteration time; the paper's single-GPU figures are in
:data:`PAPER_ITERATION_S` (used when the file stem matches and none is given).
"""

from __future__ import annotations

from pathlib import Path

from thinwire.analysis.costs import AddCost
from thinwire.analysis.formats import JSON_LIMIT
from thinwire.analysis.profile import ParamTiming, Profile
from thinwire.errors import ConfigError
from thinwire.io import read_input_bytes

__all__ = ["PAPER_ITERATION_S", "read_bklog", "read_vec_add_table"]

PAPER_ITERATION_S: dict[str, float] = {
    "resnet50": 0.12809,
    "resnet101": 0.19201,
    "vgg16": 0.19452,
}
"""Single-V100 iteration times the paper measured (seconds), by ``.bk.log`` stem."""


def _int_line(lines: list[str], i: int, path: Path, what: str) -> int:
    if i >= len(lines):
        raise ConfigError(f"{path}:{i + 1}: file ends before the {what}")
    try:
        value = int(lines[i].strip())
    except ValueError:
        raise ConfigError(
            f"{path}:{i + 1}: expected the {what} (an integer), got {lines[i].strip()!r}"
        ) from None
    if value < 1:
        raise ConfigError(f"{path}:{i + 1}: the {what} must be >= 1, got {value}")
    return value


def _pair(line: str, lineno: int, path: Path) -> tuple[float, float]:
    parts = line.strip().split(",")
    if len(parts) != 2:
        raise ConfigError(f"{path}:{lineno}: expected two comma-separated numbers, got {line!r}")
    try:
        a, b = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(f"{path}:{lineno}: not a number in {line.strip()!r}") from None
    if a != a or b != b or abs(a) == float("inf") or abs(b) == float("inf"):
        raise ConfigError(f"{path}:{lineno}: non-finite number in {line.strip()!r}")
    return a, b


def _read_lines(path: Path) -> list[str]:
    raw = read_input_bytes(path, "cannot read profile", JSON_LIMIT)
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None


def read_bklog(path: str | Path, iteration_s: float | None = None) -> Profile:
    """Read a ``.bk.log`` backward profile into a :class:`Profile`.

    Args:
        path: the log file.
        iteration_s: the single-worker iteration time; defaults to the paper's figure
            for ``resnet50``/``resnet101``/``vgg16`` and is required for other stems.
    """
    path = Path(path)
    lines = _read_lines(path)
    batches = _int_line(lines, 1, path, "number of batches")
    count = _int_line(lines, 2, path, "number of parameters")
    sums = [0.0] * count
    sizes: list[int] = [0] * count
    lineno = 3
    for b in range(batches):
        t = 0.0
        for k in range(count):
            if lineno >= len(lines) or not lines[lineno].strip():
                raise ConfigError(
                    f"{path}:{lineno + 1}: expected row {k + 1} of {count} of batch "
                    f"{b + 1} (wait_us,bytes), found "
                    + ("the end of the file" if lineno >= len(lines) else "an empty line")
                )
            wait_us, nbytes = _pair(lines[lineno], lineno + 1, path)
            if nbytes < 0 or nbytes != int(nbytes):
                raise ConfigError(
                    f"{path}:{lineno + 1}: size must be a whole number of bytes >= 0, got {nbytes}"
                )
            if b > 0 and int(nbytes) != sizes[k]:
                raise ConfigError(
                    f"{path}:{lineno + 1}: batch {b + 1} gives parameter {k + 1} "
                    f"{int(nbytes)} bytes, batch 1 gave {sizes[k]}"
                )
            sizes[k] = int(nbytes)
            t += max(0.0, wait_us) * 1e-6  # negative waits are measurement noise
            sums[k] += t
            lineno += 1
    for extra in range(lineno, len(lines)):
        if lines[extra].strip():
            raise ConfigError(f"{path}:{extra + 1}: unexpected data after {batches} x {count} rows")
    if iteration_s is None:
        iteration_s = PAPER_ITERATION_S.get(path.name.split(".")[0])
        if iteration_s is None:
            raise ConfigError(
                f"{path}: the log has no iteration time; pass the single-worker "
                "iteration time (--iteration-ms)"
            )
    ready = [s / batches for s in sums]
    params = [
        # Rows are in backward order, the reverse of registration order.
        ParamTiming(name=f"bk{k}", index=count - 1 - k, nbytes=sizes[k], ready_s=ready[k])
        for k in range(count)
    ]
    return Profile(
        model=path.name.split(".")[0],
        iteration_s=float(iteration_s),
        backward_s=ready[-1],
        params=params,
        source=f"bk.log {path.name}",
        device="gpu (paper)",
        steps=batches,
    )


def read_vec_add_table(path: str | Path) -> AddCost:
    """Read a ``bytes,seconds`` vector-add table (the paper's ``cuda_vec_add.log``)."""
    path = Path(path)
    rows: list[tuple[float, float]] = []
    for i, line in enumerate(_read_lines(path)):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        size, secs = _pair(line, i + 1, path)
        if size <= 0 or secs < 0:
            raise ConfigError(f"{path}:{i + 1}: need bytes > 0 and seconds >= 0, got {line!r}")
        if rows and size <= rows[-1][0]:
            raise ConfigError(
                f"{path}:{i + 1}: sizes must increase, {size:g} after {rows[-1][0]:g}"
            )
        rows.append((size, secs))
    if len(rows) < 2:
        raise ConfigError(f"{path}: a vector-add table needs at least 2 rows, found {len(rows)}")
    return AddCost(tuple(r[0] for r in rows), tuple(r[1] for r in rows), source=str(path.name))
