"""The imports of thinwire point one way: down the layers, never into the CLI.

The layers, lowest first (an arrow reads "is imported by")::

    compress <- comm <- optim <- (localsgd, train) <- (analysis, testbed, zoo) <- workflow
        <- cli

The rules this file checks, read from the source with :mod:`ast`:

* A module may import its own package, any package of a lower layer, and the leaves.
* Two packages share a layer, and between them one direction is allowed. The example
  trainer runs Local-SGD, so ``train -> localsgd`` is fine, but ``thinwire.localsgd``
  never imports ``thinwire.train``. Validation runs on the testbed, so
  ``analysis -> testbed`` is fine, but ``thinwire.testbed`` never imports
  ``thinwire.analysis``.
* The leaves are small shared modules that sit below every layer: ``thinwire``'s own
  ``__init__``, ``errors``, ``io``, ``safeload``, ``rundir``, ``runlock``,
  ``plotting``, ``units`` and ``prestart``. Every module may import them. They import only each other, besides the
  standard library and third-party packages. A new top-level module must be listed here
  as a leaf or a layer, or the test fails.
* ``thinwire.__main__`` belongs to the CLI. No library module imports ``thinwire.cli``.
* The packages (layers and leaves) import each other without cycles.
* Inside ``thinwire.localsgd``, the algorithm (``localsgd/algorithm/``) never imports the
  runtime (``localsgd/runtime/``), nor do the modules both halves share (``settings``,
  ``config``, ``task``, ``messages``); the package's ``__init__`` re-exports the runtime, so neither
  imports it either. Every module of the package is in one of these parts.
* One parser of byte sizes: only :mod:`thinwire.units` holds a table of size units or a
  function named like a size parser, so ``16MB`` means the same to every flag.
* One table of dtype names: only :mod:`thinwire.compress.cast` spells two or more of
  ``fp32``, ``fp16``, ``bf16`` in one collection; every other list derives from it.

Every import counts: imports at module level and inside functions, relative ones
(resolved), and those under ``if TYPE_CHECKING:``. An annotation that names a higher
layer is still a dependency on it, so that block gets no exception either.

One block is exempt: the body of ``if __name__ == "__main__":`` in a library module.
Importing the module never runs it. It only runs when the file is executed as a script
(``python -m thinwire.train.compare``), and then it hands over to the CLI that owns
that script's flags. Once every command lives under ``thinwire ...``, these shims go.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: dict[str, int] = {
    "compress": 0,
    "comm": 1,
    "optim": 2,
    "localsgd": 3,
    "train": 3,
    "analysis": 4,
    "testbed": 4,
    "zoo": 4,
    "workflow": 5,
    "cli": 6,
}
"""Each package's layer; a module imports only packages of a lower layer (or its own)."""

SAME_LAYER_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {("train", "localsgd"), ("analysis", "testbed")}
)
"""The one allowed direction between packages that share a layer: (importer, imported)."""

LEAVES: frozenset[str] = frozenset(
    {"__init__", "errors", "io", "safeload", "rundir", "runlock", "plotting", "units", "prestart"}
)
"""Shared modules below every layer: anyone may import them; they import only leaves."""

ALIASES = {"__main__": "cli"}
"""Top-level modules that belong to a package's layer."""


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``"""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    return (
        isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and len(t.comparators) == 1
        and isinstance(t.comparators[0], ast.Constant)
        and t.comparators[0].value == "__main__"
    )


def imports_of(
    source: str, module: str, is_package: bool, src: Path = SRC
) -> Iterator[tuple[str, int]]:
    """Every ``thinwire`` module ``source`` imports, with its line.

    ``module`` is the importing module's dotted name (to resolve relative imports). An
    ``if __name__ == "__main__":`` block at module level is skipped (see the docstring).
    """
    tree = ast.parse(source)
    body = [n for n in tree.body if not _is_main_guard(n)]
    for top in body:
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "thinwire":
                        yield alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    if not is_package:
                        base = base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                if target.split(".")[0] != "thinwire":
                    continue
                if target == "thinwire":
                    # ``from thinwire import x``: x may be a package or a name in __init__
                    for alias in node.names:
                        sub = src / "thinwire" / alias.name
                        known = sub.is_dir() or sub.with_suffix(".py").is_file()
                        yield (f"thinwire.{alias.name}" if known else "thinwire"), node.lineno
                else:
                    yield target, node.lineno


def unit_of(module: str) -> str:
    """The package (``comm``) or leaf (``errors``, ``__init__``) a module belongs to."""
    parts = module.split(".")
    if parts == ["thinwire"]:
        return "__init__"
    return ALIASES.get(parts[1], parts[1])


def allowed(src_unit: str, dst_unit: str) -> bool:
    if src_unit == dst_unit or dst_unit in LEAVES:
        return True
    if src_unit in LEAVES:
        return False
    a, b = LAYERS[src_unit], LAYERS[dst_unit]
    return b < a or (a == b and (src_unit, dst_unit) in SAME_LAYER_ALLOWED)


def all_imports(src: Path = SRC) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every thinwire import under ``src/thinwire``."""
    out = []
    for path in sorted((src / "thinwire").rglob("*.py")):
        mod = module_name(path, src)
        for target, line in imports_of(path.read_text(), mod, path.name == "__init__.py", src):
            out.append((mod, target, line))
    return out


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges``, as a list of nodes, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_every_top_level_module_has_a_place() -> None:
    units = {unit_of(module_name(p)) for p in (SRC / "thinwire").rglob("*.py")}
    unplaced = sorted(units - set(LAYERS) - LEAVES)
    assert not unplaced, f"give these a layer in LAYERS or list them in LEAVES: {unplaced}"
    assert {"compress", "comm", "optim", "localsgd", "train", "cli"} <= units


def test_imports_point_down_the_layers() -> None:
    bad = [
        f"{src}:{line} imports {dst}"
        for src, dst, line in all_imports()
        if not allowed(unit_of(src), unit_of(dst))
    ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_library_module_imports_the_cli() -> None:
    bad = [
        f"{src}:{line} imports {dst}"
        for src, dst, line in all_imports()
        if unit_of(dst) == "cli" and unit_of(src) != "cli"
    ]
    assert not bad, "\n".join(bad)


def test_localsgd_never_imports_the_example_trainer() -> None:
    bad = [
        f"{src}:{line} imports {dst}"
        for src, dst, line in all_imports()
        if unit_of(src) == "localsgd" and unit_of(dst) == "train"
    ]
    assert not bad, "\n".join(bad)


def test_packages_import_each_other_without_cycles() -> None:
    edges: dict[str, set[str]] = {}
    for src, dst, _ in all_imports():
        a, b = unit_of(src), unit_of(dst)
        if a != b:
            edges.setdefault(a, set()).add(b)
    assert find_cycle(edges) is None, f"import cycle between packages: {find_cycle(edges)}"


# The checker itself: a rule that cannot fail checks nothing.


def _fake_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "thinwire" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_checker_sees_function_level_relative_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    src = _fake_tree(
        tmp_path,
        {
            "__init__.py": "",
            "comm/__init__.py": "",
            "comm/x.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from thinwire.optim.base import A\n"
                "def f():\n"
                "    import thinwire.train.run\n"
                "    from ..cli import main\n"
                "    from . import y\n"
                "if __name__ == '__main__':\n"
                "    from thinwire.cli.x import main\n"
            ),
        },
    )
    found = {(dst, line) for _, dst, line in all_imports(src)}
    assert found == {
        ("thinwire.optim.base", 3),
        ("thinwire.train.run", 5),
        ("thinwire.cli", 6),
        ("thinwire.comm", 7),
    }
    verdicts = {dst: allowed("comm", unit_of(dst)) for dst, _ in found}
    assert verdicts == {
        "thinwire.optim.base": False,
        "thinwire.train.run": False,
        "thinwire.cli": False,
        "thinwire.comm": True,
    }


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ("comm", "compress", True),
        ("compress", "comm", False),
        ("train", "localsgd", True),
        ("localsgd", "train", False),
        ("analysis", "testbed", True),
        ("testbed", "analysis", False),
        ("cli", "analysis", True),
        ("optim", "errors", True),
        ("errors", "comm", False),
        ("rundir", "errors", True),
    ],
)
def test_layer_rule(src: str, dst: str, ok: bool) -> None:
    assert allowed(src, dst) is ok


def test_cycle_finder() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# Inside thinwire.localsgd: the algorithm (the math and the rules) never imports the
# runtime (the processes and the wire), so the simulator and any new runtime reuse it whole.

LOCALSGD_SHARED: frozenset[str] = frozenset(
    {
        "thinwire.localsgd.config",
        "thinwire.localsgd.messages",
        "thinwire.localsgd.settings",
        "thinwire.localsgd.task",
    }
)
"""The modules of ``thinwire.localsgd`` that both halves use: the settings, the user's
task, the messages. Like the algorithm, they never import the runtime."""


def localsgd_part(module: str) -> str | None:
    """Where a module sits in ``thinwire.localsgd``: ``algorithm``, ``runtime``, ``shared``
    (:data:`LOCALSGD_SHARED`), ``api`` (the package's ``__init__``, which re-exports both
    halves) or ``unplaced`` (any other module); None outside the package."""
    parts = module.split(".")
    if parts[:2] != ["thinwire", "localsgd"]:
        return None
    if len(parts) == 2:
        return "api"
    if parts[2] in ("algorithm", "runtime"):
        return parts[2]
    return "shared" if module in LOCALSGD_SHARED else "unplaced"


def localsgd_problems(imports: list[tuple[str, str, int]]) -> list[str]:
    """The imports by which the algorithm or a shared module reaches the runtime, directly
    or through the package's ``__init__``, one line each ("importer:line imports x")."""
    return [
        f"{src}:{line} imports {dst}"
        for src, dst, line in imports
        if localsgd_part(src) in ("algorithm", "shared")
        and localsgd_part(dst) in ("runtime", "api")
    ]


def test_every_localsgd_module_has_a_part() -> None:
    modules = {module_name(p) for p in (SRC / "thinwire" / "localsgd").rglob("*.py")}
    unplaced = sorted(m for m in modules if localsgd_part(m) == "unplaced")
    assert not unplaced, (
        "move these into localsgd/algorithm/ or localsgd/runtime/, or list them in "
        f"LOCALSGD_SHARED: {unplaced}"
    )
    assert sorted(LOCALSGD_SHARED - modules) == []
    assert {localsgd_part(m) for m in modules} == {"algorithm", "runtime", "shared", "api"}


def test_localsgd_algorithm_never_imports_the_runtime() -> None:
    bad = localsgd_problems(all_imports())
    assert not bad, (
        "the algorithm (and the modules both halves share) must not import the runtime:\n"
        + "\n".join(bad)
    )


@pytest.mark.parametrize(
    ("module", "part"),
    [
        ("thinwire.localsgd", "api"),
        ("thinwire.localsgd.algorithm", "algorithm"),
        ("thinwire.localsgd.algorithm.server_core", "algorithm"),
        ("thinwire.localsgd.runtime.server_loop", "runtime"),
        ("thinwire.localsgd.config", "shared"),
        ("thinwire.localsgd.server", "unplaced"),
        ("thinwire.train.trainer", None),
    ],
)
def test_localsgd_part(module: str, part: str | None) -> None:
    assert localsgd_part(module) == part


def test_localsgd_rule_sees_relative_function_level_and_package_imports(
    tmp_path: Path,
) -> None:
    src = _fake_tree(
        tmp_path,
        {
            "__init__.py": "",
            "localsgd/__init__.py": "from thinwire.localsgd.runtime.launch import run\n",
            "localsgd/config.py": "from thinwire.localsgd.algorithm.outer import Outer\n",
            "localsgd/algorithm/__init__.py": "",
            "localsgd/algorithm/core.py": (
                "from thinwire.localsgd.config import Config\n"
                "from thinwire.localsgd.messages import Work\n"
                "def f():\n"
                "    from ..runtime.transport import Transport\n"
                "    from thinwire.localsgd import run\n"
            ),
            "localsgd/runtime/__init__.py": "",
            "localsgd/runtime/launch.py": "from thinwire.localsgd.algorithm.core import f\n",
            "localsgd/task.py": "import thinwire.localsgd.runtime.launch\n",
        },
    )
    assert localsgd_problems(all_imports(src)) == [
        "thinwire.localsgd.algorithm.core:4 imports thinwire.localsgd.runtime.transport",
        "thinwire.localsgd.algorithm.core:5 imports thinwire.localsgd",
        "thinwire.localsgd.task:1 imports thinwire.localsgd.runtime.launch",
    ]


# One size parser, one dtype table: the rules, read from the source with ast.

SIZE_PARSER_MODULE = "thinwire.units"
"""The one module that may read sizes like ``64MiB`` (see its docstring for the rule)."""

SIZE_UNITS = frozenset({"k", "ki", "kib", "kb", "m", "mi", "mib", "mb", "g", "gi", "gib", "gb"})
"""The spellings of a byte-size unit, lower case."""

SIZE_PARSER_NAME = re.compile(r"_size|_?parse_\w*(size|bytes)\w*|\w*(size|bytes)_arg")
"""Function names that say "I read a size": ``_size``, ``parse_size``, ``parse_bytes``,
``_bytes_arg``, ... but not ``element_size``, ``set_buffer_size`` or a ``size`` property."""

DTYPE_NAMES = frozenset({"fp32", "fp16", "bf16"})

DTYPE_TABLE_MODULE = "thinwire.compress.cast"
"""The one module that spells the dtype names in a collection."""


def _is_unit(piece: str) -> bool:
    return piece.strip().strip("()^$?:").strip().lower() in SIZE_UNITS


def size_parsing(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each sign in ``source`` of its own byte-size parser.

    Three signs, each one an old parser had: a function named like a size parser, a
    dict with two or more unit keys (``{"k": 2**10, "m": 2**20}``), and a string that
    lists units as a regex would (``"(k|kib|m|mib)"`` or ``"[kKmMgG]"``). Formatting
    sizes (``fmt_bytes``'s ``("MiB", 2**20)`` pairs) is none of these.
    """
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if SIZE_PARSER_NAME.fullmatch(node.name):
                yield node.lineno, f"function {node.name}()"
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if sum(isinstance(k, str) and _is_unit(k) for k in keys) >= 2:
                yield node.lineno, f"a dict of size units {keys}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if sum(_is_unit(piece) for piece in node.value.split("|")) >= 2:
                yield node.lineno, f"a regex of size units {node.value!r}"
            for cls in re.findall(r"\[([A-Za-z]+)\]", node.value):
                if set(cls.lower()) <= set("kmgib") and len(set(cls.lower()) & set("kmg")) >= 2:
                    yield node.lineno, f"a regex class of size units [{cls}]"


def dtype_tables(source: str) -> Iterator[tuple[int, list[str]]]:
    """(line, names) for each tuple, list, set or dict (its keys) of ``source`` that
    spells two or more of ``fp32``, ``fp16``, ``bf16``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items: list[ast.expr | None] = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        else:
            continue
        names = {i.value for i in items if isinstance(i, ast.Constant) and i.value in DTYPE_NAMES}
        if len(names) >= 2:
            yield node.lineno, sorted(names)


def _scan(rule: str, owner: str, src: Path = SRC) -> list[str]:
    found = []
    for path in sorted((src / "thinwire").rglob("*.py")):
        if module_name(path, src) == owner:
            continue
        text = path.read_text()
        hits = size_parsing(text) if rule == "size" else dtype_tables(text)
        found += [f"{path.relative_to(src)}:{line}: {what}" for line, what in hits]
    return found


def test_one_size_parser() -> None:
    found = _scan("size", SIZE_PARSER_MODULE)
    assert not found, (
        "read byte sizes with thinwire.units.parse_size (or parse_count), not here:\n"
        + "\n".join(found)
    )


def test_one_dtype_table() -> None:
    found = _scan("dtype", DTYPE_TABLE_MODULE)
    assert not found, (
        "derive dtype names from thinwire.compress.cast.WIRE_DTYPES / CAST_DTYPES:\n"
        + "\n".join(found)
    )


def test_size_rule_sees_each_kind_of_parser() -> None:
    def kinds(source: str) -> int:
        return len(list(size_parsing(source)))

    assert kinds("def parse_size(text): pass") == 1
    assert kinds("def _size(text): pass") == 1
    assert kinds("U = {'': 1, 'k': 2**10, 'm': 2**20}") == 1
    assert kinds("R = r'^([0-9]+)(|b|k|kib|m|mib)$'") == 1
    assert kinds("R = r'(\\d+)([kKmMgG]?)'") == 1
    # not parsers: sizes of tensors, a formatter's units, a table that mentions MiB
    assert kinds("def element_size(t): pass\ndef set_buffer_size(n): pass") == 0
    assert kinds("def size(self): pass\ndef to_bytes(self): pass") == 0
    assert kinds("U = (('GiB', 2**30), ('MiB', 2**20))\nH = '| size | MiB per call |'") == 0
    assert kinds("R = {'bit': 1, 'kbit': 10**3}\nS = '[a-z]'") == 0


def test_dtype_rule_sees_tuples_lists_and_dict_keys() -> None:
    def hits(source: str) -> int:
        return len(list(dtype_tables(source)))

    assert hits("C = ('fp32', 'fp16', 'bf16')") == 1
    assert hits("ok = m in ['fp16', 'bf16']") == 1
    assert hits("D = {'fp16': 1, 'bf16': 2}") == 1
    assert hits("C = (*WIRE_DTYPES, 'onebit')\nx = m == 'fp32'") == 0


# Small functions: no function over MAX_FUNCTION_LINES lines, none that takes more than
# MAX_PARAMETERS parameters. Read from the source with ast, like the rules above.

MAX_FUNCTION_LINES = 80
"""The most lines a function may span, from its ``def`` to its last line (decorators
not counted, nested functions counted with the function that holds them). Past this a
function does several things; split it where the logic has seams, into named helpers."""

MAX_PARAMETERS = 8
"""The most parameters a function may take: positional, keyword-only, ``*args`` and
``**kwargs`` each count one; ``self`` and ``cls`` do not. A function that needs more
takes a settings object (a frozen dataclass). The ``__init__`` a ``@dataclass``
generates is not in the source, so its fields never count."""

_OPTIMIZER = "an optimizer takes its hyperparameters as keywords, as torch.optim's do"
_ENTRY_POINT = "a public entry point whose keywords are documented API"

KEYWORD_API: dict[str, str] = {
    "thinwire.optim.lamb:Lamb.__init__": _OPTIMIZER,
    "thinwire.optim.onebit_adam:OneBitAdam.__init__": _OPTIMIZER,
    "thinwire.optim.onebit_lamb:OneBitLamb.__init__": _OPTIMIZER,
    "thinwire.localsgd.algorithm.diloco:DiLoCo.__init__": (
        "a public wrapper that takes its inner and outer hyperparameters as keywords"
    ),
    "thinwire.localsgd.algorithm.streaming:StreamingDiLoCo.__init__": (
        "DiLoCo's keywords plus the fragments' (fragments, overlap, alpha), like torchft's"
    ),
    "thinwire.localsgd.algorithm.worker_core:LocalWorker.__init__": (
        "a public class (thinwire.localsgd) whose keywords the docs show, inner_momentum=..."
    ),
    "thinwire.testbed.cluster:Cluster.__init__": (
        "a public class whose constructor keywords (rate, delay, loss, ...) are documented API"
    ),
    "thinwire.train.compare:compare": _ENTRY_POINT,
    "thinwire.testbed.experiments:compare_on_testbed": _ENTRY_POINT + " (compare on a testbed)",
    "thinwire.localsgd.algorithm.sweep:run_sweep": _ENTRY_POINT,
    "thinwire.analysis.study:run_study": _ENTRY_POINT + " (thinwire.analysis)",
    "thinwire.analysis.recorded:analyze_record": (
        _ENTRY_POINT + " (thinwire.analysis; the what-if knobs of run_study, as keywords)"
    ),
    "thinwire.analysis.colocated:profile_processes": (
        "a public function docs/analysis.md points users to; its keywords are its API"
    ),
}
"""Functions allowed more than MAX_PARAMETERS parameters, each with its reason: public
APIs that users call with keywords, which a settings object would break. Internal
functions are fixed instead (a settings dataclass), never listed here. An entry whose
function no longer needs it fails the test, so the list stays true."""


def _n_parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - 1 if names and names[0] in ("self", "cls") else n


def function_sizes(source: str) -> Iterator[tuple[str, int, int, int]]:
    """(qualified name, line, lines, parameters) of every function in ``source``,
    methods and nested functions included (``Class.method``, ``outer.inner``)."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                yield name, child.lineno, lines, _n_parameters(child)
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    return visit(ast.parse(source), "")


def all_function_sizes(src: Path = SRC) -> list[tuple[str, str, int, int, int]]:
    """(``module:name``, path, line, lines, parameters) for every function of thinwire."""
    out = []
    for path in sorted((src / "thinwire").rglob("*.py")):
        mod = module_name(path, src)
        rel = str(path.relative_to(src))
        for name, line, lines, params in function_sizes(path.read_text()):
            out.append((f"{mod}:{name}", rel, line, lines, params))
    return out


def long_function_problems(
    sizes: list[tuple[str, str, int, int, int]], limit: int = MAX_FUNCTION_LINES
) -> list[str]:
    """Functions over ``limit`` lines, one line each ("path:line name size")."""
    return [
        f"{path}:{line} {key.split(':', 1)[1]} {lines} lines (the most is {limit})"
        for key, path, line, lines, _ in sizes
        if lines > limit
    ]


def parameter_problems(
    sizes: list[tuple[str, str, int, int, int]],
    allowed_keys: dict[str, str],
    limit: int = MAX_PARAMETERS,
) -> list[str]:
    """Functions with too many parameters, and allowlist entries that no longer need to be."""
    bad = []
    seen = set()
    for key, path, line, _, params in sizes:
        where = f"{path}:{line} {key.split(':', 1)[1]} {params} parameters"
        if key in allowed_keys:
            seen.add(key)
            if params <= limit:
                bad.append(f"{where}: few enough now, take it off KEYWORD_API")
        elif params > limit:
            bad.append(f"{where} (the most is {limit})")
    bad += [f"{key}: in KEYWORD_API but not found" for key in sorted(set(allowed_keys) - seen)]
    return bad


def test_functions_are_short() -> None:
    bad = long_function_problems(all_function_sizes())
    assert not bad, (
        f"functions over {MAX_FUNCTION_LINES} lines; split them into named helpers:\n"
        + "\n".join(bad)
    )


def test_functions_take_few_parameters() -> None:
    bad = parameter_problems(all_function_sizes(), KEYWORD_API)
    assert not bad, (
        f"functions with more than {MAX_PARAMETERS} parameters; pass a settings object:\n"
        + "\n".join(bad)
    )


def test_size_rules_see_methods_nested_functions_and_every_kind_of_parameter() -> None:
    source = (
        "class A:\n"
        "    def m(self, a, /, b, *c, d, **e):\n"
        "        def inner(x):\n"
        "            return x\n"
        "        return inner\n"
        "    @classmethod\n"
        "    def k(cls):\n"
        "        pass\n"
        "def f(a, b=1):\n"
        "    pass\n"
    )
    assert list(function_sizes(source)) == [
        ("A.m", 2, 4, 5),
        ("A.m.inner", 3, 2, 1),
        ("A.k", 7, 2, 0),
        ("f", 9, 2, 2),
    ]
    sizes = [
        ("m:long", "m.py", 1, 81, 9),
        ("m:short", "m.py", 5, 80, 8),
        ("m:listed", "m.py", 9, 20, 12),
        ("m:needless", "m.py", 12, 20, 3),
    ]
    assert long_function_problems(sizes) == ["m.py:1 long 81 lines (the most is 80)"]
    allowed = {"m:listed": "why", "m:needless": "why", "m:gone": "why"}
    assert parameter_problems(sizes, allowed) == [
        "m.py:1 long 9 parameters (the most is 8)",
        "m.py:12 needless 3 parameters: few enough now, take it off KEYWORD_API",
        "m:gone: in KEYWORD_API but not found",
    ]
