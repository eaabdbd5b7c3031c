"""The device side: batches of step inputs, the jitted step functions and the model runner."""
