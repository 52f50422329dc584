"""Sessions: multi-turn conversations whose history stays in the engine between turns.

SGLang's `open_session` / `session_params`. A session is a tree of turns. A turn continues an
earlier one (by default the last that finished), so its prompt is that turn's whole history,
prompt and output, then the new input; the scheduler keeps every finished turn's KV pinned
(runtime/scheduler/session_pins.py), so the history is found in the prefix cache instead of
being recomputed. What `session_params` may say:

- `rid`: the turn to continue (a finished request of this session); default: the last one.
- `offset`: keep only that turn's first `offset` history tokens (negative: drop that many
  from its end), then append the new input: a rewind.
- `drop_previous_output`: continue from that turn's prompt, without its output.
- `replace`: the turns that continued from the same turn before (and theirs) are forgotten,
  and their KV released: the new turn replaces those branches.

A session holds at most MAX_TURNS finished turns, all sessions together at most
MAX_STORED_TOKENS tokens of history (a session's oldest turns are forgotten first; a turn that
still does not fit is not kept), and a turn's prompt at most `capacity_of_str_len` tokens.
Each opening of a session has its own key for the scheduler, so a session closed and opened
again under the same id shares nothing with its old self, not even a turn that was running.
"""

from __future__ import annotations

import itertools
import math
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from runtime.frontend.outbox import Outbox
from runtime.protocol import SessionParams
from runtime.wire.messages import AddRequest, OpenSession, ReleaseTurns

MAX_TURNS = 256
MAX_STORED_TOKENS = 2**24  # of all sessions' histories: 128 MiB as 8-byte integers


@dataclass(frozen=True, slots=True)
class Turn:
    request_id: str  # the engine's id for it: the scheduler pins its KV under it
    history: array[int]  # prompt, then output
    prompt_len: int
    parent: str | None  # the caller's rid of the turn it continued


@dataclass(slots=True)
class Session:
    session_id: str
    key: str  # this opening's, for the scheduler
    capacity: int
    timeout: float  # idle seconds before it closes by itself (inf: never)
    turns: dict[str, Turn] = field(default_factory=dict)  # finished turns by caller's rid
    running: dict[str, str | None] = field(default_factory=dict)  # rid -> parent, running
    last: str | None = None
    idle_since: float = 0.0

    def expires_at(self) -> float:
        return math.inf if self.running else self.idle_since + self.timeout


class SessionBook:
    """Every open session's turns: what a new turn's prompt is, and what ending it keeps."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._openings = itertools.count()
        self.stored_tokens = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(
        self, capacity: int, session_id: str | None, timeout: float | None, now: float
    ) -> Session:
        if session_id is not None and session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        if len(self._sessions) >= self.max_sessions:
            raise ValueError(f"{self.max_sessions} sessions are open: close one first")
        if capacity < 1:
            raise ValueError(f"capacity_of_str_len must be >= 1, not {capacity}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        session_id = session_id or uuid.uuid4().hex
        key = f"{session_id}#{next(self._openings)}"
        session = Session(session_id, key, capacity, timeout or math.inf, idle_since=now)
        self._sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ValueError(f"no open session {session_id!r}")
        return session

    def close(self, session_id: str) -> Session:
        session = self._sessions.pop(self.get(session_id).session_id)
        self.stored_tokens -= sum(len(t.history) for t in session.turns.values())
        return session

    def is_open(self, session: Session) -> bool:
        return self._sessions.get(session.session_id) is session

    def prompt(
        self, params: SessionParams, rid: str, input_ids: Sequence[int], bos: int | None
    ) -> tuple[tuple[int, ...], Session, str | None]:
        """The prompt of a new turn `rid`, its session, and the turn it continues; ValueError
        if the session cannot take it. Nothing changes until `start`."""
        session = self.get(params.id)
        if rid in session.turns or rid in session.running:
            raise ValueError(f"rid {rid!r} already names a turn of session {params.id!r}")
        parent = params.rid if params.rid is not None else session.last
        history = self._history(session, parent, params)
        if history and bos is not None and list(input_ids[:1]) == [bos]:
            input_ids = input_ids[1:]  # the new input continues a text: no second BOS
        prompt = (*history, *input_ids)
        if not prompt:
            raise ValueError("the turn's prompt is empty")
        if len(prompt) > session.capacity:
            raise ValueError(
                f"the turn's prompt has {len(prompt)} tokens, over the session's "
                f"capacity_of_str_len of {session.capacity}"
            )
        return prompt, session, parent

    def start(
        self, session: Session, params: SessionParams, rid: str, parent: str | None
    ) -> list[str]:
        """The turn runs: with `replace`, the engine ids of the turns it replaces. (A session
        closed since `prompt` keeps nothing: the turn runs as a plain request.)"""
        if not self.is_open(session):
            return []
        replaced = self._descendants(session, parent) if params.replace else []
        session.running[rid] = parent
        if session.last in replaced:
            session.last = parent
        return [self._forget(session, old) for old in replaced]

    def _forget(self, session: Session, rid: str) -> str:
        """Drop a finished turn; the engine id whose KV to release."""
        turn = session.turns.pop(rid)
        self.stored_tokens -= len(turn.history)
        return turn.request_id

    def _history(self, session: Session, parent: str | None, params: SessionParams) -> list[int]:
        if parent is None:
            return []
        turn = session.turns.get(parent)
        if turn is None:
            state = "has not finished" if parent in session.running else "is not a turn"
            raise ValueError(f"request {parent!r} {state} of session {params.id!r}")
        kept = turn.prompt_len if params.drop_previous_output else len(turn.history)
        history = turn.history[:kept].tolist()
        if params.offset:
            if not -len(history) <= params.offset <= len(history):
                raise ValueError(
                    f"offset {params.offset} is outside the {len(history)} tokens of the "
                    f"history of {parent!r}"
                )
            history = history[: params.offset]
        return history

    def _descendants(self, session: Session, parent: str | None) -> list[str]:
        found: list[str] = []
        frontier = {parent}
        while frontier:
            children = [rid for rid, t in session.turns.items() if t.parent in frontier]
            found += children
            frontier = set(children)
        return found

    def ended(self, session: Session, rid: str, turn: Turn | None, now: float) -> list[str] | None:
        """A turn ended (`turn` None if it did not finish); the engine ids whose KV to
        release (its own, if it is not kept), or None if the session is gone."""
        if not self.is_open(session):
            return None
        session.running.pop(rid, None)
        session.idle_since = now
        if turn is None:
            return []
        forgotten = []
        size = len(turn.history)
        while session.turns and (
            len(session.turns) >= MAX_TURNS or self.stored_tokens + size > MAX_STORED_TOKENS
        ):
            oldest = next(iter(session.turns))
            if session.last == oldest:
                session.last = None
            forgotten.append(self._forget(session, oldest))
        if self.stored_tokens + size > MAX_STORED_TOKENS:
            return [*forgotten, turn.request_id]  # no room even alone: not kept
        session.turns[rid] = turn
        self.stored_tokens += size
        session.last = rid
        return forgotten

    def expired(self, now: float) -> list[str]:
        return [s.session_id for s in self._sessions.values() if s.expires_at() <= now]

    def next_expiry(self) -> float:
        return min((s.expires_at() for s in self._sessions.values()), default=math.inf)


SessionTurn = tuple[Session, SessionParams, "str | None"]  # a request's session, and parent


class Sessions:
    """The engine's sessions: the book of their turns, and what the scheduler must hear of
    them (a session opened, turns whose KV it may release), queued in order with requests."""

    def __init__(self, max_sessions: int, outbox: Outbox) -> None:
        self.book = SessionBook(max_sessions)
        self._outbox = outbox
        self._changed = trio.Event()

    def open(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> str:
        session = self.book.open(capacity_of_str_len, session_id, timeout, trio.current_time())
        self._outbox.send_after(OpenSession(session.key))  # before any of its turns
        self._changed.set()
        return session.session_id

    def close(self, session_id: str) -> None:
        session = self.book.close(session_id)
        self._outbox.send_after(ReleaseTurns(session.key, (), True))

    def prompt(
        self, params: SessionParams, rid: str, input_ids: Sequence[int], bos: int | None
    ) -> tuple[tuple[int, ...], SessionTurn]:
        """A turn's whole prompt (the history it continues, then `input_ids`) and the turn."""
        prompt, session, parent = self.book.prompt(params, rid, input_ids, bos)
        return prompt, (session, params, parent)

    def start_turn(self, turn: SessionTurn, rid: str) -> None:
        session, params, parent = turn
        replaced = self.book.start(session, params, rid, parent)
        if replaced:
            self._outbox.send_after(ReleaseTurns(session.key, tuple(replaced), False))

    def end_turn(
        self,
        turn: SessionTurn,
        rid: str,
        add: AddRequest,
        output: list[int],
        finish_reason: str | None,
    ) -> None:
        """Keep a turn that finished ("stop", "length"); let the scheduler drop any other."""
        session, _, parent = turn
        kept = None
        if finish_reason in ("stop", "length"):
            history = array("q", (*add.prompt_token_ids, *output))
            kept = Turn(add.rid, history, len(add.prompt_token_ids), parent)
        released = self.book.ended(session, rid, kept, trio.current_time())
        if released is None:
            return  # closed meanwhile: the scheduler released everything
        if kept is None:
            released.append(add.rid)
        if released:
            self._outbox.send_after(ReleaseTurns(session.key, tuple(released), False))
        self._changed.set()

    async def reap(self) -> None:
        """Close sessions idle past their timeout, for as long as the engine runs."""
        while True:
            with trio.move_on_at(self.book.next_expiry()) as waiting:
                await self._changed.wait()
                self._changed = trio.Event()
            if waiting.cancelled_caught:
                for session_id in self.book.expired(trio.current_time()):
                    self.close(session_id)
