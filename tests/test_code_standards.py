"""Standards the product code keeps, checked on its source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ("engine", "storage", "app", "pages", "analysis", "fleet", "cli")


def product_modules() -> list[Path]:
    return sorted(path for name in PRODUCT_DIRS for path in (ROOT / name).rglob("*.py"))


def test_product_code_has_no_assert_statements():
    """Regression: the KV coordinator allocated blocks inside `assert`, so under `python -O` admissions
    allocated nothing, and every `check_invariants` was built from asserts that -O removes. Product code
    checks with its own errors; only tests assert."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in product_modules()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Assert)
    ]
    assert product_modules() and not found, found
