"""EngineCore: KV sizing, request validation, handshake, outputs (fake runner)."""

import msgspec
import pytest

from pkgd.config import VllmConfig
from pkgd.engine.core import EngineCore
from pkgd.ipc.messages import EngineCoreRequest, FinishReason, Handshake
from pkgd.sampling_params import SamplingParams

from .fake_runner import fake_factory


def engine(cache=None, **model):
    cfg = VllmConfig.model_validate({"model": model, "cache": cache or {"num_blocks": 64, "block_size": 16}})
    return EngineCore(cfg, runner_factory=fake_factory())


def request(rid="r", prompt=(1, 2, 3), **sp):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**sp))


def test_kv_cache_sized_from_memory_bytes_over_bytes_per_block():
    # the fake runner reports block_size * 64 bytes per block
    e = engine({"kv_cache_memory_bytes": 1 << 20, "block_size": 16})
    assert e.num_kv_blocks == (1 << 20) // (16 * 64)
    assert engine({"num_blocks": 40, "block_size": 16}).num_kv_blocks == 40


def test_cache_smaller_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="less than one sequence of max_model_len 256"):
        engine({"num_blocks": 4, "block_size": 16})


def test_kv_cache_larger_than_available_memory_is_refused_before_allocating(monkeypatch):
    import pkgd.engine.core as core

    monkeypatch.setattr(core.host, "mem_available_bytes", lambda: 3 << 20)
    with pytest.raises(ValueError, match=r"needs 0\.01 GiB of memory but only 0\.00 GiB is available"):
        engine({"kv_cache_memory_bytes": 8 << 20, "block_size": 16})
    assert engine({"kv_cache_memory_bytes": 2 << 20, "block_size": 16}).num_kv_blocks == (2 << 20) // (16 * 64)
    monkeypatch.setattr(core.host, "mem_available_bytes", lambda: None)  # no /proc/meminfo: no check
    assert engine({"kv_cache_memory_bytes": 8 << 20, "block_size": 16}).num_kv_blocks > 0


def test_prompt_plus_max_tokens_beyond_max_model_len_names_both_numbers():
    e = engine(max_model_len=64)
    with pytest.raises(ValueError, match=r"60 tokens and max_tokens is 10: 70 exceeds max_model_len 64"):
        e.add_request(request(prompt=range(1, 61), max_tokens=10))
    with pytest.raises(ValueError, match="no room"):
        e.add_request(request(prompt=[1] * 64, max_tokens=None))
    assert not e.has_unfinished_requests()


@pytest.mark.parametrize(
    "req, match",
    [
        (request(prompt=[]), "empty"),
        (request(prompt=[1, 5000]), "token id 5000 is out of range"),
        (request(temperature=-1.0), "temperature"),
    ],
)
def test_invalid_requests_raise_and_change_nothing(req, match):
    e = engine()
    with pytest.raises(ValueError, match=match):
        e.add_request(req)
    assert not e.has_unfinished_requests()


def test_duplicate_live_id_is_refused():
    e = engine()
    e.add_request(request("x"))
    with pytest.raises(ValueError, match="already in use"):
        e.add_request(request("x"))


def test_handshake_info_is_a_valid_handshake():
    e = engine(name="served")
    hs = Handshake(**e.handshake_info())
    assert hs.model_name == "served" and hs.num_kv_blocks == 64 and hs.block_size == 16
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(hs), type=Handshake) == hs


def test_outputs_stream_per_step_and_end_with_a_finish_reason():
    e = engine()
    e.add_request(request("a", max_tokens=3, temperature=0.0, logprobs=0))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]
    assert all(o.new_logprobs and len(o.new_logprobs) == 1 for o in outs)
    st = e.stats()
    assert st.num_running_reqs == 0 and st.kv_cache_usage == 0.0


def test_seeded_sampling_does_not_depend_on_the_batch():
    def run(extra):
        e = engine()
        for i in range(extra):
            e.add_request(request(f"o{i}", prompt=[9, i + 1], max_tokens=5, temperature=1.0))
        e.add_request(request("s", prompt=[4, 5, 6], max_tokens=8, temperature=1.0, seed=123))
        toks = []
        while e.has_unfinished_requests():
            toks += [t for o in e.step() if o.request_id == "s" for t in o.new_token_ids]
        return toks

    assert run(0) == run(3) == run(7)


def test_shutdown_aborts_everything():
    e = engine()
    e.add_request(request("a", max_tokens=100))
    e.step()
    e.shutdown()
    assert not e.has_unfinished_requests() and e.kv_cache_manager.get_num_free_blocks() == 64


def test_sleep_mode_releases_refuses_and_restores():
    from pkgd.engine.core import EngineBusyError, EngineSleepingError

    with pytest.raises(ValueError, match="sleep mode is off"):
        engine().sleep(1)
    e = engine(enable_sleep_mode=True)
    e.add_request(request("a", prompt=range(1, 21), max_tokens=3))
    with pytest.raises(EngineBusyError, match="still running"):
        e.sleep(1)
    while e.has_unfinished_requests():
        e.step()
    assert e.kv_cache_manager.block_pool.cached_blocks  # a prefix is cached
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        e.sleep(3)
    e.sleep(2)
    assert e.is_sleeping() and e.model_runner.slept == [2] and not e.kv_cache_manager.block_pool.cached_blocks
    with pytest.raises(EngineSleepingError):
        e.add_request(request("b"))
    e.wake_up(["weights"])
    assert e.is_sleeping()  # the KV cache is still released
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        e.wake_up(["gpu"])
    e.wake_up()
    assert not e.is_sleeping() and e.model_runner.woken == [["weights"], ["kv_cache"]]
    e.add_request(request("c", max_tokens=2))
    while e.has_unfinished_requests():
        assert e.step() is not None


def test_pooling_requests_are_refused_by_a_generating_engine_and_vice_versa():
    from pkgd.pooling_params import PoolingParams

    pooled = EngineCoreRequest(request_id="p", prompt_token_ids=[1, 2], pooling_params=PoolingParams())
    with pytest.raises(ValueError, match="embeddings need model.runner: pooling"):
        engine().add_request(pooled)
    both = EngineCoreRequest(request_id="x", prompt_token_ids=[1], sampling_params=SamplingParams(), pooling_params=PoolingParams())
    with pytest.raises(ValueError, match="exactly one"):
        engine().add_request(both)
