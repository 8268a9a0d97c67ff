"""Thin DVC stage entry points: load config, open inputs, call one ``pipeline`` function, write outputs."""
