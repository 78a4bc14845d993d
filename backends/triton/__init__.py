"""The fused Triton scans for torch tensors (CUDA, or the CPU under Triton's interpreter): the
launchers ``dense`` (CuPy's too, through DLPack) and ``local`` over the shared ``launch``,
and their ``@triton.jit`` kernels (``dense_kernels``, ``local_kernels``, built from
``parts``; only these import ``triton``, when a launch needs them).
"""
