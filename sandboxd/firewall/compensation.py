"""Compensations: the undo a tool declares for a fired effect that a rollback orphaned, run exactly once.

A sent email cannot be unsent, but a webhook's far side may offer an undo URL (the saga pattern). A tool's
manifest names its compensating action (`ToolManifest.compensation`); an operator runs it for one orphaned
call (`sandboxd compensate CALL`, or `rollback --compensate` for all of them). It runs through the ledger
like any effect: its own ledger row, `cmp-<call id>`, is made durable (state `intent`) before anything is
sent, so a second request is answered from the record, a crash mid-send leaves it `unknown` (never sent
again by itself), and only a certain failure (`failed`) may be tried again.

Rejected: marking the orphaned call itself `compensated` in place of a row of its own. Its state must stay
`orphaned`, which is what the rollback left it, and the compensation needs states of its own (in flight,
unknown, failed) that the original's history would then have to carry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sandboxd.errors import CallUnknown, EffectFailed, InvalidArguments, InvalidState, NotFound
from sandboxd.firewall.adapters import EffectAdapter, EffectNotDelivered, EffectOutcomeUnknown
from sandboxd.firewall.ledger import IN_FLIGHT_STATES, CallRecord, Ledger

PREFIX = "cmp-"


def compensation_id(call_id: str) -> str:
    """The ledger id of the compensation of `call_id`: one per call, so it can run only once."""
    return PREFIX + call_id


class Compensator:
    """Runs declared compensations through the ledger."""

    def __init__(self, ledger: Ledger, adapter_of: Callable[[str], EffectAdapter], lock: threading.RLock) -> None:
        self.ledger = ledger
        self.adapter_of = adapter_of
        self.lock = lock
        self._in_flight: set[str] = set()

    def declared(self, tool: str) -> str | None:
        """The compensating action a tool declares, if the tool is still served."""
        try:
            return self.adapter_of(tool).manifest.compensation
        except Exception:  # noqa: BLE001 - a tool no longer configured declares nothing
            return None

    def get(self, call_id: str) -> CallRecord | None:
        """The compensation of `call_id`, if it was ever asked for."""
        return self.ledger.get(compensation_id(call_id))

    def undone(self, call_id: str) -> bool:
        """Whether the effect of `call_id` was compensated (its compensation is done)."""
        record = self.get(call_id)
        return record is not None and record.state == "done"

    def of_session(self, session_id: str) -> list[CallRecord]:
        return self.ledger.of_session_like(session_id, PREFIX + "%")

    def run(self, call_id: str) -> tuple[CallRecord, bool]:
        """Compensate one orphaned call; returns the compensation's record and whether it ran just now
        (False: it had run before and its record answers)."""
        original = self.ledger.get(call_id)
        if original is None or call_id.startswith(PREFIX):
            raise NotFound(f"no external call {call_id!r} in the ledger", call_id=call_id)
        adapter = self.adapter_of(original.tool)
        if adapter.manifest.compensation is None:
            raise InvalidArguments("compensate", f"{original.tool} declares no compensating action: call {call_id} "
                                   "cannot be compensated by the daemon (undo it by hand, then nothing more is "
                                   "needed)", "$.call_id")
        cid = compensation_id(call_id)
        with self.ledger.transaction():
            if original.state != "orphaned":
                raise InvalidState(call_id, original.state, "orphaned", "only an effect a rollback or revocation "
                                   "orphaned is compensated")
            record = self.ledger.get(cid)
            if record is not None and record.state == "done":
                return record, False
            if record is not None and record.state == "unknown":
                raise CallUnknown(cid)
            if record is not None and (record.state in IN_FLIGHT_STATES or cid in self._in_flight):
                raise InvalidState(cid, record.state, "done", "the compensation is running now")
            if record is None:
                self.ledger.insert_call(CallRecord(
                    call_id=cid, tool=original.tool, state="intent", session_id=original.session_id,
                    lineage=original.lineage, branch=original.branch, occurrence=0,
                    intent_key=f"compensate:{call_id}", intent={"compensates": call_id}, args=original.args,
                    policy="immediate", turn=original.turn))
            else:  # failed before: certainly never happened, so it may be tried again
                self.ledger.transition(cid, "intent", ("failed",), note="compensation tried again")
            self.ledger.transition(cid, "fired", ("intent",), count_attempt=True, note=f"compensates {call_id}")
            self._in_flight.add(cid)
        try:
            result = adapter.compensate(original.args, call_id, cid)
        except (EffectNotDelivered, EffectOutcomeUnknown) as exc:
            state = "failed" if isinstance(exc, EffectNotDelivered) else "unknown"
            self._settle(cid, state, error=exc.reason)
            raise EffectFailed(cid, exc.reason, state) from exc
        except BaseException as exc:
            self._settle(cid, "unknown", error=f"adapter raised {type(exc).__name__}: {exc}")
            raise
        finally:
            with self.lock:
                self._in_flight.discard(cid)
        self._settle(cid, "done", result=result)
        done = self.ledger.get(cid)
        assert done is not None
        return done, True

    def _settle(self, cid: str, state: str, result: dict[str, Any] | None = None, error: str | None = None) -> None:
        with self.ledger.transaction():
            self.ledger.transition(cid, state, ("fired",), result=result, error=error)  # type: ignore[arg-type]
