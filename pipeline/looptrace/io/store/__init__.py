"""The trajectory store (SPEC §1, DESIGN "Trajectory store"): the only package that imports zarr.

One Zarr v3 group per (model, split); one row per scored token, ordered by (sequence, position).
Every array names its dimensions (``dimension_names``) so ``xarray.open_zarr(path)`` opens the group,
and the group attributes describe the store fully (schema version, model, task, regime, dtypes,
resolved dump parameters, seeds, versions, completion flag, non-finite count).

Layout choices and why:

- Chunks run along the ``token`` axis only (``chunk_tokens`` rows, every other axis whole), so a chunk
  is a self-contained block of tokens: readers stream chunk-aligned blocks (:meth:`TrajectoryStore.blocks`)
  and the writer only ever writes whole, aligned chunks. Measured on this machine: two writers may share
  a store only if each writes whole chunks; unaligned concurrent writes silently lose rows (SPEC §1).
- Codecs: Blosc(zstd, bit shuffle) then a crc32c checksum (SPEC §1), so a damaged chunk raises
  :class:`StoreError` instead of returning wrong numbers.
- Every chunk is written, even one that equals the fill value (``write_empty_chunks``), so a missing chunk
  file is detected on open instead of reading back as zeros.
- Resume markers: ``chunk_nan_count`` [chunk] int64, one Zarr chunk per element, ``-1`` until every array
  of that token chunk is written; then the number of non-finite values in that chunk's ``hidden`` and
  ``hidden_init`` (after the cast to the stored dtype, so float16 overflow counts). A killed dump resumes
  from the first chunk whose marker is still ``-1``; the store is only marked ``complete`` at the end.
  (The local store writes every key atomically — temp file + rename — so a marker is never half-written;
  an object store's PUT is atomic too.)
- Chunk identity: ``chunk_digest`` [chunk, array] uint32, one Zarr chunk per row, holds the crc32c of each
  token array's stored bytes in that chunk (written after the arrays, before the marker). The codec's
  checksum proves a chunk's bytes are intact; the digest proves they are *that* chunk's bytes, so two swapped
  chunk files are caught (:meth:`TrajectoryStore.verify`, chunk-aligned reads, and the dump's re-run, which
  rewrites them). The data arrays' chunks are unchanged by it, byte for byte.
- Targets: a path, a ``file://`` URL, any fsspec URL (``s3://``, ``gs://``, ``memory://``) or a
  :func:`memory_store`; :func:`resolve_store` is the one place that turns them into a zarr store. Credentials
  and endpoints come from the libraries' own environment and config (``AWS_*``, ``AWS_ENDPOINT_URL``,
  ``FSSPEC_S3_*``, ``~/.aws``, ``~/.config/fsspec/*.json``), never from params. A URL that went through
  ``pathlib.Path`` (``s3:/bucket/key``) is restored, so ``Path(root) / model / "val.zarr"`` keeps working.
- Writers coordinate through :mod:`looptrace.io.claims` (a sibling ``.<name>.claims``), never inside the store.

One concern per module: :mod:`~looptrace.io.store.schema` (arrays, dimensions, dtypes, attributes, codecs,
:class:`~looptrace.io.store.schema.StoreError`), :mod:`~looptrace.io.store.location` (paths and URLs,
:func:`~looptrace.io.store.location.resolve_store`), :mod:`~looptrace.io.store.reader` (``open_store``,
``TrajectoryStore``), :mod:`~looptrace.io.store.writer` (``StoreWriter``, ``write_store``) and
:mod:`~looptrace.io.store.identity` (the split stores of one model belong together).

Reader API (other stages use only this)::

    from looptrace.io.store.reader import open_store
    st = open_store(path)                      # validates; every problem is a one-line StoreError
    st.read("hidden", tokens=slice(0, 100))    # np.ndarray, hidden upcast to float32
    for sl in st.blocks(): st.read_block(["hidden", "entropy"], sl)
    st.tokens_frame()                          # polars: token + TOKEN_FIELDS
"""
