"""plait.kernels: Triton kernels for the GPU path, each with a pure-torch reference.

Importing this package never requires a GPU or a compiler; Triton is imported lazily
by the modules that need it.
"""
