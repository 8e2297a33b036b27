"""The candidates: the libggml-quantized bytes of every (tensor, type), cached on disk
(``cache``), built in a process pool (``precache``), kept as int8 codes (``compact``) and mixed
by the native kernel (``mixkernel``); error compensation (``compensate``, its column walk
``compensation_walk``) and the Hessians file it reads (``hessian_store``). Above ``quants`` (the
torch kernels of the ggml types).
"""
