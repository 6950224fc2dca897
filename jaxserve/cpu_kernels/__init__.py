"""Hand-written CPU kernels, called from XLA:CPU programs through the FFI where its own lowering reads memory slower
than the machine can: C++ built for fixed instruction-set variants (`isa`), ahead of time by `jaxserve build-kernels`
or on first use (`build`), one module per kernel."""
