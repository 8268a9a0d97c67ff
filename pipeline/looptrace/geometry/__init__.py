"""The geometry stage's library (SPEC §2): ``blocks`` (the block functions and the stream of a store's blocks)
and ``stage`` (``GeometryConfig``, the tables, :func:`~looptrace.geometry.stage.geometry_model`)."""
