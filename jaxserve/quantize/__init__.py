"""Load-time quantization: the method's dispatch, AWQ's calibration, perplexity to check the result."""
