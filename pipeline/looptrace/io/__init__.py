"""Storage: the Zarr trajectory store (the only zarr importer), state precision, atomic artifacts, tables."""
