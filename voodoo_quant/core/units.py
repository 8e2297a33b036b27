"""Units the package prints sizes in."""

GB = 1e9  # decimal gigabyte: memory plans (memory/) and the phases' notes (training/layer_hessians.py)
