"""Packed DiT models whose attention is :class:`~deepspeed_knap.runtime.attention.KnapDistributedAttention`."""
