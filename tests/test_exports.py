import aiokv


def test_public_names_are_pinned() -> None:
    assert set(aiokv.__all__) == {
        "AiokvError", "AsyncOffloadingWorker", "CPULoadStoreSpec", "CanonicalKVCacheRef",
        "CanonicalKVCacheTensor", "CanonicalKVCaches", "Direction", "DuplicateJob",
        "GPULoadStoreSpec", "InvalidSpec", "LoadStoreSpec", "OffloadingWorker",
        "SyncOffloadingWorker", "TransferFailed", "TransferFuture", "TransferResult",
        "WorkerBroken", "WorkerClosed", "WorkerOptions", "WorkerStatistics", "LaneStatistics",
        # the cache face and its vocabulary
        "AdmissionPolicy", "CacheStats", "ChunkManager", "EvictionPolicy", "KeyNotLoadable",
        "LookupResult", "OffloadCache", "OffloadCacheStats", "OffloadResult",
        "available_admissions", "available_policies", "register_admission", "register_policy",
        # tiers under the host pool
        "DiskTier", "RedisTier", "RestoreResult", "Tier", "TierCacheStats", "TierStatistics",
        # the rest of the error tree (aiokv.errors)
        "CudaCallFailed", "DriverError", "HostMemoryError", "MissingExtra", "QueueFull", "TierError",
        "UsageError",
        # what the async face's poller did (for the bench)
        "PollerStatistics",
        # layerwise jobs: the per-layer handles, their status, statistics and timelines
        "LayerStatistics", "LayerStatus", "LayerTimeline", "LayerwiseFuture", "LayerwiseJob",
    }
    for name in aiokv.__all__:
        assert getattr(aiokv, name) is not None


def test_api_reference_documents_every_public_name() -> None:
    from pathlib import Path

    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [name for name in aiokv.__all__ if f"::: aiokv.{name}\n" not in api]
    assert not missing, f"docs/api.md lacks {missing}"
