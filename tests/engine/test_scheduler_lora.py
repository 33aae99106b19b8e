"""The scheduler's LoRA rules: at most ``max_loras`` distinct adapters among running requests
(a request of another adapter waits, requests behind it may go first, nothing fails), and
prefix-cache hashes that differ per adapter."""

from pkgd.config.sections import SchedulerConfig
from pkgd.engine.kv_cache_manager import KVCacheManager
from pkgd.engine.request import Request
from pkgd.engine.scheduler import Scheduler
from pkgd.lora_request import LoRARequest
from pkgd.sampling_params import SamplingParams

A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")


def _scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_caching=True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256), kv, max_model_len=64, max_loras=max_loras)


def _req(rid: str, lora: LoRARequest | None, prompt=(1, 2, 3, 4, 5)) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=4), max_model_len=64, lora_request=lora)


def test_a_second_adapter_waits_while_the_slot_is_taken_and_others_pass_it():
    s = _scheduler(max_loras=1)
    for r in (_req("a1", A), _req("b1", B), _req("base", None), _req("a2", A)):
        s.add_request(r)
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a1", "base", "a2"}  # b1 waits; the ones behind it go
    assert [r.request_id for r in s.waiting] == ["b1"]  # still first in line
    assert s.make_stats().waiting_lora_adapters == ["b"] and s.make_stats().running_lora_adapters == ["a"]
    s.finish_requests(["a1", "a2"])
    out = s.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b1"]
    assert out.scheduled_new_reqs[0].lora_request == B


def test_two_slots_take_two_adapters():
    s = _scheduler(max_loras=2)
    for r in (_req("a1", A), _req("b1", B)):
        s.add_request(r)
    assert set(s.schedule().num_scheduled_tokens) == {"a1", "b1"}


def test_prefix_hashes_differ_per_adapter():
    kv = KVCacheManager(64, 4, enable_caching=True)
    prompt = list(range(1, 13))
    hashes = [kv.update_block_hashes(_req(str(i), lora, prompt)) for i, lora in enumerate((None, A, B, None))]
    assert hashes[0] == hashes[3]
    assert len({h[0] for h in hashes[:3]}) == 3 and not set(hashes[0]) & set(hashes[1])
