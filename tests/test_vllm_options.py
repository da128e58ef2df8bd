"""The vLLM plug-in's option parsing and version gate, which import no vLLM (main suite)."""

from __future__ import annotations

import pytest

import aiokv.integrations.vllm.options as plugin_options
from aiokv.errors import HostMemoryError, InvalidSpec, UsageError
from aiokv.integrations.vllm._compat import check_vllm_version
from aiokv.integrations.vllm.options import KEYS, MAX_CHUNKS, PluginOptions, read_cpu_bytes, size_host_pool


def test_defaults_are_adaptive_auto() -> None:
    opts = PluginOptions.from_extra_config({"cpu_bytes_to_use": 1 << 30, "spec_name": "x"})
    assert (opts.policy, opts.admission, opts.strategy, opts.backend) == ("adaptive", None, "auto", "auto")
    assert opts.worker_options.strategy == "auto"


def test_every_key_is_read() -> None:
    opts = PluginOptions.from_extra_config({
        "aiokv_policy": "ARC",
        "aiokv_admission": "second-offer",
        "aiokv_strategy": "dma",
        "aiokv_backend": "cpu",
        "aiokv_worker_options": {"streams_per_direction": 2},
    })
    assert (opts.policy, opts.admission, opts.strategy, opts.backend) == ("arc", "second-offer", "dma", "cpu")
    assert opts.worker_options.streams_per_direction == 2
    assert opts.worker_options.strategy == "dma"
    assert set(KEYS) == {
        "aiokv_policy", "aiokv_admission", "aiokv_strategy", "aiokv_backend", "aiokv_worker_options",
        "aiokv_tiers",
    }


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"aiokv_polcy": "lru"}, "aiokv_policy"),
        ({"aiokv_policy": "mru"}, "'lru'"),
        ({"aiokv_policy": 3}, "'adaptive'"),
        ({"aiokv_strategy": "fast"}, "'staged'"),
        ({"aiokv_backend": "gpu"}, "'cuda'"),
        ({"aiokv_admission": "never"}, "'second-offer'"),
        ({"aiokv_worker_options": {"streamz": 1}}, "streams_per_direction"),
        ({"aiokv_worker_options": {"strategy": "dma"}}, "aiokv_strategy"),
        ({"aiokv_worker_options": [1]}, "JSON object"),
    ],
)
def test_bad_keys_and_values_name_the_valid_ones(extra: dict, names: str) -> None:
    with pytest.raises(InvalidSpec, match=names):
        PluginOptions.from_extra_config(extra)


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("aiokv-policy", "aiokv_policy"),
        ("AIOKV_POLICY", "aiokv_policy"),
        ("Aiokv_Backend", "aiokv_backend"),
        ("aiokv.worker-options", "aiokv_worker_options"),
        ("aiokvstrategy", "aiokv_strategy"),
        ("aiokv_admision", "aiokv_admission"),
    ],
)
def test_misspelled_keys_are_refused_naming_the_one_meant(key: str, meant: str) -> None:
    # vLLM ignores keys it does not know, so a misspelled aiokv key would run the defaults.
    with pytest.raises(InvalidSpec, match=rf"{key!r}: did you mean {meant!r}\?"):
        PluginOptions.from_extra_config({key: "lru", "cpu_bytes_to_use": 1 << 30})


def test_vllm_keys_are_left_alone() -> None:
    opts = PluginOptions.from_extra_config(
        {"blocks_per_chunk": 4, "offload_prompt_only": False, "self_describing_kv_events": True, 7: "x"}
    )
    assert opts.policy == "adaptive"


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("eviction_policy", "arc", "aiokv_policy"),
        ("cache_policy_module_path", "my.policies", "aiokv_policy"),
        ("store_threshold", 2, "aiokv_admission"),
        ("max_tracker_size", 1000, "aiokv_admission"),
    ],
)
def test_cpu_spec_keys_are_refused_not_ignored(key: str, value: object, instead: str) -> None:
    # A config carried over from vLLM's CPU spec must not run with another policy silently.
    with pytest.raises(InvalidSpec, match=rf"{key}: use {instead}"):
        PluginOptions.from_extra_config({key: value, "aiokv_policy": "lru"})


@pytest.mark.parametrize(("raw", "value"), [(4096, 4096), (4e9, 4_000_000_000), ("8192", 8192)])
def test_cpu_bytes_reads_json_numbers(raw: object, value: int) -> None:
    assert read_cpu_bytes({"cpu_bytes_to_use": raw}) == value


@pytest.mark.parametrize("raw", [None, 0, -5, 1.5, "lots", True, float("inf"), [1]])
def test_cpu_bytes_refuses_what_is_not_a_byte_count(raw: object) -> None:
    extra = {} if raw is None else {"cpu_bytes_to_use": raw}
    with pytest.raises(InvalidSpec, match="cpu_bytes_to_use"):
        read_cpu_bytes(extra)


@pytest.mark.parametrize(
    ("raw", "world", "chunk", "count"),
    [(4096, 1, 2560, 1), (10 * 2560, 1, 2560, 10), (10 * 2560, 2, 2560, 5), (1e9, 1, 2560, 390625)],
)
def test_pool_size_is_chunks_of_aligned_bytes_over_all_ranks(raw, world, chunk, count) -> None:
    assert size_host_pool(read_cpu_bytes({"cpu_bytes_to_use": raw}), 2304, world) == (chunk, count)
    assert size_host_pool(1 << 30, 0, world) == (0, 0)  # nothing offloadable: no pool


@pytest.mark.parametrize("raw", [1e30, "1e30", 10**40, (MAX_CHUNKS + 1) * 512])
def test_a_pool_vllms_chunk_ids_cannot_address_is_refused(raw: object) -> None:
    # Left to the chunk manager, 1e30 bytes failed as an OverflowError or an empty MemoryError.
    with pytest.raises(InvalidSpec, match=r"cpu_bytes_to_use=\d+ makes \d+ host chunks .* int32 chunk ids"):
        size_host_pool(read_cpu_bytes({"cpu_bytes_to_use": raw}), 512, 1)


def test_a_pool_larger_than_the_hosts_memory_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(plugin_options, "available_host_memory", lambda: 1 << 30)
    assert size_host_pool(2 << 30, 512, 2) == (512, 1 << 21)  # 1 GiB on each of 2 ranks fits
    with pytest.raises(HostMemoryError, match=r"host pool of 2 GiB, but this host has 1 GiB available"):
        size_host_pool(2 << 30, 512, 1)
    with pytest.raises(HostMemoryError, match="lower cpu_bytes_to_use"):
        size_host_pool(10**12, 2304, 1)
    monkeypatch.setattr(plugin_options, "available_host_memory", lambda: None)  # unknown: not refused
    assert size_host_pool(10**12, 2304, 1) == (2560, 390625000)


def test_a_pool_of_no_chunk_is_refused() -> None:
    with pytest.raises(InvalidSpec, match="holds no chunk: one chunk takes 2560 bytes on each of 2 rank"):
        size_host_pool(4000, 2304, 2)


@pytest.mark.parametrize(
    "version", ["0.33.0", "0.33.7", "0.33.1.dev4+g12ab", "v0.33.2", "0.34.0", "0.34.2rc1"]
)
def test_tested_range_is_accepted(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.9", "0.35.0", "1.0.0", "nightly"])
def test_other_releases_are_refused_naming_the_range(version: str) -> None:
    with pytest.raises(UsageError, match=r"vllm>=0\.33,<0\.35"):
        check_vllm_version(version)


def test_import_aiokv_does_not_import_vllm() -> None:
    import sys

    if "vllm" in sys.modules:
        pytest.skip("vLLM was imported by an earlier test (tests/vllm checks this in a fresh process)")
    import aiokv
    import aiokv.integrations
    import aiokv.integrations.vllm as plugin

    assert aiokv.__version__ and plugin.KEYS
    assert "vllm" not in sys.modules


def test_spec_without_vllm_says_how_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    import aiokv.integrations.vllm as plugin

    with pytest.raises(UsageError, match=r"pip install -e '\.\[vllm\]' in a clone of aiokv"):
        plugin.AiokvOffloadingSpec  # noqa: B018


def test_docs_list_every_key() -> None:
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    table = {m for m in re.findall(r"^\| `(aiokv_\w+)`", page, re.M)}
    assert table == set(KEYS)
