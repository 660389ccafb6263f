"""List the torch operators of a model that no Kiln mapping rule handles yet.

    kiln unmapped MODULE:CALLABLE

CALLABLE (imported from MODULE, which may be a file path ending in .py) takes no arguments and
returns `(model, example_inputs)`: a tuple of positional inputs, or a dict of keyword inputs.
The model is captured by dynamo on those inputs and nothing is compiled. The table lists each
operator once with its kind, how many graph nodes use it and one of them. Exits with status 1
when some operator is unmapped.
"""
from __future__ import annotations

HELP = "list the torch operators of a model that no mapping rule handles"


def configure(parser) -> None:
    parser.add_argument("target", metavar="MODULE:CALLABLE",
                        help="a callable returning (model, example_inputs)")


def load(target: str):
    """The callable named by MODULE:CALLABLE (MODULE a dotted name or a .py file)."""
    import importlib
    import importlib.util

    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"kiln unmapped: expected MODULE:CALLABLE, got {target!r}")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("kiln_unmapped_target", module_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, attr)


def run(args) -> int:
    from kiln.frontend.torch import unmapped_operators
    from kiln.frontend.torch.errors import GUIDE
    from kiln.table import format_table

    model, inputs = load(args.target)()
    if isinstance(inputs, dict):
        found = unmapped_operators(model, **inputs)
    else:
        found = unmapped_operators(model, *inputs)
    if not found:
        print("every operator of the model is mapped to Kiln")
        return 0
    print(format_table([(o.name, o.kind, o.count, o.example) for o in found],
                       ("operator", "kind", "count", "example node")))
    print(f"\nTo add the rules, see {GUIDE}.")
    return 1
