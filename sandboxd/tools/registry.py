"""The tool registry: manifests by name, and validation of a call's arguments before anything runs."""

from __future__ import annotations

import math
import posixpath
from collections.abc import Iterable
from typing import Any

import jsonschema

from sandboxd.errors import InvalidArguments, PathEscape, UnknownTool
from sandboxd.protocol import ToolManifest
from sandboxd.tools.builtin import PATH_ARGUMENTS
from sandboxd.tools.quickcheck import Check, compile_check

WORKSPACE = "/workspace"


class ToolRegistry:
    """Every tool the daemon serves, with a compiled validator for each."""

    def __init__(self, manifests: Iterable[ToolManifest]) -> None:
        self._tools: dict[str, ToolManifest] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        self._quick: dict[str, Check] = {}
        """A fast yes for the flat schemas (`sandboxd.tools.quickcheck`); jsonschema still words every no."""
        for manifest in manifests:
            if manifest.name in self._tools:
                raise ValueError(f"tool {manifest.name!r} is registered twice")
            cls = jsonschema.validators.validator_for(manifest.parameters)
            cls.check_schema(manifest.parameters)
            self._tools[manifest.name] = manifest
            self._validators[manifest.name] = cls(manifest.parameters)
            if (quick := compile_check(manifest.parameters)) is not None:
                self._quick[manifest.name] = quick

    def manifests(self) -> list[ToolManifest]:
        """All manifests, sorted by name."""
        return [self._tools[name] for name in sorted(self._tools)]

    def get(self, name: str) -> ToolManifest:
        """The manifest of `name`, or UnknownTool."""
        try:
            return self._tools[name]
        except KeyError:
            raise UnknownTool(name, sorted(self._tools)) from None

    def validate(self, name: str, args: dict[str, Any]) -> ToolManifest:
        """Check `args` against the tool's schema and confine its paths; raise on the first problem."""
        manifest = self.get(name)
        check_json_numbers(name, args)
        quick = self._quick.get(name)
        if quick is None or not quick(args):
            error = jsonschema.exceptions.best_match(self._validators[name].iter_errors(args))
            if error is not None:
                raise InvalidArguments(name, error.message, error.json_path)
        for key in PATH_ARGUMENTS.get(name, ()):
            if key in args:
                check_workspace_path(args[key])
        return manifest


def check_json_numbers(tool: str, value: Any, path: str = "$") -> None:
    """Refuse NaN and infinities, which JSON has no spelling for and JSON Schema bounds let through."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArguments(tool, f"{value!r} is not a JSON number", path)
    if isinstance(value, dict):
        for key, item in value.items():
            check_json_numbers(tool, item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_json_numbers(tool, item, f"{path}[{index}]")


def check_workspace_path(path: str) -> str:
    """Refuse paths that leave /workspace by their spelling (symlinks are checked in the sandbox)."""
    if "\x00" in path:
        raise PathEscape(path, "contains a NUL byte")
    joined = path if path.startswith("/") else posixpath.join(WORKSPACE, path)
    normal = posixpath.normpath(joined)
    if normal != WORKSPACE and not normal.startswith(WORKSPACE + "/"):
        raise PathEscape(path, "absolute path elsewhere" if path.startswith("/") else "'..' leaves the workspace")
    return normal
