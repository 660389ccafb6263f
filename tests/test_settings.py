"""One settings object (`kiln.settings.Settings`): environment variables only as defaults, read
in one module; `patch()` for a block of code; the backend, the passes and the scheduler read the
settings in effect."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import kiln
from kiln import ops
from kiln.frontend.torch.config import DynamoConfig
from kiln.passes import PassContext, graph_pass
from kiln.schedule import CompileSession
from kiln.settings import ENVIRONMENT, Settings, current, patch

CORE = Path(kiln.__file__).parent


def test_no_module_but_the_settings_reads_the_environment():
    readers = [str(p.relative_to(CORE)) for p in CORE.rglob("*.py")
               if re.search(r"os\.environ|getenv", p.read_text())]
    assert readers == ["settings.py"]


def test_environment_variables_are_defaults(monkeypatch):
    monkeypatch.setenv("KILN_TUNE_LEVEL", "2")
    monkeypatch.setenv("KILN_NVRTC_CHECK", "sm_80, sm_90")
    monkeypatch.setenv("KILN_GRAPH_CACHE", "0")
    monkeypatch.setenv("KILN_DUMP_DIR", "")          # empty: unset
    settings = current()
    assert (settings.search_space, settings.nvrtc_check, settings.graph_cache, settings.dump_dir) == \
        (2, ("sm_80", "sm_90"), False, None)
    with patch(search_space=1):
        assert current().search_space == 1 and current().nvrtc_check == ("sm_80", "sm_90")
    assert current().search_space == 2
    assert DynamoConfig().search_space(0).resolve().search_space == 0, "a setting set overrides its variable"
    monkeypatch.setenv("KILN_TUNE_LEVEL", "high")
    with pytest.raises(ValueError, match="KILN_TUNE_LEVEL"):
        current()
    assert set(ENVIRONMENT) >= {"KILN_TUNE_LEVEL", "KILN_CACHE_DIR", "KILN_LOG", "CC"}


def test_settings_are_validated():
    with pytest.raises(ValueError, match="0, 1 or 2"):
        Settings(search_space=3)
    with pytest.raises(ValueError, match="channels_last"):
        Settings(channels_last="yes")
    with pytest.raises(ValueError, match="plan_ahead must be one of auto, always, never"):
        Settings(plan_ahead=True)


def test_a_pass_context_config_changes_the_settings_its_passes_read():
    seen = []

    @graph_pass("read_settings")
    def read_settings(graph, ctx):
        seen.append((ctx.session.settings.use_fp16, ctx.session.settings.channels_last))
        return graph

    graph = kiln.trace_from(ops.relu(kiln.symbol([3])))
    with patch(channels_last="always"), PassContext(config={"use_fp16": True}):
        read_settings(graph)
    read_settings(graph)
    assert seen == [(True, "always"), (False, "auto")]


def test_one_session_serves_a_pipeline_and_answers_once_per_task(monkeypatch):
    sessions, asked = [], []

    @graph_pass("note_session")
    def note_session(graph, ctx):
        sessions.append(ctx.session)
        return graph

    graph = kiln.trace_from(ops.matmul(kiln.symbol([4, 8]), kiln.symbol([8, 2])))
    kiln.passes.Sequential([note_session, note_session])(graph)
    assert len(sessions) == 2 and sessions[0] is sessions[1] and sessions[0].target == kiln.device("cpu")
    assert CompileSession.current() is None, "the session closes with its pipeline"
    session = CompileSession(kiln.device("cpu"))
    module = importlib.import_module("kiln.schedule.session")
    original = module.schedules_for
    monkeypatch.setattr(module, "schedules_for", lambda *a: asked.append(a[0]) or original(*a))
    task = graph.nodes[0].task
    assert session.template(task) is session.template(task) and len(asked) == 1


def test_the_backend_compiles_under_its_settings(monkeypatch):
    levels = []
    module = importlib.import_module("kiln.graph.operator")
    build = module.build_task
    monkeypatch.setattr(module, "build_task",
                        lambda task, device, settings: levels.append(settings.search_space) or build(task, device, settings))
    model = torch.compile(lambda x: torch.relu(x) * 3, backend="kiln", options={"search_space": 1})
    x = torch.randn(5, 3)
    torch.testing.assert_close(model(x), torch.relu(x) * 3)
    assert levels and set(levels) == {1}
