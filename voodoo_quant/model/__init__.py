"""Loading models: HF checkpoint dirs, GGUF files and hub ids (``modeling``), the checkpoint
formats ``voodoo make-teacher`` writes (``checkpoints``), one tensor at a time from a skeleton
(``lazyload``). Above ``hardware``.
"""
