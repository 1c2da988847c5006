"""Packed DiT models whose attention is :class:`~deepspeed_knap.attention.KnapDistributedAttention`."""
