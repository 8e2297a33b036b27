"""The bottom layer: errors, the one env-var module, atomic file I/O, fault points, paths on disk,
the one ggml type table (``qtypes``) and the cffi bridge to libggml-base (``ggml``).

Imports nothing else of the package. Layers, lowest first: core, gguf, selection, quants,
candidates, hardware, model, distributed, arch, student, training, memory, tools, cli
(``tests/test_package_layers.py`` holds the order).
"""
