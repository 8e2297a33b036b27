"""llama.cpp's side of a file: its HF to GGUF converter, reading a GGUF's header (``header``),
where every element of an HF tensor lies in the GGUF (``layout``), the types stock llama-quantize
writes (``recipes``, ``recipe_inputs``) and importance matrices (``imatrix``: the data and its
files; ``imatrix_compute``: computing one in torch). Above ``core``.
"""
