"""Speculative decoding on the host: the proposers (n-gram, draft model) and the controller that decides when to
speculate."""
