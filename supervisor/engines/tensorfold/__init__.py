"""The TensorFold engine (the Spark recipe): its engine, source checkout and grammar image."""
