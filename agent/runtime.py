"""The agent runtime: context blocks, the turn loop, tool calls over ZeroMQ, provenance and checkpoints.

A session's context is an ordered list of blocks. The loop is a function of that list: a pending
tool call is executed and its result appended; after a user input or a result the model decodes a
turn; after a final answer the next exogenous input (a memory injection or a user input) is taken
from the queue. Because nothing else drives the loop, a session resumes from any checkpoint by
restoring the model cache and the blocks of the checkpoint's manifest: that is how a replay runs.

Every block and every derived artifact (plan, tool call, reply) is reported to the daemon with the
dependencies that actually occurred; a checkpoint (metadata only) is registered before every
observation, before every external call and before every compaction.

The context policy says what a model turn's prompt holds. `session` (the default): every block so
far. `task`: a new task opens with the system prompt, the memories and the task, not the raw blocks of
earlier tasks (the model's cache is cropped back to the memories and the task is appended); a turn's
recorded parents are exactly that prompt, so a later task that reads nothing tainted is independent of
a revoked input as the graph certifies it, and a replay prefills its recorded turns (`agent.replay`).

Why one module: the loop, the blocks it appends and the provenance it reports are one state machine
over one list; a replay resumes it from a checkpoint's manifest, so the code that writes a block and
the code that records its parents must change together. Backends, tool-call parsing, compaction and
the replay itself already live beside it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import msgspec

from agent.context import SeededContext, artifact_id
from agent.conversation import END, ROLE, Conversation, MessageConversation, TokenConversation
from agent.models.base import GREEDY, Checkpoint, Sampling
from agent.models.errors import CheckpointInvalid
from agent.replay import DIGEST, ReplayPlan
from agent.scenario import ContextBlock, Scenario, ScriptedPolicy, ToolStep
from agent.toolcalls import ParsedTurn, ToolCallParser
from sandboxd import protocol as p
from sandboxd.client import Client, RemoteError

__all__ = ["END", "ROLE", "AgentSession", "Block", "Exogenous", "artifact_of", "block_of", "exogenous_inputs"]

DEFAULT_SYSTEM = "You are an assistant working in /workspace. Use the tools; answer briefly."
CONTEXT_POLICIES = ("session", "task")

#: Why a model-driven session refuses compaction (summaries are written by the scripted policy only)
COMPACTION_REFUSED = (
    "compaction is not available when the model decides: a summary is a turn the model writes when asked for "
    "one, and the runtime would have to add that request to the context (changing what B5 and B7 compare) for "
    "a model trained to answer it (the fixture is not). Run with compact_every=0; the scripted baselines "
    "exercise compaction and its revocation")


class Block(msgspec.Struct, kw_only=True):
    """One block of the context: the artifact it is, its text and where its tokens sit."""

    artifact_id: str
    type: str
    text: str
    span: tuple[int, int]
    calls: list[tuple[str, ToolStep]] = []
    """For a model turn: the tool calls it emitted, with their artifact ids."""
    errors: list[str | None] = []
    """For a model turn: per call, what was wrong with it (None: a valid call)."""
    reply: str | None = None
    """For a model turn: its final answer, if it is one."""
    plan: str = ""
    answers: str | None = None
    """For an observation: the tool-call artifact it answers."""
    injects: str | None = None
    """For a memory injection of a summary: the summary artifact."""


class Exogenous(msgspec.Struct, frozen=True, kw_only=True):
    """An input from outside the model: a user input or a seeded memory."""

    type: str
    text: str


def exogenous_inputs(scenario: Scenario) -> list[Exogenous]:
    """A scenario's exogenous stream: seeded memories first, then the user's tasks."""
    return [Exogenous(type="memory", text=m) for m in scenario.memories] + [
        Exogenous(type="user", text=t.text) for t in scenario.tasks]


class AgentSession:
    """One agent session against one daemon session; scripted turns through a real model backend."""

    def __init__(self, client: Client, session_id: str, backend: Any, policy: ScriptedPolicy | None = None,
                 ctx: SeededContext | None = None, *, system: str | None = None, chat: Any = None,
                 toolcall_format: str | None = None, sampling: Sampling = GREEDY, compact_every: int | None = None,
                 max_turn_tokens: int = 4096, echo: Any = None, max_turns: int = 12,
                 context_policy: str = "session") -> None:
        """`policy` given: its turns, teacher-forced through the backend (the scripted baselines). Otherwise the
        model decides: `chat` (an `agent.chat.ChatRenderer` factory taking the tools, or None for the byte
        tokenizer's role markers) lays the context out, `toolcall_format` reads its turns."""
        self.client = client
        self.session_id = session_id
        self.policy = policy
        self.backend = backend
        if policy is not None and getattr(backend, "KIND", "") == "local":
            from agent.models.scripted import ScriptedBackend  # imports torch: only for the scripted baselines

            # Scripted turns: the policy picks the text, the local engine runs every token of it.
            self.backend = ScriptedBackend(backend, lambda _ctx: self._choose())
        self.system = system if system is not None else policy.scenario.system if policy else DEFAULT_SYSTEM
        if policy is None and compact_every:
            raise ValueError(COMPACTION_REFUSED)
        self.compact_every = compact_every if compact_every is not None else \
            policy.scenario.compact_every if policy else 0
        self._chat = chat
        self.toolcall_format = toolcall_format or ("json" if policy is not None or chat is None else "hermes")
        self.sampling = sampling
        self.echo = echo
        """Called with each block as it is appended (the CLI prints turns and calls as they happen)."""
        self.conversation: Conversation | None = None
        self.parser: ToolCallParser | None = None
        self.ctx = ctx or SeededContext()
        self.max_turn_tokens = max_turn_tokens
        self.max_turns = max_turns
        """Model turns a task may take before the loop moves on (a model that never answers cannot spin)."""
        self.blocks: list[Block] = []
        self.queue: collections.deque[Exogenous] = collections.deque()
        self.branch = ""
        self.mode: str = "live"
        self.source_result: tuple[str, str] | None = None
        """During a replay: (tool-call artifact, sanitized recorded result) to re-feed instead of re-running."""
        self._outbox: list[p.Artifact] = []
        self._choose: Any = None
        self._effects: dict[str, str] | None = None
        self.calls_made: list[p.CallResult] = []
        self.between_turns: Any = None
        """Called before each step of the live loop (the event watcher takes pending revocations there)."""
        if context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"context_policy {context_policy!r}: choose one of {', '.join(CONTEXT_POLICIES)}")
        self.context_policy = context_policy
        self.replay: ReplayPlan | None = None
        """During a replay: the reads and turns it may take from the record (None: recompute everything)."""
        self._steps_before = 0
        self._turns_before = 0
        """Steps and turns of the blocks no longer in the context (earlier tasks under the `task` policy)."""

    def _setup(self) -> None:
        """The conversation and the parser, built on the tools the daemon serves this session."""
        if self.conversation is not None:
            return
        tools = [t.openai_format() for t in self.client.tools(self.session_id)]
        self.parser = ToolCallParser(self.toolcall_format, tools)
        if getattr(self.backend, "KIND", "") == "openai":
            self.conversation = MessageConversation(self.backend, tools, self.parser)
        else:
            self.conversation = TokenConversation(self.backend, self._chat(tools) if self._chat else None)

    # Derived state -----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._steps_before + sum(1 for b in self.blocks if b.type in p.OBSERVATION_TYPES)

    @property
    def turn(self) -> int:
        return self._turns_before + sum(1 for b in self.blocks if b.type in ("model_turn", "summary"))

    def context(self) -> list[ContextBlock]:
        """The context as the policy sees it."""
        return [ContextBlock(type=b.type, text=b.text) for b in self.blocks]

    def answer(self) -> str | None:
        """The final answer of the last task, if the session ended on one."""
        for block in reversed(self.blocks):
            if block.type == "model_turn":
                return block.reply
        return None

    def _pending_call(self) -> tuple[str, ToolStep] | None:
        answered = {b.answers for b in self.blocks if b.type == "observation"}
        for block in reversed(self.blocks):
            if block.type == "model_turn":
                for call in block.calls:
                    if call[0] not in answered:
                        return call
                return None
        return None

    def _turns_since_input(self) -> int:
        count = 0
        for block in reversed(self.blocks):
            if block.type in ("user", "memory"):
                break
            count += block.type == "model_turn"
        return count

    def _due_compaction(self) -> bool:
        k = self.compact_every
        last = max((i for i, b in enumerate(self.blocks) if b.type == "summary"), default=-1)
        return k > 0 and sum(1 for b in self.blocks[last + 1:] if b.type == "model_turn") >= k

    # The loop ----------------------------------------------------------------------------------

    def start(self, inputs: Iterable[Exogenous]) -> None:
        """Prefill the system prompt, register the start checkpoint, queue the exogenous inputs."""
        self._setup()
        self._append("system", "sys", self.system, parents=[])
        self._checkpoint("start")
        self.queue.extend(inputs)

    def run(self) -> None:
        """Run until the queue is empty and the last task has its answer."""
        while True:
            if self.between_turns is not None and not self.branch:
                self.between_turns(self)
            pending = self._pending_call()
            last = self.blocks[-1].type
            if pending is not None:
                self._execute(*pending)
            elif last == "observation" and self._turns_since_input() >= self.max_turns:
                if not self._next_input():
                    break
            elif last in ("user", "observation"):
                self._compact() if self._due_compaction() else self._decode_turn()
            elif last == "summary":
                self._decode_turn()
            elif not self._next_input():
                break
        self.flush()

    def _next_input(self) -> bool:
        if not self.queue:
            return False
        item = self.queue.popleft()
        if item.type == "user":
            pending = self._uninjected_summaries()
            if self.context_policy == "task":
                self._open_task()
            self._inject_summaries(pending)
            self._checkpoint("turn")
            self._append("user", artifact_id("user", self.step + 1), item.text, parents=[])
        else:
            self._checkpoint("memory")
            self._append("memory", artifact_id("mem", self.step + 1), item.text, parents=[])
        return True

    def _uninjected_summaries(self) -> list[Block]:
        injected = {b.injects for b in self.blocks if b.type == "memory"}
        return [b for b in self.blocks if b.type == "summary" and b.artifact_id not in injected]

    def _open_task(self) -> None:
        """`task` policy: drop the raw blocks of the tasks so far; the system prompt and memories stay."""
        if not any(b.type == "user" for b in self.blocks):
            return
        lead = next(i for i, b in enumerate(self.blocks) if b.type not in ("system", "memory"))
        kept = [b for b in self.blocks[lead:] if b.type == "memory"]
        dropped = self.blocks[lead:]
        self._steps_before += sum(1 for b in dropped if b.type in p.OBSERVATION_TYPES and b not in kept)
        self._turns_before += sum(1 for b in dropped if b.type in ("model_turn", "summary"))
        assert self.conversation is not None
        self.flush()
        self.conversation.crop(self.blocks[lead - 1].span[1], lead)
        self.blocks = self.blocks[:lead]
        for block in kept:  # memories injected after the first task: read again, not recorded again
            block.span = self.conversation.add("memory", block.text)
            self.blocks.append(block)

    def _inject_summaries(self, pending: list[Block]) -> None:
        for block in pending:
            self._checkpoint("memory")
            text = "Memory: " + block.text
            self._append("memory", artifact_id("mem", self.step + 1), text, parents=[block.artifact_id],
                         injects=block.artifact_id)

    def _decode_turn(self) -> None:
        turn = self.turn + 1
        parents = [b.artifact_id for b in self.blocks]
        assert self.conversation is not None
        recorded = self.replay.turn_for([(b.type, b.text) for b in self.blocks]) if self.replay else None
        span = self.conversation.replay_turn(recorded.text, recorded.digest) if recorded else None
        if recorded is not None and span is not None:
            text = recorded.text  # certified independent of z: re-materialized by prefill (agent.replay)
            assert self.replay is not None
            self.replay.prefilled_turns += 1
        else:
            text, span = self._decode(lambda: self.policy.next_turn(self.context()) if self.policy else "")
        parsed = self._parse(text)
        tid = artifact_id("turn", turn)
        call_ids = [(artifact_id("call", turn, k), call) for k, call in enumerate(parsed.calls)]
        assert self.conversation is not None
        self.conversation.close_turn(text, call_ids, parsed.plan)
        block = Block(artifact_id=tid, type="model_turn", text=text, span=span, calls=call_ids,
                      errors=parsed.errors, reply=parsed.answer, plan=parsed.plan)
        self.blocks.append(block)
        digest = self.conversation.digest(span)
        self._record(tid, "model_turn", text, parents, span, meta={DIGEST: digest} if digest else None)
        if parsed.plan:
            self._record(artifact_id("plan", turn), "plan", parsed.plan, [tid], None)
        for (cid, call), error in zip(call_ids, parsed.errors, strict=True):
            meta: dict[str, Any] = {"tool": call.name} if error is None else {"tool": call.name, "error": error}
            self._record(cid, "tool_call", msgspec.json.encode(call).decode(), [tid], None, meta=meta)
        if parsed.answer is not None:
            self._record(artifact_id("reply", turn), "reply", parsed.answer, [tid], None)
        if self.echo is not None:
            self.echo(block)

    def _parse(self, text: str) -> ParsedTurn:
        assert self.parser is not None
        return self.parser.parse(text)

    def _compact(self) -> None:
        self._checkpoint("compaction")
        turn = self.turn + 1
        parents = [b.artifact_id for b in self.blocks]
        assert self.policy is not None
        policy = self.policy
        text, span = self._decode(lambda: policy.summary(self.context()))
        assert self.conversation is not None
        self.conversation.close_turn(text, [], "")
        sid = artifact_id("summary", turn)
        self.blocks.append(Block(artifact_id=sid, type="summary", text=text, span=span))
        self._record(sid, "summary", text, parents, span)

    def _decode(self, choose: Any) -> tuple[str, tuple[int, int]]:
        """One model turn: the turn header by prefill, then the turn decoded up to the template's end."""
        assert self.conversation is not None
        self._choose = choose
        return self.conversation.turn(self.max_turn_tokens, self.sampling)

    def _execute(self, call_artifact: str, call: ToolStep) -> None:
        error = self._call_error(call_artifact)
        manifest_effect = self.effect(call.name)
        if manifest_effect == "external" and error is None:
            self._checkpoint("external")
        if error is not None:
            # A call the model got wrong is answered, not run: it reads what was wrong and may try again.
            text = f"error invalid_call: {error}"
        elif self.source_result is not None and self.source_result[0] == call_artifact:
            text, self.source_result = self.source_result[1], None
        elif self.replay is not None and manifest_effect == "read" and \
                (recorded := self.replay.read(call.name, call.arguments)) is not None:
            text = recorded  # nothing it reads changed since the checkpoint (agent.replay)
            self.replay.reused += 1
        else:
            if self.replay is not None and manifest_effect == "write":
                self.replay.wrote = True
            text = self._call(call_artifact, call)
        self._checkpoint("turn")
        self._append("observation", artifact_id("obs", self.step + 1), text, parents=[call_artifact],
                     answers=call_artifact, meta={"tool": call.name})

    def _call_error(self, call_artifact: str) -> str | None:
        for block in reversed(self.blocks):
            for (cid, _), error in zip(block.calls, block.errors or [None] * len(block.calls), strict=True):
                if cid == call_artifact:
                    return error
        return None

    def _call(self, call_artifact: str, call: ToolStep) -> str:
        call_id = f"{self.branch or 'live'}/{call_artifact}"
        try:
            result = self.client.call(self.session_id, call.name, call.arguments, call_id=call_id,
                                      clock=self.ctx.clock(self.step, self.turn), mode=self.mode,
                                      turn=self.turn, branch=self.branch)
        except RemoteError as exc:
            return f"error {exc.wire_code}: {exc.message}"
        self.calls_made.append(result)
        # A simulated answer is what the counterfactual run would have read from the world.
        if result.state != "done" and not result.simulated:
            return f"[{result.state}] {result.stdout}"
        return result.stdout if result.exit_code == 0 else f"exit {result.exit_code}\n{result.stdout}{result.stderr}"

    def effect(self, tool: str) -> str:
        """The effect class of a tool, as the daemon's manifests declare it."""
        if self._effects is None:
            self._effects = {t.name: t.effect for t in self.client.tools(self.session_id)}
        return self._effects.get(tool, "write")

    # Blocks, artifacts, checkpoints ------------------------------------------------------------

    def _append(self, kind: str, aid: str, text: str, parents: list[str], **extra: Any) -> None:
        assert self.conversation is not None
        meta = extra.pop("meta", {})
        span = self.conversation.add(kind, text, tool=meta.get("tool"), call_id=extra.get("answers"))
        block = Block(artifact_id=aid, type=kind, text=text, span=span, **extra)
        self.blocks.append(block)
        self._record(aid, kind, text, parents, span, meta=meta)
        if self.echo is not None:
            self.echo(block)

    def _record(self, aid: str, kind: str, text: str, parents: list[str], span: tuple[int, int] | None,
                meta: dict[str, Any] | None = None) -> None:
        self._outbox.append(p.Artifact(
            artifact_id=aid, type=kind, parents=parents, token_span=span, turn=self.turn,  # type: ignore[arg-type]
            step=self.step, committed=not self.branch, content=text, meta=meta or {}))

    def flush(self) -> None:
        """Send buffered artifacts to the daemon."""
        if self._outbox:
            self.client.record_artifacts(self.session_id, self._outbox, branch=self.branch)
            self._outbox = []

    def _checkpoint(self, reason: str) -> p.CheckpointRecord:
        self.flush()
        assert self.conversation is not None
        cp = self.conversation.checkpoint()
        record = p.CheckpointRecord(
            checkpoint_id=f"cp-{self.step}-{self.turn}-{reason}-{len(self.blocks)}", step=self.step, turn=self.turn,
            token_offset=cp.offset, cache_handle=cp.cache_handle, reason=reason,  # type: ignore[arg-type]
            manifest=[b.artifact_id for b in self.blocks])
        return self.client.checkpoint(self.session_id, record, branch=self.branch)

    # Resuming ----------------------------------------------------------------------------------

    def context_of(self, checkpoint: p.CheckpointRecord) -> list[p.Artifact]:
        """The blocks of a checkpoint's manifest, as recorded: from this session's own blocks, or, for an agent
        that does not hold them (a new process), from the daemon's graph."""
        held = {b.artifact_id: b for b in self.blocks}
        if all(aid in held for aid in checkpoint.manifest):
            return [artifact_of(held[aid]) for aid in checkpoint.manifest]
        recorded = {a.artifact_id: a for a in self.client.graph(self.session_id).artifacts}
        return [recorded[aid] for aid in checkpoint.manifest]

    def reattach(self, inputs: Iterable[Exogenous] = ()) -> p.CheckpointRecord:
        """Pick the session up where the daemon's record of it ends (after a rollback: the rollback's point,
        its latest checkpoint) with that checkpoint's context; `inputs` are what the agent has still to do."""
        self._outbox = []  # what was not recorded yet belongs to the history the daemon no longer holds
        point = max(self.client.graph(self.session_id).checkpoints, key=lambda c: c.created_at)
        self.resume(point, self.context_of(point), inputs)
        return point

    def resume(self, checkpoint: p.CheckpointRecord, context: list[p.Artifact], inputs: Iterable[Exogenous]) -> None:
        """Restore the model cache and the blocks to a checkpoint; queue the inputs that follow it."""
        self._setup()
        assert self.conversation is not None
        point = Checkpoint(offset=checkpoint.token_offset, cache_handle=checkpoint.cache_handle)
        blocks = [block_of(a, self._parse) for a in context]
        try:
            self.conversation.restore(point, len(context))
        except CheckpointInvalid:
            self._rebuild(point, blocks)
        self.blocks = blocks
        self._steps_before = checkpoint.step - sum(1 for b in blocks if b.type in p.OBSERVATION_TYPES)
        self._turns_before = checkpoint.turn - sum(1 for b in blocks if b.type in ("model_turn", "summary"))
        self.queue = collections.deque(inputs)

    def _rebuild(self, point: Checkpoint, blocks: list[Block]) -> None:
        """A checkpoint the cache no longer holds (an earlier task's, under the `task` policy): crop back to
        the system prompt and memories and prefill the manifest's blocks, model turns as recorded; the
        result must be the checkpoint's very tokens (its handle), else the restore fails as before."""
        assert self.conversation is not None
        lead = next((i for i, b in enumerate(blocks) if b.type not in ("system", "memory")), len(blocks))
        for keep in ((lead, blocks[lead - 1].span[1]) if lead else (0, 0), (0, 0)):
            if keep[1] > len(self.conversation):
                continue
            self.conversation.crop(keep[1], keep[0])
            for block in blocks[keep[0]:]:
                if block.type in ("model_turn", "summary"):
                    span = self.conversation.replay_turn(block.text, None)
                    assert span is not None, "this conversation cannot prefill a recorded turn"
                    self.conversation.close_turn(block.text, [], "")
                else:
                    tool = next((c.name for b in blocks for cid, c in b.calls if cid == block.answers), None)
                    span = self.conversation.add(block.type, block.text, tool=tool, call_id=block.answers)
                block.span = span
            if self.conversation.checkpoint() == point:
                return
        raise CheckpointInvalid(point.offset, "the recorded blocks do not rebuild the checkpoint's tokens")


def artifact_of(block: Block) -> p.Artifact:
    """The recorded shape of a context block (what `block_of` reads back)."""
    parents = [block.answers] if block.answers else [block.injects] if block.injects else []
    return p.Artifact(artifact_id=block.artifact_id, type=block.type, parents=parents,  # type: ignore[arg-type]
                      token_span=block.span, content=block.text)


def block_of(artifact: p.Artifact, parse: Any = None) -> Block:
    """The context block a recorded artifact was, rebuilt for a resumed session."""
    assert artifact.token_span is not None, f"{artifact.artifact_id} is not a context block"
    block = Block(artifact_id=artifact.artifact_id, type=artifact.type, text=artifact.content,
                  span=artifact.token_span)
    if artifact.type == "model_turn":
        turn = artifact.artifact_id.split("-")[1]
        parsed: ParsedTurn = (parse or ToolCallParser("json", []).parse)(artifact.content)
        block.calls = [(f"call-{turn}-{k}", call) for k, call in enumerate(parsed.calls)]
        block.errors, block.reply, block.plan = parsed.errors, parsed.answer, parsed.plan
    elif artifact.type == "observation":
        block.answers = artifact.parents[0] if artifact.parents else None
    elif artifact.type == "memory" and artifact.parents:
        block.injects = artifact.parents[0]
    return block
