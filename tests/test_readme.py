"""README.md's user guide holds: its Python blocks run, in order, in one fresh interpreter (on
the CPU), and what it names exists.

A `print(...)  # text` line must print `text` ("..." in it stands for anything, and runs of
white space compare equal). The settings,
options and environment variables the guide names are checked against the code: every
`dynamo_config.NAME` is a setter, its table of options lists `kiln.settings.OPTIONS`, every
`KILN_*` variable is one a setting takes its default from (`kiln.settings.ENVIRONMENT`), and
every such variable is in the table.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.frontend.torch.config import DynamoConfig
from kiln.settings import ENVIRONMENT, OPTIONS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)

RUNNER = r'''
import contextlib, io, json, re, sys, traceback
from pathlib import Path

namespace = {"__name__": "__readme__"}
for block in json.loads(Path(sys.argv[1]).read_text()):
    where = f"README.md block at line {block['line']}"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block["source"], where, "exec"), namespace)
    except BaseException:
        sys.exit(f"{where} raised:\n{traceback.format_exc()}")
    for claim in re.findall(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", block["source"], re.M):
        pattern = ".*?".join(re.escape(" ".join(part.split())) for part in claim.split("..."))
        printed = " ".join(out.getvalue().split())
        assert re.search(pattern, printed), f"{where}: printed\n{out.getvalue()}\nwithout {claim!r}"
    print(f"ran block at line {block['line']}")
'''


def python_blocks() -> list[dict]:
    return [{"source": m.group(2), "line": README[:m.start()].count("\n") + 2}
            for m in FENCE.finditer(README) if m.group(1) == "python"]


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 8
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    # No NVRTC check of what the examples build (other tests check those kernels; with it the
    # examples took over 5 minutes on a loaded 2-core machine).
    env = dict(os.environ, KILN_NVRTC_CHECK="")
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(re.findall(r"^ran block at line \d+$", proc.stdout, re.M)) == len(blocks)


def test_the_settings_named_exist():
    setters = set(re.findall(r"dynamo_config\.(\w+)\(", README)) | set(re.findall(r"`(\w+)\((?:level|flag)\)`", README))
    assert setters and all(callable(getattr(DynamoConfig, name, None)) for name in setters), setters
    table = README.split("| option (`options={...}`)", 1)[1].split("\n\n", 1)[0]
    options = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(options) == sorted(OPTIONS)


def test_the_environment_variables_named_are_those_the_code_reads():
    read = {name for name in ENVIRONMENT if name.startswith("KILN_")}
    named = set(re.findall(r"\bKILN_[A-Z0-9_]*[A-Z0-9]\b", README))
    assert named <= read, f"README names variables the code does not read: {sorted(named - read)}"
    table = README.split("### Environment variables", 1)[1].split("\n\n", 2)[1]
    assert read <= set(re.findall(r"^\| `(KILN_\w+)", table, re.M)), "a variable the code reads is not in README's table"
