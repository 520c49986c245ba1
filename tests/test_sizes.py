"""No function of the product (eagle3_train/, data_prep/) runs past 100 lines: a longer one is split
where that makes it readable."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 100


def long_functions(limit: int = MAX_LINES) -> dict[str, int]:
    """``path:line name`` -> lines, for every function or method (its nested ones included) longer
    than ``limit`` lines, from its ``def`` to its last line."""
    out = {}
    for pkg in ("eagle3_train", "data_prep"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        out[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    return out


def test_the_scan_measures_functions():
    assert any(" load_target" in name for name in long_functions(limit=20))


def test_no_product_function_over_100_lines():
    assert long_functions() == {}
