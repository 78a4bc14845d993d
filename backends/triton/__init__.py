"""The fused Triton scans for torch tensors (CUDA; the CPU under Triton's interpreter):
the launchers :mod:`~tmcore.backends.triton.dense` (the whole scan; CuPy's too, through
DLPack) and :mod:`~tmcore.backends.triton.local` (the local scan) over the shared
:mod:`~tmcore.backends.triton.launch`, and their ``@triton.jit`` kernels
(:mod:`~tmcore.backends.triton.dense_kernels`, :mod:`~tmcore.backends.triton.local_kernels`,
built from :mod:`~tmcore.backends.triton.parts`; only these import ``triton``, and only
when a launch needs them)."""
