"""Plugin discovery: throwaway plugin distributions made in a temporary directory.

Each fake distribution is a module plus a `.dist-info` folder (METADATA and entry_points.txt)
on a directory that a subprocess gets on its PYTHONPATH: importlib.metadata finds it there
exactly as it finds a pip-installed one, and the test's own environment stays untouched.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kiln.cli.plugins import plugin_table
from kiln.plugins import registry

# An operator plugin module; {name} is the operator, {factor} what it multiplies by.
OPERATOR_PLUGIN = """
from kiln.graph import operator
from kiln.ir import compute
from kiln.plugins import hookimpl


@operator("{name}", override={override})
def scaled(x):
    return compute(x.shape, lambda *i: x[i] * {factor})


@hookimpl
def kiln_operators():
    return [scaled]
"""


def make_distribution(root, dist: str, source: str, version: str = "1.0") -> None:
    """Write a distribution `dist` (module `dist` with - as _) with one `kiln` entry point."""
    module = dist.replace("-", "_")
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kiln]\n{module} = {module}\n")


def operator_plugin(root, dist: str, op: str, factor: int, override: bool = False) -> None:
    make_distribution(root, dist, OPERATOR_PLUGIN.format(name=op, factor=factor, override=override))


def run_python(code: str, path=None, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with `path` on its PYTHONPATH and extra `env`."""
    environ = {k: v for k, v in os.environ.items() if k not in ("KILN_DISABLE_PLUGINS", "PYTHONPATH")}
    if path is not None:
        environ["PYTHONPATH"] = str(path)
    environ.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=environ, timeout=120)


def check_output(code: str, path=None, **env) -> str:
    proc = run_python(code, path, **env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One temporary kernel cache for the module's subprocesses (they build the same kernels)."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture
def site(tmp_path, monkeypatch, kernel_cache):
    """A directory for fake distributions, seen by subprocesses with a temporary kernel cache."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(kernel_cache))
    folder = tmp_path / "site"
    folder.mkdir()
    return folder


RUN_TRIPLE = """
    import sys
    import kiln
    from kiln.plugins import registry
    assert "kiln_test_triple" not in sys.modules
    print(kiln.ops.triple(kiln.asarray([1.0, -2.0, 0.5])).numpy().tolist())
    info = next(p for p in registry().plugins if p.distribution == "kiln-test-triple")
    print(info.name, info.version, [op.name for op in info.contributions["operators"]])
"""


def test_installed_plugin_is_discovered_and_its_operator_runs(site):
    operator_plugin(site, "kiln-test-triple", "triple", 3)
    out = check_output(RUN_TRIPLE, site).splitlines()
    assert out == ["[3.0, -6.0, 1.5]", "kiln_test_triple 1.0 ['triple']"]


def test_broken_plugin_is_reported_and_the_others_load(site):
    operator_plugin(site, "kiln-test-triple", "triple", 3)
    make_distribution(site, "kiln-test-broken", "raise RuntimeError('broken on purpose')\n")
    out = check_output("""
        import kiln
        from kiln.plugins import registry
        print(kiln.ops.triple(kiln.asarray([2.0])).numpy().tolist())
        print(kiln.ops.add(kiln.asarray([1.0]), kiln.asarray([2.0])).numpy().tolist())
        for p in registry().errors:
            print(p.distribution, "|", p.error)
    """, site)
    assert out.splitlines() == ["[6.0]", "[3.0]",
                                "kiln-test-broken | RuntimeError: broken on purpose"]
    table = run_python("from kiln.cli import main; raise SystemExit(main(['plugins']))", site)
    assert table.returncode == 1, "kiln plugins exits 1 when a plugin failed to load"
    broken = [ln for ln in table.stdout.splitlines() if ln.startswith("kiln_test_broken")]
    assert len(broken) == 1 and "kiln-test-broken" in broken[0] and "failed to load" in broken[0]
    assert "error: RuntimeError: broken on purpose" in table.stdout


def test_duplicate_operator_is_an_error_naming_both_distributions(site):
    operator_plugin(site, "kiln-test-triple", "triple", 3)
    operator_plugin(site, "kiln-test-other", "triple", 4)
    proc = run_python("""
        import kiln
        print(kiln.ops.add(kiln.asarray([1.0]), kiln.asarray([2.0])).numpy().tolist())
        kiln.ops.triple
    """, site)
    assert proc.stdout.splitlines() == ["[3.0]"], "other operators still work"
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kiln.plugins.registry.PluginError: operator 'triple'")
    assert "kiln-test-other" in last and "kiln-test-triple" in last
    table = run_python("from kiln.cli import main; raise SystemExit(main(['plugins']))", site)
    assert table.returncode == 1
    assert "conflicts:" in table.stdout and "operator 'triple' is defined by two plugins" in table.stdout


@pytest.mark.parametrize("overriding", ["kiln-test-triple", "kiln-test-other"])
def test_override_wins(site, overriding):
    operator_plugin(site, "kiln-test-triple", "triple", 3, override=overriding == "kiln-test-triple")
    operator_plugin(site, "kiln-test-other", "triple", 4, override=overriding == "kiln-test-other")
    out = check_output("import kiln; print(kiln.ops.triple(kiln.asarray([1.0])).numpy().tolist())", site)
    assert out.strip() == ("[3.0]" if overriding == "kiln-test-triple" else "[4.0]")


@pytest.mark.parametrize("name", ["kiln_test_triple", "kiln-test-triple"])
def test_disable_by_entry_point_or_distribution_name(site, name):
    operator_plugin(site, "kiln-test-triple", "triple", 3)
    out = check_output("""
        import sys
        import kiln
        from kiln.plugins import OperatorNotFoundError, registry
        try:
            kiln.ops.triple
        except OperatorNotFoundError as exc:
            print("not found:", exc)
        info = next(p for p in registry().plugins if p.distribution == "kiln-test-triple")
        print("disabled:", info.disabled, "imported:", "kiln_test_triple" in sys.modules)
    """, site, KILN_DISABLE_PLUGINS=f"someother,{name}")
    lines = out.splitlines()
    assert lines[0].startswith("not found: no installed Kiln plugin provides operator 'triple'")
    assert lines[1] == "disabled: True imported: False"


def test_import_kiln_scans_nothing():
    out = check_output("""
        import sys
        import torch
        from importlib import metadata
        groups = []
        real = metadata.entry_points
        metadata.entry_points = lambda **kw: groups.append(kw.get("group")) or real(**kw)
        import kiln
        print(sorted(m for m in sys.modules if m.startswith("kiln_")), groups.count("kiln"))
        kiln.ops.add
        print("kiln_ops_builtin" in sys.modules, groups.count("kiln"))
    """)
    assert out.splitlines() == ["[] 0", "True 1"]


def test_without_ops_builtin_kiln_imports_and_operators_fail_clearly():
    # Uninstalled: its entry point is gone and its package cannot be imported.
    out = check_output("""
        import sys
        from importlib import metadata
        sys.modules["kiln_ops_builtin"] = None
        real = metadata.entry_points
        metadata.entry_points = lambda **kw: [ep for ep in real(**kw)
                                              if not (ep.dist and ep.dist.name == "kiln-ops-builtin")]
        import kiln
        print(kiln.randn([2]).shape)
        try:
            kiln.ops.add
        except AttributeError as exc:
            print(f"{type(exc).__name__}: {exc}")
    """)
    shape, error = out.splitlines()
    assert shape == "(2,)"
    assert error.startswith("OperatorNotFoundError: no installed Kiln plugin provides operator 'add'")
    assert error.endswith("the built-in operators come with kiln-ops-builtin, which is not installed)")


def test_ops_builtin_disabled_gives_a_clear_error():
    proc = run_python("import kiln\nkiln.ops.add", KILN_DISABLE_PLUGINS="ops_builtin")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "no installed Kiln plugin provides operator 'add'" in last
    assert last.endswith("disabled by KILN_DISABLE_PLUGINS: kiln-ops-builtin)")


def test_kiln_plugins_lists_ops_builtin_with_its_operator_count(capsys):
    from kiln.cli import main

    info = next(p for p in registry().plugins if p.distribution == "kiln-ops-builtin")
    count = len(info.contributions["operators"])
    assert count >= 2
    main(["plugins"])
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("ops_builtin "))
    assert row.split()[:4] == ["ops_builtin", "kiln-ops-builtin", info.version, str(count)]
    assert row.split()[4].startswith("operator")
    listed = out[out.index(row):].split("operators:", 1)[1]
    assert "matmul" in listed and "add" in listed


def test_plugin_table_shows_disabled_plugins_and_hides_names_on_request():
    from kiln.plugins import PluginInfo, Registry

    reg = Registry()
    reg.plugins.append(PluginInfo("off", "kiln-off", "2.0", disabled=True))
    reg.add_plugin("inline", type("P", (), {}), "kiln-inline", "0.3")
    lines = plugin_table(reg, names=False).splitlines()
    assert lines[0].split() == ["plugin", "distribution", "version", "contributes"]
    assert lines[1].split() == ["off", "kiln-off", "2.0", "disabled", "(KILN_DISABLE_PLUGINS)"]
    assert lines[2].split() == ["inline", "kiln-inline", "0.3", "nothing"]
    assert len(lines) == 3


def test_plugin_table_names_method_rules_by_their_names():
    """A plugin's rule for a Tensor method given as the method itself is listed as
    `torch.Tensor.i0`, not as "<method 'i0' of ...>" (issue 34)."""
    from kiln.frontend.torch.registry import METHOD, Rule
    from kiln.plugins import Registry, hookimpl

    rules = [Rule(METHOD, torch.Tensor.i0, lambda x: x), Rule(METHOD, "erfinv", lambda x: x)]
    reg = Registry()
    reg.add_plugin("methods", type("P", (), {"kiln_torch_mappings": hookimpl(lambda: rules)}), "kiln-methods")
    assert "torch_mappings: torch.Tensor.erfinv, torch.Tensor.i0" in plugin_table(reg)


def test_contribution_counts_read_naturally():
    from kiln.cli.plugins import count

    assert [count(1, "operators"), count(2, "operators"), count(1, "graph passes"),
            count(0, "torch mappings")] == ["1 operator", "2 operators", "1 graph pass", "0 torch mappings"]


# A plugin whose hook returns {garbage} from {hook}.
GARBAGE_PLUGIN = """
from kiln.plugins import hookimpl


def stray(x):
    return x


@hookimpl
def {hook}():
    return {garbage}
"""


@pytest.mark.parametrize("hook, garbage, expected", [
    ("kiln_operators", "'relu'", "kiln_operators returned str 'relu'; expected a list of "
                                 "kiln.graph.operator.OperatorDef"),
    ("kiln_torch_mappings", "[object()]", "kiln_torch_mappings returned a list holding object <object"),
    ("kiln_operators", "[stray]", "kiln_operators returned a list holding function <function stray"),
    ("kiln_graph_passes", "[42]", "kiln_graph_passes returned a list holding int 42; expected only "
                                  "kiln.passes.graph_pass.GraphPass"),
])
def test_plugin_returning_garbage_is_reported_by_name_and_the_others_load(site, hook, garbage, expected):
    make_distribution(site, "kiln-test-garbage", GARBAGE_PLUGIN.format(hook=hook, garbage=garbage))
    operator_plugin(site, "kiln-test-triple", "triple", 3)
    out = check_output("""
        import torch
        import kiln
        from kiln.frontend.torch import mapping_registry
        from kiln.plugins import registry
        print(kiln.ops.triple(kiln.asarray([2.0])).numpy().tolist())
        print(kiln.ops.add(kiln.asarray([1.0]), kiln.asarray([2.0])).numpy().tolist())
        print(mapping_registry().has("function", torch.relu))
        for p in registry().errors:
            print(p.distribution, "|", p.error, "|", p.contributions)
        print(sorted(name for name, _ in registry().manager.list_name_plugin()))
    """, site)
    lines = out.splitlines()
    assert lines[:3] == ["[6.0]", "[3.0]", "True"]
    dist, error, contributions = lines[3].split(" | ")
    assert dist == "kiln-test-garbage" and error.startswith("ContributionError: " + expected), error
    assert contributions == "{}"
    assert len(lines) == 5, "only the garbage plugin failed"
    assert "kiln_test_garbage" not in lines[4] and "kiln_test_triple" in lines[4], \
        "one plugin manager holds every loaded plugin, not the failed one"
    table = run_python("from kiln.cli import main; raise SystemExit(main(['plugins']))", site)
    assert table.returncode == 1
    row = next(ln for ln in table.stdout.splitlines() if ln.startswith("kiln_test_garbage"))
    assert "kiln-test-garbage" in row and "failed to load" in row
    assert "error: ContributionError: " + expected in table.stdout


def test_hook_implementation_of_an_unknown_hook_is_reported(site):
    make_distribution(site, "kiln-test-typo", """
        from kiln.plugins import hookimpl

        @hookimpl
        def kiln_operator():
            return []
    """)
    out = check_output("""
        from kiln.plugins import registry
        print([p.error for p in registry().errors])
    """, site)
    assert "unknown hook 'kiln_operator'" in out


# A plugin whose relu rule doubles, declared at import; {tail} runs after it.
DOUBLING_RELU_PLUGIN = """
import torch
from kiln import ops
from kiln.frontend.torch import register_function, rules_of
from kiln.plugins import hookimpl
import sys


@register_function(torch.relu, torch.nn.functional.relu, priority=100)
def doubled(x, inplace=False):
    return ops.mul(x, 2.0)


@hookimpl
def kiln_torch_mappings():
    return rules_of(sys.modules[__name__])

{tail}
"""

RUN_RELU = """
    import sys
    import torch
    import kiln
    from kiln.frontend.torch import mapping_registry
    from kiln.plugins import registry
    {before}
    relu = torch.compile(torch.nn.functional.relu, backend="kiln")
    print(relu(torch.tensor([-1.0, 2.0])).tolist())
    print(sorted({{r.plugin for r in mapping_registry().candidates("function", torch.relu)}}))
    print([(p.distribution, p.error) for p in registry().errors])
"""


def test_failed_plugin_contributes_no_mapping_rule(site):
    make_distribution(site, "kiln-test-doubler", DOUBLING_RELU_PLUGIN.format(tail="raise RuntimeError('late failure')"))
    lines = check_output(RUN_RELU.format(before=""), site).splitlines()
    assert lines == ["[0.0, 2.0]", "['kiln-mappings-builtin']",
                     "[('kiln-test-doubler', 'RuntimeError: late failure')]"]


def test_disabled_plugin_imported_by_name_contributes_no_mapping_rule(site):
    make_distribution(site, "kiln-test-doubler", DOUBLING_RELU_PLUGIN.format(tail=""))
    lines = check_output(RUN_RELU.format(before="import kiln_test_doubler"), site,
                         KILN_DISABLE_PLUGINS="Kiln_Test.Doubler").splitlines()
    assert lines == ["[0.0, 2.0]", "['kiln-mappings-builtin']", "[]"]
    # Enabled, the same plugin's rule is in effect: the checks above could fail.
    lines = check_output(RUN_RELU.format(before=""), site).splitlines()
    assert lines[:2] == ["[-2.0, 4.0]", "['kiln-mappings-builtin', 'kiln-test-doubler']"]


@pytest.mark.parametrize("statement, error", [
    ("import sys; sys.exit(3)", "SystemExit: 3"),
    ("raise SystemExit", "SystemExit"),
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
])
def test_plugin_exiting_at_import_does_not_end_the_process(site, statement, error):
    make_distribution(site, "kiln-test-exit", statement + "\n")
    out = check_output("""
        import kiln
        from kiln.plugins import registry
        print(kiln.ops.add(kiln.asarray([1.0]), kiln.asarray([2.0])).numpy().tolist())
        print([(p.distribution, p.error) for p in registry().errors])
    """, site)
    assert out.splitlines() == ["[3.0]", f"[('kiln-test-exit', '{error}')]"]


def test_plugin_exiting_in_a_hook_is_reported(site):
    make_distribution(site, "kiln-test-exit", """
        import sys
        from kiln.plugins import hookimpl

        @hookimpl
        def kiln_operators():
            sys.exit("no operators today")
    """)
    out = check_output("""
        from kiln.plugins import registry
        print([(p.distribution, p.error) for p in registry().errors])
    """, site)
    assert out.strip() == "[('kiln-test-exit', 'SystemExit: no operators today')]"


def test_real_ctrl_c_while_a_plugin_imports_still_interrupts(site):
    make_distribution(site, "kiln-test-slow", """
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    """)
    proc = run_python("""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal, even where the runner ignores SIGINT
        import kiln
        kiln.ops.add
        print("survived")
    """, site)
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == "KeyboardInterrupt"


@pytest.mark.parametrize("name", ["KILN-TEST-TRIPLE", "Kiln_Test-Triple", "kiln.test.triple"])
def test_disable_matches_case_and_separators_loosely(site, name):
    operator_plugin(site, "kiln-test-triple", "triple", 3)
    out = check_output("""
        from kiln.plugins import registry
        print([p.disabled for p in registry().plugins if p.distribution == "kiln-test-triple"])
    """, site, KILN_DISABLE_PLUGINS=name)
    assert out.strip() == "[True]"


def test_every_builtin_rule_module_is_returned_by_the_mapping_hook():
    """Rules are data a plugin returns: a rule module missing from the hook would be lost."""
    import importlib
    import pkgutil

    import kiln_mappings_builtin
    from kiln.frontend.torch import rules_of
    from kiln_mappings_builtin import plugin

    returned = {id(r) for r in plugin.kiln_torch_mappings()}
    modules = [importlib.import_module(f"kiln_mappings_builtin.{m.name}")
               for m in pkgutil.iter_modules(kiln_mappings_builtin.__path__)]
    declared = [r for m in modules for r in rules_of(m)]
    assert len(declared) > 400
    assert [r.name for r in declared if id(r) not in returned] == []


def test_a_job_goes_to_the_operator_implementing_it():
    """`Registry.implementing` finds an operator by the job its traits declare, through its
    name (an override of that operator does the job); no implementer, or two, is a clear error."""
    import operator as python

    from kiln.graph import Role, Traits, operator
    from kiln.ir import compute
    from kiln.plugins import OperatorNotFoundError, PluginError, Registry, hookimpl

    def plugin(*defs):
        return type("P", (), {"kiln_operators": hookimpl(lambda: list(defs))})

    def definition(input, other):
        return compute(input.shape, lambda *i: input[i] + other[i])

    plus = operator("plus", traits=Traits(implements=python.add))(definition)
    faster = operator("plus", override=True)(definition)
    reg = Registry()
    reg.add_plugin("a", plugin(plus), "kiln-a")
    with pytest.raises(OperatorNotFoundError, match="no installed Kiln plugin provides an operator implementing "
                                                     "Role.CAST"):
        reg.implementing(Role.CAST)
    assert reg.implementing(python.add) is plus
    reg.add_plugin("b", plugin(faster), "kiln-b")
    assert reg.implementing(python.add) is faster
    reg.add_plugin("c", plugin(operator("add", traits=Traits(implements=python.add))(definition)), "kiln-c")
    with pytest.raises(PluginError, match="two operators implement add: 'plus' of kiln-a and 'add' of kiln-c"):
        reg.implementing(python.add)
