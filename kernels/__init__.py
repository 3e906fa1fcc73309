"""CuPy raw kernels and their NumPy twins (same signatures, same bits)."""
