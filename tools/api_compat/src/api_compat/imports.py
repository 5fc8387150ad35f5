"""Find, with ``ast``, every use of a sibling workspace package in one source file."""

import ast
from dataclasses import dataclass
from enum import Enum


class UseKind(Enum):
    """How a sibling is used."""

    IMPORT = "import"  # import mcore_x.sub [as m]
    FROM = "from"  # from mcore_x.sub import name
    STAR = "star"  # from mcore_x import *
    ATTRIBUTE = "attribute"  # m.name, m bound by ``import mcore_x.sub [as m]`` or ``from mcore_x import m``


@dataclass(frozen=True)
class SiblingUse:
    """One use of a sibling: ``module`` is a dotted module path, ``names`` the path below it."""

    line: int
    kind: UseKind
    module: str
    names: tuple[str, ...]

    @property
    def top(self) -> str:
        """The sibling's import name."""
        return self.module.split(".", 1)[0]


def find_sibling_uses(source: str, filename: str, siblings: set[str]) -> list[SiblingUse]:
    """Uses of the packages whose import names are ``siblings`` (relative imports are skipped)."""
    tree = ast.parse(source, filename=filename)
    uses: list[SiblingUse] = []
    bound: dict[str, _Binding] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".", 1)[0] not in siblings:
                    continue
                uses.append(SiblingUse(node.lineno, UseKind.IMPORT, alias.name, ()))
                if alias.asname:
                    bound[alias.asname] = _Binding(alias.name, ())
                else:
                    top = alias.name.split(".", 1)[0]
                    bound[top] = _Binding(top, ())
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".", 1)[0] not in siblings:
                continue
            for alias in node.names:
                if alias.name == "*":
                    uses.append(SiblingUse(node.lineno, UseKind.STAR, node.module, ()))
                else:
                    uses.append(SiblingUse(node.lineno, UseKind.FROM, node.module, (alias.name,)))
                    bound[alias.asname or alias.name] = _Binding(node.module, (alias.name,))
    if bound:
        uses += _AttributeFinder(bound).find(tree)
    return uses


@dataclass(frozen=True)
class _Binding:
    """What an imported name stands for: ``names`` below the dotted ``module`` (none for ``import``)."""

    module: str
    names: tuple[str, ...]


class _AttributeFinder(ast.NodeVisitor):
    """Collects ``name.a.b`` chains rooted at names bound by imports of siblings.

    A name bound by ``from mcore_x import sub`` gives the path ``sub.a.b`` below ``mcore_x``;
    the check follows it only while it names modules, so attributes of an imported class or
    function are left alone.
    """

    def __init__(self, bound: dict[str, _Binding]):
        self._bound = bound
        self._uses: list[SiblingUse] = []

    def find(self, tree: ast.AST) -> list[SiblingUse]:
        self.visit(tree)
        return self._uses

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        current: ast.expr = node
        while isinstance(current, ast.Attribute):
            chain.append(current.attr)
            current = current.value
        if isinstance(current, ast.Name) and current.id in self._bound:
            binding = self._bound[current.id]
            names = (*binding.names, *reversed(chain))
            self._uses.append(SiblingUse(node.lineno, UseKind.ATTRIBUTE, binding.module, names))
        else:
            self.generic_visit(node)
