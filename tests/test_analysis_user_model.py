"""Profiling a user's own model: ``--model package.module:function`` / ``file.py:function``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from thinwire.analysis import load_factory, profile_factory
from thinwire.cli.main import main
from thinwire.errors import ConfigError

FACTORIES = textwrap.dedent(
    """
    import torch
    from torch import nn

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def make(batch_size: int = 3):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return model, (torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))), loss_fn

    def fixed():
        model = nn.Linear(8, 4)
        return model, {"x": torch.randn(5, 8), "y": torch.zeros(5, dtype=torch.long)}, (
            lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"])
        )

    def two_things():
        return nn.Linear(2, 2), None

    NOT_A_FUNCTION = 3
    """
)

MLP_BYTES = (8 * 16 + 16 + 16 * 4 + 4) * 4


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(FACTORIES)
    return path


@pytest.mark.timeout(60)
def test_file_factory_profiles_every_parameter(user_file: Path) -> None:
    prof = profile_factory(f"{user_file}:make", 6, warmup=1, steps=2, observe_ddp=True)
    assert prof.model == f"{user_file}:make"
    assert prof.batch_size == 6
    assert [p.name for p in prof.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert prof.grad_bytes == MLP_BYTES and not prof.frozen
    # DDP put all four gradients in one bucket (they are far below its 1 MiB first cap).
    assert prof.observed_buckets is not None and sorted(prof.observed_buckets[0]) == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_module_factory_and_inferred_batch_size(
    user_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(user_file.parent))
    prof = profile_factory("my_models:fixed", warmup=0, steps=1)
    assert prof.batch_size == 5  # the leading dimension of the first tensor in the batch
    assert prof.grad_bytes == (8 * 4 + 4) * 4
    prof = profile_factory("my_models:make", warmup=0, steps=1)
    assert prof.batch_size == 3  # the factory's own default


@pytest.mark.timeout(60)
def test_callable_factory_is_seeded() -> None:
    weights: list[torch.Tensor] = []

    def factory() -> tuple[nn.Module, torch.Tensor, object]:
        model = nn.Linear(4, 1)
        weights.append(model.weight.detach().clone())
        return model, torch.randn(2, 4), lambda m, b: m(b).sum()

    a = profile_factory(factory, warmup=0, steps=1, seed=3)
    profile_factory(factory, warmup=0, steps=1, seed=3)
    profile_factory(factory, warmup=0, steps=1, seed=4)
    assert a.model.endswith("factory") and a.grad_bytes == 5 * 4
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_colon_here", "must read package.module:function"),
        ("{file}:", "must read package.module:function"),
        ("{file}:not-a-name", "is not a function name"),
        ("{dir}/missing.py:make", "does not exist"),
        ("thinwire_no_such_module_x:make", "cannot import 'thinwire_no_such_module_x'"),
        ("{file}:absent", "has no function 'absent'"),
        ("{file}:NOT_A_FUNCTION", "is not a function (it is a int)"),
    ],
)
def test_bad_specs_are_one_line_errors(user_file: Path, spec: str, needle: str) -> None:
    spec = spec.format(file=user_file, dir=user_file.parent)
    with pytest.raises(ConfigError) as err:
        load_factory(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_factory_results_are_named(user_file: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"must return \(model, batch, loss_fn\), got a tuple of 2"
    ):
        profile_factory(f"{user_file}:two_things")
    with pytest.raises(ConfigError, match="has no batch_size parameter"):
        profile_factory(f"{user_file}:fixed", 4)
    with pytest.raises(ConfigError, match="batch size must be >= 1"):
        profile_factory(f"{user_file}:make", 0)


def test_import_error_inside_the_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "needs_missing.py"
    bad.write_text("import thinwire_surely_missing_pkg\n\ndef make():\n    pass\n")
    with pytest.raises(ConfigError, match="an import failed: No module named"):
        load_factory(f"{bad}:make")


@pytest.mark.timeout(60)
def test_cli_profiles_a_factory_and_rejects_unknown_models(
    user_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "p.json"
    args = ["analyze", "profile", "--model", f"{user_file}:make", "--batch-size", "4"]
    assert main([*args, "--warmup", "0", "--steps", "1", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["batch_size"] == 4 and sum(p["nbytes"] for p in data["params"]) == MLP_BYTES
    assert "4 parameters" in capsys.readouterr().out
    assert main(["analyze", "profile", "--model", "huge", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'huge'" in err and "package.module:function" in err
    assert main(["analyze", "profile", "--model", f"{user_file}:fixed", "--batch-size", "2"]) == 2
    assert "has no batch_size parameter" in capsys.readouterr().err


def _python_blocks(path: Path) -> list[str]:
    text = path.read_text()
    return [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("python\n")]


@pytest.mark.timeout(60)
def test_docs_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/analysis.md: the factory file works with the CLI, the Python snippet runs."""
    blocks = _python_blocks(Path(__file__).resolve().parents[1] / "docs/analysis.md")
    factory = next(b for b in blocks if b.startswith("# my_models.py"))
    snippet = next(b for b in blocks if "profile_model(" in b)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_models.py").write_text(factory)
    assert (
        main(
            [
                "analyze",
                "profile",
                "--model",
                "my_models.py:make_mlp",
                "--batch-size",
                "8",
                "--warmup",
                "0",
                "--steps",
                "1",
                "-o",
                "factory.json",
            ]
        )
        == 0
    )
    assert json.loads(Path("factory.json").read_text())["batch_size"] == 8
    exec(compile(snippet, "docs/analysis.md", "exec"), {"__name__": "__docs__"})
    assert json.loads(Path("profile.json").read_text())["model"] == "mlp"


USER_ERRORS = {
    "syntax.py": ("def f(:\n    pass\n", r"syntax error at .*syntax\.py:1"),
    "top.py": ("X = 1 / 0\ndef f():\n    pass\n", r"raised ZeroDivisionError: .*top\.py:1\)"),
    "raises.py": (
        "def f():\n    raise ValueError('no data here')\n",
        r"f raised ValueError: no data here \(at .*raises\.py:2\)",
    ),
    "shapes.py": (
        "import torch\ndef f():\n    m = torch.nn.Linear(3, 2)\n"
        "    return m, torch.zeros(4, 5), lambda mm, b: mm(b).sum()\n",
        r"model on its batch raised RuntimeError: mat1 and mat2 .*shapes\.py:4\)",
    ),
}


@pytest.mark.parametrize("name", sorted(USER_ERRORS))
def test_errors_in_the_users_code_are_one_line_naming_their_place(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source, pattern = USER_ERRORS[name]
    (tmp_path / name).write_text(source)
    spec = f"{tmp_path / name}:f"
    with pytest.raises(ConfigError, match=pattern) as e:
        profile_factory(spec, warmup=0, steps=1)
    assert "\n" not in str(e.value)
    # the torch frame of a shape mismatch is not where the user fixes it
    assert "site-packages" not in str(e.value)
    assert main(["analyze", "profile", "--model", spec, "-o", str(tmp_path / "p.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_interrupting_the_factory_claims_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "slow.py").write_text("def f():\n    raise KeyboardInterrupt\n")
    spec = f"{tmp_path / 'slow.py'}:f"
    assert main(["analyze", "profile", "--model", spec, "-o", str(tmp_path / "p.json")]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "thinwire: interrupted", err
    assert not (tmp_path / "p.json").exists()
