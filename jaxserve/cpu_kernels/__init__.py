"""Hand-written CPU kernels, called from XLA:CPU programs through the FFI where its own lowering reads memory slower
than the machine can: C++ built on first use for the CPU it runs on (`build`), one module per kernel."""
