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


def test_cpu_default_budget_is_4gib_or_half_the_available_memory_per_worker():
    from pkgd.engine.core import default_cpu_kv_cache_bytes, determine_num_kv_blocks

    cfg = VllmConfig()
    assert default_cpu_kv_cache_bytes(cfg, 64 << 30) == 4 << 30  # plenty: vLLM's CPU default
    assert default_cpu_kv_cache_bytes(cfg, 6 << 30) == 3 << 30  # half of what is available
    assert default_cpu_kv_cache_bytes(cfg, None) == 4 << 30  # unknown (no /proc/meminfo)
    two_by_two = VllmConfig.model_validate({"parallel": {"dp": 2, "tp": 2}})
    assert default_cpu_kv_cache_bytes(two_by_two, 8 << 30) == 1 << 30  # shared by 4 workers
    per_block = 720 << 10  # SmolLM2 in float32: 30 layers x K/V x 16 tokens x 3 heads x 64 x 4 bytes
    assert (
        determine_num_kv_blocks(cfg, per_block, host_available_bytes=16 << 30, max_model_len=8192)
        == (4 << 30) // per_block
    )
    assert (4 << 30) // per_block >= 64 * 256 // 16  # 64 streams of 256 tokens fit: no preemption
    # capped at what the scheduler can hold at once: max_num_seqs x max_model_len tokens
    small = VllmConfig.model_validate({"scheduler": {"max_num_seqs": 4}})
    assert determine_num_kv_blocks(small, per_block, host_available_bytes=16 << 30, max_model_len=100) == 4 * 7
    # an explicit budget or block count is taken as given
    explicit = VllmConfig.model_validate(
        {"scheduler": {"max_num_seqs": 4}, "cache": {"kv_cache_memory_bytes": 64 << 20}}
    )
    assert (
        determine_num_kv_blocks(explicit, per_block, host_available_bytes=16 << 30, max_model_len=100)
        == (64 << 20) // per_block
    )


def test_engine_threads_default_to_every_core_shared_by_the_node_workers(monkeypatch):
    import pkgd.engine.core as core

    monkeypatch.setattr(core.host, "available_cores", lambda: 8)
    assert core.default_cpu_threads(VllmConfig()) == 8  # no core held back for the API servers
    assert core.default_cpu_threads(VllmConfig.model_validate({"parallel": {"tp": 2}})) == 4
    assert core.default_cpu_threads(VllmConfig.model_validate({"parallel": {"dp": 2, "tp": 2}})) == 2
    assert core.default_cpu_threads(VllmConfig.model_validate({"parallel": {"dp": 16}})) == 1
    assert core.default_cpu_threads(VllmConfig.model_validate({"parallel": {"cpu_threads": 3}})) == 3
    monkeypatch.setattr(core.host, "available_cores", lambda: 2)
    assert core.default_cpu_threads(VllmConfig()) == 2


def test_engine_sizes_the_default_cpu_cache_from_available_memory(monkeypatch):
    import pkgd.engine.core as core

    monkeypatch.setattr(core.host, "mem_available_bytes", lambda: 2 << 20)
    e = engine({"block_size": 16})  # fake runner: 16 * 64 bytes per block, max_model_len 256
    assert e.num_kv_blocks == (1 << 20) // (16 * 64)


def test_cache_smaller_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="less than one sequence of max_model_len 256"):
        engine({"num_blocks": 4, "block_size": 16})


def test_max_model_len_above_the_models_limit_is_refused():
    """As vLLM does (not clamped silently): the runner reports the model's own limit."""
    cfg = VllmConfig.model_validate({"model": {"max_model_len": 1024}, "cache": {"num_blocks": 64, "block_size": 16}})

    def clamping(config):
        files, runner = fake_factory()(VllmConfig())  # the model's limit: 256
        return files, runner

    with pytest.raises(ValueError, match="model.max_model_len: 1024 is greater than the model's limit of 256 tokens"):
        EngineCore(cfg, runner_factory=clamping)
    assert (
        EngineCore(
            VllmConfig.model_validate({"model": {"max_model_len": 128}, "cache": {"num_blocks": 64}}),
            runner_factory=fake_factory(),
        ).max_model_len
        == 128
    )


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
    both = EngineCoreRequest(
        request_id="x", prompt_token_ids=[1], sampling_params=SamplingParams(), pooling_params=PoolingParams()
    )
    with pytest.raises(ValueError, match="exactly one"):
        engine().add_request(both)
