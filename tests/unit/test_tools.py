"""Tool manifests and argument validation, before anything reaches a sandbox."""

from __future__ import annotations

import jsonschema
import pytest

from sandboxd.errors import InvalidArguments, PathEscape, UnknownTool
from sandboxd.protocol import ToolManifest
from sandboxd.tools.builtin import BUILTIN_TOOLS, executor_request
from sandboxd.tools.registry import ToolRegistry, check_workspace_path

REGISTRY = ToolRegistry(BUILTIN_TOOLS)


def test_builtins_are_valid_openai_function_tools() -> None:
    names = [m.name for m in REGISTRY.manifests()]
    assert names == ["list_dir", "python", "read_file", "shell", "write_file"]
    effects = {m.name: m.effect for m in REGISTRY.manifests()}
    assert effects == {"list_dir": "read", "python": "write", "read_file": "read", "shell": "write",
                       "write_file": "write"}
    for manifest in REGISTRY.manifests():
        entry = manifest.openai_format()
        assert entry["type"] == "function" and entry["function"]["name"] == manifest.name
        jsonschema.Draft202012Validator.check_schema(entry["function"]["parameters"])


@pytest.mark.parametrize(("tool", "args", "problem"), [
    ("shell", {}, "'command' is a required property"),
    ("shell", {"command": ""}, "should be non-empty"),
    ("shell", {"command": "ls", "sudo": True}, "Additional properties"),
    ("shell", {"command": "ls", "timeout_s": 0}, "less than or equal to the minimum"),
    ("write_file", {"path": "a"}, "'content' is a required property"),
    ("read_file", {"path": ["a"]}, "is not of type 'string'"),
    ("list_dir", {"recursive": "yes"}, "is not of type 'boolean'"),
])
def test_invalid_arguments_are_refused(tool: str, args: dict[str, object], problem: str) -> None:
    with pytest.raises(InvalidArguments) as err:
        REGISTRY.validate(tool, args)
    assert problem in err.value.message


def test_unknown_tool_lists_the_known_ones() -> None:
    with pytest.raises(UnknownTool) as err:
        REGISTRY.validate("rm_rf", {})
    assert err.value.details["known"] == ["list_dir", "python", "read_file", "shell", "write_file"]


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "/workspace/../etc", "/workspacex/a",
                                  "//etc", "a\x00b"])
def test_paths_that_leave_the_workspace(path: str) -> None:
    with pytest.raises(PathEscape):
        check_workspace_path(path)
    with pytest.raises(PathEscape):
        REGISTRY.validate("read_file", {"path": path})


@pytest.mark.parametrize(("path", "normal"), [("a.txt", "/workspace/a.txt"), ("/workspace", "/workspace"),
                                              ("d/../e", "/workspace/e"), ("/workspace/x/./y", "/workspace/x/y")])
def test_paths_inside_the_workspace(path: str, normal: str) -> None:
    assert check_workspace_path(path) == normal


def test_duplicate_tool_names_are_refused() -> None:
    dup = ToolManifest(name="shell", description="again", parameters={"type": "object"}, effect="read")
    with pytest.raises(ValueError, match="registered twice"):
        ToolRegistry([*BUILTIN_TOOLS, dup])


def test_executor_requests() -> None:
    assert executor_request("shell", {"command": "ls"})["argv"] == ["/bin/sh", "-c", "ls"]
    assert executor_request("python", {"code": "print(1)"})["stdin"] == "print(1)"
    assert executor_request("list_dir", {}) == {"op": "list_dir", "path": ".", "recursive": False}
