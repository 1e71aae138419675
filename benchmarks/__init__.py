"""`tierq bench ...` and `tierq calibrate`: measurements of the whole platform, of its parts,
and of vLLM on its own with the worker's engine arguments. Nothing imports them but the command
line."""
