"""Engine behaviours a user relies on: batching invariants, sharing, sampling, weights, errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TEST_DEVICE, write_hf_model
from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine, RequestError
from venusrl.engine.kv_cache import KVCache
from venusrl.model.architecture import ModelConfigError
from venusrl.model.directory import iter_safetensors
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PIN_S = 0.5  # `play_turns`' tool waits


def engine_for(model_dir: Path, **cfg: object) -> Engine:
    """On `VENUSRL_TEST_DEVICE` (the CPU unless benchmarks/gpu_check.sh says cuda)."""
    base: dict[str, object] = dict(page_size=4, device_kv_pages=256, device=str(TEST_DEVICE))
    base.update(cfg)
    return Engine.from_model_dir(model_dir, EngineConfig(**base))  # type: ignore[arg-type]


def engine_at(model_dir: Path, now: list[float], **cfg: object) -> Engine:
    """An engine whose clock reads `now[0]`: the test moves time by hand."""
    config = EngineConfig(**{"page_size": 4, "max_context": 150, **cfg})  # type: ignore[arg-type]
    return Engine(Engine.from_model_dir(model_dir).model, config, clock=lambda: now[0])


def drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()
        engine.check()


workloads = st.lists(
    st.tuples(
        st.integers(0, 2),  # which shared prefix
        st.lists(st.integers(2, 500), min_size=0, max_size=9),  # own suffix
        st.integers(1, 10),  # max tokens
        st.integers(0, 2),  # priority
    ),
    min_size=1,
    max_size=7,
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    workload=workloads,
    pool_pages=st.integers(16, 64),
    page_size=st.sampled_from([1, 4, 8]),
    budget=st.integers(8, 64),
    residency=st.sampled_from([None, 0.2]),
)
def test_outputs_do_not_depend_on_paging_caching_preemption_or_layer_residency(
    tiny_qwen3: Path,
    workload: list,
    pool_pages: int,
    page_size: int,
    budget: int,
    residency: float | None,
) -> None:
    prefixes = [list(range(100, 120)), list(range(200, 213)), [300]]
    prompts = [prefixes[i] + suffix for i, suffix, _, _ in workload]
    reference = engine_for(tiny_qwen3, prefix_cache=False, page_size=16, device_kv_pages=64)
    expected = [
        reference.generate([p], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))[0]
        for p, (_, _, m, _) in zip(prompts, workload, strict=True)
    ]
    engine = engine_for(
        tiny_qwen3,
        page_size=page_size,
        device_kv_pages=max(pool_pages, 64 // page_size + 1),
        token_budget=budget,
        max_context=64,
        layer_residency=residency,
        host_kv_pages=0 if residency is None else 64,
    )
    ids = [
        engine.add_request(
            p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), TurnMeta(priority=prio)
        ).request_id
        for p, (_, _, m, prio) in zip(prompts, workload, strict=True)
    ]
    drain(engine)
    for rid, exp in zip(ids, expected, strict=True):
        assert engine.pop_finished(rid).token_ids == exp.token_ids
    engine.flush_cache()
    engine.check()
    assert engine.cache.kv.device_pages.num_free == engine.cache.kv.device_pages.capacity
    assert engine.cache.kv.host_pages.num_free == engine.cache.kv.host_pages.capacity


def test_grpo_siblings_compute_their_shared_prompt_once(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3, page_size=4, token_budget=64)
    prompt = list(range(100, 181))  # 81 tokens, 20 whole pages
    for _ in range(8):
        engine.add_request(prompt, GREEDY)
    drain(engine)
    # The first sibling computes 81 tokens; each other one only the last partial page (1 token).
    assert engine.stats.cached_prompt_tokens == 7 * 80
    assert engine.stats.prefix_hit_ratio == pytest.approx(7 * 80 / (8 * 81))


def test_seeded_sampling_does_not_depend_on_batch_composition(tiny_qwen3: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = engine_for(tiny_qwen3).generate([[5, 6, 7]], params)[0]
    crowded = engine_for(tiny_qwen3).generate(
        [[9, 9, 9, 9], [5, 6, 7], list(range(40, 70))],
        [SamplingParams(max_tokens=20, temperature=1.0), params, GREEDY],
    )[1]
    assert alone.token_ids == crowded.token_ids
    assert alone.logprobs == pytest.approx(crowded.logprobs, abs=1e-5)
    other_seed = engine_for(tiny_qwen3).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=4321)
    )[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_is_greedy(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3)
    greedy, topk1 = engine.generate(
        [[3, 4, 5], [3, 4, 5]],
        [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)],
    )
    assert greedy.token_ids == topk1.token_ids


def test_stop_token_ends_generation_with_reason_stop(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3)
    free_run = engine.generate([[8, 9, 10]], GREEDY)[0]
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    stopped = engine.generate(
        [[8, 9, 10]],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,)),
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12


def test_weight_update_mid_flight_keeps_requests_running_and_tags_versions(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    other = write_hf_model(tmp_path / "other", "qwen3", seed=5, head_dim=16)
    engine = engine_for(tiny_qwen3)
    r = engine.add_request(
        list(range(10, 30)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    for _ in range(6):
        engine.step()
    produced_before = len(r.output_ids)
    assert engine.update_weights(iter_safetensors(other)) == 1
    drain(engine)
    out = engine.pop_finished(r.request_id)
    assert len(out.token_ids) == 20
    assert out.weight_versions == [0] * produced_before + [1] * (20 - produced_before)
    # A fresh request after the update matches a fresh engine on the new weights.
    prompt = list(range(50, 70))
    fresh = engine_for(other).generate([prompt], GREEDY)[0]
    engine.flush_cache()
    assert engine.generate([prompt], GREEDY)[0].token_ids == fresh.token_ids


def test_an_engine_holding_admission_runs_its_turns_to_their_end_then_admits_under_new_weights(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """`engine.weight_update=drain`'s engine side: the request running finishes under the old
    weights, the one waiting starts only once the new ones have loaded and admission resumes."""
    other = write_hf_model(tmp_path / "other", "qwen3", seed=5, head_dim=16)
    engine = engine_for(tiny_qwen3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    running = engine.add_request(list(range(10, 30)), params)
    engine.step()
    engine.hold_admission()
    waiting = engine.add_request(list(range(40, 60)), params)
    while engine.running:
        engine.step()
        engine.check()
    assert engine.waiting == [waiting] and not waiting.output_ids
    assert engine.pop_finished(running.request_id).weight_versions == [0] * 8
    engine.update_weights(iter_safetensors(other))
    engine.resume_admission()
    drain(engine)
    assert engine.pop_finished(waiting.request_id).weight_versions == [1] * 8


def test_weights_of_another_model_are_refused_before_anything_loads(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    # Same shapes, another RoPE: the tensors would load and every token would be computed with
    # rotations the weights were not trained for.
    other = write_hf_model(tmp_path / "other", "qwen3", seed=5, head_dim=16, rope_theta=5e5)
    engine = engine_for(tiny_qwen3)
    before = {k: v.clone() for k, v in engine.model.hf_state_dict().items()}
    with pytest.raises(ModelConfigError, match=r"another model .* rope_theta 500000\.0"):
        engine.update_weights(other)
    assert engine.weight_version == 0
    assert all(torch.equal(before[k], v) for k, v in engine.model.hf_state_dict().items())


def test_salted_cache_is_not_reused_across_weight_versions(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3, salt_cache_by_version=True)
    prompt = list(range(10, 50))
    engine.generate([prompt], GREEDY)
    assert engine.generate([prompt], GREEDY)[0].cached_prompt_tokens > 0
    engine.update_weights(engine.model.hf_state_dict().items())
    assert engine.generate([prompt], GREEDY)[0].cached_prompt_tokens == 0


def test_a_version_number_given_again_still_salts_the_new_weights_apart(tiny_qwen3: Path) -> None:
    """A second run against the same server publishes version 0, 1, ... again, with other
    weights: KV cached under the first run's weights must not serve it."""
    engine = engine_for(tiny_qwen3)
    prompt = list(range(10, 50))
    engine.update_weights(engine.model.hf_state_dict().items(), version=3)
    engine.generate([prompt], GREEDY)
    assert engine.generate([prompt], GREEDY)[0].cached_prompt_tokens > 0
    engine.update_weights(engine.model.hf_state_dict().items(), version=3)
    assert engine.weight_version == 3
    assert engine.generate([prompt], GREEDY)[0].cached_prompt_tokens == 0


def test_a_trajectory_keeps_its_kv_across_weight_updates_but_new_ones_never_read_it(
    tiny_qwen3: Path,
) -> None:
    """The shared prompt of every episode stays hot in the cache: reused by trajectories started
    under later weights, the engine would sample from a policy no trainer step ever saw."""
    engine = engine_for(tiny_qwen3)  # salt_cache_by_version is the default
    prompt = list(range(10, 50))
    first = engine.add_request(prompt, GREEDY, TurnMeta(trajectory_id="old"))
    drain(engine)
    context = [*prompt, *engine.pop_finished(first.request_id).token_ids, 7, 8, 9]
    engine.update_weights(engine.model.hf_state_dict().items())
    later_turn = engine.add_request(context, GREEDY, TurnMeta(trajectory_id="old"))
    new = engine.add_request(prompt, GREEDY, TurnMeta(trajectory_id="new"))
    drain(engine)
    assert engine.pop_finished(later_turn.request_id).cached_prompt_tokens >= len(prompt)
    assert engine.pop_finished(new.request_id).cached_prompt_tokens == 0
    engine.check()


def test_abort_frees_the_request_pages(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3, prefix_cache=False)
    r = engine.add_request(list(range(10, 60)), GREEDY)
    engine.step()
    assert engine.cache.kv.device_pages.num_free < engine.cache.kv.device_pages.capacity
    assert engine.abort(r.request_id)
    assert engine.pop_finished(r.request_id).finish_reason == "abort"
    engine.check()
    assert engine.cache.kv.device_pages.num_free == engine.cache.kv.device_pages.capacity


@pytest.mark.parametrize(
    ("prompt", "words"),
    [([], "empty"), ([1, 100000], "outside the vocabulary"), (list(range(2, 400)) * 2, "context")],
)
def test_impossible_requests_are_refused_with_a_reason(
    tiny_qwen3: Path, prompt: list[int], words: str
) -> None:
    with pytest.raises(RequestError, match=words):
        engine_for(tiny_qwen3).add_request(prompt, GREEDY)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_stop_strings_without_a_tokenizer_are_refused(tiny_qwen3: Path) -> None:
    params = SamplingParams(max_tokens=4, stop=("x",))
    with pytest.raises(RequestError, match="tokenizer"):
        engine_for(tiny_qwen3).add_request([1, 2, 3], params)


def test_engine_refuses_a_cache_smaller_than_one_full_context(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="device_kv_pages"):
        engine_for(tiny_qwen3, device_kv_pages=8)


def test_kv_offload_and_load_round_trip_preserves_pages() -> None:
    kv = KVCache(
        num_layers=2, num_kv_heads=2, head_dim=4, page_size=3, device_pages=8, host_pages=8
    )
    pages = kv.device_pages.allocate(3)
    data = torch.randn(2, 2, 2, 3, 3, 4)
    kv.device_kv[:, :, :, pages] = data
    host = kv.to_host(pages)
    kv.device_pages.free(pages)
    kv.device_kv.zero_()
    back = kv.to_device(host)
    assert back is not None
    kv.free_host(host)
    torch.testing.assert_close(kv.device_kv[:, :, :, back], data)
    assert kv.host_pages.num_free == kv.host_pages.capacity
    assert kv.to_device(kv.to_host(back) * 3) is None  # more than the device has free
    kv.check()


# Top-two logits closer than this are a tie: two paths that sum the same terms in another order
# (a banded layer, a chunked prefill) may break it either way.
TIE = 1e-4


# Per generated token: how far the best logit is above the runner-up's, and those two tokens
# (in a tie, the sampled one may be either: argmax and top-k order ties apart).
RunnersUp = list[tuple[float, tuple[int, int]]]


def margins_of(out: GenerationOutput) -> RunnersUp:
    """The output's `RunnersUp` (it was sampled with `top_logprobs` >= 2)."""
    return [(tops[0][1] - tops[1][1], (tops[0][0], tops[1][0])) for tops in out.top_logprobs]


def assert_greedy_agrees(
    expected: list[list[int]], margins: list[RunnersUp], got: list[list[int]]
) -> None:
    """`got` is `expected`, each sequence to its end or to where the reference's two most likely
    tokens were tied and `got` took the other one (from there on it is another sequence, as
    legitimately)."""
    for i, (want, have, runners_up) in enumerate(zip(expected, got, margins, strict=True)):
        assert len(have) == len(want), f"sequence {i}: {len(have)} tokens, expected {len(want)}"
        differs = next((k for k, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), None)
        if differs is not None:
            margin, tied = runners_up[differs]
            assert margin < TIE and {want[differs], have[differs]} == set(tied), (
                f"sequence {i} departs at token {differs} ({have[differs]} for {want[differs]}),"
                f" where the reference's two best were {tied}, {margin:.3g} apart: not a tie"
            )


def play_turns(
    engine: Engine,
    prompts: list[list[int]],
    turns: int,
    wait_on_tools: bool,
    margins: list[RunnersUp] | None = None,
) -> list[list[int]]:
    """Multi-turn trajectories, all in flight together: each turn generates, then a fixed
    observation is appended; between turns the trajectory waits on a (pretend) tool. With
    `margins`, each trajectory's list gets its tokens' `margins_of`.

    The pin is short: best-effort requests wait for the pins of high-priority trajectories to
    expire when they need that room, and here the tools answer only once every request of the
    turn is done, so a long pin would only stall the test until it expires."""
    contexts = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for turn in range(turns):
        ids = [
            engine.add_request(
                ctx,
                GREEDY if margins is None else dataclasses.replace(GREEDY, top_logprobs=2),
                TurnMeta(
                    priority=i % 2,
                    trajectory_id=f"t{i}",
                    expected_wait_s=PIN_S if wait_on_tools else None,
                ),
            ).request_id
            for i, ctx in enumerate(contexts)
        ]
        drain(engine)
        for i, rid in enumerate(ids):
            finished = engine.pop_finished(rid)
            out = finished.token_ids
            outputs[i] += out
            if margins is not None:
                margins[i] += margins_of(finished)
            contexts[i] += [*out, 400 + turn, 401 + i, 402]  # the observation
    for i in range(len(prompts)):
        engine.end_trajectory(f"t{i}")
    engine.check()
    return outputs


@pytest.mark.parametrize("retention", ["lru", "trajectory"])
def test_offloaded_and_preempted_kv_gives_the_same_greedy_outputs(
    tiny_qwen3: Path, retention: str
) -> None:
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    reference = play_turns(
        engine_for(tiny_qwen3, prefix_cache=False, device_kv_pages=256), prompts, 3, False
    )
    # Room for about a third of the contexts: every turn evicts, offloads and preempts.
    engine = engine_for(
        tiny_qwen3, device_kv_pages=60, host_kv_pages=400, retention=retention, max_context=96
    )
    assert play_turns(engine, prompts, 3, wait_on_tools=True) == reference
    counts = engine.counters()
    assert counts["preemptions"] > 0 and counts["busy_s"] > 0
    assert counts["tool_returns"] == len(prompts) * 2  # turns 2 and 3, preempted or not
    if retention == "trajectory":
        assert counts["host_hit_tokens"] > 0 and counts["offloaded_bytes"] > 0
        assert counts["loaded_bytes"] > 0
    else:
        assert counts["host_hit_tokens"] == 0 and counts["reprefill_evicted_tokens"] > 0
        assert counts["offloaded_bytes"] == 0
    engine.flush_cache()
    engine.check()
    assert engine.cache.kv.host_pages.num_free == engine.cache.kv.host_pages.capacity


def test_a_trajectory_waiting_on_a_tool_finds_its_kv_where_lru_computes_it_again(
    tiny_qwen3: Path,
) -> None:
    def second_turn(retention: str) -> Engine:
        engine = engine_for(
            tiny_qwen3, device_kv_pages=40, host_kv_pages=64, retention=retention, max_context=150
        )
        context = list(range(100, 160))  # 15 pages
        first = engine.generate([context], GREEDY)[0]  # no trajectory: nobody owns it
        context += first.token_ids
        r = engine.add_request(
            context, GREEDY, TurnMeta(priority=1, trajectory_id="waiting", expected_wait_s=60.0)
        )
        drain(engine)
        # Meanwhile other high-priority work needs the whole device: the waiting KV has to
        # leave it (best-effort work would wait for the pin to expire instead).
        other = engine.add_request(
            list(range(200, 340)), SamplingParams(max_tokens=4, temperature=0), TurnMeta(priority=1)
        )
        drain(engine)
        engine.pop_finished(other.request_id)
        context += [*engine.pop_finished(r.request_id).token_ids, 7, 8, 9]
        engine.add_request(context, GREEDY, TurnMeta(priority=1, trajectory_id="waiting"))
        drain(engine)
        return engine

    ours, lru = second_turn("trajectory"), second_turn("lru")
    assert sum(ours.stats.reprefill_tokens.values()) == 0
    assert ours.stats.host_hit_tokens >= 80  # its 72+12-token context, whole pages
    assert lru.stats.reprefill_tokens["evicted"] >= 80
    assert lru.stats.host_hit_tokens == 0


def test_best_effort_work_waits_rather_than_push_out_pinned_high_priority_kv(
    tiny_qwen3: Path,
) -> None:
    now = [0.0]
    engine = engine_at(tiny_qwen3, now, device_kv_pages=48, host_kv_pages=64)
    context = list(range(100, 172))  # 18 pages
    engine.add_request(
        context, GREEDY, TurnMeta(priority=1, trajectory_id="hi", expected_wait_s=10.0)
    )
    drain(engine)
    pinned = engine.cache.tree.evictable_pages
    assert pinned >= 18
    # Needs more than the pages left beside the pinned KV.
    best_effort = engine.add_request(list(range(200, 330)), GREEDY, TurnMeta(priority=0))
    for _ in range(3):
        engine.step()
    assert best_effort.num_computed == 0 and engine.cache.tree.offloaded_pages == 0
    now[0] = 11.0  # the pin has expired: the tool is late, its KV is fair game
    drain(engine)
    assert best_effort.finished and engine.cache.tree.offloaded_pages > 0


def test_the_engine_counts_how_long_a_tool_answer_waits_for_its_first_token(
    tiny_qwen3: Path,
) -> None:
    now = [0.0]
    engine = engine_at(tiny_qwen3, now, device_kv_pages=64)
    first = engine.add_request(list(range(100, 140)), GREEDY, TurnMeta(trajectory_id="t"))
    engine.add_request(list(range(200, 240)), GREEDY)  # no trajectory: no tool behind it
    drain(engine)
    assert engine.counters()["tool_returns"] == 0  # a trajectory's first turn answers no tool
    context = [*range(100, 140), *engine.pop_finished(first.request_id).token_ids, 7, 8]
    now[0] = 10.0  # the tool answers
    engine.add_request(context, GREEDY, TurnMeta(trajectory_id="t"))
    now[0] = 12.5  # the engine gets to it only now
    engine.step()
    counts = engine.counters()
    assert counts["tool_returns"] == 1 and counts["tool_return_wait_s"] == 2.5
    now[0] = 20.0
    drain(engine)  # its later tokens do not count again
    assert engine.counters()["tool_return_wait_s"] == 2.5


def test_high_priority_work_may_take_the_pinned_room(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3, device_kv_pages=48, host_kv_pages=64, max_context=150)
    engine.add_request(
        list(range(100, 172)),
        GREEDY,
        TurnMeta(priority=1, trajectory_id="hi", expected_wait_s=60.0),
    )
    drain(engine)
    urgent = engine.add_request(list(range(200, 330)), GREEDY, TurnMeta(priority=1))
    drain(engine)
    assert urgent.finished and engine.cache.tree.offloaded_pages > 0


def test_trajectories_never_ended_by_the_client_are_forgotten_oldest_first(
    tiny_qwen3: Path,
) -> None:
    engine = engine_for(tiny_qwen3)
    engine.cache.max_trajectories = 3
    for i in range(5):
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY, TurnMeta(trajectory_id=f"t{i}"))
        drain(engine)
    engine.add_request(
        [1, 2, 3], GREEDY, TurnMeta(trajectory_id="t2")
    )  # seen again: the most recent
    engine.add_request([1, 2, 3], GREEDY, TurnMeta(trajectory_id="t5"))
    assert list(engine.cache.trajectories) == ["t4", "t2", "t5"]
    drain(engine)
    assert all(not n.owners - {"t4", "t2", "t5"} for n in engine.cache.tree.nodes())


def test_live_kv_counts_running_and_waiting_trajectories_not_ended_ones(tiny_qwen3: Path) -> None:
    engine = engine_for(tiny_qwen3, device_kv_pages=256)
    assert engine.cache.live_pages() == 0
    for i in range(2):
        r = engine.add_request(list(range(10 + i, 50 + i)), GREEDY, TurnMeta(trajectory_id=f"t{i}"))
        drain(engine)
        engine.pop_finished(r.request_id)
    # Both wait on a tool: their cached context is live load, though it could be evicted.
    in_use = engine.cache.kv.device_pages.capacity - engine.cache.kv.device_pages.num_free
    assert engine.cache.live_pages() == in_use > 0
    engine.end_trajectory("t0")
    ended = engine.cache.live_pages()
    assert 0 < ended < in_use  # t0's KV is only cache content now
    engine.end_trajectory("t1")
    assert engine.cache.live_pages() == 0
    assert (
        engine.cache.kv.device_pages.num_free < engine.cache.kv.device_pages.capacity
    )  # still cached


# What, on a GPU, makes the host wait for the device: every way a tensor's values reach Python.
DEVICE_TO_HOST = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_a_step_copies_from_the_device_to_the_host_once(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token ids, logprobs and top logprobs come back in one copy, whatever the mix of greedy,
    sampled, truncated and top-logprob rows, prefill chunks and decode rows. On a CPU there is
    no synchronisation to observe, so this counts the tensor methods that would cause one; a
    torch op that synchronises inside (a data-dependent shape) would escape it."""
    engine = engine_for(tiny_qwen3, token_budget=24)
    mixes = [
        GREEDY,
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=3),
        SamplingParams(max_tokens=6, temperature=1.2, top_k=7, top_logprobs=3, seed=4),
        SamplingParams(max_tokens=6, temperature=0, top_logprobs=2),
    ]
    for i, params in enumerate(mixes):
        engine.add_request(list(range(3, 3 + 10 * (i + 1))), params)
    copies = [0]
    for name in DEVICE_TO_HOST:
        method = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _method=method, **kw: object) -> object:  # type: ignore[no-untyped-def]
            copies[0] += 1
            return _method(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_step = []
    while engine.has_work():
        copies[0] = 0
        engine.step()
        per_step.append(copies[0])
    monkeypatch.undo()
    assert len(per_step) > 6 and set(per_step) == {1}


def test_a_bfloat16_engine_keeps_bfloat16_kv_and_samples_finite_logprobs(tiny_qwen3: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    prompt = list(range(100, 140))
    full = engine_for(tiny_qwen3).generate([prompt], params)[0]
    engine = engine_for(tiny_qwen3, dtype="bfloat16")
    half = engine.generate([prompt], params)[0]
    assert engine.cache.kv.device_kv.dtype == torch.bfloat16
    assert all(torch.isfinite(torch.tensor(half.logprobs)))
    # The same uniforms draw the same first token; later ones may part at a rounding boundary.
    assert half.token_ids[0] == full.token_ids[0]
    assert abs(half.logprobs[0] - full.logprobs[0]) < 0.05
