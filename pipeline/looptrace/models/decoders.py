"""The decoder of a model for one KV policy (:func:`decoder_for`): looptrace's own
(:class:`~looptrace.models.decode.LoopedTransformerDecoder`) or an adapter's
(:func:`looptrace.models.adapters.decoding.hf_decoder`). It sits above both, so that the decoding protocol
(:mod:`looptrace.models.decode`) is imported by the adapters' decoders and imports neither."""

from __future__ import annotations

from looptrace.models.adapters.decoding import hf_decoder
from looptrace.models.decode import LoopDecoder, LoopedTransformerDecoder
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.looped import LoopedTransformer


def decoder_for(model, policy: str, **options) -> LoopDecoder:
    """The decoder of a model for one KV policy.

    Args:
        model: a :class:`~looptrace.models.looped.LoopedTransformer`, its
            :class:`~looptrace.models.interface.LoopedTransformerAdapter`, or an adapter of
            :func:`looptrace.models.adapters.loading.load_adapter`.
        policy: ``share`` | ``recompute`` | ``native``.
        options: kind-specific (``huginn_lookup_strategy`` for Huginn's native cache; ``seed``).

    Raises:
        DecodeUnsupported: the model or the policy cannot be decoded this way (the message says why).
    """
    if isinstance(model, LoopedTransformerAdapter):
        model = model.model
    if isinstance(model, LoopedTransformer):
        return LoopedTransformerDecoder(model, policy)
    return hf_decoder(model, policy, **options)


__all__ = ["decoder_for"]
