"""The memory model of a training run (``voodoo train --dry_run``): the dry run, planned from the
config alone (``dry_run``), the plan (``plan``), the phases beside the training steps (``phases``)
and the activation probe (``probe``). Above ``training``, whose own sizes it adds up.
"""
