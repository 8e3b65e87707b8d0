"""The built-in sandbox tools and how each becomes an executor request."""

from __future__ import annotations

from typing import Any

from sandboxd.protocol import ToolManifest

_TIMEOUT = {"type": "number", "exclusiveMinimum": 0, "description": "Seconds before the call is killed."}
_PATH = {"type": "string", "minLength": 1, "maxLength": 4096,
         "description": "Path inside /workspace, relative to it or absolute."}


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


BUILTIN_TOOLS: tuple[ToolManifest, ...] = (
    ToolManifest(
        name="shell",
        description="Run a /bin/sh command in /workspace; returns exit code, stdout and stderr.",
        parameters=_schema({"command": {"type": "string", "minLength": 1}, "stdin": {"type": "string"},
                            "timeout_s": _TIMEOUT}, ["command"]),
        effect="write",
    ),
    ToolManifest(
        name="read_file",
        description="Read a text file from /workspace.",
        parameters=_schema({"path": _PATH}, ["path"]),
        effect="read",
    ),
    ToolManifest(
        name="write_file",
        description="Write (or append) text to a file in /workspace, creating parent directories.",
        parameters=_schema({"path": _PATH, "content": {"type": "string"}, "append": {"type": "boolean"}},
                           ["path", "content"]),
        effect="write",
    ),
    ToolManifest(
        name="list_dir",
        description="List a directory of /workspace: one JSON line per entry with path, type, size, mode.",
        parameters=_schema({"path": _PATH, "recursive": {"type": "boolean"}}, []),
        effect="read",
    ),
    ToolManifest(
        name="python",
        description="Run Python 3 code in /workspace; returns exit code, stdout and stderr.",
        parameters=_schema({"code": {"type": "string", "minLength": 1}, "timeout_s": _TIMEOUT}, ["code"]),
        effect="write",
    ),
)

#: the longest shell command passed as an argument of `sh -c`; a longer one goes as a script file
INLINE_COMMAND_BYTES = 64 * 1024

#: argument names that hold workspace paths, per tool
PATH_ARGUMENTS: dict[str, tuple[str, ...]] = {"read_file": ("path",), "write_file": ("path",), "list_dir": ("path",)}


def executor_request(tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """The executor request that carries out a validated built-in call (limits added by the caller)."""
    if tool == "shell":
        command = args["command"]
        if len(command.encode()) <= INLINE_COMMAND_BYTES:
            return {"op": "run", "argv": ["/bin/sh", "-c", command], "stdin": args.get("stdin", "")}
        # Linux caps one argument at 128 KiB (MAX_ARG_STRLEN): a longer command travels as a script the
        # executor hands the shell as a file, which `.` reads in the same shell ($0 stays /bin/sh).
        return {"op": "run", "argv": ["/bin/sh", "-c", ". {script}"], "script": command,
                "stdin": args.get("stdin", "")}
    if tool == "python":
        return {"op": "run", "argv": ["python3", "-I", "-"], "stdin": args["code"]}
    if tool == "read_file":
        return {"op": "read_file", "path": args["path"]}
    if tool == "write_file":
        return {"op": "write_file", "path": args["path"], "content": args["content"],
                "append": bool(args.get("append", False))}
    if tool == "list_dir":
        return {"op": "list_dir", "path": args.get("path", "."), "recursive": bool(args.get("recursive", False))}
    raise KeyError(tool)
