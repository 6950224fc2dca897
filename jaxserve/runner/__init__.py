"""The device side as the host loop sees it: the pure jitted step, the model runner, the batch builder, the Runner
protocol."""
