"""What the engine's scheduler sees (`policy.engine_schedule`): its queues and its KV occupancy,
as plain views; the waiting head only, which is all a plan can admit."""

from __future__ import annotations

from collections.abc import Sequence

from venusrl.engine.config import EngineConfig
from venusrl.engine.kv_manager import KVManager
from venusrl.engine.request import Request
from venusrl.policy.critical_groups import HIGH
from venusrl.policy.engine_schedule import EngineSnapshot, RequestView


def snapshot(
    running: Sequence[Request], waiting: Sequence[Request], cache: KVManager, cfg: EngineConfig
) -> EngineSnapshot:
    ps = cfg.page_size
    running_views = [
        RequestView(
            r.request_id,
            r.priority,
            r.arrival,
            r.num_computed,
            r.tokens_to_compute,
            pages_held=len(r.pages),
            pages_releasable=cache.releasable_pages(r),
        )
        for r in running
    ]
    prefilling = [r for r in running if r.tokens_to_compute > 1]
    waiting_views = []
    for r in waiting[: 2 * cfg.max_running]:
        on_device, on_host, idle = cache.cached_prefix(r)
        cached = (on_device + on_host) * ps
        key, in_flight = None, False
        if cfg.prefix_cache and r.num_tokens - cached > ps:
            head = r.all_ids[: cached + ps]
            key = (r.namespace, tuple(head))
            in_flight = any(
                o.namespace == r.namespace
                and o.num_computed <= cached
                and o.all_ids[: cached + ps] == head
                for o in prefilling
            )
        waiting_views.append(
            RequestView(
                r.request_id,
                r.priority,
                r.arrival,
                cached,
                r.num_tokens - cached,
                pages_held=on_device,  # host pages need device pages to load into
                pages_releasable=0,
                pages_idle=idle,
                prefix_key=key,
                prefix_in_flight=in_flight,
            )
        )
    return EngineSnapshot(
        running=running_views,
        waiting=waiting_views,
        free_pages=cache.free_pages(),
        page_size=ps,
        token_budget=cfg.token_budget,
        max_running=cfg.max_running,
        reserved_pages=cache.reserved_pages(running_views, waiting_views),
        reserve_priority=HIGH,
    )
