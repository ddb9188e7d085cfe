# The shared library libstrata.so and its install rules (C API).
