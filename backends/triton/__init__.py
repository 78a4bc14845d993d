"""The fused Triton scans for torch tensors (CUDA; the CPU under Triton's interpreter).

- :mod:`~tmcore.backends.triton.dense`: the whole scan, three launches per chunk step
  (``scan_fwd`` / ``scan_bwd`` of the torch table, and of CuPy's through DLPack);
- :mod:`~tmcore.backends.triton.local`: the local scan (``update="local"``), one
  launch per step each way;
- :mod:`~tmcore.backends.triton.launch`: what both launchers share (when they run,
  tile geometry, precision, entry checks, the fallback for kernels that fail, the
  CUDA graphs that replay their loops, the tap and bias gradients from the kernels'
  sums);
- the ``@triton.jit`` kernels: :mod:`~tmcore.backends.triton.dense_kernels` and
  :mod:`~tmcore.backends.triton.local_kernels`, built from the parts both share
  (:mod:`~tmcore.backends.triton.parts`); only these import ``triton``, and only when
  a launch needs them.
"""
