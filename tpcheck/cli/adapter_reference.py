"""The engine adapter reference page (``docs/reference/adapter.md``), rendered from
``tpcheck.engines.adapter.EngineAdapter``, so the page cannot fall behind the class the pipeline reads:
``python -m tpcheck.cli.adapter_reference > docs/reference/adapter.md`` writes it, and
``tests/test_tpcheck/cli/test_adapter_reference.py`` fails when the committed page differs from what this renders.

One table row per member: the required methods (abstract), then every optional capability in the class's order,
each with its type or signature, its default (what an adapter that does not override it gets) and its docstring
(the contract). Attribute docstrings are read from the class's source (Python keeps none at run time)."""
from __future__ import annotations

import ast
import inspect
import sys

from tpcheck.cli.reference import _cell
from tpcheck.engines import adapter as module
from tpcheck.engines.adapter import CAPABILITIES, EngineAdapter

HEADER = """# Engine adapter reference

Generated from `tpcheck.engines.adapter.EngineAdapter`, the base class of every engine adapter
(`python -m tpcheck.cli.adapter_reference > docs/reference/adapter.md`; a test checks the page matches it). Derive
from it and override what your engine has: the pipeline reads each member directly, and a member you do not
override keeps the default below. An object that has `begin` / `step` / `close` without deriving from the class is
wrapped (`tpcheck.engines.adapter.as_adapter`) and gets the same defaults. How to write one:
[checking a TP engine](../adapters.md).
"""


def _attribute_docs() -> dict[str, str]:
    """``{attribute: its docstring}``: the string literal that follows each annotated attribute of the class."""
    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == EngineAdapter.__name__)
    docs = {}
    for node, after in zip(cls.body, cls.body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _text(doc: str) -> str:
    """A docstring as a Markdown cell: reStructuredText's double backticks as Markdown code spans."""
    return _cell(doc.replace("``", "`"))


def _row(name: str, docs: dict[str, str]) -> str:
    """``| member | type or signature | default | contract |`` for one member of the class."""
    value = inspect.getattr_static(EngineAdapter, name)
    if callable(value):
        sig = str(inspect.signature(value)).replace("(self, ", "(").replace("(self)", "()").replace("'", "")
        default = "required" if getattr(value, "__isabstractmethod__", False) else "in the contract"
        return f"| `{name}{_cell(sig)}` | method | {default} | {_text(inspect.getdoc(value) or '')} |"
    kind = EngineAdapter.__annotations__[name]
    shown = "{}" if value is module.NONE else repr(value)
    return f"| `{name}` | `{_cell(kind)}` | `{_cell(shown)}` | {_text(docs.get(name, ''))} |"


def render() -> str:
    """The whole page, Markdown."""
    docs = _attribute_docs()
    required = sorted(EngineAdapter.__abstractmethods__, key=lambda n: ("begin", "step", "close").index(n))
    table = "| member | type | default | contract |\n|---|---|---|---|\n"
    out = [HEADER, "## Required\n", table + "\n".join(_row(n, docs) for n in required) + "\n",
           "## Optional capabilities\n", table + "\n".join(_row(n, docs) for n in CAPABILITIES) + "\n"]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
