"""The CUDA wing: everything the CUDA backend needs, behind one driver facade.

Modules, lowest first (each imports only those before it, ``tests/test_imports.py``):

- ``driver``: ``Driver``, the only importer of cuda-python; translates every driver
  error into ``aiokv.errors``. ``device``: facts for ``aiokv info``.
- ``issuer``: the per-lane thread that enqueues long jobs after ``submit`` returned.
- ``host_pool``: the exact-size pinned host pool.
- ``pitched``: planning of pitched (2D) copies.
- ``strategy``: ``CopyContext`` and ``CopyStrategy``; then the strategies
  ``dma``, ``kernel``, ``pieces`` (the gather kernel) and ``staged``.
- ``completion``: a job's end; ``lane``: one direction's ordered queue;
  ``backend``: ``CudaBackend`` (which ``aiokv.backends.resolve_backend`` loads lazily) and
  ``make_strategy``, which picks a lane's strategy from ``WorkerOptions.strategy``.

Nothing is imported here, so that importing a module of the package never loads
cuda-python unless it needs the driver.
"""
