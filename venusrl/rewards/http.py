"""The client of a reward service: bounded in-flight requests, retries with backoff, a breaker.

Shared by the remote reward and the judge model. A request that gets no answer, a 5xx or 429, or
an answer `parse` refuses is sent again (`retries` times, waiting `backoff_s` doubling, or what a
Retry-After asks); each counts against the circuit breaker. A 4xx other than 429 is our request's
fault: not sent again, and not counted against the service's health. Every failure is a
`RewardUnavailable` naming the service and what it answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from venusrl.rewards.breaker import CircuitBreaker
from venusrl.rewards.config import ServiceConfig
from venusrl.rewards.pool import RewardUnavailable

T = TypeVar("T")
MAX_RETRY_AFTER_S = 30.0  # a Retry-After longer than this waits this long


class ServiceClient:
    def __init__(self, config: ServiceConfig) -> None:
        if config.url is None:
            raise ValueError("a reward service needs reward.service.url")
        self.config, self.url = config, config.url
        headers = {"Content-Type": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(
                    f"reward.service.api_key_env={config.api_key_env}: that variable is not set"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.AsyncClient(timeout=config.request_timeout_s, headers=headers)
        self.in_flight = asyncio.Semaphore(config.max_in_flight)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.requests = self.failures = 0

    async def post(self, path: str, body: dict[str, Any], parse: Callable[[Any], T]) -> T:
        """`parse` of the service's JSON answer to `body` at `path`; it raises ValueError,
        KeyError or TypeError for an answer that is not what it wants."""
        url = self.url + path
        content = json.dumps(body, default=str).encode()
        c = self.config
        problem, retry_after = "", None
        for attempt in range(c.retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt, retry_after))
                retry_after = None
            await self._circuit_closed()
            self.requests += 1
            try:
                async with self.in_flight, asyncio.timeout(c.request_timeout_s):
                    response = await self.http.post(url, content=content)
            except (httpx.HTTPError, TimeoutError) as e:
                problem = f"no answer ({type(e).__name__}: {e})"
                self._failed()
                continue
            except BaseException:  # cancelled, or a bug: no verdict on the service
                self.breaker.abandoned()
                raise
            if response.status_code == 429 or response.status_code >= 500:
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
                retry_after = response.headers.get("Retry-After")
                self._failed()
                continue
            if response.status_code >= 400:  # our request is wrong: no retry helps
                self.breaker.succeeded()  # the service answered
                raise RewardUnavailable(
                    f"{url} refused the request: HTTP {response.status_code}: {response.text[:200]}"
                )
            try:
                value = parse(response.json())
            except (ValueError, KeyError, TypeError, IndexError) as e:
                problem = f"an answer that is not one ({e}): {response.text[:200]}"
                self._failed()
                continue
            self.breaker.succeeded()
            return value
        raise RewardUnavailable(f"{url}: {c.retries + 1} tries failed, the last with {problem}")

    async def close(self) -> None:
        await self.http.aclose()

    def _backoff(self, attempt: int, retry_after: str | None) -> float:
        wait = self.config.backoff_s * 2 ** (attempt - 1)
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP date: the doubling backoff stands
                wait = min(max(float(retry_after), 0.0), MAX_RETRY_AFTER_S)
        return wait

    def _failed(self) -> None:
        self.failures += 1
        self.breaker.failed(time.monotonic())

    async def _circuit_closed(self) -> None:
        while (wait := self.breaker.wait_s(time.monotonic())) > 0:
            await asyncio.sleep(wait)
