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
        "CudaCallFailed", "HostMemoryError", "MissingExtra", "QueueFull", "TierError", "UsageError",
        # what the async face's poller did (for the bench)
        "PollerStatistics",
    }
    for name in aiokv.__all__:
        assert getattr(aiokv, name) is not None


def test_errors_derive_from_the_builtins_callers_catch() -> None:
    assert issubclass(aiokv.InvalidSpec, ValueError)
    assert issubclass(aiokv.DuplicateJob, aiokv.InvalidSpec)
    assert issubclass(aiokv.WorkerClosed, RuntimeError)
    assert issubclass(aiokv.WorkerBroken, RuntimeError)
    assert issubclass(aiokv.WorkerClosed, aiokv.UsageError)
    assert issubclass(aiokv.KeyNotLoadable, aiokv.InvalidSpec)
    assert issubclass(aiokv.HostMemoryError, MemoryError)
    assert issubclass(aiokv.TierError, OSError)
    assert issubclass(aiokv.QueueFull, aiokv.UsageError)
    assert issubclass(aiokv.MissingExtra, aiokv.UsageError) and issubclass(aiokv.MissingExtra, ImportError)
    for cls in (aiokv.InvalidSpec, aiokv.WorkerClosed, aiokv.WorkerBroken, aiokv.TransferFailed,
                aiokv.UsageError, aiokv.HostMemoryError, aiokv.CudaCallFailed, aiokv.TierError):
        assert issubclass(cls, aiokv.AiokvError)


def test_every_error_lives_in_the_errors_module() -> None:
    import inspect

    import aiokv.errors

    for name in aiokv.__all__:
        obj = getattr(aiokv, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert obj.__module__ == "aiokv.errors", f"{name} is defined in {obj.__module__}"
    assert set(aiokv.errors.__all__) <= set(aiokv.__all__)


def test_api_reference_documents_every_public_name() -> None:
    from pathlib import Path

    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [name for name in aiokv.__all__ if f"::: aiokv.{name}\n" not in api]
    assert not missing, f"docs/api.md lacks {missing}"
