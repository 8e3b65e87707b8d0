"""No module over ~400 lines without the reason it is one module, stated at its top ("Why one module ...")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400
PACKAGES = ("sandboxd", "agent", "snapshots", "tests", "benchmarks")


def long_modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if len(path.read_text().splitlines()) > LIMIT)


def test_the_limit_is_measured_on_real_modules() -> None:
    assert ROOT / "sandboxd" / "protocol.py" in long_modules()  # the wire contract is long, and says why


@pytest.mark.parametrize("path", long_modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_a_long_module_says_why_it_is_one(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Why one module" in docstring, f"{path.relative_to(ROOT)} is over {LIMIT} lines: split it, or say why not"
