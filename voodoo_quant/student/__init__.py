"""The student: the selectable tensors of a model, their candidates and the model with one gate
per candidate (``build``), and the gated weight itself, ``MixedQuant`` (``layers``). Above ``arch``.
"""
