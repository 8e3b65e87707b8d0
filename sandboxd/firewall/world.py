"""The outside world of an AgentDojo suite, held by the daemon: one environment per session.

AgentDojo (PyPI `agentdojo`) models a bank, a Slack workspace, a mailbox and a travel agency as a
pydantic environment that its tools read and change. Here that environment plays the world outside
the sandbox. It lives in the daemon, not in the container, so restoring a sandbox snapshot never
rolls it back, exactly as a real bank would not forget a transfer because an agent rewound its files.
Tools that change it are `external`: they go through the firewall's ledger, so a replay answers them
from the ledger instead of paying twice, and a staged one only changes the world once released. Tools
that only read it are `read` and run again on every replay.

Environments are kept as Python objects and persisted with pickle after every call (a JSON round trip
of an AgentDojo environment loses data: dates, sets, enums). The daemon only ever unpickles files it
wrote itself into its own state directory; a client gets pickled bytes, never sends them.

A call's clock is frozen: every `datetime.now()` inside the suite's tools returns the call's virtual
clock (or the instant the call started), so two worlds given the same calls end in the same state.

Replays see a shadow world. The world cannot be rolled back, but what a replay reads must be the world
as the counterfactual session would find it, not one that already holds the effects the original
session made later (or the hijacked ones it must forget). So the world's state is recorded at every
agent checkpoint (`mark`), and a replay branch gets a shadow copy of the state at its splice
checkpoint (`begin_shadow`): its reads run on the shadow, and its external calls, answered from the
ledger or staged by the firewall without touching the real world, are applied to the shadow too, so
later reads see them. Committing the replay keeps the shadow's marks as the session's; the shadow
itself is dropped: the real world keeps only what really fired or is released.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import hashlib
import os
import pickle
import shutil
import sys
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sandboxd.branch import Branch
from sandboxd.errors import InvalidArguments, NotFound
from sandboxd.firewall.adapters import EffectAdapter
from sandboxd.protocol import ToolManifest
from snapshots.base import write_atomic

#: Every tool of AgentDojo's default suites that changes its environment, found by running every user
#: and injection task's ground truth and comparing the environment before and after each call
#: (`tests/integration/test_agentdojo_world.py` checks it stays complete). `get_webpage` is one: the
#: visit is logged by the far side, and a phishing task succeeds on that log alone. Workspace's
#: `get_unread_emails` marks what it returns as read.
STATE_CHANGING = frozenset({
    # banking
    "send_money", "schedule_transaction", "update_scheduled_transaction", "update_password", "update_user_info",
    # slack
    "add_user_to_channel", "invite_user_to_slack", "remove_user_from_slack", "send_channel_message",
    "send_direct_message", "get_webpage", "post_webpage",
    # workspace
    "send_email", "delete_email", "get_unread_emails", "create_calendar_event", "cancel_calendar_event",
    "reschedule_calendar_event", "add_calendar_event_participants", "append_to_file", "create_file",
    "delete_file", "share_file",
    # travel
    "reserve_hotel", "reserve_car_rental", "reserve_restaurant",
})

#: State-changing tools whose result is the data the agent asked for: a held call returns nothing to
#: read, so a deployment keeps them `immediate` whatever policy holds the others (`agent.eval` does).
RETURNS_DATA = frozenset({"get_webpage", "get_unread_emails"})

DEFAULT_VERSION = "v1.2.2"
#: the state directory's subdirectory of world environments
WORLDS = "worlds"

_clock: contextvars.ContextVar[float | None] = contextvars.ContextVar("agentdojo_clock", default=None)


class _FrozenDatetime(_dt.datetime):
    """`datetime.datetime` whose now() is the current call's frozen clock (a plain datetime, as before)."""

    @classmethod
    def now(cls, tz: _dt.tzinfo | None = None) -> _dt.datetime:  # type: ignore[override]
        frozen = _clock.get()
        if frozen is None:
            return _dt.datetime.now(tz)
        if tz is not None:
            return _dt.datetime.fromtimestamp(frozen, tz)
        return _dt.datetime.fromtimestamp(frozen, _dt.UTC).replace(tzinfo=None)


def _freeze_suite_clocks() -> None:
    """Point the suites' tool modules at a `datetime` module whose now() reads the frozen clock.

    Only AgentDojo's own modules are rebound, never the global `datetime`, so the daemon's timestamps
    (ledger, logs) keep the real time while a world call runs on another thread.
    """
    shim = types.ModuleType("datetime")
    shim.__dict__.update(_dt.__dict__)
    shim.datetime = _FrozenDatetime  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):
        if name.startswith("agentdojo.default_suites") and getattr(module, "datetime", None) is _dt:
            module.datetime = shim  # type: ignore[attr-defined]


class AgentDojoWorld:
    """The environments of one AgentDojo suite, one per session, persisted under `directory`; the branch
    participant of the outside world (a replay branch reads a shadow of it)."""

    name = "world"

    def __init__(self, suite: str, directory: Path, version: str = DEFAULT_VERSION) -> None:
        try:
            from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
            from agentdojo.functions_runtime import FunctionsRuntime
            from agentdojo.task_suite.load_suites import get_suite, get_suites
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ValueError("[world] agentdojo_suite needs the agentdojo package: pip install 'sandboxd[eval]'") \
                from exc
        try:
            known = get_suites(version)
        except KeyError:
            raise ValueError(f"unknown AgentDojo benchmark version {version!r}") from None
        if suite not in known:
            raise ValueError(f"unknown AgentDojo suite {suite!r}; version {version} has {', '.join(sorted(known))}")
        self.suite_name, self.version = suite, version
        self.suite = get_suite(version, suite)
        self._runtime = FunctionsRuntime(self.suite.tools)
        self._render = tool_result_to_str
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._envs: dict[str, Any] = {}
        self._shadows: dict[tuple[str, str], Any] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        _freeze_suite_clocks()

    # Tools --------------------------------------------------------------------------------------

    def manifests(self) -> list[ToolManifest]:
        """One manifest per suite tool, its schema AgentDojo's own; state-changing tools are external."""
        manifests = []
        for function in self.suite.tools:
            schema = function.parameters.model_json_schema()
            schema.pop("title", None)
            schema["additionalProperties"] = False  # pydantic would drop an unknown argument silently
            external = function.name in STATE_CHANGING
            manifests.append(ToolManifest(
                name=function.name, description=function.description or function.name, parameters=schema,
                effect="external" if external else "read", open_world=True,
                intent_fields=sorted(schema.get("properties", {})) if external else []))
        return manifests

    def adapters(self, timeout_s: float) -> list[EffectAdapter]:
        return [WorldToolAdapter(self, manifest, timeout_s) for manifest in self.manifests()]

    def run(self, session_id: str, tool: str, args: dict[str, Any], clock: float | None,
            branch: str = "") -> dict[str, Any]:
        """Run one tool on the session's environment (a replay branch's shadow, if it has one)."""
        with self._session(session_id) as env:
            shadow = self._shadows.get((session_id, branch)) if branch else None
            result, error = self._call(shadow if shadow is not None else env, tool, args, clock)
            if shadow is None and tool in STATE_CHANGING:
                self._save(self._path(session_id), env)
        return self._answer(result, error)

    def apply_shadow(self, session_id: str, branch: str, tool: str, args: dict[str, Any],
                     clock: float | None) -> dict[str, Any] | None:
        """A replay's external call, answered or staged by the firewall: the shadow world takes its effect.

        Returns the shadow's answer, shaped like `run`'s, or None when the replay has no shadow world.
        """
        with self._lock_of(session_id):
            shadow = self._shadows.get((session_id, branch))
            if shadow is None:
                return None
            return self._answer(*self._call(shadow, tool, args, clock))

    def _answer(self, result: Any, error: str | None) -> dict[str, Any]:
        if error is not None:
            return {"output": error, "error": error}
        return {"output": self._render(result)}

    def _call(self, env: Any, tool: str, args: dict[str, Any], clock: float | None) -> tuple[Any, str | None]:
        token = _clock.set(clock if clock is not None else time.time())
        try:
            result, error = self._runtime.run_function(env, tool, args)
        finally:
            _clock.reset(token)
        return result, error

    # Shadow worlds for replays --------------------------------------------------------------------

    def _marks(self, session_id: str, branch: str = "") -> Path:
        base = self.directory / f"{session_id}.marks"
        return base / hashlib.sha256(branch.encode()).hexdigest()[:16] if branch else base

    def mark(self, session_id: str, checkpoint_id: str, branch: str = "") -> None:
        """Record the world as it stands at an agent checkpoint (in a replay, the branch's shadow)."""
        if session_id not in self._envs and not self._path(session_id).exists():
            return  # a session with no world
        with self._session(session_id) as env:
            shadow = self._shadows.get((session_id, branch)) if branch else None
            directory = self._marks(session_id, branch)
            directory.mkdir(parents=True, exist_ok=True)
            self._save(directory / f"{checkpoint_id}.pkl", shadow if shadow is not None else env)

    def begin_shadow(self, session_id: str, branch: str, checkpoint_id: str) -> None:
        """A replay branch starts: its shadow is the world as it was at the splice checkpoint."""
        mark = self._marks(session_id) / f"{checkpoint_id}.pkl"
        if not mark.exists():
            return  # no world, or one set up after that checkpoint: the replay reads the world itself
        with self._lock_of(session_id), open(mark, "rb") as fh:
            self._shadows[(session_id, branch)] = pickle.load(fh)  # noqa: S301 - our own state file

    def end_shadow(self, session_id: str, branch: str, commit: bool) -> None:
        """A replay branch ends: committed, its marks become the session's; either way the shadow goes.

        Safe to repeat after a crash part-way through (a mark already moved is simply not there).
        """
        with self._lock_of(session_id):
            self._shadows.pop((session_id, branch), None)
            directory = self._marks(session_id, branch)
            if commit and directory.is_dir():
                for mark in sorted(directory.glob("*.pkl")):
                    os.replace(mark, self._marks(session_id) / mark.name)
            shutil.rmtree(directory, ignore_errors=True)

    # Environments -------------------------------------------------------------------------------

    def reset(self, session_id: str, injections: dict[str, str], user_task: str | None) -> bytes:
        """A fresh environment for the session: the suite's, with these injections and the task's set-up."""
        defaults = self.suite.get_injection_vector_defaults()
        unknown = sorted(set(injections) - set(defaults))
        if unknown:
            raise InvalidArguments("world_reset", f"unknown injection vectors {unknown}; the suite has "
                                   f"{', '.join(sorted(defaults))}", "$.injections")
        try:
            env = self.suite.load_and_inject_default_environment(injections)
        except Exception as exc:  # the suite templates injections into YAML; it refuses what YAML cannot hold
            raise InvalidArguments("world_reset", f"the {self.suite_name} suite cannot hold these injections: "
                                   f"{type(exc).__name__}: {exc}", "$.injections") from exc
        if user_task is not None:
            if user_task not in self.suite.user_tasks:
                raise InvalidArguments("world_reset", f"unknown user task {user_task!r}", "$.user_task")
            env = self.suite.user_tasks[user_task].init_environment(env)
        with self._lock_of(session_id):
            self._envs[session_id] = env
            shutil.rmtree(self._marks(session_id), ignore_errors=True)  # marks of an earlier world
            self._save(self._path(session_id), env)
            return pickle.dumps(env)

    def state(self, session_id: str) -> bytes:
        """The session's environment, pickled."""
        with self._session(session_id) as env:
            return pickle.dumps(env)

    def _path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.pkl"

    def _lock_of(self, session_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(session_id, threading.Lock())

    @contextmanager
    def _session(self, session_id: str) -> Iterator[Any]:
        with self._lock_of(session_id):
            env = self._envs.get(session_id)
            if env is None:
                path = self._path(session_id)
                if not path.exists():
                    raise NotFound(f"session {session_id} has no world: set it up with world_reset first",
                                   session_id=session_id)
                with open(path, "rb") as fh:
                    env = self._envs[session_id] = pickle.load(fh)  # noqa: S301 - our own state file
            yield env

    def _save(self, path: Path, env: Any) -> None:
        """Atomically replace a pickle: what a call changed survives a kill -9."""
        write_atomic(path, lambda fh: pickle.dump(env, fh))

    # The branch participant -------------------------------------------------------------------

    def begin(self, branch: Branch) -> None:
        self.begin_shadow(branch.session_id, branch.id, branch.splice.checkpoint_id)

    def commit(self, branch: Branch) -> dict[str, Any]:
        self.end_shadow(branch.session_id, branch.id, commit=True)
        return {}

    def abandon(self, branch: Branch) -> None:
        self.end_shadow(branch.session_id, branch.id, commit=False)

    def forget(self, session_id: str) -> None:
        """Drop a closed session's environment and shadows from memory (its files stay: the world does not
        forget what it was sent)."""
        with self._lock_of(session_id):
            self._envs.pop(session_id, None)
            for key in [k for k in self._shadows if k[0] == session_id]:
                del self._shadows[key]

    def require(self, session_id: str) -> None:
        """Refuse a call before the ledger records it, when the session has no world to run it on."""
        if session_id not in self._envs and not self._path(session_id).exists():
            raise NotFound(f"session {session_id} has no world: set it up with world_reset first",
                           session_id=session_id)


class WorldToolAdapter(EffectAdapter):
    """One suite tool, served in the daemon on the calling session's environment."""

    def __init__(self, world: AgentDojoWorld, manifest: ToolManifest, timeout_s: float) -> None:
        self.world = world
        self.manifest = manifest
        self.timeout_s = timeout_s

    def check_session(self, session_id: str) -> None:
        self.world.require(session_id)

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        raise AssertionError("a world tool runs on a session's environment: call fire_in")

    def fire_in(self, session_id: str, clock: float | None, args: dict[str, Any], call_id: str,
                branch: str = "") -> dict[str, Any]:
        return self.world.run(session_id, self.manifest.name, args, clock, branch)

    def shadow(self, session_id: str, branch: str, clock: float | None, args: dict[str, Any]) -> dict[str, Any] | None:
        return self.world.apply_shadow(session_id, branch, self.manifest.name, args, clock)
