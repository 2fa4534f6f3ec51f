"""Drives an `Engine` from a background thread for asyncio callers (the HTTP server, agents).

The engine is single-threaded by design: only the engine thread touches it. Callers submit
commands (add a request, abort, update weights) that run between two steps, and receive tokens
through an asyncio queue per request. Torch releases the GIL inside its kernels, so the event
loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from venusrl.engine.engine import Engine
from venusrl.engine.request import Request
from venusrl.policy.engine_schedule import RETRY_AFTER_S
from venusrl.types import GenerationOutput, SamplingParams, TopLogprobs, TurnMeta

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of a running request; `output` is set on the last delta. `top_logprobs` has one
    entry per token when the request asks for them, none otherwise."""

    token_ids: list[int]
    logprobs: list[float]
    output: GenerationOutput | None = None
    top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass
class _Listener:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenDelta | BaseException]
    request: Request
    sent: int = 0


class EngineClosed(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()
        self._listeners: dict[str, _Listener] = {}
        self._thread = threading.Thread(target=self._run, name="venusrl-engine", daemon=True)

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # -- caller side (any event loop) ---------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(command)
        return await future

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        meta: TurnMeta | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Yield tokens as they are produced; the last delta carries the whole output."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        # Named here, so that a caller cancelled even before the engine saw the request can
        # still abort it.
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        arrived = self.engine.clock()  # before it queues for the engine thread

        def add(engine: Engine) -> None:
            r = engine.add_request(
                prompt_ids, params, meta, request_id=request_id, arrived_at=arrived
            )
            self._listeners[r.request_id] = _Listener(loop, deltas, r)

        done = False
        added = True  # until the engine refuses it: a caller cancelled meanwhile still aborts
        try:
            try:
                await self.call(add)
            except Exception:
                added = False  # refused (its id may be another request's): nothing to abort
                raise
            while True:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                done = item.output is not None
                yield item
                if done:
                    return
        finally:
            # The caller went away: stop wasting compute.
            if added and not done and not self._stopped:
                self._submit(lambda: self._abort(request_id))

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        meta: TurnMeta | None = None,
        request_id: str | None = None,
    ) -> GenerationOutput:
        async for delta in self.stream(prompt_ids, params, meta, request_id):
            if delta.output is not None:
                return delta.output
        raise EngineClosed("engine stopped before the request finished")

    # -- engine thread ------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:  # so that no command slips in after the thread's final drain
            if self._stopped:
                raise EngineClosed("the engine is stopped")
            self._commands.put(command)
        self._wake.set()

    def _abort(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)
        if self.engine.abort(request_id):
            self.engine.pop_finished(request_id)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _run(self) -> None:
        while not self._stopped:
            self._run_commands()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            steps = self.engine.stats.steps
            try:
                finished = self.engine.step()
            except Exception as e:  # an engine bug must not hang every client
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(e)
                continue
            self._publish({r.request_id for r in finished})
            if self.engine.stats.steps == steps:  # nothing could run: do not spin
                self._wake.wait(timeout=RETRY_AFTER_S)
                self._wake.clear()
        self._run_commands()  # callers waiting on a command get an answer, not a hang
        self._fail_all(EngineClosed("the engine stopped"))

    def _publish(self, finished: set[str]) -> None:
        for request_id, listener in list(self._listeners.items()):
            r = listener.request
            new = len(r.output_ids) - listener.sent
            if new <= 0 and request_id not in finished:
                continue
            output = None
            if request_id in finished:
                output = self.engine.pop_finished(request_id)
                del self._listeners[request_id]
            delta = TokenDelta(
                r.output_ids[listener.sent :],
                r.output_logprobs[listener.sent :],
                output,
                r.output_top_logprobs[listener.sent :],
            )
            listener.sent = len(r.output_ids)
            listener.loop.call_soon_threadsafe(listener.queue.put_nowait, delta)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, listener in list(self._listeners.items()):
            if self.engine.abort(request_id):
                self.engine.pop_finished(request_id)
            listener.loop.call_soon_threadsafe(listener.queue.put_nowait, error)
        self._listeners.clear()


def _set_result(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
