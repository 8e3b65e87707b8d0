"""The paper's baselines, each a revocation strategy behind one interface, applied to the same recorded session.

The original session is the scenario run in world A (deterministic: the scripted policy on the local
engine, a seeded context), hijacked by the injected input and flagged by the daemon's detector.
Methods that only read it (B0, B1, B3, B4, B5', B6, B8) share one run; B2 and B7 change a session and
get a fresh copy each (B9 reads B7's). The references run in world B. What each method ends with:

- B0 no-op: the original state, unchanged.
- B1 delete the persistent record: the daemon's copy of the source observation is dropped from the
  record; the agent's answer, summaries, plans, context and cache are untouched.
- B2 instruct the model to forget: a user input ("Forget what the vendor page told you.", the pair's
  `forget_input`) is appended and the agent answers it; everything it held stays, plus the
  instruction and its reply.
- B3 redact the raw observation: z is excised from the source observation's text; derived artifacts
  (plans, tool calls, summaries, memories, later observations) are kept; the cache is re-prefilled
  from the edited block on; the sandbox is not touched.
- B4 amputate: every artifact of the taint closure I(z) is dropped from the context and the runtime
  artifacts; the cache is re-prefilled from the first dropped block on.
- B5 full reset: a fresh session in world B, from scratch, on o^{-z} (the reference).
- B5' prefix-cached full replay, run: a fresh copy of the original session replays the suffix from the
  splice checkpoint with certification off (`apply(..., certify=False)`): the cached prefix before tau
  is reused, model turns included, and every model turn of the suffix is decoded again; no read is
  answered from the record.
- B6 redact every artifact: every needle (z and its payload strings, known in advance) is removed
  from every block and artifact, model-authored ones included; the cache is re-prefilled.
- B7 this system: agent.revocation.apply on the detector's revocation (restore, replay the suffix).
- B8 information-flow control only: the session runs in world C, whose firewall refuses external
  calls carrying words of the flagged observation (`sandboxd.firewall.flow`); nothing is forgotten.
- B9 IFC plus replay: B8's session, then B7's revocation of it.

Why one module: the methods are the table of the paper's baselines, read side by side; each is a few
lines over the shared `PairContext`, and splitting them would scatter one comparison over files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from agent.eval.metrics import Artifact, FinalState, capture, leak_strings, render, state_of
from agent.harness import run_model_session, run_session
from agent.revocation import apply
from agent.runtime import END, ROLE, AgentSession, Block, Exogenous
from agent.scenario import Copy, Obey, Scenario
from sandboxd import protocol as p
from sandboxd.client import Client


class NotExposed(RuntimeError):
    """A model-driven session never read the pair's injection: no method has anything to forget."""


class MethodResult(msgspec.Struct, kw_only=True):
    """A method's final state, what it cost, and the session whose world its state belongs to."""

    method: str
    state: FinalState
    tokens_recomputed: int = 0
    fired_twice: int = 0
    blocked_sinks: int = 0
    blocked: list[list[str]] = []
    """(tool, JSON arguments) of the calls flow control refused (B8, B9)."""
    session: AgentSession | None = None
    """The session whose world is the method's world."""
    report: p.RevocationReport | None = None
    wall_s: float = 0.0
    """Wall time of the method's own work (B5: its whole run; B7: the revocation; not the original run)."""


class Reference(msgspec.Struct, kw_only=True):
    """B5's run: its final state, its blocks, the tokens it recomputed and its session."""

    state: FinalState
    blocks: list[Block]
    tokens: int
    session: AgentSession
    wall_s: float


class PairContext:
    """One (user task, injection) pair: both worlds, the scenario, the target and the runs methods share.

    Methods that only read a session share one original run; methods that change it (B2 appends an
    input, B7 replays) get a fresh one. The target is the pair's, or, when a pair leaves it to the
    detector, the span the detector flagged in the original's source observation.
    """

    def __init__(self, world_a: Client, world_b: Client, pair: PairLike, world_c: Client | None = None) -> None:
        self.world_a, self.world_b, self.pair = world_a, world_b, pair
        self.world_c = world_c
        self.scenario, self.files = pair.scenario, pair.files
        self._target = pair.target
        self._reference: Reference | None = None
        self._shared: AgentSession | None = None
        self.revoked: tuple[AgentSession, p.RevocationReport, float] | None = None
        self.tau: int | None = None
        self._opened: list[tuple[Client, str]] = []
        self.model = False
        """True: the fixture model plays the sessions (free generation), not the scripted policy."""

    @property
    def target(self) -> str:
        if self._target is None:
            self.original(fresh=False)
        assert self._target is not None
        return self._target

    @property
    def needles(self) -> list[str]:
        return leak_strings(self.target, self.pair.payloads)

    def _run(self, client: Client, forget: list[str] | None = None) -> AgentSession:
        if self.model:
            scenario = msgspec.structs.replace(self.scenario, compact_every=0)
            agent = run_model_session(client, scenario, self.files, forget=forget, setup=self.pair.setup)
            self._opened.append((client, agent.session_id))
            return agent
        agent = run_session(client, self.scenario, self.files, forget=forget, setup=self.pair.setup,
                            obey=self.pair.obey, copy=self.pair.copy)
        self._opened.append((client, agent.session_id))
        return agent

    def flow_controlled(self) -> AgentSession:
        """The session run again in world C, whose firewall blocks external calls carrying flagged text."""
        if self.world_c is None:
            raise RuntimeError("B8 and B9 need world C, a daemon with [firewall] flow_control = true")
        return self._run(self.world_c)

    def original(self, fresh: bool = True) -> AgentSession:
        """The recorded session in world A (hijacked, flagged by the detector): shared, or a fresh copy."""
        if not fresh and self._shared is not None:
            return self._shared
        agent = self._run(self.world_a)
        if self._target is None:
            _, source = self.revocation(agent)
            text = next(b.text for b in agent.blocks if b.artifact_id == source)
            self._target = self.pair.flag(text)
        if not fresh:
            self._shared = agent
        return agent

    def revocation(self, agent: AgentSession) -> tuple[str, str]:
        """(revocation id, source artifact) of the detector's first pending revocation of this session, or,
        for a withdrawn input, of the operator's revocation of the observation that carried it.

        An injection read twice is flagged twice; the first is the one to revoke (the replay's results
        are sanitized of it, and the later flags' sources are part of the suffix the replay discards).
        """
        pending = agent.client.pending_revocations(agent.session_id)
        if not pending and self.pair.withdrawn:
            source = next((b.artifact_id for b in agent.blocks if b.type == "observation" and self.target in b.text),
                          None)
            if source is None:
                raise RuntimeError("the withdrawn input was never read: no observation carries it")
            pending = [agent.client.revoke(agent.session_id, source, self.target).revocation]
        if not pending and self.model and not any(
                b.type == "observation" and any(n in b.text for n in self.pair.payloads) for b in agent.blocks):
            called = sorted({c.name for b in agent.blocks for _, c in b.calls})
            opening = next((b.text for b in agent.blocks if b.type == "model_turn"), "")
            raise NotExposed("the model never read the injection (no observation carries it), so there is nothing "
                             f"to revoke; the tools it called: {', '.join(called) or 'none'}; its first turn: "
                             f"{opening[:100]!r}")
        if not pending:
            raise RuntimeError("the detector raised no revocation: the injection was not flagged")
        first = min(pending, key=lambda r: r.tau)
        self.tau = first.tau
        return first.revocation_id, first.source

    def reference(self) -> Reference:
        """B5, run once per pair: a fresh session in world B that never sees z."""
        if self._reference is None:
            target = self.target
            started = time.perf_counter()
            ref = self._run(self.world_b, forget=[target])
            wall = time.perf_counter() - started
            assert ref.conversation is not None
            self._reference = Reference(state=capture(ref), blocks=list(ref.blocks),
                                        tokens=ref.conversation.meter.recomputed, session=ref, wall_s=wall)
        return self._reference

    def close(self) -> None:
        """Close every session this pair opened."""
        for client, session_id in self._opened:
            client.close_session(session_id)
        self._opened = []


class PairLike(Protocol):
    """What a method needs of a pair (see `agent.eval.runner.Pair`)."""

    name: str
    scenario: Scenario
    files: dict[str, str]
    target: str | None
    payloads: tuple[str, ...]
    forget_input: str
    withdrawn: bool
    setup: Callable[[Client, str], object] | None
    obey: Obey | None
    copy: Copy | None

    def flag(self, observation: str) -> str: ...


class Method(Protocol):
    """A revocation strategy: applied to a pair, it returns the state it ends with."""

    name: str

    def run(self, ctx: PairContext) -> MethodResult: ...


def prefill_cost(agent: AgentSession, blocks: Sequence[Block]) -> int:
    """Tokens a prefill of these blocks computes (role header, text, end marker each)."""
    backend = agent.backend
    return sum(len(backend.tokenize(ROLE[b.type] + END, specials=True)) + len(backend.tokenize(b.text))
               for b in blocks)


def edited(agent: AgentSession, edit_block: Callable[[Block], Block | None],
           edit_artifact: Callable[[Artifact], Artifact | None], name: str) -> MethodResult:
    """A state edit: blocks and artifacts rewritten or dropped, the cache re-prefilled from the first change."""
    before = capture(agent)
    blocks: list[Block] = []
    first_change: int | None = None
    for i, block in enumerate(agent.blocks):
        new = edit_block(block)
        if first_change is None and (new is None or new.text != block.text):
            first_change = i  # every block before it is kept as it was, so the kept prefix is the same length
        if new is not None:
            blocks.append(new)
    artifacts = [a for a in (edit_artifact(x) for x in before.artifacts) if a is not None]
    tokens = 0 if first_change is None else prefill_cost(agent, blocks[first_change:])
    state = state_of(blocks, artifacts, before.tree, render(blocks))
    return MethodResult(method=name, state=state, tokens_recomputed=tokens, session=agent)


def _redact(text: str, needles: Sequence[str]) -> str:
    for needle in needles:
        text = text.replace(needle, "")
    return text


class NoOp:
    """B0: nothing is done."""

    name = "B0"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original(fresh=False)
        return MethodResult(method=self.name, state=capture(agent), session=agent)


class DeleteRecord:
    """B1: the daemon's copy of the source observation is deleted; the agent's state is untouched."""

    name = "B1"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original(fresh=False)
        _, source = ctx.revocation(agent)
        state = capture(agent)
        state.record = [(aid, text) for aid, text in state.record if aid != source]
        return MethodResult(method=self.name, state=state, session=agent)


class InstructForget:
    """B2: the user tells the agent to forget; the agent answers and keeps everything it held."""

    name = "B2"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original()
        assert agent.conversation is not None
        before = agent.conversation.meter
        agent.queue.append(Exogenous(type="user", text=ctx.pair.forget_input))
        agent.run()
        used = agent.conversation.meter - before
        return MethodResult(method=self.name, state=capture(agent), tokens_recomputed=used.recomputed, session=agent)


class RedactObservation:
    """B3: z excised from the source observation only; derived artifacts kept."""

    name = "B3"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original(fresh=False)
        _, source = ctx.revocation(agent)

        def block(b: Block) -> Block:
            return msgspec.structs.replace(b, text=b.text.replace(ctx.target, "")) if b.artifact_id == source else b

        def artifact(a: Artifact) -> Artifact:
            return (a[0], a[1], a[2].replace(ctx.target, ""), a[3]) if a[0] == source else a

        return edited(agent, block, artifact, self.name)


class Amputate:
    """B4: every artifact of the taint closure dropped from the state."""

    name = "B4"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original(fresh=False)
        _, source = ctx.revocation(agent)
        closure = set(ctx.world_a.provenance(agent.session_id, source).taint_closure)
        return edited(agent, lambda b: None if b.artifact_id in closure else b,
                      lambda a: None if a[0] in closure else a, self.name)


class RedactAll:
    """B6: every needle string-replaced out of every block and artifact, model-authored ones included."""

    name = "B6"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original(fresh=False)
        return edited(agent, lambda b: msgspec.structs.replace(b, text=_redact(b.text, ctx.needles)),
                      lambda a: (a[0], a[1], _redact(a[2], ctx.needles), a[3]), self.name)


class FullReset:
    """B5: the reference, a fresh session from scratch on o^{-z} in world B."""

    name = "B5"

    def run(self, ctx: PairContext) -> MethodResult:
        ref = ctx.reference()
        return MethodResult(method=self.name, state=ref.state, tokens_recomputed=ref.tokens, session=ref.session,
                            wall_s=ref.wall_s)


class PrefixCachedReplay:
    """B5': the suffix replayed from the splice checkpoint with nothing taken from the record (run, not derived):
    the cached prefix before tau is reused, model turns included; every suffix turn is decoded again."""

    name = "B5'"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.original()
        revocation_id, _ = ctx.revocation(agent)
        started = time.perf_counter()
        report = apply(agent, revocation_id, certify=False)
        wall = time.perf_counter() - started
        return MethodResult(method=self.name, state=capture(agent), tokens_recomputed=report.tokens.recomputed,
                            fired_twice=int(report.calls.get("fired_twice", 0)), session=agent, report=report,
                            wall_s=wall)


class Revocation:
    """B7: this system, agent.revocation.apply. With `ifc`, B9: the same on a session that ran under
    information-flow control (world C), so the hijack was blocked before the revocation replayed it away."""

    def __init__(self, name: str = "B7", ifc: bool = False) -> None:
        self.name, self.ifc = name, ifc

    def run(self, ctx: PairContext) -> MethodResult:
        if self.ifc:
            agent = ctx.flow_controlled()
            blocked = blocked_calls(agent)
            revocation_id, _ = ctx.revocation(agent)
            started = time.perf_counter()
            report = apply(agent, revocation_id)
            wall = time.perf_counter() - started
        else:
            if ctx.revoked is None:
                agent = ctx.original()
                revocation_id, _ = ctx.revocation(agent)
                started = time.perf_counter()
                ctx.revoked = (agent, apply(agent, revocation_id), time.perf_counter() - started)
            agent, report, wall = ctx.revoked
            blocked = []
        return MethodResult(method=self.name, state=capture(agent), tokens_recomputed=report.tokens.recomputed,
                            fired_twice=int(report.calls.get("fired_twice", 0)), blocked_sinks=len(blocked),
                            blocked=blocked, session=agent, report=report, wall_s=wall)


def blocked_calls(agent: AgentSession) -> list[list[str]]:
    """(tool, JSON arguments) of the tool calls the firewall's flow control refused in this session."""
    refused = {b.answers for b in agent.blocks if b.type == "observation" and b.text.startswith("error flow_blocked")}
    return [[call.name, json.dumps(call.arguments, sort_keys=True)]
            for b in agent.blocks if b.type == "model_turn" for cid, call in b.calls if cid in refused]


class FlowControl:
    """B8: information-flow control only: the session runs under a firewall that refuses external calls
    carrying flagged text; nothing is forgotten, the state keeps z."""

    name = "B8"

    def run(self, ctx: PairContext) -> MethodResult:
        agent = ctx.flow_controlled()
        blocked = blocked_calls(agent)
        return MethodResult(method=self.name, state=capture(agent), blocked_sinks=len(blocked), blocked=blocked,
                            session=agent)


def methods() -> dict[str, Method]:
    """Every method by name, in the paper's order."""
    made: list[Method] = [NoOp(), DeleteRecord(), InstructForget(), RedactObservation(), Amputate(), FullReset(),
                          PrefixCachedReplay(), RedactAll(), Revocation(), FlowControl(), Revocation("B9", ifc=True)]
    return {m.name: m for m in made}
