"""The `kiln` command: its subcommand table and `kiln demo` (plugins and cache have their own tests)."""
from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kiln.cli
from kiln.cli import COMMANDS, build_parser, main


def test_console_script_lists_every_subcommand():
    script = Path(sys.executable).parent / "kiln"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = re.findall(r"^ {4}(\w+)", proc.stdout, flags=re.M)
    assert listed == list(COMMANDS)
    assert {"plugins", "cache", "demo"} <= set(listed)


def test_a_command_is_a_module_named_in_the_table(monkeypatch, capsys):
    hello = types.ModuleType("kiln.cli.hello", "Say hello.")
    hello.HELP = "say hello"
    hello.configure = lambda parser: parser.add_argument("--name", default="world")
    hello.run = lambda args: print(f"hello {args.name}") or 3
    monkeypatch.setitem(sys.modules, "kiln.cli.hello", hello)
    monkeypatch.setattr(kiln.cli, "COMMANDS", COMMANDS + ("hello",))
    assert main(["hello", "--name", "kiln"]) == 3
    assert capsys.readouterr().out == "hello kiln\n"


def test_missing_or_unknown_command_is_a_usage_error(capsys):
    for argv in ([], ["frobnicate"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_demo_runs_the_quick_start_flow(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    titles = re.findall(r"^== (.*)$", out, flags=re.M)
    assert titles == ["Define tensors", "Run operators imperatively", "Symbolic tensors",
                      "Trace a flow graph", "Run the flow graph", "Compile a model with torch.compile"]
    assert "Tensor(shape=(2, 3), dtype='float32', device='cpu')\n[[" in out
    assert ("Graph(x: float32[2, 3][cpu]){\n"
            "  c = Constant(float32[3, 2][cpu])\n"
            "  c_1 = Constant(float32[2][cpu])\n"
            "  x_1: float32[2, 2][cpu] = Matmul(x, c)\n"
            "  x_2: float32[2, 2][cpu] = Add(x_1, c_1)\n"
            "  return x_2\n}") in out
    assert "flow graph == imperative == PyTorch: True" in out
    assert "attention" in out and "call_function  torch.nn.functional.conv2d" in out
    assert out.rstrip().endswith("torch.compile(backend='kiln') == eager: True")


def test_version_names_kiln_torch_and_the_plugins():
    script = Path(sys.executable).parent / "kiln"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import kiln
    import torch
    assert proc.stdout.startswith(f"kiln {kiln.__version__} (torch {torch.__version__}, Python ")
    assert "kiln-ops-builtin" in proc.stdout and "kiln-mappings-builtin" in proc.stdout
    assert kiln.__version__ != "0.0.0+unknown"


@pytest.mark.parametrize("folder,package", [
    ("core", "kiln"), ("ops_builtin", "kiln_ops_builtin"),
    ("mappings_builtin", "kiln_mappings_builtin"),
    ("plugins/kiln_example_rmsnorm", "kiln_example_rmsnorm")])
def test_each_distribution_ships_py_typed(folder, package, tmp_path):
    import shutil
    import zipfile
    root = Path(__file__).resolve().parents[1]
    source = tmp_path / "source"          # a copy: building leaves build/ folders behind
    shutil.copytree(root / folder, source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert f"{package}/py.typed" in zipfile.ZipFile(wheel).namelist()
