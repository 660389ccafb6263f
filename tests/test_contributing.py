"""CONTRIBUTING.md's code runs: its Python blocks, in order, in one fresh interpreter.

A block right after a line naming a file ("`kiln_hardshrink/ops.py`:") is that file of the
example plugin kiln-hardshrink: the files are written to a temporary folder with a
`.dist-info` made from the guide's own pyproject.toml (as tests/test_plugins.py makes throwaway
distributions), so the interpreter discovers the plugin exactly as an installed one. Every
other Python block runs in one shared namespace, in order; a block defining `test_` functions
runs under pytest; a `print(...)  # text` line must print `text`. Finally `kiln plugins` must
list the plugin as the guide shows it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "CONTRIBUTING.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
FILE_LINE = re.compile(r"`([\w./-]+\.(?:py|toml|cuh))`:\s*$")


def blocks(text: str) -> list[dict]:
    """Every fenced block: its language, source, first line number and the file it shows."""
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        named = FILE_LINE.search(before[-1]) if before else None
        found.append({"lang": m.group(1), "source": m.group(2), "line": text[:m.start()].count("\n") + 2,
                      "file": named.group(1) if named else None})
    return found


RUNNER = r'''
import contextlib, io, json, re, sys, tempfile, traceback
from pathlib import Path

import pytest

namespace = {"__name__": "__contributing__"}
for block in json.loads(Path(sys.argv[1]).read_text()):
    where = f"CONTRIBUTING.md block at line {block['line']}"
    source = block["source"]
    if re.search(r"^def test_", source, re.M):
        path = Path(tempfile.mkdtemp()) / f"test_contributing_block_{block['line']}.py"
        path.write_text(source)
        code = pytest.main([str(path), "-q", "-p", "no:cacheprovider"])
        assert code == 0, f"{where}: its tests failed (pytest exit code {code})"
        continue
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, where, "exec"), namespace)
    except BaseException:
        sys.exit(f"{where} raised:\n{traceback.format_exc()}")
    for claim in re.findall(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", source, re.M):
        assert claim in out.getvalue(), f"{where}: printed\n{out.getvalue()}\nwithout {claim!r}"
    print(f"ran block at line {block['line']}")

from kiln.cli import main
table = io.StringIO()
with contextlib.redirect_stdout(table):
    main(["plugins"])
print("KILN PLUGINS")
print(table.getvalue())
'''


def write_plugin(root: Path, files: dict[str, str]) -> Path:
    """The guide's plugin files under `root`, with a .dist-info from its pyproject.toml."""
    project = tomllib.loads(files["pyproject.toml"])["project"]
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for package in {Path(n).parts[0] for n in files if n.endswith(".py")}:
        (root / package / "__init__.py").touch()
    info = root / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    entry = "".join(f"{k} = {v}\n" for k, v in project["entry-points"]["kiln"].items())
    (info / "entry_points.txt").write_text("[kiln]\n" + entry)
    return root


def test_guide_blocks_are_found():
    found = blocks(GUIDE.read_text())
    files = {b["file"] for b in found if b["file"]}
    assert {"pyproject.toml", "kiln_hardshrink/plugin.py", "kiln_hardshrink/ops.py"} <= files
    assert sum(b["lang"] == "python" and not b["file"] for b in found) >= 8


def test_every_python_block_of_the_guide_runs(tmp_path):
    found = blocks(GUIDE.read_text())
    files = {b["file"]: b["source"] for b in found if b["file"]}
    site = write_plugin(tmp_path / "kiln_hardshrink", files)
    snippets = [b for b in found if b["lang"] == "python" and not b["file"]]
    (tmp_path / "blocks.json").write_text(json.dumps(snippets))
    (tmp_path / "runner.py").write_text(RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "KILN_DISABLE_PLUGINS"}
    # the caller's PYTHONPATH last: a checkout run through it (a worktree) is the one tested
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"^ran block at line (\d+)$", proc.stdout, re.M)
    tests = [b for b in snippets if re.search(r"^def test_", b["source"], re.M)]
    assert len(ran) + len(tests) == len(snippets)
    table = proc.stdout.split("KILN PLUGINS\n", 1)[1].splitlines()
    shown = next(b["source"] for b in found if b["source"].startswith("plugin ") and not b["lang"])
    for line in shown.splitlines()[1:]:
        assert any(t.split() == line.split() for t in table), f"kiln plugins lacks {line!r}:\n" + "\n".join(table)
    assert any((work / "stages").iterdir()), "DumpGraph wrote the stages"
