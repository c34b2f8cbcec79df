"""The C kernels (int8 matmuls, fused layers, attention over rows) and their ctypes bindings: the only way into C.
Built once per CPU into the cache folder (native); each binding keeps a torch version of what it calls."""
