"""`tierq bench ...` (with `tierq bench calibrate`): measurements of the whole platform, of
its parts, and of vLLM on its own with the worker's engine arguments. A distribution of its
own (pyproject.toml here), not part of the `tierq` wheel: no module of `tierq` imports it;
once installed, the `tierq` command loads its command group (cli.py) through the
`tierq.commands` entry point."""
