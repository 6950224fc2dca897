"""Engine replicas behind one request interface: data parallelism, and disaggregated prefill/decode pools."""
