"""The choice every run makes: which types a tensor may take (``menus``), what the selectable
tensors may weigh (``budget``) and which type each one got (``assignment``). Above ``gguf``.
"""
